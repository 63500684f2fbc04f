//! \file
//! Execution spaces: where the data-parallel steps of weave's device algorithms run.
//!
//! An algorithm written once against a space runs on host streams (`host_space`, here: each
//! step is a task that visits its indices in order on the stream's thread) or on CUDA streams
//! (`cuda_space` in `weave/exec/cuda_space.cuh`: each step is a kernel, sorts and scans are
//! CUB's). A step is a functor with `WEAVE_HOST_DEVICE void operator()(std::int64_t i) const`
//! over raw pointers, so the same code is compiled for both. Within one step the host visits
//! i = 0, 1, ... in order, so `atomic_add` there is a plain add; steps whose results do not
//! depend on the order of their atomics give identical results in both spaces.
//!
//! The host space is what CI runs: it checks the orchestration and every step of the device
//! algorithms against the host reference implementations, without a GPU.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/float_bits.hpp" // detail::is_finite and the other checks of the steps
#include "weave/core/memory.hpp"

#include <cmath>
#include <concepts>
#include <cstddef>
#include <cstdint>

WEAVE_NAMESPACE_BEGIN

namespace detail {

WEAVE_HOST_DEVICE inline void atomic_add(unsigned long long* p, unsigned long long v) {
#ifdef __CUDA_ARCH__
  atomicAdd(p, v);
#else
  *p += v;
#endif
}

WEAVE_HOST_DEVICE inline void atomic_add(std::uint32_t* p, std::uint32_t v) {
#ifdef __CUDA_ARCH__
  atomicAdd(reinterpret_cast<unsigned int*>(p), static_cast<unsigned int>(v));
#else
  *p += v;
#endif
}

WEAVE_HOST_DEVICE inline void atomic_add(std::int64_t* p, std::int64_t v) {
  atomic_add(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
}

WEAVE_HOST_DEVICE inline void atomic_or(std::uint32_t* p, std::uint32_t v) {
#ifdef __CUDA_ARCH__
  atomicOr(reinterpret_cast<unsigned int*>(p), static_cast<unsigned int>(v));
#else
  *p |= v;
#endif
}

// True for the one caller that finds `*p` zero (and sets it): who records a first occurrence
// among a step's indices.
WEAVE_HOST_DEVICE inline bool atomic_claim(std::uint32_t* p) {
#ifdef __CUDA_ARCH__
  return atomicExch(reinterpret_cast<unsigned int*>(p), 1u) == 0u;
#else
  const bool first = *p == 0;
  *p = 1;
  return first;
#endif
}

} // namespace detail

//! What a space provides to weave's device algorithms (see `host_space` in
//! `weave/exec/host_space.hpp` for the meaning of each member).
template <class S>
concept execution_space = requires {
  typename S::stream_type;
  typename S::stream_arg;
  { S::memory } -> std::convertible_to<memory_space>;
  { S::runs_later } -> std::convertible_to<bool>;
}
&&requires(typename S::stream_arg s, void* p, const void* q, std::int64_t n,
           const std::int64_t* count, std::uint32_t* keys, std::int32_t* values) {
  S::fill(s, p, 0, std::size_t{1});
  S::copy(s, p, q, std::size_t{1});
  S::copy_to_host(s, p, q, std::size_t{1});
  S::copy_from_host(s, p, q, std::size_t{1});
  { S::sort_temp_bytes(n) } -> std::convertible_to<std::size_t>;
  { S::scan_temp_bytes(n) } -> std::convertible_to<std::size_t>;
  S::sort_pairs(s, keys, keys, values, values, n, 1, p, std::size_t{0});
  S::exclusive_scan(s, count, const_cast<std::int64_t*>(count), n, p, std::size_t{0});
};

//! True for a space whose steps visit their indices in order on one thread (`host_space::serial`):
//! an algorithm may then hand a step a group of indices at once (see `host_space`).
template <class S>
inline constexpr bool serial_space = [] {
  if constexpr (requires { S::serial; })
    return static_cast<bool>(S::serial);
  else
    return false;
}();

//! Enqueues on `s` the copy of the error word `word` (memory of the space) into `*host` and
//! its clearing; `*host` is valid once the caller synchronizes the stream.
template <execution_space Space>
void take_error_word(typename Space::stream_arg s, std::uint32_t* host, std::uint32_t* word) {
  Space::copy_to_host(s, host, word, sizeof(std::uint32_t));
  Space::fill(s, word, 0, sizeof(std::uint32_t));
}

WEAVE_NAMESPACE_END
