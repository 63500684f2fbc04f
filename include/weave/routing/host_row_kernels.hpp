//! \file
//! The row loops under the host kernels (`gather_rows`, `merge_rows` and the host-stream
//! `row_moves<host_space>`), written to run at memory speed:
//! - scattered source rows are left to the hardware prefetcher (a software prefetch of the rows
//!   ahead helped the gathers of one row and slowed the merges of several; docs/perf.md);
//! - rows are copied by a 16-byte vector loop, with non-temporal stores once a call writes more
//!   than the caches hold (`streaming_store_bytes`), so the destination is not read first;
//! - the layout moves that have the inverse map scatter instead of gather: each source row is
//!   read once, in order, and written where it goes (writes do not stall; scattered reads do);
//! - merges accumulate up to four input rows per pass in registers, fp32, in index order, and
//!   round bf16 without branches, two columns per 32-bit word, so GCC and Clang vectorise the
//!   loops (`weave/routing/host_merge_row.hpp`);
//! - on x86-64 with GCC or Clang the converting loops are compiled twice more, for AVX2 and for
//!   AVX-512 (F, VL, BW, DQ: the same eight-lane vectors, with mask compares and three-input
//!   logic; bf16 rows once more where the CPU has AVX-512 BF16, rounded by its conversion), and
//!   the best copy the CPU runs is taken; products and sums are not fused (GCC:
//!   under any flags; Clang: unless built with -ffp-contract=fast), so every one rounds as in
//!   the baseline build.
//! Results equal the element-by-element definition bitwise (same operations, same order); only
//! the payload and sign of a NaN result may differ (IEEE 754 leaves them open, and compilers may
//! swap the operands of an addition).
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/dtype.hpp"
#include "weave/core/error.hpp"
#include "weave/core/tensor.hpp"
#include "weave/routing/host_merge_row.hpp"
#include "weave/routing/host_row_copy.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#include <cpuid.h>
#define WEAVE_HOST_AVX2_CLONE 1
#define WEAVE_TARGET_AVX2 __attribute__((target("avx2")))
#define WEAVE_TARGET_AVX512 __attribute__((target("avx2,avx512f,avx512vl,avx512bw,avx512dq")))
#else
#define WEAVE_HOST_AVX2_CLONE 0
#define WEAVE_TARGET_AVX2
#endif

// The converting loops' multiplies and adds stay unfused: GCC fuses them under its GNU default
// (-ffp-contract=fast) wherever the target has FMA, which the AVX-512 copy always has and the
// others have under -mfma or -march=native, so each loop switches contraction off for itself.
// Clang fuses across statements only when asked (-ffp-contract=fast, which also ignores its
// pragmas); its default keeps the kernels' separate products and sums apart.
#if defined(__GNUC__) && !defined(__clang__)
#define WEAVE_UNFUSED __attribute__((optimize("fp-contract=off")))
#else
#define WEAVE_UNFUSED
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

//! Instruction sets the converting loops are compiled for, each a superset of the one before.
enum class host_isa : std::uint8_t {
  baseline,    //!< what the translation unit is compiled for
  avx2,        //!< x86-64 AVX2 (GCC and Clang builds only)
  avx512,      //!< x86-64 AVX-512 F/VL/BW/DQ on 256-bit vectors (GCC and Clang builds only)
  avx512_bf16, //!< and AVX-512 BF16: bf16 rows rounded by the CPU's conversion
};

#if WEAVE_HOST_AVX2_CLONE
// CPUID leaf 7, subleaf 1, EAX bit 5 (the OS's support of the AVX-512 state is the caller's
// test of AVX-512 VL).
inline bool cpu_has_avx512_bf16() noexcept {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid_count(7, 1, &a, &b, &c, &d) != 0 && (a & (1u << 5)) != 0;
}
#endif

//! The best of `host_isa` this CPU runs.
inline host_isa detected_host_isa() noexcept {
#if WEAVE_HOST_AVX2_CLONE
  static const host_isa isa = [] {
    if (!__builtin_cpu_supports("avx2"))
      return host_isa::baseline;
    if (!__builtin_cpu_supports("avx512vl") || !__builtin_cpu_supports("avx512bw") ||
        !__builtin_cpu_supports("avx512dq"))
      return host_isa::avx2;
    return cpu_has_avx512_bf16() ? host_isa::avx512_bf16 : host_isa::avx512;
  }();
  return isa;
#else
  return host_isa::baseline;
#endif
}

template <class T, class Lanes = merge_lanes<T>>
WEAVE_ALWAYS_INLINE void merge_loop(const const_token_view& src, const token_view& dst,
                                    const std::int64_t* index, std::size_t k, const float* weight,
                                    std::size_t rows, bool skip_empty) {
  const bool streaming = rows * dst.row_bytes() >= streaming_store_bytes;
  for (std::size_t i = 0; i < rows; ++i) {
    const std::int64_t* idx = index + i * k;
    if (skip_empty && std::none_of(idx, idx + k, [](std::int64_t x) { return x >= 0; }))
      continue;
    merge_row<T, Lanes>(src, reinterpret_cast<T*>(dst.row(i)), idx,
                        weight != nullptr ? weight + i * k : nullptr, k, streaming);
  }
  end_streaming(streaming);
}

