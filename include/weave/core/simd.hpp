//! \file
//! Eight 32-bit lanes, written out: the host row kernels' arithmetic in vectors that do not
//! depend on the compiler's auto-vectoriser, so that they run as fast at the consumer's -O2 as at
//! -O3 (weave is header-only: the consumer's flags compile its kernels). GCC and Clang lower the
//! vector extensions to what the target has (two SSE registers, or one AVX register inside the
//! kernels' AVX2 clones); other compilers get `WEAVE_SIMD == 0` and the kernels' scalar loops.
//! Every operation is lane by lane and exact (IEEE add and multiply), so results are bitwise those
//! of the scalar code.
//!
//! No function here takes or returns a vector by value: a 32-byte vector crossing a call changes
//! the ABI without AVX, which GCC reports (-Wpsabi) at the end of the consumer's translation
//! unit, out of reach of a diagnostic pragma. Loads, stores and conversions write through
//! references, and the arithmetic is the extensions' own operators.
#pragma once

#include "weave/core/config.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#if defined(__GNUC__) || defined(__clang__)
#define WEAVE_SIMD 1
#define WEAVE_SIMD_INLINE [[gnu::always_inline]] inline
// Unrolls the next loop (of a constant trip count) whole: GCC does it at -O3 but at -O2 only
// where the code does not grow, and a loop over a kernel's inputs left rolled keeps its vectors
// in memory. WEAVE_UNROLL_BY(n): n times. (nvcc's front end does not know the pragma: CUDA
// sources leave it to the host compiler's level.)
#if defined(__CUDACC__)
#define WEAVE_UNROLL
#define WEAVE_UNROLL_BY(n)
#else
#define WEAVE_UNROLL_BY(n) _Pragma(WEAVE_UNROLL_TEXT(GCC unroll n))
#define WEAVE_UNROLL_TEXT(x) #x
#define WEAVE_UNROLL WEAVE_UNROLL_BY(8)
#endif
#else
#define WEAVE_SIMD 0
#define WEAVE_UNROLL
#define WEAVE_UNROLL_BY(n)
#endif

WEAVE_NAMESPACE_BEGIN

