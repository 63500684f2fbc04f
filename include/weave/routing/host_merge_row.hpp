//! \file
//! One merged row of the host kernels: fp32 accumulation of up to four input rows per pass in
//! registers, in index order (so the bits of the element-by-element definition), with bf16
//! handled two columns per 32-bit word so that every vector operation stays on 32-bit lanes
//! without widening or narrowing. The loops are written in explicit vectors (`core/simd.hpp`),
//! not left to the auto-vectoriser: as fast at the consumer's -O2 as at -O3. Used by
//! `weave/routing/host_row_kernels.hpp`.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/dtype.hpp"
#include "weave/core/float_bits.hpp"
#include "weave/core/simd.hpp"
#include "weave/core/tensor.hpp"
#include "weave/routing/host_row_copy.hpp"

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>

WEAVE_NAMESPACE_BEGIN

namespace detail {

// Element loads and stores in fp32. bf16 rounds as bfloat16(float) (nearest even, NaN quieted)
// but without branches, so the loops vectorise; f16 rounds by half(float).
WEAVE_ALWAYS_INLINE float load_f32(const float* p) noexcept {
  return *p;
}
WEAVE_ALWAYS_INLINE float load_f32(const bfloat16* p) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(p->bits) << 16);
}
WEAVE_ALWAYS_INLINE float load_f32(const half* p) noexcept {
  return static_cast<float>(*p);
}
WEAVE_ALWAYS_INLINE void store_f32(float* p, float v) noexcept {
  *p = v;
}
// bfloat16(v) in the high half of a word, low half zero: nearest even, a NaN kept a NaN (the
// rounding could carry a NaN into an infinity or a zero). Under fast math, which folds `v != v`,
// the NaN is told by its bits.
WEAVE_ALWAYS_INLINE std::uint32_t bf16_rounded_high(float v) noexcept {
  const auto x = std::bit_cast<std::uint32_t>(v);
  const std::uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) & 0xffff0000u;
  const std::uint32_t quiet = (x & 0xffff0000u) | 0x400000u;
#if WEAVE_FINITE_MATH_ONLY
  return is_nan(v) ? quiet : rounded;
#else
  return v != v ? quiet : rounded;
#endif
}
WEAVE_ALWAYS_INLINE void store_f32(bfloat16* p, float v) noexcept {
  p->bits = static_cast<std::uint16_t>(bf16_rounded_high(v) >> 16);
}
WEAVE_ALWAYS_INLINE void store_f32(half* p, float v) noexcept {
  *p = half(v);
}

// Elements per slice of a row the converting loops work on (on the stack, in L1).
inline constexpr std::size_t row_slice = 1024;

// Room for a slice of T on the stack, left uninitialised (an array of T would zero every
// element: bfloat16 and half default to zero, a store as large as a 2 KiB row's output).
template <class T>
struct slice_room {
  alignas(T) unsigned char bytes[row_slice * sizeof(T)];
  T* data() noexcept { return reinterpret_cast<T*>(bytes); }
};

// How a merge loop step reads and writes its columns as fp32 lanes: one column per step, or
// for bf16 two, as one 32-bit word split into two floats (a shift and a mask) and joined back
// from two roundings (a shift and a mask again), so every vector operation stays on 32-bit lanes
// with no widening or narrowing (about 1.5x faster than a column at a time).
template <class T>
struct merge_lanes {
  static constexpr std::size_t width = 1;
  static constexpr bool vectors = false; // a conversion per column (half)
  WEAVE_ALWAYS_INLINE static void load(const T* in, std::size_t u, float* x) noexcept {
    x[0] = load_f32(in + u);
  }
  WEAVE_ALWAYS_INLINE static void store(T* out, std::size_t u, const float* a) noexcept {
    store_f32(out + u, a[0]);
  }
};

template <>
struct merge_lanes<float> {
  static constexpr std::size_t width = 1;
  static constexpr bool vectors = WEAVE_SIMD != 0;
  WEAVE_ALWAYS_INLINE static void load(const float* in, std::size_t u, float* x) noexcept {
    x[0] = in[u];
  }
  WEAVE_ALWAYS_INLINE static void store(float* out, std::size_t u, const float* a) noexcept {
    out[u] = a[0];
  }
#if WEAVE_SIMD
  // Steps u .. u + 7 at once.
  WEAVE_ALWAYS_INLINE static void load8(const float* in, std::size_t u, simd::f32x8* x) noexcept {
    simd::load(x[0], in + u);
  }
  WEAVE_ALWAYS_INLINE static void store8(float* out, std::size_t u, const simd::f32x8* a) noexcept {
    simd::store(out + u, a[0]);
  }
#endif
};