// Gathers (k = 1, index by destination row) or scatters (index by source row, k per row).
template <class T, bool Scatter, class Lanes = merge_lanes<T>>
WEAVE_ALWAYS_INLINE void scale_loop(const const_token_view& src, const token_view& dst,
                                    const std::int64_t* index, std::size_t k, const float* scale,
                                    std::size_t rows) {
  const bool streaming = dst.rows() * dst.row_bytes() >= streaming_store_bytes;
  for (std::size_t i = 0; i < rows; ++i) {
    if constexpr (!Scatter) {
      if (index[i] >= 0)
        scale_row<T, Lanes>(reinterpret_cast<const T*>(src.row(static_cast<std::size_t>(index[i]))),
                            reinterpret_cast<T*>(dst.row(i)), src.cols(), scale[i], streaming);
    } else {
      const T* in = reinterpret_cast<const T*>(src.row(i));
      for (std::size_t j = 0; j < k; ++j)
        if (index[i * k + j] >= 0)
          scale_row<T, Lanes>(
              in, reinterpret_cast<T*>(dst.row(static_cast<std::size_t>(index[i * k + j]))),
              src.cols(), scale[i * k + j], streaming);
    }
  }
  end_streaming(streaming);
}

// The converting loops, once per instruction set.
template <class T>
WEAVE_UNFUSED void merge_loop_baseline(const const_token_view& src, const token_view& dst,
                                       const std::int64_t* index, std::size_t k,
                                       const float* weight, std::size_t rows, bool skip_empty) {
  merge_loop<T>(src, dst, index, k, weight, rows, skip_empty);
}
template <class T, bool Scatter>
WEAVE_UNFUSED void scale_loop_baseline(const const_token_view& src, const token_view& dst,
                                       const std::int64_t* index, std::size_t k, const float* scale,
                                       std::size_t rows) {
  scale_loop<T, Scatter>(src, dst, index, k, scale, rows);
}
#if WEAVE_HOST_AVX2_CLONE
template <class T>
WEAVE_TARGET_AVX2 WEAVE_UNFUSED void
merge_loop_avx2(const const_token_view& src, const token_view& dst, const std::int64_t* index,
                std::size_t k, const float* weight, std::size_t rows, bool skip_empty) {
  merge_loop<T>(src, dst, index, k, weight, rows, skip_empty);
}
template <class T>
WEAVE_TARGET_AVX512 WEAVE_UNFUSED void
merge_loop_avx512(const const_token_view& src, const token_view& dst, const std::int64_t* index,
                  std::size_t k, const float* weight, std::size_t rows, bool skip_empty) {
  merge_loop<T>(src, dst, index, k, weight, rows, skip_empty);
}
template <class T, bool Scatter>
WEAVE_TARGET_AVX512 WEAVE_UNFUSED void
scale_loop_avx512(const const_token_view& src, const token_view& dst, const std::int64_t* index,
                  std::size_t k, const float* scale, std::size_t rows) {
  scale_loop<T, Scatter>(src, dst, index, k, scale, rows);
}
template <class T, bool Scatter>
WEAVE_TARGET_AVX2 WEAVE_UNFUSED void
scale_loop_avx2(const const_token_view& src, const token_view& dst, const std::int64_t* index,
                std::size_t k, const float* scale, std::size_t rows) {
  scale_loop<T, Scatter>(src, dst, index, k, scale, rows);
}
// bf16 rows rounded by the CPU's conversion (`merge_lanes_bf16_native`).
WEAVE_TARGET_AVX512 WEAVE_UNFUSED inline void
merge_loop_avx512_bf16(const const_token_view& src, const token_view& dst,
                       const std::int64_t* index, std::size_t k, const float* weight,
                       std::size_t rows, bool skip_empty) {
  merge_loop<bfloat16, merge_lanes_bf16_native>(src, dst, index, k, weight, rows, skip_empty);
}
template <bool Scatter>
WEAVE_TARGET_AVX512 WEAVE_UNFUSED void
scale_loop_avx512_bf16(const const_token_view& src, const token_view& dst,
                       const std::int64_t* index, std::size_t k, const float* scale,
                       std::size_t rows) {
  scale_loop<bfloat16, Scatter, merge_lanes_bf16_native>(src, dst, index, k, scale, rows);
}
#endif

template <bool Scatter>
void scale_rows_host(const const_token_view& src, const token_view& dst, const std::int64_t* index,
                     std::size_t k, const float* scale, std::size_t rows, host_isa isa) {
  visit_float(src.element_type(), "gate-scaled gather", [&]<class T>(T*) {
#if WEAVE_HOST_AVX2_CLONE
    if constexpr (!std::is_same_v<T, half>) { // f16 converts element by element
      if constexpr (std::is_same_v<T, bfloat16>)
        if (isa >= host_isa::avx512_bf16)
          return scale_loop_avx512_bf16<Scatter>(src, dst, index, k, scale, rows);
      if (isa >= host_isa::avx512)
        return scale_loop_avx512<T, Scatter>(src, dst, index, k, scale, rows);
      if (isa == host_isa::avx2)
        return scale_loop_avx2<T, Scatter>(src, dst, index, k, scale, rows);
    }
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
  for (std::size_t i = 0; i < rows; ++i) {
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
    if constexpr (!std::is_same_v<T, half>) { // f16 converts element by element
      if constexpr (std::is_same_v<T, bfloat16>)
        if (isa >= host_isa::avx512_bf16)
          return merge_loop_avx512_bf16(src, dst, index, k, weight, rows, skip_empty);
      if (isa >= host_isa::avx512)
        return merge_loop_avx512<T>(src, dst, index, k, weight, rows, skip_empty);
      if (isa == host_isa::avx2)
        return merge_loop_avx2<T>(src, dst, index, k, weight, rows, skip_empty);
    }
#endif
    (void)isa;
    merge_loop_baseline<T>(src, dst, index, k, weight, rows, skip_empty);
  });
}

} // namespace detail

WEAVE_NAMESPACE_END
