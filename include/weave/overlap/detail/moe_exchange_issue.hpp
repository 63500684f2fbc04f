//! \file
//! How `moe_exchange_base` issues a call's phases: slots leased and released, a phase started,
//! its chunks' stages issued in pipeline order across the two streams (see the order in
//! `moe_exchange_base.hpp`), a dispatch whose counts the host reads deferred by one step, and
//! the failures that end a phase on every rank or abort the communicator. Included by
//! `moe_exchange_base.hpp`.
#pragma once

#include "weave/overlap/detail/moe_exchange_base.hpp"

#include <exception>
#include <type_traits>
#include <utility>

WEAVE_NAMESPACE_BEGIN

template <class Derived, class Traits>
auto moe_exchange_base<Derived, Traits>::acquire(std::size_t tokens) -> handle {
  int pick = -1;
  const auto idle = [&](int i) {
    return slot(i).compute_done.query() && slot(i).comm_done.query();
  };
  for (int i = 0; i < max_in_flight(); ++i)
    if (!slot(i).held && (pick < 0 || (!idle(pick) && idle(i))))
      pick = i;
  WEAVE_EXPECT(pick >= 0, errc::invalid_state, "all ", max_in_flight(),
               " in-flight slots are held by live handles (moe_options.max_in_flight = ",
               max_in_flight(), "): combine and release one first, or raise max_in_flight");
  slot_type& s = slot(pick);
  if constexpr (Traits::runs_later) {
    for (auto* e : {&s.compute_done, &s.comm_done}) {
      try {
        e->synchronize(); // a failure of the last call surfaced at its caller's synchronize
      } catch (...) {
      }
      *e = {}; // a failed call's events must not fail the next call that waits for them
    }
  }
  s.held = true;
  s.phase = moe_phase::finished; // nothing issued yet: releasing it now aborts nothing
  s.tokens = tokens;
  s.call = ++calls_; // every rank counts its dispatches (a rejected one too) alike
  s.args = {};
  return detail::moe_access::make_handle(self(), pick);
}

template <class Derived, class Traits>
void moe_exchange_base<Derived, Traits>::reject(const std::exception_ptr& failure,
                                                stream_arg compute, stream_arg comm) {
  bool free = false;
  for (int i = 0; i < max_in_flight(); ++i)
    free = free || !slot(i).held;
  bool same_stream = false;
  if constexpr (std::is_reference_v<stream_arg>)
    same_stream = &compute == &comm;
  if (!free || same_stream) {
    abort_peers(*comm_, failure);
    return;
  }
  int i = -1;
  try {
    handle h = acquire(0);
    i = slot_of(h);
    slot_type& s = slot(i);
    s.failed_together = false; // said by this call's exchanges alone, not an earlier call's
    self().enqueue_rejected(s, failure, compute, comm, [&] {
      start(i, false, compute, comm);
      while (s.current < options_.chunks)
        advance_slot(i);
      finish_phase(i, compute, moe_phase::combined); // into an empty output
    });
  } catch (...) {
    const bool together = i >= 0 && slot(i).failed_together; // every rank failed alike
    if (!communicator_aborted(*comm_) && !together)
      abort_peers(*comm_, failure);
  }
}

template <class Derived, class Traits>
template <class F>
void moe_exchange_base<Derived, Traits>::issue_or_end(slot_type& s, F&& f) {
  try {
    std::forward<F>(f)();
  } catch (...) {
    if (!s.failed_together)
      abort_peers(*comm_, std::current_exception());
    try {
      mark_done(s, load(s.compute));
    } catch (...) {
    }
    s.phase = moe_phase::finished;
    // A failure every rank raised here ends the call on every rank: its slot is free for the
    // next call, and its handle stale (its uses throw, releasing it does nothing).
    if (s.failed_together && pending_.slot != &s)
      s.held = false;
    throw;
  }
}

