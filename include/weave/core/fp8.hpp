//! \file
//! 8-bit floating-point storage types of the OCP 8-bit floating point specification (OFP8):
//! `fp8_e4m3` (E4M3, "E4M3FN": no infinities, NaN only S.1111.111, largest finite 448) and
//! `fp8_e5m2` (E5M2: IEEE-like, with infinities and NaNs, largest finite 57344).
//!
//! Conversions from `float` round to nearest, ties to even, with one rounding; a `bfloat16` or
//! `half` value widens to `float` exactly, so converting it through `float` is also one rounding
//! (as CUDA's `__nv_cvt_bfloat16raw_to_fp8` does). Conversions to `float` are exact. What
//! happens past the largest finite value is chosen by `fp8_overflow` (default `saturate`, as the
//! constructors of CUDA's `__nv_fp8_e4m3` / `__nv_fp8_e5m2`). Every NaN input becomes the
//! canonical NaN 0x7F (CUDA does the same). Results equal CUDA's `__nv_cvt_float_to_fp8` bit for
//! bit (tested against it where the CUDA headers exist). The functions are `constexpr` and
//! `WEAVE_HOST_DEVICE`: CUDA kernels can call them, and weave's host and device paths share them.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/float_bits.hpp"

#include <cstdint>

WEAVE_NAMESPACE_BEGIN

//! What a conversion to FP8 does with a value that rounds past the largest finite magnitude
//! (448 for E4M3, 57344 for E5M2), and with infinities. NaN always becomes NaN.
enum class fp8_overflow : std::uint8_t {
  //! Becomes the largest finite value of its sign, infinities included: the OCP saturation
  //! mode, CUDA's `__NV_SATFINITE`. The default.
  saturate,
  //! Becomes NaN in E4M3 (which has no infinity) and the infinity of its sign in E5M2; an
  //! infinity becomes NaN (E4M3) or stays infinite (E5M2): the OCP non-saturating mode, CUDA's
  //! `__NV_NOSAT`.
  non_saturating,
};

