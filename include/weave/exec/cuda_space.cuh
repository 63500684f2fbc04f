//! \file
//! `cuda_space`: the execution space of weave's device algorithms on CUDA streams (compiled by
//! the consumer's nvcc; component `weave::cuda`). Steps are grid-stride kernels over the same
//! functors `host_space` runs on the host; sorts and scans are CUB's, with scratch carved from
//! the algorithm's workspace; copies and fills are stream-ordered runtime calls. `on_host`
//! synchronizes the stream (the one place a device algorithm waits for the GPU: dynamic shapes
//! need counts on the host).
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/cuda_error.hpp"
#include "weave/core/memory.hpp"
#include "weave/exec/cuda_stream.hpp"
#include "weave/exec/space.hpp"

#include <cub/cub.cuh>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>

WEAVE_NAMESPACE_BEGIN

namespace detail {

template <class F>
__global__ void for_each_kernel(std::int64_t n, F f) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride)
    f(i);
}

template <class F>
__global__ void for_each_counted_kernel(const std::int64_t* count, std::int64_t bound, F f) {
  const std::int64_t n = *count < bound ? *count : bound;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride)
    f(i);
}

inline constexpr unsigned space_threads = 256;

inline unsigned space_blocks(std::int64_t n) {
  const std::int64_t blocks = (n + space_threads - 1) / space_threads;
  return static_cast<unsigned>(blocks < 65536 ? (blocks < 1 ? 1 : blocks) : 65536);
}

} // namespace detail

//! Runs device algorithms on borrowed CUDA streams.
struct cuda_space {
  using stream_type = cuda_stream_ref;
  using stream_arg = cuda_stream_ref;
  static constexpr memory_space memory = memory_space::device;
  static constexpr bool runs_later = false; // host code runs at enqueue time

  template <class F>
  static void for_each(stream_arg s, std::int64_t n, F f) {
    if (n <= 0)
      return;
    detail::for_each_kernel<<<detail::space_blocks(n), detail::space_threads, 0, s.get()>>>(n, f);
    WEAVE_CUDA_CHECK(cudaGetLastError());
  }

  template <class F>
  static void for_each_counted(stream_arg s, const std::int64_t* count, std::int64_t bound, F f) {
    if (bound <= 0)
      return;
    detail::
        for_each_counted_kernel<<<detail::space_blocks(bound), detail::space_threads, 0, s.get()>>>(
            count, bound, f);
    WEAVE_CUDA_CHECK(cudaGetLastError());
  }

  static void fill(stream_arg s, void* p, int byte, std::size_t bytes) {
    if (bytes != 0)
      WEAVE_CUDA_CHECK(cudaMemsetAsync(p, byte, bytes, s.get()));
  }

  static void copy(stream_arg s, void* dst, const void* src, std::size_t bytes) {
    if (bytes != 0)
      WEAVE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s.get()));
  }

  static void copy_to_host(stream_arg s, void* dst, const void* src, std::size_t bytes) {
    if (bytes != 0)
      WEAVE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s.get()));
  }

  static void copy_from_host(stream_arg s, void* dst, const void* src, std::size_t bytes) {
    if (bytes != 0)
      WEAVE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s.get()));
  }

  //! Stream-ordered device memory (`stream_allocator`'s default): the current device's pool
  //! (`cudaMallocAsync`); freed with `cudaFreeAsync` on `s`, or `cudaFree` for a null `s`.
  static void* allocate_async(std::size_t bytes, cuda_stream_ref s) {
    void* p = nullptr;
    WEAVE_CUDA_CHECK(cudaMallocAsync(&p, bytes == 0 ? 1 : bytes, s.get()));
    return p;
  }
  static void free_async(void* p, std::size_t /*bytes*/, const cuda_stream_ref* s) noexcept {
    if (s != nullptr)
      (void)cudaFreeAsync(p, s->get());
    else
      (void)cudaFree(p);
  }

  //! Pinned host memory (`cudaMallocHost`): copies into and out of it are asynchronous, so the
  //! host blocks only where it waits for the stream (see `host_mirror`).
  static void* allocate_host(std::size_t bytes) {
    void* p = nullptr;
    WEAVE_CUDA_CHECK(cudaMallocHost(&p, bytes == 0 ? 1 : bytes));
    return p;
  }
  static void free_host(void* p) noexcept { (void)cudaFreeHost(p); }

  //! Waits for the stream, then runs `f()` on the calling thread.
  template <class F>
  static void on_host(stream_arg s, F&& f) {
    s.synchronize();
    std::forward<F>(f)();
  }

  //! True while `s` is being captured into a CUDA graph (work that waits for the GPU on the
  //! host cannot be captured).
  static bool is_capturing(stream_arg s) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    WEAVE_CUDA_CHECK(cudaStreamIsCapturing(s.get(), &status));
    return status != cudaStreamCaptureStatusNone;
  }

  //! Calls `f(s)` now; `f` enqueues its work on `s`.
  template <class F>
  static void launch(stream_arg s, F f) {
    f(s);
  }

  // CUB picks its offset type from the type of the item count: a 32-bit count selects the
  // cheaper 32-bit-offset kernels, which every caller's sizes fit (plans check n < 2^31).
  static int cub_items(std::int64_t n) {
    WEAVE_EXPECT(n >= 0 && n <= std::numeric_limits<int>::max(), errc::size_overflow, n,
                 " items exceed the 32-bit item counts of the device sorts and scans");
    return static_cast<int>(n);
  }

  static std::size_t sort_temp_bytes(std::int64_t n) {
    std::size_t bytes = 0;
    WEAVE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
        nullptr, bytes, static_cast<const std::uint32_t*>(nullptr),
        static_cast<std::uint32_t*>(nullptr), static_cast<const std::int32_t*>(nullptr),
        static_cast<std::int32_t*>(nullptr), cub_items(n)));
    return bytes;
  }

  static std::size_t scan_temp_bytes(std::int64_t n) {
    std::size_t bytes = 0;
    WEAVE_CUDA_CHECK(
        cub::DeviceScan::ExclusiveSum(nullptr, bytes, static_cast<const std::int64_t*>(nullptr),
                                      static_cast<std::int64_t*>(nullptr), cub_items(n)));
    return bytes;
  }

  static void sort_pairs(stream_arg s, const std::uint32_t* keys_in, std::uint32_t* keys_out,
                         const std::int32_t* values_in, std::int32_t* values_out, std::int64_t n,
                         int bits, void* temp, std::size_t temp_bytes) {
    if (n <= 0)
      return;
    std::size_t bytes = temp_bytes;
    WEAVE_EXPECT(sort_temp_bytes(n) <= bytes, errc::invalid_state, "sort scratch of ", bytes,
                 " bytes is too small for ", n, " pairs");
    WEAVE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, bytes, keys_in, keys_out, values_in,
                                                     values_out, cub_items(n), 0, bits, s.get()));
  }

  static void exclusive_scan(stream_arg s, const std::int64_t* in, std::int64_t* out,
                             std::int64_t n, void* temp, std::size_t temp_bytes) {
    if (n <= 0)
      return;
    std::size_t bytes = temp_bytes;
    WEAVE_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(temp, bytes, in, out, cub_items(n), s.get()));
  }
};

static_assert(execution_space<cuda_space>);

WEAVE_NAMESPACE_END
