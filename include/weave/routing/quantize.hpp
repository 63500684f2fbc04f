//! \file
//! Block-scaled FP8 quantisation of token rows: per token, per block of `block` (128) elements,
//! one f32 scale from the block's largest magnitude, as DeepSeek-V3 quantises activations (1 x
//! 128 tiles) and DeepEP sends its FP8 dispatch.
//!
//! For row r, block b with elements x (f32, bf16 or f16, read as float) and an FP8 format of
//! largest finite value M (448 for E4M3, 57344 for E5M2):
//! - amax = max |x|, and a = max(amax, min_amax) (DeepEP's 1e-4 floor: an all-zero block gets a
//!   finite scale and zero codes);
//! - `scale_rounding::exact`: scale = a * fl(1/M), multiplier = M / a;
//!   `scale_rounding::power_of_two`: scale = 2^ceil(log2(a * fl(1/M))), multiplier = 1 / scale
//!   (DeepEP's `round_scale`, DeepSeek-V3.2's UE8M0 `scale_fmt`);
//! - q = FP8(x * multiplier) rounded to nearest even, saturating (|x * multiplier| <= M up to
//!   one f32 rounding, so saturation only absorbs that rounding);
//! - scales[r][b] = scale, and dequantisation gives T(float(q) * scale).
//!
//! Every product and quotient is one IEEE f32 operation (the CUDA kernels use `__fmul_rn`,
//! `__fdiv_rn`), so host and device results are identical bit for bit.
//!
//! Non-finite input: a block holding a NaN or an infinity gets scale NaN and every code NaN
//! (0x7f), so it dequantises to NaN everywhere and is never silently finite; the row is
//! reported: `quantize_rows` throws `errc::invalid_argument` naming the first such row and
//! block (after writing every row), the stream forms (`quant_moves`) lower a status word.
//!
//! Scales are a separate f32 view of cols / block columns; views may be strided, so a packed
//! wire layout (each row's codes, then its scales at the next 16-byte boundary,
//! `quantized_row_layout`) is two views of one buffer.
#pragma once

#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/core/dtype.hpp"
#include "weave/core/error.hpp"
#include "weave/core/float_bits.hpp"
#include "weave/core/fp8.hpp"
#include "weave/core/simd.hpp"
#include "weave/core/tensor.hpp"
#include "weave/routing/kernels_host.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

WEAVE_NAMESPACE_BEGIN

//! How a block's scale is chosen from its largest magnitude.
enum class scale_rounding : std::uint8_t {
  exact,        //!< scale = amax * fl(1/M) (DeepEP's default)
  power_of_two, //!< scale rounded up to a power of two (DeepEP `round_scale`, UE8M0)
};

//! Settings of block-scaled FP8 quantisation (see the file comment for the exact definition).
struct block_quantization {
  std::size_t block = 128;                         //!< elements per scale; must divide the row
  scale_rounding rounding = scale_rounding::exact; //!< how scales are chosen
  float min_amax = 1e-4f; //!< floor of a block's amax (DeepEP's margin); > 0
};

//! Bytes of one row's quantised form: codes, then scales from the next 16-byte boundary, the
//! row padded to 16 bytes. Rows of a 16-byte aligned buffer thus have 16-byte aligned scales at
//! any row length: a float access needs 4 (a GPU faults on less) and 16 lets the row kernels
//! move scales as vectors. For rows of a multiple of 16 elements (every real hidden size) the
//! scales follow the codes directly.
struct quantized_row_layout {
  std::size_t code_bytes = 0;   //!< FP8 codes: cols bytes, at offset 0
  std::size_t scale_offset = 0; //!< where the f32 scales start: code_bytes rounded up to 16
  std::size_t scale_bytes = 0;  //!< f32 scales: 4 * cols / block bytes
  std::size_t stride = 0;       //!< scale_offset + scale_bytes rounded up to 16

  //! Layout of a row of `cols` elements; throws `errc::invalid_argument` unless `block` divides
  //! `cols`.
  static quantized_row_layout of(std::size_t cols, std::size_t block = 128) {
    WEAVE_EXPECT(block > 0 && cols % block == 0, errc::invalid_argument, "quantisation block of ",
                 block, " elements does not divide rows of ", cols, " elements");
    quantized_row_layout out;
    out.code_bytes = cols;
    out.scale_offset = checked_add(cols, std::size_t{15}, "quantized row bytes") / 16 * 16;
    out.scale_bytes = cols / block * sizeof(float);
    out.stride =
        checked_add(out.scale_offset, out.scale_bytes + 15, "quantized row bytes") / 16 * 16;
    return out;
  }