template <>
struct merge_lanes<bfloat16> {
  static constexpr std::size_t width = std::endian::native == std::endian::little ? 2 : 1;
  static constexpr bool vectors = width == 2 && WEAVE_SIMD != 0;
#if WEAVE_SIMD
  WEAVE_ALWAYS_INLINE static void load8(const bfloat16* in, std::size_t u,
                                        simd::f32x8* x) noexcept {
    simd::u32x8 word;
    simd::load(word, in + 2 * u);
    simd::bits(x[0], word << 16);
    simd::bits(x[1], word & 0xffff0000u);
  }
  WEAVE_ALWAYS_INLINE static void store8(bfloat16* out, std::size_t u,
                                         const simd::f32x8* a) noexcept {
    simd::u32x8 low, high;
    simd::bf16_rounded_high(low, a[0]);
    simd::bf16_rounded_high(high, a[1]);
    simd::store(out + 2 * u, (low >> 16) | high);
  }
#endif
  WEAVE_ALWAYS_INLINE static void load(const bfloat16* in, std::size_t u, float* x) noexcept {
    if constexpr (width == 1) {
      x[0] = load_f32(in + u);
    } else {
      std::uint32_t word = 0;
      std::memcpy(&word, in + 2 * u, sizeof(word));
      x[0] = std::bit_cast<float>(word << 16);
      x[1] = std::bit_cast<float>(word & 0xffff0000u);
    }
  }
  WEAVE_ALWAYS_INLINE static void store(bfloat16* out, std::size_t u, const float* a) noexcept {
    if constexpr (width == 1) {
      store_f32(out + u, a[0]);
    } else {
      const std::uint32_t word = bf16_rounded_high(a[0]) >> 16 | bf16_rounded_high(a[1]);
      std::memcpy(static_cast<void*>(out + 2 * u), &word, sizeof(word));
    }
  }
};

#if WEAVE_SIMD_BF16_NATIVE
// bf16 lanes rounded by the CPU's conversion (AVX-512 BF16): about 2x faster stores of a merge
// in cache. A vector holding a subnormal (which that conversion flushes) rounds as the base.
struct merge_lanes_bf16_native : merge_lanes<bfloat16> {
  WEAVE_ALWAYS_INLINE static void store8(bfloat16* out, std::size_t u,
                                         const simd::f32x8* a) noexcept {
    if (!simd::bf16_pairs_native(out + 2 * u, a[0], a[1]))
      merge_lanes<bfloat16>::store8(out, u, a);
  }
};
#endif

// out[c] = s * in[c] for c < n, converted to T (the vector steps' loads and stores: `Lanes`).
template <class T, class Lanes = merge_lanes<T>>
WEAVE_ALWAYS_INLINE void scale_span(const T* in, T* out, std::size_t n, float s) {
  using lanes = Lanes;
  std::size_t c = 0;
#if WEAVE_SIMD
  if constexpr (lanes::vectors) {
    constexpr std::size_t block = simd::lanes * lanes::width; // columns per vector step
    simd::f32x8 sv;
    simd::splat(sv, s);
    for (; c + block <= n; c += block) {
      simd::f32x8 x[lanes::width];
      lanes::load8(in, c / lanes::width, x);
      WEAVE_UNROLL
      for (std::size_t l = 0; l < lanes::width; ++l)
        x[l] = sv * x[l];
      lanes::store8(out, c / lanes::width, x);
    }
  }
#endif
  for (; c < n; ++c)
    store_f32(out + c, s * load_f32(in + c));
}

