//! \file
//! Moving host rows at memory speed: a 16-byte row copy with non-temporal stores for outputs
//! larger than the caches. Used by the host row kernels (`weave/routing/host_row_kernels.hpp`).
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

// Bytes a call writes from which row copies use non-temporal stores: beyond the caches, the
// destination's lines would be read before being overwritten and evict everything else.
inline constexpr std::size_t streaming_store_bytes = std::size_t{16} << 20;

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
