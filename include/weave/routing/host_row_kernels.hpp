//! \file
//! The row loops under the host kernels (`gather_rows`, `merge_rows` and the host-stream
//! `row_moves<host_space>`), written to run at memory speed:
//! - scattered source rows are prefetched ahead, in two stages (each starts with a TLB miss and a
//!   cold hardware prefetcher);
//! - rows are copied by a 16-byte vector loop, with non-temporal stores once a call writes more
//!   than the caches hold (`streaming_store_bytes`), so the destination is not read first;
//! - the layout moves that have the inverse map scatter instead of gather: each source row is
//!   read once, in order, and written where it goes (writes do not stall; scattered reads do);
//! - merges accumulate up to four input rows per pass in registers, fp32, in index order, and
//!   convert bf16 and f16 without branches, so GCC and Clang vectorise the loops;
//! - on x86-64 with GCC or Clang the converting loops are compiled a second time for AVX2
//!   (without FMA, so every product and sum rounds as in the baseline build) and that copy runs
//!   where the CPU has AVX2.
//! Results equal the element-by-element definition bitwise (same operations, same order); only
//! the payload and sign of a NaN result may differ (IEEE 754 leaves them open, and compilers may
//! swap the operands of an addition).
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/dtype.hpp"
#include "weave/core/error.hpp"
#include "weave/core/tensor.hpp"

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define WEAVE_HOST_AVX2_CLONE 1
#define WEAVE_TARGET_AVX2 __attribute__((target("avx2")))
#else
#define WEAVE_HOST_AVX2_CLONE 0
#define WEAVE_TARGET_AVX2
#endif

#if defined(__GNUC__) || defined(__clang__)
#define WEAVE_ALWAYS_INLINE [[gnu::always_inline]] inline
#else
#define WEAVE_ALWAYS_INLINE inline
#endif

WEAVE_NAMESPACE_BEGIN

