//! \file
//! Element types of token rows, and portable 16-bit float storage types for the host path.
//!
//! `bfloat16` and `half` are storage types: two bytes, bit-compatible with CUDA's
//! `__nv_bfloat16` and `__half`, converted to and from `float` with round-to-nearest-even.
//! weave does its arithmetic in fp32; these types only move and store. The 8-bit types
//! `fp8_e4m3` and `fp8_e5m2` are in `weave/core/fp8.hpp`.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/float_bits.hpp"
#include "weave/core/fp8.hpp"

#include <bit>
#include <cstddef>
#include <cstdint>
#include <ostream>
#include <type_traits>

WEAVE_NAMESPACE_BEGIN

//! Element type of a tensor. (Values are stable: new types are appended.)
enum class dtype : std::uint8_t {
  f32,
  f16,
  bf16,
  f64,
  i8,
  u8,
  i32,
  i64,
  e4m3, //!< OFP8 E4M3 (`fp8_e4m3`)
  e5m2, //!< OFP8 E5M2 (`fp8_e5m2`)
};

//! Bytes per element.
constexpr std::size_t size_of(dtype t) noexcept {
  switch (t) {
  case dtype::f32:
    return 4;
  case dtype::f16:
    return 2;
  case dtype::bf16:
    return 2;
  case dtype::f64:
    return 8;
  case dtype::i8:
    return 1;
  case dtype::u8:
    return 1;
  case dtype::i32:
    return 4;
  case dtype::i64:
    return 8;
  case dtype::e4m3:
  case dtype::e5m2:
    return 1;
  }
  return 0;
}

constexpr const char* to_string(dtype t) noexcept {
  switch (t) {
  case dtype::f32:
    return "f32";
  case dtype::f16:
    return "f16";
  case dtype::bf16:
    return "bf16";
  case dtype::f64:
    return "f64";
  case dtype::i8:
    return "i8";
  case dtype::u8:
    return "u8";
  case dtype::i32:
    return "i32";
  case dtype::i64:
    return "i64";
  case dtype::e4m3:
    return "e4m3";
  case dtype::e5m2:
    return "e5m2";
  }
  return "?";
}

inline std::ostream& operator<<(std::ostream& out, dtype t) {
  return out << to_string(t);
}

//! True for the floating-point types weave can read as gate logits and accumulate (the 8-bit
//! floats are storage for block-quantised rows only: see `is_fp8`).
constexpr bool is_floating(dtype t) noexcept {
  return t == dtype::f32 || t == dtype::f16 || t == dtype::bf16 || t == dtype::f64;
}

//! True for the 8-bit float types (`e4m3`, `e5m2`).
constexpr bool is_fp8(dtype t) noexcept {
  return t == dtype::e4m3 || t == dtype::e5m2;
}

//! Brain float: the upper 16 bits of an IEEE binary32.
struct bfloat16 {
  std::uint16_t bits = 0;

  constexpr bfloat16() = default;
  constexpr explicit bfloat16(float value) noexcept
      : bits(from_float(value)) {}
  constexpr explicit operator float() const noexcept {
    return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
  }
  static constexpr bfloat16 from_bits(std::uint16_t b) noexcept {
    bfloat16 out;
    out.bits = b;
    return out;
  }
  friend constexpr bool operator==(bfloat16, bfloat16) = default;

 private:
  static constexpr std::uint16_t from_float(float value) noexcept {
    const auto x = std::bit_cast<std::uint32_t>(value);
    const std::uint32_t rounding = 0x7fffu + ((x >> 16) & 1u); // ties to even
    // NaN keeps its sign with a quiet payload. A select, so that row loops vectorise.
    return static_cast<std::uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? (x >> 16) | 0x40u
                                                                      : (x + rounding) >> 16);
  }
};

//! IEEE binary16.
struct half {
  std::uint16_t bits = 0;

  constexpr half() = default;
  constexpr explicit half(float value) noexcept
      : bits(from_float(value)) {}
  constexpr explicit operator float() const noexcept { return to_float(bits); }
  static constexpr half from_bits(std::uint16_t b) noexcept {
    half out;
    out.bits = b;
    return out;
  }
  friend constexpr bool operator==(half, half) = default;

 private:
  static constexpr std::uint16_t round_shift(std::uint32_t value, std::uint32_t shift) noexcept {
    std::uint32_t out = value >> shift;
    const std::uint32_t rest = value & ((1u << shift) - 1u);
    const std::uint32_t halfway = 1u << (shift - 1u);
    if (rest > halfway || (rest == halfway && (out & 1u)))
      ++out; // a carry into the exponent is the correct encoding
    return static_cast<std::uint16_t>(out);
  }

