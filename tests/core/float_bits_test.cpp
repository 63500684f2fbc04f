// Classification by bits (weave/core/float_bits.hpp) against the standard library's, which is
// exact in this build (no fast math): every bf16 and half pattern, the special and extreme
// doubles, and a strided sweep of f32 patterns; and at compile time.
#include <doctest/doctest.h>

#include <weave/core/dtype.hpp>
#include <weave/core/float_bits.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

namespace {

// The helpers on x agree with std::isnan, std::isinf, std::isfinite and the sign of `wide`
// (x's exact value as a double).
template <class T>
bool agrees(T x, double wide) {
  using weave::detail::is_finite, weave::detail::is_inf, weave::detail::is_nan;
  return is_nan(x) == std::isnan(wide) && is_inf(x) == std::isinf(wide) &&
         is_finite(x) == std::isfinite(wide) &&
         weave::detail::is_positive_inf(x) == (std::isinf(wide) && wide > 0) &&
         weave::detail::is_negative_inf(x) == (std::isinf(wide) && wide < 0) &&
         weave::detail::is_zero(x) == (wide == 0.0);
}

} // namespace

TEST_CASE("bit classification equals the standard library's for every bf16 and half value") {
  for (std::uint32_t b = 0; b <= 0xffffu; ++b) {
    const auto bits = static_cast<std::uint16_t>(b);
    const weave::bfloat16 x = weave::bfloat16::from_bits(bits);
    const weave::half h = weave::half::from_bits(bits);
    CAPTURE(b);
    CHECK(agrees(x, static_cast<double>(static_cast<float>(x))));
    CHECK(agrees(h, static_cast<double>(static_cast<float>(h))));
    CHECK(weave::detail::magnitude_bits_of(x) == (bits & 0x7fffu));
  }
}

TEST_CASE("bit classification equals the standard library's for f32 and f64") {
  std::uint64_t mismatches = 0;
  for (std::uint64_t b = 0; b <= 0xffffffffu; b += 997)
    mismatches += agrees(std::bit_cast<float>(static_cast<std::uint32_t>(b)),
                         static_cast<double>(std::bit_cast<float>(static_cast<std::uint32_t>(b))))
                      ? 0
                      : 1;
  CHECK(mismatches == 0);
  using limits = std::numeric_limits<double>;
  for (const double x :
       {0.0, -0.0, 1.0, -2.5, limits::max(), limits::lowest(), limits::min(), limits::denorm_min(),
        -limits::denorm_min(), limits::infinity(), -limits::infinity(), limits::quiet_NaN(),
        -limits::quiet_NaN(), limits::signaling_NaN(),
        std::bit_cast<double>(std::uint64_t{0x7fffffffffffffffu}),
        std::bit_cast<double>(std::uint64_t{0x7ff0000000000001u})}) {
    CAPTURE(x);
    CHECK(agrees(x, x));
    CHECK(agrees(static_cast<float>(x), static_cast<double>(static_cast<float>(x))));
  }
}

TEST_CASE("bit classification is usable in constant expressions") {
  using weave::detail::is_finite, weave::detail::is_nan;
  static_assert(is_nan(std::numeric_limits<double>::quiet_NaN()));
  static_assert(!is_finite(-std::numeric_limits<double>::infinity()));
  static_assert(is_finite(std::numeric_limits<double>::max()));
  static_assert(is_nan(weave::bfloat16::from_bits(0xff81u)));
  static_assert(weave::detail::is_negative_inf(weave::half::from_bits(0xfc00u)));
  static_assert(is_finite(weave::half::from_bits(0x7bffu)));
  static_assert(weave::detail::infinity_bits<weave::half>() == 0x7c00u);
  static_assert(weave::detail::infinity_bits<double>() == 0x7ff0000000000000u);
  CHECK(true);
}
