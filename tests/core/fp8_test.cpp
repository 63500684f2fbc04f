// FP8 conversions against an independent brute-force reference (tests/support/fp8_reference.hpp:
// every code decoded by the specification's formula, float -> FP8 by searching the nearest of
// the 256 decoded values, ties to the even code), over every bf16 and f16 input and a dense f32
// sample (every exponent, every midpoint and its neighbours, boundaries, NaN, inf, -0).
#include <doctest/doctest.h>

#include <weave/core/dtype.hpp>
#include <weave/core/fp8.hpp>

#include "fp8_reference.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace {

using weave::fp8_overflow;

using fp8_ref::decode;
using fp8_ref::e4m3;
using fp8_ref::e5m2;
using fp8_ref::format;
using fp8_ref::table;

template <class T>
std::uint8_t encode(float x, fp8_overflow mode) {
  return T(x, mode).bits;
}

// Checks both formats and both overflow modes on every input.
void check_inputs(const std::vector<float>& inputs) {
  const table t4(e4m3), t5(e5m2);
  for (float x : inputs)
    for (auto mode : {fp8_overflow::saturate, fp8_overflow::non_saturating}) {
      const auto want4 = t4.round(x, mode);
      const auto got4 = encode<weave::fp8_e4m3>(x, mode);
      if (got4 != want4)
        FAIL("e4m3(", x, " = 0x", std::hex, std::bit_cast<std::uint32_t>(x), ") = 0x", +got4,
             ", want 0x", +want4);
      const auto want5 = t5.round(x, mode);
      const auto got5 = encode<weave::fp8_e5m2>(x, mode);
      if (got5 != want5)
        FAIL("e5m2(", x, " = 0x", std::hex, std::bit_cast<std::uint32_t>(x), ") = 0x", +got5,
             ", want 0x", +want5);
    }
}

void add_with_neighbours(std::vector<float>& out, double v) {
  const float f = static_cast<float>(v);
  out.push_back(f);
  out.push_back(std::nextafter(f, INFINITY));
  out.push_back(std::nextafter(f, -INFINITY));
}

} // namespace

TEST_CASE("every FP8 code decodes to its exact value") {
  for (int code = 0; code < 256; ++code) {
    const auto c = static_cast<std::uint8_t>(code);
    for (const auto& [f, got] :
         {std::pair{e4m3, static_cast<float>(weave::fp8_e4m3::from_bits(c))},
          std::pair{e5m2, static_cast<float>(weave::fp8_e5m2::from_bits(c))}}) {
      const double want = decode(f, c);
      if (std::isnan(want)) {
        CHECK(std::isnan(got));
      } else {
        REQUIRE(static_cast<double>(got) == want);
        CHECK(std::signbit(got) == bool(code & 0x80));
      }
    }
  }
  CHECK(weave::fp8_e4m3::max_finite == 448.0f);
  CHECK(weave::fp8_e5m2::max_finite == 57344.0f);
  CHECK(decode(e4m3, 0x7e) == 448.0);
  CHECK(decode(e5m2, 0x7b) == 57344.0);
  CHECK(std::isinf(static_cast<float>(weave::fp8_e5m2::from_bits(0xfc))));
}

TEST_CASE("every finite FP8 value converts back to its own code") {
  for (int code = 0; code < 256; ++code) {
    const auto c = static_cast<std::uint8_t>(code);
    for (auto mode : {fp8_overflow::saturate, fp8_overflow::non_saturating}) {
      const float v4 = static_cast<float>(weave::fp8_e4m3::from_bits(c));
      if (!std::isnan(v4))
        CHECK(weave::fp8_e4m3(v4, mode).bits == c);
      const float v5 = static_cast<float>(weave::fp8_e5m2::from_bits(c));
      if (std::isfinite(v5))
        CHECK(weave::fp8_e5m2(v5, mode).bits == c);
    }
  }
}

TEST_CASE("every bf16 and every f16 value rounds to the nearest FP8 value, ties to even") {
  std::vector<float> inputs;
  for (std::uint32_t bits = 0; bits <= 0xffff; ++bits) {
    inputs.push_back(
        static_cast<float>(weave::bfloat16::from_bits(static_cast<std::uint16_t>(bits))));
    inputs.push_back(static_cast<float>(weave::half::from_bits(static_cast<std::uint16_t>(bits))));
  }
  check_inputs(inputs);
}

