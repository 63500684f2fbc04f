//! \file
//! `host_space`: the execution space of weave's device algorithms on `host_stream`s (see
//! `weave/exec/space.hpp`). Each step is a task that visits its indices in order on the
//! stream's thread (or at once within a task of that stream); sorts are counting sorts, scans
//! loops. It is what `moe_exchange` runs in, and what CI runs every device algorithm in (the
//! device decode exchange among them). A step whose functor outgrows `unique_task`'s inline buffer
//! allocates its task.
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
#include <exception>
#include <new>
#include <numeric>
#include <utility>
#include <vector>

WEAVE_NAMESPACE_BEGIN

namespace detail {

// Key bits a counting pass of `radix_sort_pairs` sorts by: 2^11 buckets (16 KiB of counts) stay
// in L1; the plans' keys (a device, a local expert) need one pass.
inline constexpr int radix_digit_bits = 11;

// Stable LSD radix sort of (key, value) pairs by the low `bits` bits of the keys, out of place
// (keys_in / values_in are not modified). The bucket counts, and the ping-pong arrays of keys
// over two digits, are this thread's scratch, grown once and reused (no allocation per call).
inline void radix_sort_pairs(const std::uint32_t* keys_in, std::uint32_t* keys_out,
                             const std::int32_t* values_in, std::int32_t* values_out,
                             std::int64_t n, int bits) {
  if (n <= 0)
    return;
  bits = std::clamp(bits, 1, 32);
  const int passes = (bits + radix_digit_bits - 1) / radix_digit_bits;
  thread_local std::vector<std::int64_t> counts;
  thread_local std::vector<std::uint32_t> keys_tmp;
  thread_local std::vector<std::int32_t> values_tmp;
  const auto N = static_cast<std::size_t>(n);
  if (passes > 1 && keys_tmp.size() < N) {
    keys_tmp.resize(N);
    values_tmp.resize(N);
  }
  const std::uint32_t* k_from = keys_in;
  const std::int32_t* v_from = values_in;
  for (int pass = 0; pass < passes; ++pass) {
    const int shift = pass * radix_digit_bits;
    const int width = std::min(radix_digit_bits, bits - shift);
    const std::uint32_t mask = (1u << width) - 1u;
    counts.assign(std::size_t{1} << width, 0);
    for (std::size_t i = 0; i < N; ++i)
      ++counts[(k_from[i] >> shift) & mask];
    std::int64_t at = 0;
    for (std::int64_t& c : counts)
      at += std::exchange(c, at);
    // The last pass writes the output; the ones before alternate so that it does.
    const bool to_out = (passes - 1 - pass) % 2 == 0;
    std::uint32_t* k_to = to_out ? keys_out : keys_tmp.data();
    std::int32_t* v_to = to_out ? values_out : values_tmp.data();
    for (std::size_t i = 0; i < N; ++i) {
      const auto at_i = static_cast<std::size_t>(counts[(k_from[i] >> shift) & mask]++);
      k_to[at_i] = k_from[i];
      v_to[at_i] = v_from[i];
    }
    k_from = k_to;
    v_from = v_to;
  }
}

} // namespace detail

//! Runs device algorithms on `host_stream`s: every step is a task on the stream, or runs at once
//! when the calling thread is running a task of that stream (`host_stream::runs_here`: a step
//! enqueued from within the stream's own work is at the stream's point) or holds it under its
//! claim (`host_stream::claim_if_idle`), so `launch(s, f)` runs all of `f`'s steps as one task.
struct host_space {
  using stream_type = host_stream;
  //! How streams are passed: by reference (a host stream owns its thread).
  using stream_arg = host_stream&;
  //! Where the buffers of algorithms in this space live.
  static constexpr memory_space memory = memory_space::host;
  //! True: host code handed to `launch` / `on_host` runs later, on the stream's thread.
  static constexpr bool runs_later = true;
  //! True: a step visits its indices in order on one thread, so an algorithm may give it a
  //! group of indices at once (a row's k entries in one pass, a scatter instead of a gather)
  //! where a GPU wants one index per thread. `emulated_gpu_space` says false, so CI runs the
  //! GPU's forms too.
  static constexpr bool serial = true;

