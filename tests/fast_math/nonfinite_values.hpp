// What the non-finite tests feed weave's checks: NaNs (quiet and signalling, both signs, a full
// payload), infinities of both signs and finite extremes, as bit patterns of f32, f64, bf16 and
// f16. These tests are compiled with -ffast-math too (test_fast_math), where `std::isnan`,
// `std::isfinite` and `x != x` fold to constants, so every expectation here is decided from bits
// by this file's own few lines, independent of the library's helpers.
#pragma once

#include <weave/core/dtype.hpp>
#include <weave/core/error.hpp>

#include <bit>
#include <cstdint>
#include <string>

namespace nonfinite {

// A value under test: its name (for CAPTURE) and its bits.
template <class Bits>
struct special {
  const char* name;
  Bits bits;
};

using f32 = special<std::uint32_t>;
using f64 = special<std::uint64_t>;
using f16 = special<std::uint16_t>; // bf16 or half bits

inline float value(f32 s) {
  return std::bit_cast<float>(s.bits);
}
inline double value(f64 s) {
  return std::bit_cast<double>(s.bits);
}
inline std::uint32_t bits(float x) {
  return std::bit_cast<std::uint32_t>(x);
}

// NaNs and infinities.
inline constexpr f32 f32_nonfinite[] = {
    {"quiet NaN", 0x7fc00000u},      {"negative quiet NaN", 0xffc00000u},
    {"signalling NaN", 0x7f800001u}, {"NaN with a full payload", 0x7fffffffu},
    {"+inf", 0x7f800000u},           {"-inf", 0xff800000u},
};
// Finite values at the edges: largest, smallest normal, smallest subnormal, signed zeros.
inline constexpr f32 f32_extremes[] = {
    {"FLT_MAX", 0x7f7fffffu},    {"-FLT_MAX", 0xff7fffffu},    {"FLT_MIN", 0x00800000u},
    {"denorm_min", 0x00000001u}, {"-denorm_min", 0x80000001u}, {"-0", 0x80000000u},
    {"+0", 0x00000000u},
};
inline constexpr f64 f64_nonfinite[] = {
    {"quiet NaN", 0x7ff8000000000000u},    {"signalling NaN", 0x7ff0000000000001u},
    {"negative NaN", 0xfff8000000000001u}, {"+inf", 0x7ff0000000000000u},
    {"-inf", 0xfff0000000000000u},
};
inline constexpr f16 bf16_nonfinite[] = {
    {"quiet NaN", 0x7fc0u},
    {"negative signalling NaN", 0xff81u},
    {"+inf", 0x7f80u},
    {"-inf", 0xff80u},
};
inline constexpr f16 bf16_extremes[] = {
    {"bf16 max", 0x7f7fu}, {"-bf16 max", 0xff7fu}, {"bf16 denorm_min", 0x0001u}, {"-0", 0x8000u}};
inline constexpr f16 half_nonfinite[] = {
    {"quiet NaN", 0x7e00u},
    {"negative signalling NaN", 0xfc01u},
    {"+inf", 0x7c00u},
    {"-inf", 0xfc00u},
};
inline constexpr f16 half_extremes[] = {
    {"65504", 0x7bffu}, {"-65504", 0xfbffu}, {"half denorm_min", 0x0001u}, {"-0", 0x8000u}};

// Classification of the patterns above, by their fields.
inline bool nan_bits(std::uint32_t b) {
  return (b & 0x7fffffffu) > 0x7f800000u;
}
inline bool finite_bits(std::uint32_t b) {
  return (b & 0x7f800000u) != 0x7f800000u;
}
inline bool nan_bits64(std::uint64_t b) {
  return (b & 0x7fffffffffffffffu) > 0x7ff0000000000000u;
}
inline bool finite_bits64(std::uint64_t b) {
  return (b & 0x7ff0000000000000u) != 0x7ff0000000000000u;
}
inline bool positive_inf_bits(std::uint32_t b) {
  return b == 0x7f800000u;
}
// bf16 is the top half of an f32; half has 5 exponent bits.
inline bool bf16_finite(std::uint16_t b) {
  return (b & 0x7f80u) != 0x7f80u;
}
inline bool half_finite(std::uint16_t b) {
  return (b & 0x7c00u) != 0x7c00u;
}

// The code of the weave::error `f()` throws (errc{} when none) and its message.
struct outcome {
  weave::errc code{};
  std::string message;
};

template <class F>
outcome outcome_of(F&& f) {
  try {
    f();
  } catch (const weave::error& e) {
    return {e.code(), e.what()};
  }
  return {};
}

} // namespace nonfinite