  static constexpr std::uint16_t from_float(float value) noexcept {
    const auto x = std::bit_cast<std::uint32_t>(value);
    const auto sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
    const std::uint32_t magnitude = x & 0x7fffffffu;
    if (magnitude >= 0x7f800000u) // inf or NaN (quiet, payload truncated)
      return sign | 0x7c00u |
             (magnitude > 0x7f800000u ? 0x200u | ((magnitude >> 13) & 0x3ffu) : 0u);
    if (magnitude >= 0x477ff000u) // rounds past 65504
      return sign | 0x7c00u;
    if (magnitude < 0x38800000u) { // below 2^-14: subnormal half or zero
      const std::uint32_t exponent = magnitude >> 23;
      if (exponent < 102u)
        return sign;
      const std::uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
      return sign | round_shift(mantissa, 126u - exponent);
    }
    const std::uint32_t rebased = magnitude - (112u << 23); // exponent bias 127 -> 15
    return sign | round_shift(rebased, 13u);
  }

  static constexpr float to_float(std::uint16_t h) noexcept {
    const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
    const std::uint32_t exponent = (h >> 10) & 0x1fu;
    const std::uint32_t mantissa = h & 0x3ffu;
    if (exponent == 0) {
      const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f; // 2^-24
      return sign ? -magnitude : magnitude;
    }
    if (exponent == 31)
      return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
    return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  }
};

static_assert(sizeof(bfloat16) == 2 && sizeof(half) == 2);

template <>
struct ieee_format<bfloat16> {
  using bits_type = std::uint16_t;
  static constexpr int exponent_bits = 8;
  static constexpr int mantissa_bits = 7;
};

template <>
struct ieee_format<half> {
  using bits_type = std::uint16_t;
  static constexpr int exponent_bits = 5;
  static constexpr int mantissa_bits = 10;
};

//! Maps a C++ element type to its `dtype`. Specialise it for other element types; CUDA's
//! `__half` and `__nv_bfloat16` are mapped by `weave/core/cuda_dtype.hpp`.
template <class T>
struct dtype_of; // undefined: a type with no dtype cannot be a token element

template <>
struct dtype_of<float> {
  static constexpr dtype value = dtype::f32;
};
template <>
struct dtype_of<double> {
  static constexpr dtype value = dtype::f64;
};
template <>
struct dtype_of<half> {
  static constexpr dtype value = dtype::f16;
};
template <>
struct dtype_of<bfloat16> {
  static constexpr dtype value = dtype::bf16;
};
template <>
struct dtype_of<fp8_e4m3> {
  static constexpr dtype value = dtype::e4m3;
};
template <>
struct dtype_of<fp8_e5m2> {
  static constexpr dtype value = dtype::e5m2;
};
template <>
struct dtype_of<std::int8_t> {
  static constexpr dtype value = dtype::i8;
};
template <>
struct dtype_of<std::uint8_t> {
  static constexpr dtype value = dtype::u8;
};
template <>
struct dtype_of<std::int32_t> {
  static constexpr dtype value = dtype::i32;
};
template <>
struct dtype_of<std::int64_t> {
  static constexpr dtype value = dtype::i64;
};

template <class T>
inline constexpr dtype dtype_of_v = dtype_of<std::remove_cv_t<T>>::value;

//! Reads element `i` of a row of type `t` as float (the fp32-math entry point of the host path).
inline float load_as_float(const void* row, std::size_t i, dtype t) noexcept {
  switch (t) {
  case dtype::f32:
    return static_cast<const float*>(row)[i];
  case dtype::f16:
    return static_cast<float>(static_cast<const half*>(row)[i]);
  case dtype::bf16:
    return static_cast<float>(static_cast<const bfloat16*>(row)[i]);
  case dtype::f64:
    return static_cast<float>(static_cast<const double*>(row)[i]);
  case dtype::i8:
    return static_cast<const std::int8_t*>(row)[i];
  case dtype::u8:
    return static_cast<const std::uint8_t*>(row)[i];
  case dtype::i32:
    return static_cast<float>(static_cast<const std::int32_t*>(row)[i]);
  case dtype::i64:
    return static_cast<float>(static_cast<const std::int64_t*>(row)[i]);
  case dtype::e4m3:
    return static_cast<float>(static_cast<const fp8_e4m3*>(row)[i]);
  case dtype::e5m2:
    return static_cast<float>(static_cast<const fp8_e5m2*>(row)[i]);
  }
  return 0.0f;
}

WEAVE_NAMESPACE_END