  //! Runs `f(i)` for i in [0, n) in order, as one task on `s`.
  template <class F>
  static void for_each(stream_arg s, std::int64_t n, F f) {
    enqueue(s, [n, f] {
      for (std::int64_t i = 0; i < n; ++i)
        f(i);
    });
  }

  //! Like `for_each` with n = min(*count, bound), read when the step runs (a count another
  //! step of the stream produced).
  template <class F>
  static void for_each_counted(stream_arg s, const std::int64_t* count, std::int64_t bound, F f) {
    enqueue(s, [count, bound, f] {
      const std::int64_t n = std::min(*count, bound);
      for (std::int64_t i = 0; i < n; ++i)
        f(i);
    });
  }

  //! Sets `bytes` bytes at `p` to `byte`.
  static void fill(stream_arg s, void* p, int byte, std::size_t bytes) {
    if (bytes != 0)
      enqueue(s, [p, byte, bytes] { std::memset(p, byte, bytes); });
  }

  //! Copies between buffers of this space.
  static void copy(stream_arg s, void* dst, const void* src, std::size_t bytes) {
    if (bytes != 0)
      enqueue(s, [dst, src, bytes] { std::memcpy(dst, src, bytes); });
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
    enqueue(s, std::forward<F>(f));
  }

  //! Calls `f(s)` so that the work `f` does on `s` is ordered in the stream: here `f` runs as
  //! one task, and the steps it enqueues on `s` run at once within it (it computes directly);
  //! in the CUDA space `f` runs now and enqueues kernels on `s`.
  template <class F>
  static void launch(stream_arg s, F f) {
    if (s.runs_here())
      return f(s);
    enqueue(s, [&s, f = std::move(f)]() mutable { f(s); });
  }

  //! Runs `task` now when the calling thread runs a task of `s`, or holds `s` under its
  //! `claim_if_idle` (as `run_inline_or_submit`: a failure fails the stream); else submits it.
  template <class F>
  static void enqueue(stream_arg s, F&& task) {
    if (s.runs_here())
      std::forward<F>(task)();
    else if (s.claimed_here())
      s.run_inline_or_submit(std::forward<F>(task));
    else
      s.submit(std::forward<F>(task));
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
    try { // a task that runs on a failed stream too (keeping its failure): nothing leaks
      s->submit_always([free](std::exception_ptr pending) {
        free();
        return pending;
      });
    } catch (...) { // no memory for the task: leaking beats freeing under queued work
    }
  }

  //! Scratch bytes `sort_pairs` and `exclusive_scan` need for n elements (none here: the sort's
  //! bucket counts live in its thread's scratch, reused from call to call).
  static std::size_t sort_temp_bytes(std::int64_t) { return 0; }
  static std::size_t scan_temp_bytes(std::int64_t) { return 0; }

  //! Stable sort of (key, value) pairs by the low `bits` bits of the keys: a counting sort, in
  //! one pass over the pairs per `detail::radix_digit_bits` bits of key (one pass for the keys
  //! of weave's plans, which name a device or a local expert), in O(n + 2^digit).
  static void sort_pairs(stream_arg s, const std::uint32_t* keys_in, std::uint32_t* keys_out,
                         const std::int32_t* values_in, std::int32_t* values_out, std::int64_t n,
                         int bits, void* /*temp*/, std::size_t /*temp_bytes*/) {
    enqueue(s,
            [=] { detail::radix_sort_pairs(keys_in, keys_out, values_in, values_out, n, bits); });
  }

  //! out[i] = in[0] + ... + in[i - 1] over n values (in place allowed).
  static void exclusive_scan(stream_arg s, const std::int64_t* in, std::int64_t* out,
                             std::int64_t n, void* /*temp*/, std::size_t /*temp_bytes*/) {
    enqueue(s, [=] {
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