  //! Views `rows` packed rows at `base` (16-byte aligned) as FP8 codes of `type` and f32 scales.
  std::pair<token_view, token_view> views(std::byte* base, std::size_t rows, dtype type,
                                          memory_space space = memory_space::host,
                                          int device = -1) const {
    WEAVE_EXPECT(is_fp8(type), errc::invalid_argument, "quantized rows of ", type,
                 " (need e4m3 or e5m2)");
    const std::size_t scales = scale_bytes / sizeof(float);
    return {token_view(base, rows, code_bytes, type, space, device, stride),
            token_view(base + scale_offset, rows, scales, dtype::f32, space, device, stride)};
  }
};

namespace detail {

//! The multiplier applied before rounding and the scale stored (its inverse).
struct fp8_block_scale {
  float multiplier;
  float scale;
};

//! The scale of a block whose finite largest magnitude is `amax`, for an FP8 format of largest
//! finite value `max_finite`.
WEAVE_HOST_DEVICE constexpr fp8_block_scale block_scale(float amax, float min_amax,
                                                        scale_rounding rounding, float max_finite,
                                                        float inverse_max) noexcept {
  const float a = amax > min_amax ? amax : min_amax;
  const float exact = fmul_rn(a, inverse_max);
  if (rounding == scale_rounding::power_of_two) {
    // ceil(log2(exact)) from the bits; `exact` is a normal float (min_amax is checked).
    const std::uint32_t bits = float_bits(exact);
    const int e = static_cast<int>((bits >> 23) & 0xffu) - 127 + ((bits & 0x7fffffu) != 0 ? 1 : 0);
    return {bits_float(static_cast<std::uint32_t>(127 - e) << 23),
            bits_float(static_cast<std::uint32_t>(127 + e) << 23)};
  }
  return {fdiv_rn(max_finite, a), exact};
}

template <class Fp8>
struct fp8_traits {
  static constexpr float max_finite = Fp8::max_finite;
  static constexpr float inverse_max = 1.0f / Fp8::max_finite;
};

//! |x| as float bits (ordered like the magnitudes; NaN and inf compare above every finite).
WEAVE_HOST_DEVICE constexpr std::uint32_t magnitude_bits(float x) noexcept {
  return float_bits(x) & 0x7fffffffu;
}

#if WEAVE_SIMD
// Eight lanes of the host loops below (f32 and bf16 elements): the same integer and float
// operations as the scalar code, written in vectors so that the consumer's -O2 runs them as
// fast as -O3 (see core/simd.hpp).
template <class T>
inline constexpr bool quantize_vectors = std::is_same_v<T, float> || std::is_same_v<T, bfloat16>;

template <class T>
WEAVE_SIMD_INLINE void load_as_f32(simd::f32x8& x, const T* in) noexcept {
  if constexpr (std::is_same_v<T, float>)
    simd::load(x, in);
  else
    simd::load_bf16(x, in);
}

// `fp8_encode_in_range` of eight values: sign | the rounded magnitude code, in the low byte.
template <class F>
WEAVE_SIMD_INLINE void fp8_encode_in_range8(simd::u32x8& code, const simd::f32x8& value) noexcept {
  simd::u32x8 x, normal_lanes, sub;
  simd::bits(x, value);
  const simd::u32x8 magnitude = x & 0x7fffffffu;
  const simd::u32x8 normal =
      (magnitude - F::rebias + ((1u << (F::shift - 1)) - 1u) + ((magnitude >> F::shift) & 1u)) >>
      F::shift;
  simd::greater(normal_lanes, magnitude, simd::u32x8{} + (F::min_normal - 1u)); // >= min_normal
  simd::f32x8 below;
  simd::bits(below, (magnitude & ~normal_lanes) | (F::min_normal & normal_lanes));
  const simd::f32x8 scaled = below * F::to_subnormal_units;
  simd::bits(sub, scaled + 12582912.0f);
  code = ((x >> 24) & 0x80u) | (normal & normal_lanes) | ((sub & 0xffu) & ~normal_lanes);
}
#endif

//! Quantises one block of `n` elements into `out` and its scale into `*scale`; returns false for
//! a non-finite block (scale and codes NaN). Two passes over the block (amax, then codes), f32
//! and bf16 in explicit vectors. Whether the block is finite is decided from the bits of its
//! elements (their largest magnitude), never from a float result, so the consumer's fast math
//! cannot drop it.
template <class Fp8, class T>
bool quantize_block(const T* in, Fp8* out, float* scale, std::size_t n,
                    const block_quantization& q) {
  std::uint32_t amax_bits = 0;
  std::size_t j = 0;
#if WEAVE_SIMD
  if constexpr (quantize_vectors<T>) {
    simd::u32x8 most{}, m, above;
    for (; j + simd::lanes <= n; j += simd::lanes) {
      simd::f32x8 x;
      load_as_f32(x, in + j);
      simd::bits(m, x);
      m &= 0x7fffffffu;
      simd::greater(above, m, most);
      most = (m & above) | (most & ~above);
    }
    for (std::size_t l = 0; l < simd::lanes; ++l)
      amax_bits = most[l] > amax_bits ? most[l] : amax_bits;
  }
#endif
  for (; j < n; ++j) {
    const std::uint32_t m = magnitude_bits(static_cast<float>(in[j]));
    amax_bits = m > amax_bits ? m : amax_bits;
  }
  if (amax_bits >= 0x7f800000u) {
    for (std::size_t i = 0; i < n; ++i)
      out[i] = Fp8::from_bits(0x7f);
    *scale = bits_float(0x7fc00000u); // a quiet NaN
    return false;
  }
  const fp8_block_scale s = block_scale(bits_float(amax_bits), q.min_amax, q.rounding,
                                        fp8_traits<Fp8>::max_finite, fp8_traits<Fp8>::inverse_max);
  // |x * multiplier| <= M up to one f32 rounding, far below M + half an ulp: in range.
  j = 0;
#if WEAVE_SIMD
  if constexpr (quantize_vectors<T>) {
    simd::f32x8 multiplier;
    simd::splat(multiplier, s.multiplier);
    for (; j + simd::lanes <= n; j += simd::lanes) {
      simd::f32x8 x;
      simd::u32x8 codes;
      load_as_f32(x, in + j);
      fp8_encode_in_range8<typename Fp8::format>(codes, x * multiplier);
      static_assert(sizeof(Fp8) == 1);
      simd::store_bytes(out + j, codes);
    }
  }
#endif
  for (; j < n; ++j)
    out[j] = Fp8::from_bits(
        fp8_encode_in_range<typename Fp8::format>(static_cast<float>(in[j]) * s.multiplier));
  *scale = s.scale;
  return true;
}

//! Every code's value: on the host a table lookup beats decoding with baseline x86-64 vectors
//! (and equals it with AVX-512).
template <class Fp8>
inline constexpr std::array<float, 256> fp8_values = [] {
  std::array<float, 256> out{};
  for (int i = 0; i < 256; ++i)
    out[static_cast<std::size_t>(i)] = static_cast<float>(Fp8::from_bits(std::uint8_t(i)));
  return out;
}();

template <class Fp8, class T>
void dequantize_block(const Fp8* in, T* out, std::size_t n, float scale) {
  const auto& values = fp8_values<Fp8>;
  std::size_t j = 0;
#if WEAVE_SIMD
  if constexpr (quantize_vectors<T>) { // eight lookups into one vector, the rest in vectors
    simd::f32x8 s;
    simd::splat(s, scale);
    for (; j + simd::lanes <= n; j += simd::lanes) {
      const Fp8* c = in + j;
      simd::f32x8 x = {values[c[0].bits], values[c[1].bits], values[c[2].bits], values[c[3].bits],
                       values[c[4].bits], values[c[5].bits], values[c[6].bits], values[c[7].bits]};
      x = x * s;
      if constexpr (std::is_same_v<T, float>) {
        simd::store(out + j, x);
      } else {
        simd::u32x8 rounded;
        simd::bf16_rounded_high(rounded, x);
        simd::store_high_halves(out + j, rounded);
      }
    }
  }
#endif
  for (; j < n; ++j)
    out[j] = T(values[in[j].bits] * scale);
}

//! Calls f(Fp8*) for the FP8 dtype `t`.
template <class F>
void visit_fp8(dtype t, const char* what, F&& f) {
  if (t == dtype::e4m3)
    return f(static_cast<fp8_e4m3*>(nullptr));
  WEAVE_EXPECT(t == dtype::e5m2, errc::invalid_argument, what, ": rows of ", t,
               " (need e4m3 or e5m2)");
  return f(static_cast<fp8_e5m2*>(nullptr));
}

//! Checks settings for rows of `cols` elements quantised to `format`: a block that divides the
//! rows, an FP8 format and a usable floor (`errc::invalid_argument` otherwise).
inline void check_quantization(std::size_t cols, dtype format, const block_quantization& q,
                               const char* what) {
  WEAVE_EXPECT(q.block > 0 && cols % q.block == 0, errc::invalid_argument, what, ": rows of ", cols,
               " elements are not a multiple of the block of ", q.block);
  WEAVE_EXPECT(is_fp8(format), errc::invalid_argument, what, ": FP8 rows of ", format,
               " (need e4m3 or e5m2)");
  visit_fp8(format, what, [&]<class Fp8>(Fp8*) {
    WEAVE_EXPECT(is_finite(q.min_amax) &&
                     q.min_amax * fp8_traits<Fp8>::inverse_max >= std::numeric_limits<float>::min(),
                 errc::invalid_argument, what, ": min_amax = ", q.min_amax,
                 " (need a finite value with min_amax / ", Fp8::max_finite, " a normal float)");
  });
}

//! Checks the shapes and types shared by quantisation and dequantisation: `wide` rows of f32,
//! f16 or bf16, `codes` of an FP8 type with the same columns, `scales` f32 with cols / block
//! columns and as many rows as `codes`, and a usable block and floor.
inline void check_quantized(const const_token_view& wide, const const_token_view& codes,
                            const const_token_view& scales, const block_quantization& q,
                            const char* what) {
  check_quantization(wide.cols(), codes.element_type(), q, what);
  visit_float(wide.element_type(), what, [](auto*) {});
  WEAVE_EXPECT(scales.element_type() == dtype::f32, errc::invalid_argument, what, ": scales of ",
               scales.element_type(), " (need f32)");
  WEAVE_EXPECT(codes.cols() == wide.cols(), errc::size_mismatch, what, ": FP8 rows of ",
               codes.cols(), " elements for rows of ", wide.cols());
  WEAVE_EXPECT(scales.cols() == wide.cols() / q.block && scales.rows() == codes.rows(),
               errc::size_mismatch, what, ": scales of ", scales.rows(), " x ", scales.cols(),
               " for ", codes.rows(), " rows of ", wide.cols() / q.block, " blocks");
}

inline void check_host_memory(const const_token_view& a, const const_token_view& b,
                              const const_token_view& c, const char* what) {
  WEAVE_EXPECT(host_accessible(a.space()) && host_accessible(b.space()) &&
                   host_accessible(c.space()),
               errc::invalid_argument, what, " on the host with ", a.space(), ", ", b.space(),
               " and ", c.space(), " memory");
}

//! Quantises row `src` into row `dst` and its scales; returns false for a non-finite block
//! (its index in `bad_block`).
template <class Fp8, class T>
bool quantize_row(const T* src, Fp8* dst, float* scales, std::size_t cols,
                  const block_quantization& q, std::size_t& bad_block) {
  bool finite = true;
  for (std::size_t b = 0; b * q.block < cols; ++b) {
    if (!quantize_block(src + b * q.block, dst + b * q.block, scales + b, q.block, q) && finite) {
      finite = false;
      bad_block = b;
    }
  }
  return finite;
}

template <class Fp8, class T>
void dequantize_row(const Fp8* src, const float* scales, T* dst, std::size_t cols,
                    std::size_t block) {
  for (std::size_t b = 0; b * block < cols; ++b)
    dequantize_block(src + b * block, dst + b * block, block, scales[b]);
}

} // namespace detail