namespace detail {

//! a * b rounded once (IEEE f32): on the device never contracted into an FMA, whatever the
//! consumer's flags, so host and device agree bit for bit.
WEAVE_HOST_DEVICE constexpr float fmul_rn(float a, float b) noexcept {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

//! a / b rounded once (IEEE f32), on the device even under -use_fast_math.
WEAVE_HOST_DEVICE constexpr float fdiv_rn(float a, float b) noexcept {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

//! `if_true` where `condition` holds, else `if_false`, without a branch.
WEAVE_HOST_DEVICE constexpr std::uint32_t select_bits(bool condition, std::uint32_t if_true,
                                                      std::uint32_t if_false) noexcept {
  const std::uint32_t mask = 0u - static_cast<std::uint32_t>(condition);
  return (if_true & mask) | (if_false & ~mask);
}

// One OFP8 format: E exponent bits with bias 2^(E-1) - 1, M mantissa bits. The constants are
// float bit patterns or codes, so the conversion needs only constant shifts and selects (the
// host compiler vectorises it; it is the same code on the device).
template <int E, int M, bool Infinities>
struct fp8_format {
  static constexpr int exponent_bits = E;
  static constexpr int mantissa_bits = M;
  static constexpr int bias = (1 << (E - 1)) - 1;
  static constexpr bool has_infinity = Infinities;
  // Largest finite code: E5M2 S.11110.11; E4M3 S.1111.110 (S.1111.111 is its NaN).
  static constexpr std::uint8_t max_code = Infinities ? 0x7b : 0x7e;
  static constexpr std::uint8_t nan_code = 0x7f;
  // The value of max_code: (2 - 2^-M) * 2^(top - 1 - bias) with infinities (the top exponent is
  // special), (2 - 2^(1-M)) * 2^(top - bias) without (only the top mantissa is special).
  static constexpr float max_finite =
      Infinities ? (2.0f - 1.0f / (1 << M)) * static_cast<float>(1u << ((1 << E) - 2 - bias))
                 : (2.0f - 2.0f / (1 << M)) * static_cast<float>(1u << ((1 << E) - 1 - bias));
  static constexpr std::uint8_t overflow_code = Infinities ? 0x7c : nan_code; // inf or NaN
  // Float bits of the smallest magnitude that rounds past max_code: max + half an ulp, where
  // the tie goes to the even neighbour (E4M3: 464 ties to 448, whose code is even; E5M2: 61440
  // ties to 65536, which is the overflow).
  static constexpr std::uint32_t first_overflow = Infinities ? 0x47700000u : 0x43e80001u;
  // Float bits of the smallest normal value 2^(1 - bias).
  static constexpr std::uint32_t min_normal = static_cast<std::uint32_t>(128 - bias) << 23;
  // Float exponent field minus this is the FP8 exponent field.
  static constexpr std::uint32_t rebias = static_cast<std::uint32_t>(127 - bias) << 23;
  static constexpr int shift = 23 - M;
  // 2^(bias + M - 1): multiplies a subnormal magnitude into units of the smallest subnormal.
  static constexpr float to_subnormal_units = static_cast<float>(1u << (bias + M - 1));
};

using e4m3_format = fp8_format<4, 3, false>;
using e5m2_format = fp8_format<5, 2, true>;

//! The FP8 magnitude code of format F nearest to the magnitude `magnitude` (float bits), ties to
//! even, for magnitudes below F::first_overflow (no overflow, no NaN).
template <class F>
WEAVE_HOST_DEVICE constexpr std::uint32_t fp8_round_magnitude(std::uint32_t magnitude) noexcept {
  // Normal range: drop the low mantissa bits with round-half-even; a carry into the exponent
  // field is the correct encoding.
  const std::uint32_t normal =
      (magnitude - F::rebias + ((1u << (F::shift - 1)) - 1u) + ((magnitude >> F::shift) & 1u)) >>
      F::shift;
  // Below the smallest normal: the magnitude in units of the smallest subnormal, rounded half
  // even by the FPU in its default rounding mode (adding 1.5 * 2^23 leaves the rounded integer
  // in the low mantissa bits). The scaling by a power of two is exact, so this is one rounding.
  const float below = bits_float(magnitude < F::min_normal ? magnitude : F::min_normal);
  const std::uint32_t subnormal = float_bits(below * F::to_subnormal_units + 12582912.0f) & 0xffu;
  // Bit-mask selects: compilers keep them branch-free, so loops over rows vectorise (a `?:`
  // between integer results gets turned back into branches around the float operations, which
  // may not be speculated under the default -ftrapping-math).
  return select_bits(magnitude >= F::min_normal, normal, subnormal);
}

//! Rounds `value` to the nearest FP8 code of format F, ties to even.
template <class F>
WEAVE_HOST_DEVICE constexpr std::uint8_t fp8_encode(float value, fp8_overflow mode) noexcept {
  const std::uint32_t x = float_bits(value);
  const std::uint32_t magnitude = x & 0x7fffffffu;
  const auto sign = static_cast<std::uint32_t>((x >> 24) & 0x80u);
  const std::uint32_t overflow = mode == fp8_overflow::saturate ? F::max_code : F::overflow_code;
  std::uint32_t code =
      select_bits(magnitude >= F::first_overflow, overflow, fp8_round_magnitude<F>(magnitude));
  code = select_bits(magnitude > 0x7f800000u, F::nan_code, sign | code);
  return static_cast<std::uint8_t>(code);
}

//! `fp8_encode` for a value known to be finite and to round within range (|value| below
//! max_finite plus half an ulp): the hot loop of block quantisation, where scaling guarantees it.
template <class F>
WEAVE_HOST_DEVICE constexpr std::uint8_t fp8_encode_in_range(float value) noexcept {
  const std::uint32_t x = float_bits(value);
  return static_cast<std::uint8_t>(((x >> 24) & 0x80u) | fp8_round_magnitude<F>(x & 0x7fffffffu));
}

//! The exact value of FP8 code `bits` of format F (a quiet NaN for NaN codes). Branch-free, and
//! exact without float subnormals (so flush-to-zero modes do not change it).
template <class F>
WEAVE_HOST_DEVICE constexpr float fp8_decode(std::uint8_t bits) noexcept {
  const std::uint32_t magnitude = bits & 0x7fu;
  const std::uint32_t exponent = magnitude >> F::mantissa_bits;
  const std::uint32_t mantissa = magnitude & ((1u << F::mantissa_bits) - 1u);
  const std::uint32_t normal = (magnitude << F::shift) + F::rebias;
  // Subnormal: (2^emin + m * 2^(emin - M)) - 2^emin, both operands normal, the difference exact.
  const std::uint32_t subnormal =
      float_bits(bits_float(F::min_normal | (mantissa << F::shift)) - bits_float(F::min_normal));
  std::uint32_t out = select_bits(exponent == 0, subnormal, normal);
  constexpr std::uint32_t top = (1u << F::exponent_bits) - 1u;
  if constexpr (F::has_infinity)
    out = select_bits(exponent == top, mantissa == 0 ? 0x7f800000u : 0x7fc00000u, out);
  else
    out = select_bits(magnitude == F::nan_code, 0x7fc00000u, out);
  return bits_float((static_cast<std::uint32_t>(bits & 0x80u) << 24) | out);
}

} // namespace detail

//! An OFP8 value of format `Format` (`detail::e4m3_format` or `detail::e5m2_format`): the
//! code in `bits`, converted from float by rounding to nearest even and to float exactly.
template <class Format>
struct basic_fp8 {
  using format = Format;
  std::uint8_t bits = 0;

  //! Largest finite value.
  static constexpr float max_finite = Format::max_finite;

  constexpr basic_fp8() = default;
  //! Rounds to nearest even; `mode` decides overflow (see `fp8_overflow`).
  WEAVE_HOST_DEVICE constexpr explicit basic_fp8(
      float value, fp8_overflow mode = fp8_overflow::saturate) noexcept
      : bits(detail::fp8_encode<Format>(value, mode)) {}
  //! The exact value.
  WEAVE_HOST_DEVICE constexpr explicit operator float() const noexcept {
    return detail::fp8_decode<Format>(bits);
  }
  WEAVE_HOST_DEVICE static constexpr basic_fp8 from_bits(std::uint8_t b) noexcept {
    basic_fp8 out;
    out.bits = b;
    return out;
  }
  friend constexpr bool operator==(basic_fp8, basic_fp8) = default;
};

//! OFP8 E4M3 ("E4M3FN"): 1 sign, 4 exponent (bias 7), 3 mantissa bits; finite range +-448,
//! smallest subnormal 2^-9, no infinities, NaN = S.1111.111. Bit-compatible with CUDA's
//! `__nv_fp8_e4m3` and PyTorch's `float8_e4m3fn`.
using fp8_e4m3 = basic_fp8<detail::e4m3_format>;

//! OFP8 E5M2: 1 sign, 5 exponent (bias 15), 2 mantissa bits; finite range +-57344, smallest
//! subnormal 2^-16, infinities S.11111.00, NaNs S.11111.{01,10,11}. Bit-compatible with CUDA's
//! `__nv_fp8_e5m2` and PyTorch's `float8_e5m2`.
using fp8_e5m2 = basic_fp8<detail::e5m2_format>;

static_assert(sizeof(fp8_e4m3) == 1 && sizeof(fp8_e5m2) == 1);
static_assert(fp8_e4m3::max_finite == 448.0f && fp8_e5m2::max_finite == 57344.0f);
static_assert(fp8_e4m3(448.0f).bits == 0x7e && fp8_e5m2(57344.0f).bits == 0x7b);
static_assert(static_cast<float>(fp8_e4m3::from_bits(0x01)) == 0x1p-9f &&
              static_cast<float>(fp8_e5m2::from_bits(0x01)) == 0x1p-16f);

WEAVE_NAMESPACE_END