template <class Derived, class Traits>
void moe_exchange_base<Derived, Traits>::shutdown() noexcept {
  int in_flight = pending_.slot != nullptr ? 1 : 0;
  for (int i = 0; i < max_in_flight(); ++i) {
    const slot_type& s = slot(i);
    const bool half_issued =
        s.phase == moe_phase::dispatched || s.phase == moe_phase::gradients_dispatched;
    const bool backward_due = s.phase == moe_phase::combined && options_.save_for_backward &&
                              !(last_.valid() && last_.slot() == i); // forward-only: eval mode
    in_flight += s.held && (half_issued || backward_due) ? 1 : 0;
  }
  if (in_flight > 0 && !communicator_aborted(*comm_)) {
    try {
      abort_peers(*comm_, std::make_exception_ptr(
                              error(errc::invalid_state,
                                    detail::concat("a moe layer was destroyed with ", in_flight,
                                                   " call(s) in flight (half issued, or a backward "
                                                   "due): its peers would wait for them"))));
    } catch (...) {
    }
  }
  for (int i = 0; i < max_in_flight(); ++i) {
    slot_type& s = slot(i);
    for (auto* e : {&s.compute_done, &s.comm_done, &s.compute_last, &s.comm_last})
      detail::wait_at_end(*e);
  }
  life_->alive.store(false, std::memory_order_release);
  // A collective the communicator abandoned may still write into the slots' count blocks and
  // staging buffers (MPI, until MPI_Finalize): keep them rather than free them under it.
  if (abandoned(abandoned_))
    for (auto& s : slots_)
      detail::retain_until_exit(std::shared_ptr<void>(std::move(s)));
}

template <class Derived, class Traits>
void moe_exchange_base<Derived, Traits>::note_enqueued(slot_type& s) {
  if (s.pipeline().captured() || !s.compute || !s.comm)
    return; // captured work runs when the graph is launched; its events cannot be waited for
  load(s.compute).record(s.compute_last);
  load(s.comm).record(s.comm_last);
}

template <class Derived, class Traits>
void moe_exchange_base<Derived, Traits>::end_calls_in_flight() noexcept {
  for (int i = 0; i < max_in_flight(); ++i) {
    slot_type& s = slot(i);
    if (pending_.slot == &s)
      pending_ = {};
    s.phase = moe_phase::finished;
    s.held = false;
  }
}

template <class Derived, class Traits>
void moe_exchange_base<Derived, Traits>::release_slot(int i) noexcept {
  slot_type& s = slot(i);
  if (pending_.slot == &s)
    pending_ = {}; // never issued: the abort below tells the peers
  if (s.phase == moe_phase::dispatched || s.phase == moe_phase::gradients_dispatched) {
    try {
      abort_peers(*comm_,
                  std::make_exception_ptr(error(
                      errc::invalid_state,
                      detail::concat("a moe handle was released in phase ", to_string(s.phase),
                                     ", with its collectives half enqueued"))));
    } catch (...) {
    }
    try { // the next user of the slot waits for what was queued
      mark_done(s, load(s.compute));
    } catch (...) {
    }
    s.phase = moe_phase::finished;
  }
  s.held = false;
}

template <class Derived, class Traits>
void moe_exchange_base<Derived, Traits>::start(int i, bool backward, stream_arg compute,
                                               stream_arg comm) {
  flush_dispatch(); // another call's: a failure it carries is thrown before this call issues
  slot_type& s = slot(i);
  s.backward = backward;
  s.current = 0;
  s.opened = false;
  s.prepared = 0;
  s.finished = 0;
  s.output_known = false;
  s.failed_together = false;
  if constexpr (std::is_pointer_v<typename slot_type::stream_store>) {
    s.compute = &compute;
    s.comm = &comm;
    s.phase_compute[backward ? 1 : 0] = &compute;
  } else {
    s.compute = compute;
    s.comm = comm;
    s.phase_compute[backward ? 1 : 0] = compute;
  }
  self().on_start(s, load(s.compute)); // may refuse the call: nothing is issued yet
  s.phase = backward ? moe_phase::gradients_dispatched : moe_phase::dispatched;
  last_pipeline_ = &s.pipeline();
  // A captured phase cannot wait for events recorded outside its capture (CUDA:
  // cudaErrorStreamCaptureIsolation); it needs not: its first comm stage waits for its first
  // prepare, which follows on the compute stream everything captured or launched before it.
  if (!s.pipeline().captured()) {
    load(s.compute).wait(s.comm_done);
    load(s.comm).wait(s.compute_done);
  }
  issue_or_end(s, [&] {
    prepare_next(s);
    if (options_.chunks > 1)
      prepare_next(s);
    note_enqueued(s);
  });
}

template <class Derived, class Traits>
void moe_exchange_base<Derived, Traits>::prepare_next(slot_type& s) {
  const int c = s.prepared++;
  auto& pipe = s.pipeline();
  pipe.stage(pipeline_stage::prepare, c, load(s.compute),
             [&](stream_type& st) { self().enqueue_prepare(s, c, st); });
  comm_stage(s, pipeline_stage::dispatch, c);
}

