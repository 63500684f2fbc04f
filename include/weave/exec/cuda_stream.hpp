//! \file
//! `cuda_stream_ref` (non-owning, like `cuda::stream_ref`) and `cuda_event` (owning, RAII).
//! Component `weave::cuda`; compiles with the host compiler against the CUDA runtime headers.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/cuda_error.hpp"
#include "weave/exec/stream.hpp"

#include <cuda_runtime_api.h>

#include <utility>

WEAVE_NAMESPACE_BEGIN

//! An owned `cudaEvent_t`. Move-only; the destructor never throws.
class cuda_event {
 public:
  //! Creates an event; by default without timing (cheapest). Pass `cudaEventDefault` to time.
  explicit cuda_event(unsigned flags = cudaEventDisableTiming) {
    WEAVE_CUDA_CHECK(cudaEventCreateWithFlags(&event_, flags));
  }
  cuda_event(cuda_event&& other) noexcept
      : event_(std::exchange(other.event_, nullptr)) {}
  cuda_event& operator=(cuda_event&& other) noexcept {
    if (this != &other) {
      destroy();
      event_ = std::exchange(other.event_, nullptr);
    }
    return *this;
  }
  cuda_event(const cuda_event&) = delete;
  cuda_event& operator=(const cuda_event&) = delete;
  ~cuda_event() { destroy(); }

  //! True once the recorded point is reached; throws on a device error.
  bool query() const {
    const cudaError_t status = cudaEventQuery(event_);
    if (status == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    WEAVE_CUDA_CHECK(status);
    return true;
  }

  void synchronize() const { WEAVE_CUDA_CHECK(cudaEventSynchronize(event_)); }

  //! Milliseconds between two reached events created with timing enabled.
  static float elapsed_ms(const cuda_event& start, const cuda_event& end) {
    float ms = 0;
    WEAVE_CUDA_CHECK(cudaEventElapsedTime(&ms, start.event_, end.event_));
    return ms;
  }

  cudaEvent_t get() const noexcept { return event_; }

 private:
  void destroy() noexcept {
    if (event_)
      (void)cudaEventDestroy(event_); // released once reached, even if still pending
    event_ = nullptr;
  }

  cudaEvent_t event_ = nullptr;
};

//! A borrowed `cudaStream_t`. Never creates, owns or destroys the stream.
class cuda_stream_ref {
 public:
  using event_type = cuda_event;

  //! Refers to `stream` (nullptr is the legacy default stream).
  constexpr cuda_stream_ref(cudaStream_t stream) noexcept
      : stream_(stream) {} // NOLINT

  cuda_event record() const {
    cuda_event e;
    record(e);
    return e;
  }
  void record(cuda_event& e) const { WEAVE_CUDA_CHECK(cudaEventRecord(e.get(), stream_)); }
  void wait(const cuda_event& e) const {
    WEAVE_CUDA_CHECK(cudaStreamWaitEvent(stream_, e.get(), 0));
  }
  void synchronize() const { WEAVE_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

  //! True when all work on the stream has completed.
  bool query() const {
    const cudaError_t status = cudaStreamQuery(stream_);
    if (status == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    WEAVE_CUDA_CHECK(status);
    return true;
  }

  constexpr cudaStream_t get() const noexcept { return stream_; }
  friend constexpr bool operator==(cuda_stream_ref, cuda_stream_ref) = default;

 private:
  cudaStream_t stream_;
};

static_assert(stream<cuda_stream_ref>);

WEAVE_NAMESPACE_END
