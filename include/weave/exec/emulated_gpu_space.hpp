//! \file
//! `emulated_gpu_space`: `cuda_space`'s host-side behaviour on host streams, with the CUDA
//! runtime's rules checked, so CI runs (and catches regressions in) the control flow that
//! `cuda_space` takes, without a GPU.
//!
//! Steps, sorts and copies are `host_space`'s tasks; what differs is what the host does:
//! - host code runs at enqueue time (`runs_later` is false): `launch(s, f)` calls `f(s)` now, and
//!   `f` enqueues its work on `s` as a CUDA caller enqueues kernels; `on_host` waits for the
//!   stream first;
//! - a copy from a device buffer to pageable host memory blocks the calling thread until the
//!   stream has run it, unwatched, as `cudaMemcpyAsync` does; a copy from pageable memory is
//!   staged at once. Host memory from `allocate_host` (a `host_mirror`) is "pinned": copies
//!   into and out of it are stream-ordered tasks that do not block;
//! - `is_capturing` reports a host stream capture (`host_stream::begin_capture`), in which a copy
//!   to or from pageable memory is refused, as are the waits, queries and synchronizations a CUDA
//!   capture refuses (see `host_capture.hpp`).
//! Memory is host memory (`memory_space::host`): tests read every buffer directly.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/exec/host_space.hpp"
#include "weave/exec/host_stream.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <utility>
#include <vector>

WEAVE_NAMESPACE_BEGIN

namespace detail {

// The host allocations `emulated_gpu_space` treats as pinned: start -> bytes.
class emulated_pinned_registry {
 public:
  // Never destroyed: host mirrors kept until exit (an aborted layer's, retained while MPI may
  // still write into its buffers) leave the registry during static destruction.
  static emulated_pinned_registry& get() {
    static auto* const r = new emulated_pinned_registry;
    return *r;
  }
  void add(const void* p, std::size_t bytes) {
    std::lock_guard lock(mutex_);
    ranges_[reinterpret_cast<std::uintptr_t>(p)] = bytes;
  }
  void remove(const void* p) {
    std::lock_guard lock(mutex_);
    ranges_.erase(reinterpret_cast<std::uintptr_t>(p));
  }
  //! True when [p, p + bytes) lies within one registered allocation.
  bool contains(const void* p, std::size_t bytes) const {
    const auto at = reinterpret_cast<std::uintptr_t>(p);
    std::lock_guard lock(mutex_);
    auto it = ranges_.upper_bound(at);
    if (it == ranges_.begin())
      return false;
    --it;
    return at + bytes <= it->first + it->second;
  }

 private:
  mutable std::mutex mutex_;
  std::map<std::uintptr_t, std::size_t> ranges_;
};

} // namespace detail

//! Runs device algorithms on host streams with `cuda_space`'s host-side behaviour (see the file
//! comment).
struct emulated_gpu_space : host_space {
  //! False: host code runs at enqueue time, as with CUDA.
  static constexpr bool runs_later = false;
  //! False: algorithms take the GPU's forms of their steps (one index per thread), as on CUDA.
  static constexpr bool serial = false;

  //! Copies into host memory `dst`: a task when `dst` is pinned (`allocate_host`); otherwise
  //! blocks until the stream ran everything before it, then copies (refused while capturing).
  static void copy_to_host(stream_arg s, void* dst, const void* src, std::size_t bytes) {
    if (bytes == 0)
      return;
    if (pinned(dst, bytes)) {
      host_space::copy(s, dst, src, bytes);
      return;
    }
    s.refuse_while_capturing("cudaErrorStreamCaptureUnsupported", "a copy to pageable host memory");
    if (std::exception_ptr failure = s.record().outcome()) // the unwatched block of CUDA
      std::rethrow_exception(failure);
    std::memcpy(dst, src, bytes);
  }

  //! Uploads host memory `src`: a task when `src` is pinned; otherwise staged at once (the
  //! caller may reuse `src` on return) and copied in stream order (refused while capturing).
  static void copy_from_host(stream_arg s, void* dst, const void* src, std::size_t bytes) {
    if (bytes == 0)
      return;
    if (pinned(src, bytes)) {
      host_space::copy(s, dst, src, bytes);
      return;
    }
    s.refuse_while_capturing("cudaErrorStreamCaptureUnsupported",
                             "a copy from pageable host memory");
    auto staged = std::make_shared<std::vector<std::byte>>(
        static_cast<const std::byte*>(src), static_cast<const std::byte*>(src) + bytes);
    s.submit([dst, staged] { std::memcpy(dst, staged->data(), staged->size()); });
  }

  //! Waits for the stream, then runs `f()` on the calling thread.
  template <class F>
  static void on_host(stream_arg s, F&& f) {
    s.synchronize();
    std::forward<F>(f)();
  }

  //! Calls `f(s)` now; `f` enqueues its work on `s`.
  template <class F>
  static void launch(stream_arg s, F f) {
    f(s);
  }

  //! True while `s` belongs to a capture (`host_stream::begin_capture`).
  static bool is_capturing(stream_arg s) { return s.capturing(); }

  //! Stream-ordered memory, as host_space's; refused while `s` captures (CUDA graphs cannot hold
  //! an allocation a call sizes on the host).
  static void* allocate_async(std::size_t bytes, host_stream& s) {
    s.refuse_while_capturing("cudaErrorStreamCaptureUnsupported", "an allocation");
    return host_space::allocate_async(bytes, s);
  }

  //! "Pinned" host memory: copies into and out of it do not block (see `host_mirror`).
  static void* allocate_host(std::size_t bytes) {
    void* p = ::operator new(bytes == 0 ? 1 : bytes);
    detail::emulated_pinned_registry::get().add(p, bytes);
    return p;
  }
  static void free_host(void* p) noexcept {
    detail::emulated_pinned_registry::get().remove(p);
    ::operator delete(p);
  }
  //! True when [p, p + bytes) is memory from `allocate_host`.
  static bool pinned(const void* p, std::size_t bytes) {
    return detail::emulated_pinned_registry::get().contains(p, bytes);
  }
};
static_assert(execution_space<emulated_gpu_space>);

WEAVE_NAMESPACE_END