namespace detail::simd {

//! Lanes per vector.
inline constexpr std::size_t lanes = 8;

#if WEAVE_SIMD
using f32x8 = float __attribute__((vector_size(32)));
using u32x8 = std::uint32_t __attribute__((vector_size(32)));

using u16x8 = std::uint16_t __attribute__((vector_size(16)));
using u8x8 = std::uint8_t __attribute__((vector_size(8)));

// A vector at any address, allowed to alias anything: a load or store through it is one
// unaligned vector move. (A packed struct, because Clang ignores a smaller `aligned` on a vector
// typedef and moves it as aligned; memcpy into a vector variable can go through the stack in
// halves and stall on store forwarding.)
template <class V>
struct __attribute__((packed, may_alias)) unaligned {
  V v;
};

//! `v` = the lanes at `p` (any alignment).
template <class V>
WEAVE_SIMD_INLINE void load(V& v, const void* p) noexcept {
  v = static_cast<const unaligned<V>*>(p)->v;
}
//! The lanes at `p` (any alignment) = `v`.
template <class V>
WEAVE_SIMD_INLINE void store(void* p, const V& v) noexcept {
  static_cast<unaligned<V>*>(p)->v = v;
}

//! `out` = the bits of `in` (vectors of one size).
template <class To, class From>
WEAVE_SIMD_INLINE void bits(To& out, const From& in) noexcept {
  static_assert(sizeof(To) == sizeof(From));
  out = reinterpret_cast<To>(in); // GCC's and Clang's vector casts keep the bits
}

//! `v` = the eight bfloat16 values at `p` (any alignment), widened exactly to fp32.
WEAVE_SIMD_INLINE void load_bf16(f32x8& v, const void* p) noexcept {
  u16x8 halves;
  load(halves, p);
  bits(v, __builtin_convertvector(halves, u32x8) << 16);
}

//! The eight bytes at `p` = each lane of `v`, every lane below 256.
WEAVE_SIMD_INLINE void store_bytes(void* p, const u32x8& v) noexcept {
#if defined(__SSE2__)
  // Two saturating packs (exact for lanes below 256): baseline x86-64 has no narrowing shuffle,
  // and GCC builds `__builtin_convertvector` from scalar moves there.
  __m128i half[2];
  std::memcpy(half, &v, sizeof(half));
  const __m128i words = _mm_packs_epi32(half[0], half[1]);
  _mm_storel_epi64(static_cast<__m128i*>(p), _mm_packus_epi16(words, words));
#else
  store(p, __builtin_convertvector(v, u8x8));
#endif
}

//! The eight 16-bit values at `p` = the high halves of the lanes of `v`.
WEAVE_SIMD_INLINE void store_high_halves(void* p, const u32x8& v) noexcept {
#if defined(__SSE2__)
  // Sign-extended high halves pack exactly with signed saturation.
  __m128i half[2];
  std::memcpy(half, &v, sizeof(half));
  _mm_storeu_si128(static_cast<__m128i*>(p),
                   _mm_packs_epi32(_mm_srai_epi32(half[0], 16), _mm_srai_epi32(half[1], 16)));
#else
  store(p, __builtin_convertvector(v >> 16, u16x8));
#endif
}

//! `out` = all ones in the lanes where `a` > `b`, else zero, for lanes below 2^31: the sign of
//! b - a, spread. (GCC compares 32-byte vectors lane by lane in scalar code where the target
//! has only 16-byte vectors; subtractions and shifts it splits.)
WEAVE_SIMD_INLINE void greater(u32x8& out, const u32x8& a, const u32x8& b) noexcept {
  out = 0u - ((b - a) >> 31);
}

//! Every lane of `out` = `x`.
WEAVE_SIMD_INLINE void splat(f32x8& out, float x) noexcept {
  // Through memory: GCC 12 sees an assignment of a vector literal to an array element as a read
  // of that element (-Wmaybe-uninitialized with -ffast-math).
  const float all[lanes] = {x, x, x, x, x, x, x, x};
  load(out, all);
}

//! `out` = bfloat16(v) of each lane in its high half, low half zero: nearest even, a NaN kept a
//! NaN (quieted), told by its bits (so also under fast math). The lanes of the scalar
//! `bf16_rounded_high`.
WEAVE_SIMD_INLINE void bf16_rounded_high(u32x8& out, const f32x8& v) noexcept {
  u32x8 x, nan;
  bits(x, v);
  const u32x8 rounded = (x + 0x7fffu + ((x >> 16) & 1u)) & 0xffff0000u;
  const u32x8 quiet = (x & 0xffff0000u) | 0x400000u;
  greater(nan, x & 0x7fffffffu, u32x8{} + 0x7f800000u); // all ones in a NaN's lane
  out = (quiet & nan) | (rounded & ~nan);
}

#if defined(__x86_64__)
#define WEAVE_SIMD_BF16_NATIVE 1
#if defined(__clang__)
#define WEAVE_SIMD_AVX512_HELPER                                                                   \
  __attribute__((target("avx2,avx512f,avx512vl,avx512bw,avx512dq"))) inline
#else
#define WEAVE_SIMD_AVX512_HELPER WEAVE_SIMD_INLINE
#endif
using u16x16 = std::uint16_t __attribute__((vector_size(32)));

//! Stores bfloat16(even[i]) and bfloat16(odd[i]) at `p` as 16 values interleaved (even first),
//! rounded by the CPU's own conversion (VCVTNE2PS2BF16: nearest even, a NaN quieted, exactly
//! `bf16_rounded_high`), and returns true; returns false and stores nothing when a lane is
//! subnormal, which that instruction would flush to zero. Run it only on a CPU with AVX-512 BF16
//! and VL, from a function compiled for AVX-512. (Written as assembly: a helper without the
//! intrinsics' target cannot call them. GCC inlines it anywhere and checks the operands where it
//! lands; Clang checks them in the helper, so there it carries the target, and its inliner takes
//! it into callers of that target only.)
WEAVE_SIMD_AVX512_HELPER bool bf16_pairs_native(void* p, const f32x8& even,
                                                const f32x8& odd) noexcept {
  unsigned char subnormal_even = 0, subnormal_odd = 0;
  asm("vfpclassps $0x20, %1, %0" : "=k"(subnormal_even) : "v"(even));
  asm("vfpclassps $0x20, %1, %0" : "=k"(subnormal_odd) : "v"(odd));
  if ((subnormal_even | subnormal_odd) != 0) [[unlikely]]
    return false;
  const u16x16 interleave = {0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15};
  u16x16 halves; // bfloat16(even) in values 0-7, bfloat16(odd) in 8-15
  asm("vcvtne2ps2bf16 %1, %2, %0" : "=v"(halves) : "v"(even), "v"(odd));
  asm("vpermw %1, %2, %0" : "=v"(halves) : "v"(halves), "v"(interleave));
  store(p, halves);
  return true;
}
#endif
#endif

} // namespace detail::simd

WEAVE_NAMESPACE_END