namespace detail {

template <class F>
void visit_float(dtype t, const char* what, F&& f) {
  switch (t) {
  case dtype::f32:
    return f(static_cast<float*>(nullptr));
  case dtype::f16:
    return f(static_cast<half*>(nullptr));
  case dtype::bf16:
    return f(static_cast<bfloat16*>(nullptr));
  default:
    WEAVE_THROW(errc::not_supported, what, " of ", t, " rows (f32, f16 and bf16 are supported)");
  }
}

//! Instruction sets the converting loops are compiled for.
enum class host_isa : std::uint8_t {
  baseline, //!< what the translation unit is compiled for
  avx2,     //!< x86-64 AVX2 (GCC and Clang builds only)
};

//! The best of `host_isa` this CPU runs.
inline host_isa detected_host_isa() noexcept {
#if WEAVE_HOST_AVX2_CLONE
  static const host_isa isa = __builtin_cpu_supports("avx2") ? host_isa::avx2 : host_isa::baseline;
  return isa;
#else
  return host_isa::baseline;
#endif
}

// Source rows are prefetched in two stages: `prefetch_far` rows ahead, their first
// `prefetch_far_bytes` into L2 (the TLB miss and the DRAM latency overlap the rows in between),
// then `prefetch_near` rows ahead their first two lines into L1.
inline constexpr std::size_t prefetch_far = 16;
inline constexpr std::size_t prefetch_near = 2;
inline constexpr std::size_t prefetch_far_bytes = 4096;

// Bytes a call writes from which row copies use non-temporal stores: beyond the caches, the
// destination's lines would be read before being overwritten and evict everything else.
inline constexpr std::size_t streaming_store_bytes = std::size_t{16} << 20;

WEAVE_ALWAYS_INLINE void prefetch_far_row(const std::byte* row, std::size_t bytes) noexcept {
#if defined(__GNUC__) || defined(__clang__)
  bytes = bytes < prefetch_far_bytes ? bytes : prefetch_far_bytes;
  for (std::size_t o = 0; o < bytes; o += 64)
    __builtin_prefetch(row + o, 0, 2);
#else
  (void)row;
  (void)bytes;
#endif
}

WEAVE_ALWAYS_INLINE void prefetch_near_row(const std::byte* row) noexcept {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(row, 0, 3);
  __builtin_prefetch(row + 64, 0, 3);
#else
  (void)row;
#endif
}

// Both stages for row i of a loop over `rows` rows; `sources(r, f)` calls f on each source row
// of row r.
template <class Sources>
WEAVE_ALWAYS_INLINE void prefetch_sources(std::size_t i, std::size_t rows, std::size_t bytes,
                                          Sources&& sources) {
  if (i + prefetch_far < rows)
    sources(i + prefetch_far, [&](const std::byte* row) { prefetch_far_row(row, bytes); });
  if (i + prefetch_near < rows)
    sources(i + prefetch_near, [](const std::byte* row) { prefetch_near_row(row); });
}

// Copies one row with 16-byte loads and stores (non-temporal ones when `streaming`). A vector
// loop rather than memcpy: glibc's memcpy picks `rep movsb` for row-sized copies, which some
// CPUs run at a fraction of their bandwidth.
inline void copy_row(std::byte* dst, const std::byte* src, std::size_t bytes, bool streaming) {
#if defined(__SSE2__)
  std::size_t i = 0;
  if (streaming) { // stores must be 16-byte aligned: copy the head plainly
    i = (16 - reinterpret_cast<std::uintptr_t>(dst) % 16) % 16;
    i = i < bytes ? i : bytes;
    std::memcpy(dst, src, i);
  }
  for (; i + 64 <= bytes; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    auto* out = reinterpret_cast<__m128i*>(dst + i);
    if (streaming) {
      _mm_stream_si128(out, a);
      _mm_stream_si128(out + 1, b);
      _mm_stream_si128(out + 2, c);
      _mm_stream_si128(out + 3, d);
    } else {
      _mm_storeu_si128(out, a);
      _mm_storeu_si128(out + 1, b);
      _mm_storeu_si128(out + 2, c);
      _mm_storeu_si128(out + 3, d);
    }
  }
  std::memcpy(dst + i, src + i, bytes - i);
#else
  (void)streaming;
  std::memcpy(dst, src, bytes);
#endif
}

// Orders the non-temporal stores before whatever the caller does next (another thread may read
// the rows once the call returns).
inline void end_streaming(bool streaming) noexcept {
#if defined(__SSE2__)
  if (streaming)
    _mm_sfence();
#else
  (void)streaming;
#endif
}

// Element loads and stores in fp32. bf16 rounds as bfloat16(float) (nearest even, NaN quieted)
// and f16 as half(float), without branches in the bf16 case so the loops vectorise.
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
WEAVE_ALWAYS_INLINE void store_f32(bfloat16* p, float v) noexcept {
  const auto x = std::bit_cast<std::uint32_t>(v);
  const std::uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  const std::uint32_t quiet = (x >> 16) | 0x40u;
  p->bits = static_cast<std::uint16_t>(v != v ? quiet : rounded); // NaN: keep it a NaN
}
WEAVE_ALWAYS_INLINE void store_f32(half* p, float v) noexcept {
  *p = half(v);
}

// Elements per slice of a row the converting loops work on (on the stack, in L1).
inline constexpr std::size_t row_slice = 1024;

// out[c] = in[c] * s for c < n, converted to T; non-temporal stores through a stack slice when
// `streaming`.
template <class T>
WEAVE_ALWAYS_INLINE void scale_row(const T* in, T* out, std::size_t cols, float s, bool streaming) {
  if (!streaming) {
    for (std::size_t c = 0; c < cols; ++c)
      store_f32(out + c, s * load_f32(in + c));
    return;
  }
  T slice[row_slice];
  for (std::size_t c0 = 0; c0 < cols; c0 += row_slice) {
    const std::size_t n = cols - c0 < row_slice ? cols - c0 : row_slice;
    for (std::size_t c = 0; c < n; ++c)
      store_f32(slice + c, s * load_f32(in + c0 + c));
    copy_row(reinterpret_cast<std::byte*>(out + c0), reinterpret_cast<const std::byte*>(slice),
             n * sizeof(T), true);
  }
}

// How a merge loop step reads and writes its columns as fp32 lanes: one column per step, or
// for bf16 two, as one 32-bit word split into two floats (a shift and a mask) and joined back
// from two roundings (a shift and a mask again), so every vector operation stays on 32-bit lanes
// with no widening or narrowing (about 1.5x faster than a column at a time).
template <class T>
struct merge_lanes {
  static constexpr std::size_t width = 1;
  WEAVE_ALWAYS_INLINE static void load(const T* in, std::size_t u, float* x) noexcept {
    x[0] = load_f32(in + u);
  }
  WEAVE_ALWAYS_INLINE static void store(T* out, std::size_t u, const float* a) noexcept {
    store_f32(out + u, a[0]);
  }
};

template <>
struct merge_lanes<bfloat16> {
  static constexpr std::size_t width = std::endian::native == std::endian::little ? 2 : 1;
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
  // The rounding of store_f32(bfloat16*), into the low or the high half of a word.
  WEAVE_ALWAYS_INLINE static std::uint32_t rounded_high(float v) noexcept {
    const auto x = std::bit_cast<std::uint32_t>(v);
    const std::uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) & 0xffff0000u;
    const std::uint32_t quiet = (x & 0xffff0000u) | 0x400000u;
    return v != v ? quiet : rounded;
  }
  WEAVE_ALWAYS_INLINE static void store(bfloat16* out, std::size_t u, const float* a) noexcept {
    if constexpr (width == 1) {
      store_f32(out + u, a[0]);
    } else {
      const std::uint32_t word = rounded_high(a[0]) >> 16 | rounded_high(a[1]);
      std::memcpy(static_cast<void*>(out + 2 * u), &word, sizeof(word));
    }
  }
};

