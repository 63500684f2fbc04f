//! \file
//! The stream and event vocabulary every weave algorithm is written against.
//!
//! A stream runs work in submission order; an event marks a point in a stream. The model is
//! CUDA's: `record()` marks the point reached by all work submitted so far, `wait(e)` makes all
//! later work on a stream wait for `e`'s point, `synchronize()` blocks the caller until the
//! stream is drained and reports the first failure. `host_stream` implements it with a worker
//! thread, `cuda_stream_ref` over a borrowed `cudaStream_t`.
#pragma once

#include "weave/core/config.hpp"

#include <concepts>
#include <utility>

WEAVE_NAMESPACE_BEGIN

//! A point in a stream that other streams and the host can wait for.
template <class E>
concept event = std::movable<E> && requires(E& e, const E& ce) {
  { ce.query() } -> std::convertible_to<bool>; // true once the point is reached
  ce.synchronize();                            // block the caller until reached
};

//! An ordered queue of work with CUDA stream semantics.
template <class S>
concept stream = requires(S& s, typename S::event_type& e) {
  typename S::event_type;
  requires event<typename S::event_type>;
  { s.record() } -> std::same_as<typename S::event_type>; // a new event at the current point
  s.record(e);                                            // move an existing event there
  s.wait(std::as_const(e));                               // order later work after e
  s.synchronize();                                        // drain; rethrow the first failure
};

//! A stream that also runs arbitrary host callables in order (`host_stream`).
template <class S>
concept host_executor = stream<S> && requires(S& s, void (*task)()) {
  s.submit(task);
};

//! Runs `task` on the calling thread when `s` is idle and can say so
//! (`host_stream::run_inline_or_submit`), else submits it.
template <host_executor S, class F>
void run_inline_or_submit(S& s, F&& task) {
  if constexpr (requires { s.run_inline_or_submit(std::forward<F>(task)); })
    s.run_inline_or_submit(std::forward<F>(task));
  else
    s.submit(std::forward<F>(task));
}

//! What `claim_if_idle` returns for a stream that cannot be claimed: nothing held.
struct no_claim {
  explicit operator bool() const noexcept { return false; }
  bool all_ran_here() const noexcept { return false; }
};

//! Holds `s` for the calling thread while it is idle, where `s` can
//! (`host_stream::claim_if_idle`): the steps a layer issues through `run_inline_or_submit`
//! until the returned claim ends then run here without claiming `s` each. Else `no_claim`.
template <class S>
[[nodiscard]] auto claim_if_idle(S& s) {
  if constexpr (requires { s.claim_if_idle(); })
    return s.claim_if_idle();
  else
    return no_claim{};
}

//! Moves `e` to the end of `s`'s queue unless `s` can tell that nothing is left on it
//! (`host_stream::idle`): an event that only says when a layer's queued work has run (to wait
//! for it at destruction) need not be recorded after a call that ran on the calling thread.
template <stream S>
void record_unless_idle(S& s, typename S::event_type& e) {
  if constexpr (requires {
                  { s.idle() } -> std::convertible_to<bool>;
                })
    if (s.idle())
      return;
  s.record(e);
}

//! Makes `consumer` wait for everything submitted to `producer` so far.
template <stream S>
void order_after(S& consumer, S& producer) {
  consumer.wait(producer.record());
}

WEAVE_NAMESPACE_END
