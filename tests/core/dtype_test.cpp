// 16-bit float conversions against brute-force references: every half bit pattern decoded by
// a direct formula, and float -> half/bf16 rounding checked by searching the nearest
// representable neighbours with ties to even.
#include <doctest/doctest.h>

#include <weave/core/dtype.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace {

double decode_half_reference(std::uint16_t bits) {
  const int sign = (bits & 0x8000) ? -1 : 1;
  const int exponent = (bits >> 10) & 0x1f;
  const int mantissa = bits & 0x3ff;
  if (exponent == 0)
    return sign * std::ldexp(mantissa, -24);
  if (exponent == 31)
    return mantissa ? NAN : sign * INFINITY;
  return sign * std::ldexp(1024 + mantissa, exponent - 25);
}

// Nearest value among `candidates` (sorted, each with its bit pattern), ties to even bits.
std::uint16_t round_reference(double x,
                              const std::vector<std::pair<double, std::uint16_t>>& table) {
  auto upper = std::lower_bound(table.begin(), table.end(), x,
                                [](const auto& entry, double v) { return entry.first < v; });
  if (upper == table.end())
    return table.back().second;
  if (upper == table.begin() || upper->first == x)
    return upper->second;
  auto lower = upper - 1;
  const double below = x - lower->first, above = upper->first - x;
  if (below < above)
    return lower->second;
  if (above < below)
    return upper->second;
  return (lower->second & 1) ? upper->second : lower->second;
}

} // namespace

TEST_CASE("half decodes every bit pattern exactly") {
  for (std::uint32_t bits = 0; bits <= 0xffff; ++bits) {
    const float got = static_cast<float>(weave::half::from_bits(static_cast<std::uint16_t>(bits)));
    const double want = decode_half_reference(static_cast<std::uint16_t>(bits));
    if (std::isnan(want)) {
      CHECK(std::isnan(got));
    } else {
      REQUIRE(static_cast<double>(got) == want);
      CHECK(std::signbit(got) == bool(bits & 0x8000));
    }
  }
}

TEST_CASE("float -> half rounds to nearest even, saturating to infinity past 65504") {
  std::vector<std::pair<double, std::uint16_t>> table; // non-negative finite halves + inf
  for (std::uint16_t bits = 0; bits < 0x7c00; ++bits)
    table.emplace_back(decode_half_reference(bits), bits);
  std::mt19937 rng(7);
  std::vector<float> inputs = {0.0f,           65504.0f,       65519.99f,      65520.0f, 1e-8f,
                               2.98023224e-8f, 5.96046448e-8f, 6.1035156e-5f,  6.1e-5f,  1.0f,
                               1.0009765625f,  1.00048828125f, 1.00146484375f, 3.0e38f};
  for (int i = 0; i < 200000; ++i) {
    // Spread across all float exponents relevant to half, plus exact halfway points.
    const float magnitude = std::ldexp(std::uniform_real_distribution<float>(1, 2)(rng),
                                       std::uniform_int_distribution<int>(-27, 16)(rng));
    inputs.push_back(magnitude);
    const std::uint16_t h = static_cast<std::uint16_t>(rng() % 0x7bff);
    inputs.push_back(static_cast<float>(
        (decode_half_reference(h) + decode_half_reference(static_cast<std::uint16_t>(h + 1))) / 2));
  }
  for (float x : inputs) {
    const std::uint16_t got = weave::half(x).bits;
    const std::uint16_t want = x >= 65520.0f ? std::uint16_t{0x7c00} : round_reference(x, table);
    REQUIRE_MESSAGE(got == want, "x = " << x);
    CHECK(weave::half(-x).bits == (want | 0x8000));
  }
  CHECK(weave::half(INFINITY).bits == 0x7c00);
  CHECK(std::isnan(static_cast<float>(weave::half(NAN))));
}

TEST_CASE("float -> bfloat16 rounds to nearest even and keeps NaN a NaN") {
  std::mt19937 rng(11);
  for (int i = 0; i < 200000; ++i) {
    const auto bits = static_cast<std::uint32_t>(rng());
    const float x = std::bit_cast<float>(bits);
    if (std::isnan(x)) {
      CHECK(std::isnan(static_cast<float>(weave::bfloat16(x))));
      continue;
    }
    if (std::isinf(x))
      continue;
    const std::uint32_t low = bits & 0xffff0000u;
    const float lower = std::bit_cast<float>(low);
    const float upper = std::bit_cast<float>(low + 0x10000u); // next magnitude (may be inf)
    const double below = std::fabs(double(x) - double(lower));
    const double above = std::isinf(upper) && !std::isinf(lower)
                             ? std::fabs(double(x) - std::ldexp(1.0, 128) * (x < 0 ? -1 : 1))
                             : std::fabs(double(upper) - double(x));
    std::uint16_t want = 0;
    if (below < above || (below == above && ((low >> 16) & 1u) == 0))
      want = static_cast<std::uint16_t>(low >> 16);
    else
      want = static_cast<std::uint16_t>((low + 0x10000u) >> 16);
    REQUIRE_MESSAGE(weave::bfloat16(x).bits == want, "bits = " << bits);
  }
  CHECK(static_cast<float>(weave::bfloat16(1.0f)) == 1.0f);
  CHECK(static_cast<float>(weave::bfloat16(-2.5f)) == -2.5f);
}

TEST_CASE("dtype sizes and names") {
  CHECK(weave::size_of(weave::dtype::bf16) == 2);
  CHECK(weave::size_of(weave::dtype::f32) == 4);
  CHECK(weave::size_of(weave::dtype::i64) == 8);
  CHECK(weave::dtype_of_v<weave::bfloat16> == weave::dtype::bf16);
  CHECK(weave::dtype_of_v<const float> == weave::dtype::f32);
  const weave::half h(0.5f);
  CHECK(weave::load_as_float(&h, 0, weave::dtype::f16) == 0.5f);
}