// One pass of a merge over `steps` loop steps (merge_lanes<T>::width columns each): per
// column, a = (First ? 0 : its accumulator), then a = a + w[j] * in[j][column] for j < N in
// order, into the accumulators (lane l of step u at acc[l * steps + u]), or rounded into out
// when Last. A pass keeps its accumulators in registers across its inputs: the operations and
// their order are those of one input at a time, and so are the bits.
template <class T, int N, bool First, bool Last>
WEAVE_ALWAYS_INLINE void merge_pass(const T* const* rows, const float* w, float* acc, T* out,
                                    std::size_t steps) {
  using lanes = merge_lanes<T>;
  constexpr std::size_t L = lanes::width;
  const T* in[N];
  float wj[N];
  for (int j = 0; j < N; ++j) {
    in[j] = rows[j];
    wj[j] = w[j];
  }
  for (std::size_t u = 0; u < steps; ++u) {
    float a[L];
    for (std::size_t l = 0; l < L; ++l)
      a[l] = First ? 0.0f : acc[l * steps + u];
    for (int j = 0; j < N; ++j) {
      float x[L];
      lanes::load(in[j], u, x);
      for (std::size_t l = 0; l < L; ++l) {
        const float product = wj[j] * x[l];
        a[l] = a[l] + product;
      }
    }
    if constexpr (Last) {
      lanes::store(out, u, a);
    } else {
      for (std::size_t l = 0; l < L; ++l)
        acc[l * steps + u] = a[l];
    }
  }
}

// A pass over `group` inputs (1..4); one that rounds into the output takes at most two (with
// more, the fused loop runs slower than a pass and a separate rounding).
template <class T, bool First, bool Last>
WEAVE_ALWAYS_INLINE void merge_pass(int group, const T* const* rows, const float* w, float* acc,
                                    T* out, std::size_t steps) {
  switch (group) {
  case 1:
    return merge_pass<T, 1, First, Last>(rows, w, acc, out, steps);
  case 2:
    return merge_pass<T, 2, First, Last>(rows, w, acc, out, steps);
  case 3:
    if constexpr (!Last)
      return merge_pass<T, 3, First, false>(rows, w, acc, out, steps);
    break;
  default:
    if constexpr (!Last)
      return merge_pass<T, 4, First, false>(rows, w, acc, out, steps);
    break;
  }
}

