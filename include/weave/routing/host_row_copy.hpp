//! \file
//! Moving host rows at memory speed: two-stage prefetch of scattered source rows, and a 16-byte
//! row copy with non-temporal stores for outputs larger than the caches. Used by the host row
//! kernels (`weave/routing/host_row_kernels.hpp`).
#pragma once

#include "weave/core/config.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#if defined(__GNUC__) || defined(__clang__)
#define WEAVE_ALWAYS_INLINE [[gnu::always_inline]] inline
#else
#define WEAVE_ALWAYS_INLINE inline
#endif

WEAVE_NAMESPACE_BEGIN

namespace detail {

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

} // namespace detail

WEAVE_NAMESPACE_END