// out[c] = in[c] * s for c < n, converted to T; non-temporal stores through a stack slice when
// `streaming`.
template <class T, class Lanes = merge_lanes<T>>
WEAVE_ALWAYS_INLINE void scale_row(const T* in, T* out, std::size_t cols, float s, bool streaming) {
  if (!streaming) {
    scale_span<T, Lanes>(in, out, cols, s);
    return;
  }
  slice_room<T> room;
  T* const slice = room.data();
  for (std::size_t c0 = 0; c0 < cols; c0 += row_slice) {
    const std::size_t n = cols - c0 < row_slice ? cols - c0 : row_slice;
    scale_span<T, Lanes>(in + c0, slice, n, s);
    copy_row(reinterpret_cast<std::byte*>(out + c0), reinterpret_cast<const std::byte*>(slice),
             n * sizeof(T), true);
  }
}

// One pass of a merge over `steps` loop steps (merge_lanes<T>::width columns each): per
// column, a = (First ? 0 : its accumulator), then a = a + w[j] * in[j][column] for j < N in
// order, into the accumulators (lane l of step u at acc[l * steps + u]), or rounded into out
// when Last. A pass keeps its accumulators in registers across its inputs: the operations and
// their order are those of one input at a time, and so are the bits.
template <class T, class Lanes, int N, bool First, bool Last>
WEAVE_ALWAYS_INLINE void merge_pass(const T* const* rows, const float* w, float* acc, T* out,
                                    std::size_t steps) {
  using lanes = Lanes;
  constexpr std::size_t L = lanes::width;
  const T* in[N];
  float wj[N];
  WEAVE_UNROLL
  for (int j = 0; j < N; ++j) {
    in[j] = rows[j];
    wj[j] = w[j];
  }
  std::size_t u = 0;
#if WEAVE_SIMD
  if constexpr (lanes::vectors) { // eight steps at a time, the same operations in each lane
    simd::f32x8 wv[N];
    WEAVE_UNROLL
    for (int j = 0; j < N; ++j)
      simd::splat(wv[j], wj[j]);
    // Unrolled at any level: rolled (GCC's -O2), a merge of one input row from DRAM keeps too
    // few loads in flight (0.62-0.74 of memcpy against 0.83-0.95 unrolled).
    WEAVE_UNROLL_BY(4)
    for (; u + simd::lanes <= steps; u += simd::lanes) {
      simd::f32x8 a[L];
      WEAVE_UNROLL
      for (std::size_t l = 0; l < L; ++l) {
        if constexpr (First)
          simd::splat(a[l], 0.0f);
        else
          simd::load(a[l], acc + l * steps + u);
      }
      WEAVE_UNROLL
      for (int j = 0; j < N; ++j) {
        simd::f32x8 x[L];
        lanes::load8(in[j], u, x);
        WEAVE_UNROLL
        for (std::size_t l = 0; l < L; ++l) {
          const simd::f32x8 product = wv[j] * x[l];
          a[l] = a[l] + product;
        }
      }
      if constexpr (Last) {
        lanes::store8(out, u, a);
      } else {
        WEAVE_UNROLL
        for (std::size_t l = 0; l < L; ++l)
          simd::store(acc + l * steps + u, a[l]);
      }
    }
  }
#endif
  for (; u < steps; ++u) {
    float a[L];
    WEAVE_UNROLL
    for (std::size_t l = 0; l < L; ++l)
      a[l] = First ? 0.0f : acc[l * steps + u];
    WEAVE_UNROLL
    for (int j = 0; j < N; ++j) {
      float x[L];
      lanes::load(in[j], u, x);
      WEAVE_UNROLL
      for (std::size_t l = 0; l < L; ++l) {
        const float product = wj[j] * x[l];
        a[l] = a[l] + product;
      }
    }
    if constexpr (Last) {
      lanes::store(out, u, a);
    } else {
      WEAVE_UNROLL
      for (std::size_t l = 0; l < L; ++l)
        acc[l * steps + u] = a[l];
    }
  }
}

// out = the accumulators rounded to T (zeros when `acc` is null: a row without any index), in
// vectors: this rounding follows every merge of more than two inputs.
template <class T, class Lanes>
WEAVE_ALWAYS_INLINE void round_accumulators(const float* acc, T* out, std::size_t steps) {
  using lanes = Lanes;
  constexpr std::size_t L = lanes::width;
  std::size_t u = 0;
#if WEAVE_SIMD
  if constexpr (lanes::vectors)
    for (; u + simd::lanes <= steps; u += simd::lanes) {
      simd::f32x8 a[L];
      WEAVE_UNROLL
      for (std::size_t l = 0; l < L; ++l) {
        if (acc != nullptr)
          simd::load(a[l], acc + l * steps + u);
        else
          simd::splat(a[l], 0.0f);
      }
      lanes::store8(out, u, a);
    }
#endif
  for (; u < steps; ++u) {
    float a[L];
    WEAVE_UNROLL
    for (std::size_t l = 0; l < L; ++l)
      a[l] = acc != nullptr ? acc[l * steps + u] : 0.0f;
    lanes::store(out, u, a);
  }
}