// out = sum over j < k with index[j] >= 0 of weight[j] * src[index[j]] (the plain sum when
// `weight` is null: weights of 1, and 1 * x is x for every x but a NaN's payload), in j order,
// fp32 accumulation, rounded once; zeros without any index. Passes take up to four inputs; the
// last one rounds straight into the output.
template <class T>
WEAVE_ALWAYS_INLINE void merge_row(const const_token_view& src, T* out, const std::int64_t* index,
                                   const float* weight, std::size_t k, bool streaming) {
  using lanes = merge_lanes<T>;
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
    T slice[row_slice];
    T* to = streaming ? slice : out + c0;
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
        merge_pass<T, true, true>(group, rows, w, acc, to, steps);
      else if (first)
        merge_pass<T, true, false>(group, rows, w, acc, to, steps);
      else if (last)
        merge_pass<T, false, true>(group, rows, w, acc, to, steps);
      else
        merge_pass<T, false, false>(group, rows, w, acc, to, steps);
      first = false;
      done = last;
    }
    if (!done)
      for (std::size_t u = 0; u < steps; ++u) { // zeros without any index
        float a[L];
        for (std::size_t l = 0; l < L; ++l)
          a[l] = first ? 0.0f : acc[l * steps + u];
        lanes::store(to, u, a);
      }
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
      copy_row(reinterpret_cast<std::byte*>(out + c0), reinterpret_cast<const std::byte*>(slice),
               n * sizeof(T), true);
  }
}

template <class T>
WEAVE_ALWAYS_INLINE void merge_loop(const const_token_view& src, const token_view& dst,
                                    const std::int64_t* index, std::size_t k, const float* weight,
                                    std::size_t rows, bool skip_empty) {
  const bool streaming = rows * dst.row_bytes() >= streaming_store_bytes;
  const auto sources = [&](std::size_t r, auto&& f) {
    for (std::size_t j = 0; j < k; ++j)
      if (index[r * k + j] >= 0)
        f(src.row(static_cast<std::size_t>(index[r * k + j])));
  };
  for (std::size_t i = 0; i < rows; ++i) {
    prefetch_sources(i, rows, src.row_bytes(), sources);
    const std::int64_t* idx = index + i * k;
    if (skip_empty && std::none_of(idx, idx + k, [](std::int64_t x) { return x >= 0; }))
      continue;
    merge_row<T>(src, reinterpret_cast<T*>(dst.row(i)), idx,
                 weight != nullptr ? weight + i * k : nullptr, k, streaming);
  }
  end_streaming(streaming);
}

// Gathers (k = 1, index by destination row) or scatters (index by source row, k per row).
template <class T, bool Scatter>
WEAVE_ALWAYS_INLINE void scale_loop(const const_token_view& src, const token_view& dst,
                                    const std::int64_t* index, std::size_t k, const float* scale,
                                    std::size_t rows) {
  const bool streaming = dst.rows() * dst.row_bytes() >= streaming_store_bytes;
  const auto sources = [&](std::size_t r, auto&& f) {
    if (index[r] >= 0)
      f(src.row(static_cast<std::size_t>(index[r])));
  };
  for (std::size_t i = 0; i < rows; ++i) {
    if constexpr (!Scatter) {
      prefetch_sources(i, rows, src.row_bytes(), sources);
      if (index[i] >= 0)
        scale_row(reinterpret_cast<const T*>(src.row(static_cast<std::size_t>(index[i]))),
                  reinterpret_cast<T*>(dst.row(i)), src.cols(), scale[i], streaming);
    } else {
      const T* in = reinterpret_cast<const T*>(src.row(i));
      for (std::size_t j = 0; j < k; ++j)
        if (index[i * k + j] >= 0)
          scale_row(in, reinterpret_cast<T*>(dst.row(static_cast<std::size_t>(index[i * k + j]))),
                    src.cols(), scale[i * k + j], streaming);
    }
  }
  end_streaming(streaming);
}

// The converting loops, once per instruction set.
template <class T>
void merge_loop_baseline(const const_token_view& src, const token_view& dst,
                         const std::int64_t* index, std::size_t k, const float* weight,
                         std::size_t rows, bool skip_empty) {
  merge_loop<T>(src, dst, index, k, weight, rows, skip_empty);
}
template <class T, bool Scatter>
void scale_loop_baseline(const const_token_view& src, const token_view& dst,
                         const std::int64_t* index, std::size_t k, const float* scale,
                         std::size_t rows) {
  scale_loop<T, Scatter>(src, dst, index, k, scale, rows);
}
#if WEAVE_HOST_AVX2_CLONE
template <class T>
WEAVE_TARGET_AVX2 void merge_loop_avx2(const const_token_view& src, const token_view& dst,
                                       const std::int64_t* index, std::size_t k,
                                       const float* weight, std::size_t rows, bool skip_empty) {
  merge_loop<T>(src, dst, index, k, weight, rows, skip_empty);
}
template <class T, bool Scatter>
WEAVE_TARGET_AVX2 void scale_loop_avx2(const const_token_view& src, const token_view& dst,
                                       const std::int64_t* index, std::size_t k, const float* scale,
                                       std::size_t rows) {
  scale_loop<T, Scatter>(src, dst, index, k, scale, rows);
}
#endif