//! Quantises every row of `src` (f32, f16 or bf16) into `dst` (e4m3 or e5m2, same shape) and
//! `scales` (f32, src.rows() x src.cols() / q.block). Throws `errc::invalid_argument` when the
//! block does not divide the rows or `min_amax` is unusable, `errc::size_mismatch` for shapes
//! that disagree, `errc::not_supported` for other source types, and, after writing every row,
//! `errc::invalid_argument` naming the first row and block holding a NaN or an infinity (those
//! blocks are NaN: see the file comment).
inline void quantize_rows(const_token_view src, token_view dst, token_view scales,
                          const block_quantization& q = {}) {
  detail::check_quantized(src, dst, scales, q, "quantize_rows");
  detail::check_host_memory(src, dst, scales, "quantize_rows");
  WEAVE_EXPECT(src.rows() == dst.rows(), errc::size_mismatch, "quantize_rows: ", src.rows(),
               " source rows for ", dst.rows(), " destination rows");
  std::int64_t bad_row = -1;
  std::size_t bad_block = 0;
  detail::visit_fp8(dst.element_type(), "quantize_rows", [&]<class Fp8>(Fp8*) {
    detail::visit_float(src.element_type(), "quantize_rows", [&]<class T>(T*) {
      for (std::size_t i = 0; i < src.rows(); ++i) {
        std::size_t block = 0;
        const bool finite = detail::quantize_row(
            reinterpret_cast<const T*>(src.row(i)), reinterpret_cast<Fp8*>(dst.row(i)),
            reinterpret_cast<float*>(scales.row(i)), src.cols(), q, block);
        if (!finite && bad_row < 0) {
          bad_row = static_cast<std::int64_t>(i);
          bad_block = block;
        }
      }
    });
  });
  WEAVE_EXPECT(bad_row < 0, errc::invalid_argument, "quantize_rows: row ", bad_row, " block ",
               bad_block, " (columns ", bad_block * q.block, "..", (bad_block + 1) * q.block - 1,
               ") holds a NaN or an infinity; its scale and codes are NaN");
}