template <class Derived, class Traits>
void moe_exchange_base<Derived, Traits>::open_slot(int i) {
  slot_type& s = slot(i);
  if (s.opened || s.current >= options_.chunks)
    return;
  if (pending_.slot == &s && pending_.chunk == s.current)
    flush_dispatch();
  s.pipeline().begin_stage(pipeline_stage::experts, s.current, load(s.compute));
  self().enqueue_open_experts(s, s.current, load(s.compute));
  s.opened = true;
  note_enqueued(s);
}

template <class Derived, class Traits>
void moe_exchange_base<Derived, Traits>::comm_stage(slot_type& s, pipeline_stage stage, int c) {
  flush_dispatch(); // the layer's collectives stay in issue order
  auto& pipe = s.pipeline();
  stream_type& comm = load(s.comm);
  // A forward dispatch carries a failure before it in its count exchange; the other stages
  // carry no status, so a failure of the work they wait for aborts the communicator.
  if (stage != pipeline_stage::dispatch || s.backward)
    detail::wait_or_abort(*comm_, comm,
                          pipe.ended(chunk_pipeline<stream_type>::dependency(stage), c));
  pipe.begin_stage(stage, c, comm);
  if (stage == pipeline_stage::dispatch) {
    if (self().enqueue_dispatch(s, c, comm)) { // the rest waits for the counts on the host
      pending_ = {&s, c};
      return;
    }
  } else {
    self().enqueue_combine(s, c, comm);
  }
  pipe.end_stage(stage, c, comm);
}

template <class Derived, class Traits>
void moe_exchange_base<Derived, Traits>::flush_dispatch() {
  if (pending_.slot == nullptr)
    return;
  const pending_dispatch p = std::exchange(pending_, {});
  slot_type& s = *p.slot;
  issue_or_end(s, [&] {
    self().complete_dispatch(s, p.chunk, load(s.comm));
    s.pipeline().end_stage(pipeline_stage::dispatch, p.chunk, load(s.comm));
    note_enqueued(s);
  });
}

template <class Derived, class Traits>
void moe_exchange_base<Derived, Traits>::advance_slot(int i) {
  slot_type& s = slot(i);
  abort_peers_on_failure(*comm_, [&] { // misuse: the peers would wait for this rank
    WEAVE_EXPECT(s.phase == moe_phase::dispatched || s.phase == moe_phase::gradients_dispatched,
                 errc::invalid_state, "no chunk to advance in phase ", to_string(s.phase));
    WEAVE_EXPECT(s.current < options_.chunks, errc::invalid_state, "all ", options_.chunks,
                 " chunks of the phase are already closed");
  });
  flush_dispatch(); // before this slot issues anything (it may end another slot's phase)
  const int c = s.current;
  issue_or_end(s, [&] {
    open_slot(i);
    self().enqueue_close_experts(s, c, load(s.compute));
    s.pipeline().end_stage(pipeline_stage::experts, c, load(s.compute));
    comm_stage(s, pipeline_stage::combine, c);
    if (s.prepared < options_.chunks)
      prepare_next(s);
  });
  if (s.output_known && c >= 1)
    finish_chunk(s, c - 1, load(s.compute));
  ++s.current;
  s.opened = false;
  note_enqueued(s);
}

template <class Derived, class Traits>
void moe_exchange_base<Derived, Traits>::finish_chunk(slot_type& s, int c, stream_type& compute) {
  s.pipeline().stage(pipeline_stage::finish, c, compute,
                     [&](stream_type& st) { self().enqueue_finish(s, c, st); });
  s.finished = c + 1;
}

template <class Derived, class Traits>
void moe_exchange_base<Derived, Traits>::finish_phase(int i, stream_arg compute, moe_phase next) {
  slot_type& s = slot(i);
  const int C = options_.chunks;
  if (s.current == C - 1 && s.opened)
    advance_slot(i);
  abort_peers_on_failure(*comm_, [&] { // misuse: the peers would wait for this rank
    WEAVE_EXPECT(s.current == C, errc::invalid_state, "chunk ", s.current, " of ", C,
                 " has not been computed: iterate chunks(handle) to the end first");
  });
  for (int c = s.finished; c < C; ++c)
    finish_chunk(s, c, compute);
  mark_done(s, compute);
  s.phase = next;
}

template <class Derived, class Traits>
void moe_exchange_base<Derived, Traits>::mark_done(slot_type& s, stream_arg compute) {
  if (s.pipeline().captured())
    return;
  compute.record(s.compute_done);
  load(s.comm).record(s.comm_done);
}

WEAVE_NAMESPACE_END