template <bool Scatter>
void scale_rows_host(const const_token_view& src, const token_view& dst, const std::int64_t* index,
                     std::size_t k, const float* scale, std::size_t rows, host_isa isa) {
  visit_float(src.element_type(), "gate-scaled gather", [&]<class T>(T*) {
#if WEAVE_HOST_AVX2_CLONE
    if constexpr (!std::is_same_v<T, half>) // f16 converts element by element
      if (isa == host_isa::avx2)
        return scale_loop_avx2<T, Scatter>(src, dst, index, k, scale, rows);
#endif
    (void)isa;
    scale_loop_baseline<T, Scatter>(src, dst, index, k, scale, rows);
  });
}

// dst[i] = src[index[i]] (times scale[i] when `scale` is not null) for i < rows; rows with a
// negative index are left as they are.
inline void gather_rows_host(const const_token_view& src, const token_view& dst,
                             const std::int64_t* index, const float* scale, std::size_t rows,
                             host_isa isa = detected_host_isa()) {
  if (scale != nullptr)
    return scale_rows_host<false>(src, dst, index, 1, scale, rows, isa);
  const std::size_t bytes = src.row_bytes();
  const bool streaming = dst.rows() * bytes >= streaming_store_bytes;
  const auto sources = [&](std::size_t r, auto&& f) {
    if (index[r] >= 0)
      f(src.row(static_cast<std::size_t>(index[r])));
  };
  for (std::size_t i = 0; i < rows; ++i) {
    prefetch_sources(i, rows, bytes, sources);
    if (index[i] >= 0)
      copy_row(dst.row(i), src.row(static_cast<std::size_t>(index[i])), bytes, streaming);
  }
  end_streaming(streaming);
}

// The inverse of a gather: dst[index[i*k + j]] = src[i] (times scale[i*k + j] when `scale` is
// not null) for i < rows and j < k with index >= 0. Each source row is read once, in order, and
// written where it goes; the writes need no reads, so with non-temporal stores this beats a
// gather of scattered rows. Each destination row must appear at most once.
inline void scatter_rows_host(const const_token_view& src, const token_view& dst,
                              const std::int64_t* index, std::size_t k, const float* scale,
                              std::size_t rows, host_isa isa = detected_host_isa()) {
  if (scale != nullptr)
    return scale_rows_host<true>(src, dst, index, k, scale, rows, isa);
  const std::size_t bytes = src.row_bytes();
  const bool streaming = dst.rows() * bytes >= streaming_store_bytes;
  for (std::size_t i = 0; i < rows; ++i)
    for (std::size_t j = 0; j < k; ++j)
      if (index[i * k + j] >= 0)
        copy_row(dst.row(static_cast<std::size_t>(index[i * k + j])), src.row(i), bytes, streaming);
  end_streaming(streaming);
}

// dst[i] = the merge of src rows index[i*k .. i*k+k) (weights weight[i*k ..] when not null) for
// i < rows; with `skip_empty`, rows without any index are left as they are, else zeroed.
inline void merge_rows_host(const const_token_view& src, const token_view& dst,
                            const std::int64_t* index, std::size_t k, const float* weight,
                            std::size_t rows, bool skip_empty, host_isa isa = detected_host_isa()) {
  visit_float(src.element_type(), "merge", [&]<class T>(T*) {
#if WEAVE_HOST_AVX2_CLONE
    if constexpr (!std::is_same_v<T, half>) // f16 converts element by element
      if (isa == host_isa::avx2)
        return merge_loop_avx2<T>(src, dst, index, k, weight, rows, skip_empty);
#endif
    (void)isa;
    merge_loop_baseline<T>(src, dst, index, k, weight, rows, skip_empty);
  });
}

} // namespace detail

WEAVE_NAMESPACE_END