TEST_CASE("f32 -> FP8 over every exponent, every midpoint and the boundaries") {
  std::vector<float> inputs = {0.0f,
                               -0.0f,
                               INFINITY,
                               -INFINITY,
                               std::numeric_limits<float>::max(),
                               -std::numeric_limits<float>::max(),
                               std::numeric_limits<float>::denorm_min(),
                               std::numeric_limits<float>::min(),
                               std::bit_cast<float>(0x7fc00000u), // quiet NaN
                               std::bit_cast<float>(0xffc00000u), // negative quiet NaN
                               std::bit_cast<float>(0x7f800001u), // signalling NaN
                               std::bit_cast<float>(0x7fa00000u),
                               std::bit_cast<float>(0xff812345u)};
  for (const format& f : {e4m3, e5m2}) {
    const table t(f);
    // Every value, every midpoint between neighbours (including max and the overflow point),
    // and the float neighbours of each, with both signs.
    for (std::size_t i = 0; i < t.entries.size(); ++i) {
      for (double sign : {1.0, -1.0}) {
        add_with_neighbours(inputs, sign * t.entries[i].first);
        if (i + 1 < t.entries.size())
          add_with_neighbours(inputs, sign * (t.entries[i].first + t.entries[i + 1].first) / 2);
      }
    }
    // Half the smallest subnormal (ties to zero) and a quarter of it.
    add_with_neighbours(inputs, t.entries[1].first / 2);
    add_with_neighbours(inputs, t.entries[1].first / 4);
  }
  // Every float exponent (subnormals included) with random mantissas and both signs.
  std::mt19937 rng(11);
  for (std::uint32_t exponent = 0; exponent < 256; ++exponent)
    for (int i = 0; i < 512; ++i) {
      const std::uint32_t mantissa = rng() & 0x7fffffu;
      for (std::uint32_t sign : {0u, 1u})
        inputs.push_back(std::bit_cast<float>((sign << 31) | (exponent << 23) | mantissa));
    }
  // A strided sweep over all 2^32 bit patterns.
  for (std::uint64_t bits = 0; bits <= 0xffffffffu; bits += 4099)
    inputs.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(bits)));
  check_inputs(inputs);
}

TEST_CASE("FP8 overflow: saturate to the largest finite value, or NaN / inf without saturation") {
  using weave::fp8_e4m3;
  using weave::fp8_e5m2;
  // 464 is halfway between 448 (even code 0x7e) and the first overflowing value: it stays.
  CHECK(fp8_e4m3(464.0f, fp8_overflow::non_saturating).bits == 0x7e);
  CHECK(fp8_e4m3(std::nextafter(464.0f, INFINITY), fp8_overflow::non_saturating).bits == 0x7f);
  CHECK(fp8_e4m3(std::nextafter(464.0f, INFINITY)).bits == 0x7e);
  CHECK(fp8_e4m3(-1e30f).bits == 0xfe);
  CHECK(fp8_e4m3(-INFINITY).bits == 0xfe);
  CHECK(fp8_e4m3(-INFINITY, fp8_overflow::non_saturating).bits == 0xff);
  // E5M2: 61440 ties to 65536, past the largest finite 57344.
  CHECK(fp8_e5m2(std::nextafter(61440.0f, 0.0f), fp8_overflow::non_saturating).bits == 0x7b);
  CHECK(fp8_e5m2(61440.0f, fp8_overflow::non_saturating).bits == 0x7c);
  CHECK(fp8_e5m2(61440.0f).bits == 0x7b);
  CHECK(fp8_e5m2(-INFINITY, fp8_overflow::non_saturating).bits == 0xfc);
  CHECK(fp8_e5m2(-INFINITY).bits == 0xfb);
  // NaN stays NaN in both modes, as the canonical 0x7f; -0 keeps its sign.
  for (auto mode : {fp8_overflow::saturate, fp8_overflow::non_saturating}) {
    CHECK(fp8_e4m3(-NAN, mode).bits == 0x7f);
    CHECK(fp8_e5m2(NAN, mode).bits == 0x7f);
    CHECK(fp8_e4m3(-0.0f, mode).bits == 0x80);
    CHECK(fp8_e5m2(-1e-30f, mode).bits == 0x80);
  }
}

TEST_CASE("FP8 dtypes: size, name, loading, and not floating for gate logits") {
  CHECK(weave::size_of(weave::dtype::e4m3) == 1);
  CHECK(weave::size_of(weave::dtype::e5m2) == 1);
  CHECK(std::string(weave::to_string(weave::dtype::e4m3)) == "e4m3");
  CHECK(std::string(weave::to_string(weave::dtype::e5m2)) == "e5m2");
  CHECK(weave::dtype_of_v<weave::fp8_e4m3> == weave::dtype::e4m3);
  CHECK(weave::dtype_of_v<const weave::fp8_e5m2> == weave::dtype::e5m2);
  CHECK(weave::is_fp8(weave::dtype::e5m2));
  CHECK_FALSE(weave::is_fp8(weave::dtype::bf16));
  CHECK_FALSE(weave::is_floating(weave::dtype::e4m3));
  const weave::fp8_e4m3 row[2] = {weave::fp8_e4m3(-3.5f), weave::fp8_e4m3(0.25f)};
  CHECK(weave::load_as_float(row, 0, weave::dtype::e4m3) == -3.5f);
  CHECK(weave::load_as_float(row, 1, weave::dtype::e4m3) == 0.25f);
  const weave::fp8_e5m2 wide[1] = {weave::fp8_e5m2(40960.0f)};
  CHECK(weave::load_as_float(wide, 0, weave::dtype::e5m2) == 40960.0f);
}