// A pass over `group` inputs (1..4); one that rounds into the output takes at most two (with
// more, the fused loop runs slower than a pass and a separate rounding).
template <class T, class Lanes, bool First, bool Last>
WEAVE_ALWAYS_INLINE void merge_pass(int group, const T* const* rows, const float* w, float* acc,
                                    T* out, std::size_t steps) {
  switch (group) {
  case 1:
    return merge_pass<T, Lanes, 1, First, Last>(rows, w, acc, out, steps);
  case 2:
    return merge_pass<T, Lanes, 2, First, Last>(rows, w, acc, out, steps);
  case 3:
    if constexpr (!Last)
      return merge_pass<T, Lanes, 3, First, false>(rows, w, acc, out, steps);
    break;
  default:
    if constexpr (!Last)
      return merge_pass<T, Lanes, 4, First, false>(rows, w, acc, out, steps);
    break;
  }
}

// out = sum over j < k with index[j] >= 0 of weight[j] * src[index[j]] (the plain sum when
// `weight` is null: weights of 1, and 1 * x is x for every x but a NaN's payload), in j order,
// fp32 accumulation, rounded once; zeros without any index. Passes take up to four inputs; the
// last one rounds straight into the output.
template <class T, class Lanes = merge_lanes<T>>
WEAVE_ALWAYS_INLINE void merge_row(const const_token_view& src, T* out, const std::int64_t* index,
                                   const float* weight, std::size_t k, bool streaming) {
  using lanes = Lanes;
  constexpr std::size_t L = lanes::width;
  constexpr int max_group = 4; // inputs per pass
  const std::size_t cols = src.cols();
  const auto input = [&](std::size_t j, std::size_t c0) {
    return reinterpret_cast<const T*>(src.row(static_cast<std::size_t>(index[j]))) + c0;
  };
  for (std::size_t c0 = 0; c0 < cols; c0 += row_slice) {
    const std::size_t n = cols - c0 < row_slice ? cols - c0 : row_slice;
    const std::size_t steps = n / L; // and n % L columns left for one at a time
    float acc[row_slice];
    slice_room<T> slice;
    T* to = streaming ? slice.data() : out + c0;
    bool first = true, done = false;
    for (std::size_t j = 0; j < k && !done;) {
      const T* rows[max_group];
      float w[max_group];
      int group = 0;
      for (; j < k && group < max_group; ++j)
        if (index[j] >= 0) {
          rows[group] = input(j, c0);
          w[group++] = weight != nullptr ? weight[j] : 1.0f;
        }
      if (group == 0)
        break;
      bool last = true;
      for (std::size_t rest = j; rest < k && last; ++rest)
        last = index[rest] < 0;
      last = last && group <= 2;
      if (first && last)
        merge_pass<T, Lanes, true, true>(group, rows, w, acc, to, steps);
      else if (first)
        merge_pass<T, Lanes, true, false>(group, rows, w, acc, to, steps);
      else if (last)
        merge_pass<T, Lanes, false, true>(group, rows, w, acc, to, steps);
      else
        merge_pass<T, Lanes, false, false>(group, rows, w, acc, to, steps);
      first = false;
      done = last;
    }
    if (!done)
      round_accumulators<T, Lanes>(first ? nullptr : acc, to, steps);
    for (std::size_t c = steps * L; c < n; ++c) { // the odd column of a paired row
      float a = 0.0f;
      for (std::size_t j = 0; j < k; ++j)
        if (index[j] >= 0) {
          const float product = (weight != nullptr ? weight[j] : 1.0f) * load_f32(input(j, c0) + c);
          a = a + product;
        }
      store_f32(to + c, a);
    }
    if (streaming)
      copy_row(reinterpret_cast<std::byte*>(out + c0), reinterpret_cast<const std::byte*>(to),
               n * sizeof(T), true);
  }
}

} // namespace detail

WEAVE_NAMESPACE_END