//! dst[i] = T(float(src[i][c]) * scales[i][c / q.block]) for every row: `src` e4m3 or e5m2,
//! `dst` f32, f16 or bf16 (same shape). Throws as `quantize_rows` does for bad shapes.
inline void dequantize_rows(const_token_view src, const_token_view scales, token_view dst,
                            const block_quantization& q = {}) {
  detail::check_quantized(dst, src, scales, q, "dequantize_rows");
  detail::check_host_memory(src, scales, dst, "dequantize_rows");
  WEAVE_EXPECT(src.rows() == dst.rows(), errc::size_mismatch, "dequantize_rows: ", src.rows(),
               " source rows for ", dst.rows(), " destination rows");
  detail::visit_fp8(src.element_type(), "dequantize_rows", [&]<class Fp8>(Fp8*) {
    detail::visit_float(dst.element_type(), "dequantize_rows", [&]<class T>(T*) {
      for (std::size_t i = 0; i < src.rows(); ++i)
        detail::dequantize_row(reinterpret_cast<const Fp8*>(src.row(i)),
                               reinterpret_cast<const float*>(scales.row(i)),
                               reinterpret_cast<T*>(dst.row(i)), src.cols(), q.block);
    });
  });
}

//! Row primitives of block quantisation in an execution space (specialised for `host_space` in
//! `weave/routing/host_quant_moves.hpp` and `cuda_space` in `weave/routing/quantize.cuh`), in the
//! form `row_moves` has, so an exchange can quantise the row ranges it sends:
//! - `quantize(s, src, dst, scales, index, count, q, status)`: for i < n, dst[i] and scales[i]
//!   quantise src[index[i]] (src[i] when `index` is null; rows with index -1 are left
//!   untouched); a row holding a non-finite value lowers `*status` (if not null) to its source
//!   row index, with -1 meaning none (initialise it to -1);
//! - `dequantize(s, src, scales, dst, index, count, q)`: for i < n, dst[i] = the dequantised
//!   src[index[i]] (src[i] when `index` is null; -1 leaves dst[i] untouched);
//! where n = dst.rows(), or min(*count, dst.rows()) when `count` is not null. `index`, `count`
//! and `status` are memory of the space; indices are not range-checked.
template <class Space>
struct quant_moves;

WEAVE_NAMESPACE_END
