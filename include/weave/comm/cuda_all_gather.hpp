//! \file
//! The blocking all-gather of the device communicators' setup-time agreement (component
//! `weave::cuda`): the words go through a temporary device buffer and stream, because their
//! count exchanges work on device memory.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/cuda_error.hpp"
#include "weave/exec/cuda_stream.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

WEAVE_NAMESPACE_BEGIN

namespace detail {

//! `mine` from each of `ranks` ranks, rank-major: `exchange(stream, send, recv)` enqueues a count
//! exchange of device memory and `wait(stream)` waits for it (through the communicator where it
//! watches its waits). Allocates; for setup only.
template <class Exchange, class Wait>
std::vector<std::int64_t> all_gather_through_device(int ranks, std::span<const std::int64_t> mine,
                                                    Exchange&& exchange, Wait&& wait) {
  const std::size_t n = static_cast<std::size_t>(ranks) * mine.size();
  std::vector<std::int64_t> send(n), recv(n);
  for (std::size_t j = 0; j < static_cast<std::size_t>(ranks); ++j)
    std::copy(mine.begin(), mine.end(),
              send.begin() + static_cast<std::ptrdiff_t>(j * mine.size()));
  struct scratch { // freed on every path
    std::int64_t* words = nullptr;
    cudaStream_t stream = nullptr;
    ~scratch() {
      if (stream)
        (void)cudaStreamDestroy(stream);
      if (words)
        (void)cudaFree(words);
    }
  } tmp;
  WEAVE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&tmp.words), 2 * n * sizeof(std::int64_t)));
  WEAVE_CUDA_CHECK(cudaStreamCreateWithFlags(&tmp.stream, cudaStreamNonBlocking));
  const cuda_stream_ref s(tmp.stream);
  WEAVE_CUDA_CHECK(cudaMemcpyAsync(tmp.words, send.data(), n * sizeof(std::int64_t),
                                   cudaMemcpyHostToDevice, tmp.stream));
  exchange(s, std::span<const std::int64_t>(tmp.words, n),
           std::span<std::int64_t>(tmp.words + n, n));
  // Wait (watched) before copying back: a copy into pageable memory would block the host until
  // the exchange ran, outside the watchdog, and hang it for good on a peer that never arrives.
  wait(s);
  WEAVE_CUDA_CHECK(cudaMemcpyAsync(recv.data(), tmp.words + n, n * sizeof(std::int64_t),
                                   cudaMemcpyDeviceToHost, tmp.stream));
  WEAVE_CUDA_CHECK(cudaStreamSynchronize(tmp.stream)); // the copy alone: the stream is idle
  return recv;
}

} // namespace detail

WEAVE_NAMESPACE_END
