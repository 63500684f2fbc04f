//! \file
//! Floating-point classification by the IEEE bit pattern, for host and device code alike.
//!
//! weave is header-only, so the consumer's flags compile its checks. Under `-ffast-math` or
//! `-ffinite-math-only` (GCC, Clang; nvcc's host compiler likewise) the compiler may assume that
//! no value is a NaN or an infinity, and folds `std::isnan(x)`, `std::isfinite(x)` and `x != x`
//! to constants: a NaN token or gate weight would then pass every check. The helpers here read
//! the bits instead (an all-ones exponent is non-finite; with a non-zero mantissa, a NaN), which
//! no floating-point flag changes. Every check of weave that decides correctness (validation,
//! error flags, the NaN rules its results follow) uses them, on values as they were loaded or
//! converted, never on results of arithmetic the compiler could assume finite.
//!
//! They accept every type `ieee_format` describes: `float` and `double` here, weave's `bfloat16`
//! and `half` in `weave/core/dtype.hpp`. All are `constexpr` and `WEAVE_HOST_DEVICE`.
#pragma once

#include "weave/core/config.hpp"

#include <cstdint>

//! 1 when this translation unit is compiled to assume that no value is a NaN or an infinity
//! (GCC's and Clang's `-ffinite-math-only`, implied by `-ffast-math`), else 0. Hot loops keep a
//! plain `v != v` (one vector compare, where the bit test takes three) unless it is 1.
#if defined(__FINITE_MATH_ONLY__) && __FINITE_MATH_ONLY__
#define WEAVE_FINITE_MATH_ONLY 1
#else
#define WEAVE_FINITE_MATH_ONLY 0
#endif

WEAVE_NAMESPACE_BEGIN

//! The bit layout of an IEEE-style binary floating-point type `T`: `bits_type` (an unsigned
//! integer of T's size) and the widths of its exponent and mantissa fields, sign bit on top.
//! Specialised for `float` and `double` here and for `bfloat16` and `half` in
//! `weave/core/dtype.hpp`; the primary template is undefined, so a type without a layout is
//! refused at compile time.
template <class T>
struct ieee_format;

template <>
struct ieee_format<float> {
  using bits_type = std::uint32_t;
  static constexpr int exponent_bits = 8;
  static constexpr int mantissa_bits = 23;
};

template <>
struct ieee_format<double> {
  using bits_type = std::uint64_t;
  static constexpr int exponent_bits = 11;
  static constexpr int mantissa_bits = 52;
};

namespace detail {

// std::bit_cast's builtin: constexpr in host and device code alike (GCC, Clang, nvcc, MSVC).
WEAVE_HOST_DEVICE constexpr std::uint32_t float_bits(float x) noexcept {
  return __builtin_bit_cast(std::uint32_t, x);
}

WEAVE_HOST_DEVICE constexpr float bits_float(std::uint32_t x) noexcept {
  return __builtin_bit_cast(float, x);
}

//! The bits of `x`.
template <class T>
WEAVE_HOST_DEVICE constexpr typename ieee_format<T>::bits_type bits_of(T x) noexcept {
  using bits_type = typename ieee_format<T>::bits_type;
  static_assert(sizeof(bits_type) == sizeof(T));
  return __builtin_bit_cast(bits_type, x);
}

//! The bits of an infinity of T (exponent all ones, mantissa zero), without the sign.
template <class T>
WEAVE_HOST_DEVICE constexpr typename ieee_format<T>::bits_type infinity_bits() noexcept {
  using bits_type = typename ieee_format<T>::bits_type;
  constexpr int e = ieee_format<T>::exponent_bits;
  return static_cast<bits_type>(((bits_type{1} << e) - 1u) << ieee_format<T>::mantissa_bits);
}

//! |x| as bits: the bits of `x` without the sign. Ordered as the magnitudes are, infinities
//! above every finite value and NaNs above the infinity.
template <class T>
WEAVE_HOST_DEVICE constexpr typename ieee_format<T>::bits_type magnitude_bits_of(T x) noexcept {
  using bits_type = typename ieee_format<T>::bits_type;
  constexpr int sign = 8 * static_cast<int>(sizeof(T)) - 1;
  return static_cast<bits_type>(bits_of(x) & ~static_cast<bits_type>(bits_type{1} << sign));
}

//! True for every NaN (quiet or signalling, either sign, any payload), whatever the flags.
template <class T>
WEAVE_HOST_DEVICE constexpr bool is_nan(T x) noexcept {
  return magnitude_bits_of(x) > infinity_bits<T>();
}

//! True for +inf and -inf, whatever the flags.
template <class T>
WEAVE_HOST_DEVICE constexpr bool is_inf(T x) noexcept {
  return magnitude_bits_of(x) == infinity_bits<T>();
}

//! True for every value that is neither a NaN nor an infinity, whatever the flags.
template <class T>
WEAVE_HOST_DEVICE constexpr bool is_finite(T x) noexcept {
  return magnitude_bits_of(x) < infinity_bits<T>();
}

//! True for +inf only.
template <class T>
WEAVE_HOST_DEVICE constexpr bool is_positive_inf(T x) noexcept {
  return bits_of(x) == infinity_bits<T>();
}

//! True for -inf only.
template <class T>
WEAVE_HOST_DEVICE constexpr bool is_negative_inf(T x) noexcept {
  return is_inf(x) && bits_of(x) != infinity_bits<T>();
}

//! True for +0 and -0 (`x == 0` is true for both too, but `-fno-signed-zeros` lets a compiler
//! drop code that tells them apart, such as turning -0 into +0 after that test).
template <class T>
WEAVE_HOST_DEVICE constexpr bool is_zero(T x) noexcept {
  return magnitude_bits_of(x) == 0;
}

static_assert(is_nan(bits_float(0x7fc00000u)) && is_nan(bits_float(0xff800001u)) &&
              !is_nan(bits_float(0x7f800000u)));
static_assert(is_inf(bits_float(0xff800000u)) && is_negative_inf(bits_float(0xff800000u)) &&
              is_positive_inf(bits_float(0x7f800000u)) &&
              !is_negative_inf(bits_float(0x7f800000u)));
static_assert(is_finite(bits_float(0x7f7fffffu)) && !is_finite(bits_float(0x7f800000u)) &&
              is_zero(bits_float(0x80000000u)));

} // namespace detail

WEAVE_NAMESPACE_END
