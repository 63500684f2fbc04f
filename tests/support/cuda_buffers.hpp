// Device buffers and streams for the CUDA tests: poisoned device memory freed at scope exit, a
// copy back to the host, and an owned stream.
//
// The streams are non-blocking, so the legacy-stream copies other rank threads issue never add
// implicit device-wide ordering that could hide a missing dependency in the code under test.
// In exchange, every host-side upload, poison and read here synchronizes the whole device
// (a pageable cudaMemcpy/cudaMemset is not ordered with non-blocking streams).
#pragma once

#include <weave/core/cuda_error.hpp>
#include <weave/exec/cuda_stream.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <span>
#include <vector>

namespace weave_test {

// Device memory of n elements, poisoned with 0xFF bytes, freed at scope exit.
template <class T>
struct dev {
  T* ptr = nullptr;
  std::size_t size = 0;
  explicit dev(std::size_t n)
      : size(n) {
    WEAVE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&ptr), n * sizeof(T) + 256));
    poison();
  }
  explicit dev(const std::vector<T>& host)
      : dev(host.size()) {
    if (!host.empty())
      WEAVE_CUDA_CHECK(
          cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    WEAVE_CUDA_CHECK(cudaDeviceSynchronize());
  }
  ~dev() { (void)cudaFree(ptr); }
  dev(const dev&) = delete;
  void poison() {
    WEAVE_CUDA_CHECK(cudaMemset(ptr, 0xFF, size * sizeof(T) + 256));
    WEAVE_CUDA_CHECK(cudaDeviceSynchronize());
  }
  std::span<T> span() { return {ptr, size}; }
  std::span<const T> cspan() const { return {ptr, size}; }
};

template <class T>
std::vector<T> to_host(std::span<const T> d) {
  std::vector<T> out(d.size());
  WEAVE_CUDA_CHECK(cudaDeviceSynchronize());
  if (!d.empty())
    WEAVE_CUDA_CHECK(cudaMemcpy(out.data(), d.data(), d.size_bytes(), cudaMemcpyDeviceToHost));
  return out;
}

struct stream_holder {
  cudaStream_t raw = nullptr;
  stream_holder() { WEAVE_CUDA_CHECK(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking)); }
  ~stream_holder() { (void)cudaStreamDestroy(raw); }
  weave::cuda_stream_ref ref() const { return weave::cuda_stream_ref(raw); }
};

} // namespace weave_test
