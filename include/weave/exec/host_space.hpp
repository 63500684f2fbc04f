//! \file
//! `host_space`: the execution space of weave's device algorithms on `host_stream`s (see
//! `weave/exec/space.hpp`). Each step is a task that visits its indices in order on the
//! stream's thread; sorts are stable sorts, scans loops. It is what CI runs the device
//! algorithms in, and a way to run them on CPUs; it is not allocation-free (a step whose
//! functor outgrows `unique_task`'s inline buffer, and every sort, allocates).
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/memory.hpp"
#include "weave/exec/host_stream.hpp"
#include "weave/exec/space.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <numeric>
#include <utility>
#include <vector>

WEAVE_NAMESPACE_BEGIN

//! Runs device algorithms on `host_stream`s: every step is a task on the stream.
struct host_space {
  using stream_type = host_stream;
  //! How streams are passed: by reference (a host stream owns its thread).
  using stream_arg = host_stream&;
  //! Where the buffers of algorithms in this space live.
  static constexpr memory_space memory = memory_space::host;
  //! True: host code handed to `launch` / `on_host` runs later, on the stream's thread.
  static constexpr bool runs_later = true;

  //! Runs `f(i)` for i in [0, n) in order, as one task on `s`.
  template <class F>
  static void for_each(stream_arg s, std::int64_t n, F f) {
    s.submit([n, f] {
      for (std::int64_t i = 0; i < n; ++i)
        f(i);
    });
  }

  //! Like `for_each` with n = min(*count, bound), read when the step runs (a count another
  //! step of the stream produced).
  template <class F>
  static void for_each_counted(stream_arg s, const std::int64_t* count, std::int64_t bound, F f) {
    s.submit([count, bound, f] {
      const std::int64_t n = std::min(*count, bound);
      for (std::int64_t i = 0; i < n; ++i)
        f(i);
    });
  }

  //! Sets `bytes` bytes at `p` to `byte`.
  static void fill(stream_arg s, void* p, int byte, std::size_t bytes) {
    if (bytes != 0)
      s.submit([p, byte, bytes] { std::memset(p, byte, bytes); });
  }

  //! Copies between buffers of this space.
  static void copy(stream_arg s, void* dst, const void* src, std::size_t bytes) {
    if (bytes != 0)
      s.submit([dst, src, bytes] { std::memcpy(dst, src, bytes); });
  }

  //! Copies a buffer of this space into host memory `dst` (the host reads it in `on_host`).
  static void copy_to_host(stream_arg s, void* dst, const void* src, std::size_t bytes) {
    copy(s, dst, src, bytes);
  }

  //! Uploads host memory to a buffer of this space. `src` must stay valid until the copy ran.
  static void copy_from_host(stream_arg s, void* dst, const void* src, std::size_t bytes) {
    copy(s, dst, src, bytes);
  }

  //! Runs `f()` on the host once the stream has reached this point. Here: a task (the caller
  //! keeps going); in the CUDA space the caller waits for the stream (a host synchronisation).
  template <class F>
  static void on_host(stream_arg s, F&& f) {
    s.submit(std::forward<F>(f));
  }

  //! Calls `f(s)` so that the work `f` does on `s` is ordered in the stream: here `f` runs as a
  //! task (it computes directly); in the CUDA space `f` runs now and enqueues kernels on `s`.
  template <class F>
  static void launch(stream_arg s, F f) {
    s.submit([&s, f = std::move(f)]() mutable { f(s); });
  }

  //! True while `s` belongs to a capture (`host_stream::begin_capture`): the CUDA capture rules
  //! are checked on host streams too.
  static bool is_capturing(stream_arg s) { return s.capturing(); }

  //! Stream-ordered memory of this space (`stream_allocator`'s default): heap memory, aligned to
  //! 256 bytes; freed by a task of `s` (after the work queued on it), or at once for a null `s`.
  static void* allocate_async(std::size_t bytes, host_stream& /*s*/) {
    return ::operator new (bytes == 0 ? 1 : bytes, std::align_val_t{256});
  }
  static void free_async(void* p, std::size_t /*bytes*/, host_stream* s) noexcept {
    const auto free = [p] { ::operator delete (p, std::align_val_t{256}); };
    if (s == nullptr) {
      free();
      return;
    }
    try {
      s->submit(free);
    } catch (...) { // no memory for the task: leaking beats freeing under queued work
    }
  }

  //! Scratch bytes `sort_pairs` and `exclusive_scan` need for n elements (none here).
  static std::size_t sort_temp_bytes(std::int64_t) { return 0; }
  static std::size_t scan_temp_bytes(std::int64_t) { return 0; }

  //! Stable sort of (key, value) pairs by the low `bits` bits of the keys.
  static void sort_pairs(stream_arg s, const std::uint32_t* keys_in, std::uint32_t* keys_out,
                         const std::int32_t* values_in, std::int32_t* values_out, std::int64_t n,
                         int bits, void* /*temp*/, std::size_t /*temp_bytes*/) {
    s.submit([=] {
      const std::uint32_t mask = bits >= 32 ? ~0u : ((1u << bits) - 1u);
      std::vector<std::int64_t> order(static_cast<std::size_t>(n));
      std::iota(order.begin(), order.end(), std::int64_t{0});
      std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
        return (keys_in[a] & mask) < (keys_in[b] & mask);
      });
      for (std::int64_t i = 0; i < n; ++i) {
        keys_out[i] = keys_in[order[static_cast<std::size_t>(i)]];
        values_out[i] = values_in[order[static_cast<std::size_t>(i)]];
      }
    });
  }

  //! out[i] = in[0] + ... + in[i - 1] over n values (in place allowed).
  static void exclusive_scan(stream_arg s, const std::int64_t* in, std::int64_t* out,
                             std::int64_t n, void* /*temp*/, std::size_t /*temp_bytes*/) {
    s.submit([=] {
      std::int64_t total = 0;
      for (std::int64_t i = 0; i < n; ++i) {
        const std::int64_t v = in[i];
        out[i] = total;
        total += v;
      }
    });
  }
};
static_assert(execution_space<host_space>);

WEAVE_NAMESPACE_END
