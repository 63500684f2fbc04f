//! \file
//! The calls of `moe_exchange_base`'s handle API and callback form, out of the class: each checks
//! its arguments and the handle's phase (a misuse aborts the communicator, a rejected dispatch
//! takes its turn carrying the error), then issues its stages (`moe_exchange_issue.hpp`).
//! Included by `moe_exchange_base.hpp`.
#pragma once

#include "weave/overlap/detail/moe_exchange_base.hpp"

#include <exception>
#include <utility>

WEAVE_NAMESPACE_BEGIN

template <class Derived, class Traits>
auto moe_exchange_base<Derived, Traits>::dispatch(const_token_view x,
                                                  std::span<const std::int32_t> ids,
                                                  std::span<const float> weights,
                                                  stream_arg compute, stream_arg comm,
                                                  const hooks_type* hooks) -> handle {
  flush_dispatch(); // an earlier call's failure surfaces here, on every rank, before this call
  abort_peers_on_failure(*comm_, [&] { self().ensure_initialized(compute); });
  try {
    check_dispatch(x, ids, weights, hooks, compute, comm);
  } catch (...) {
    reject(std::current_exception(), compute, comm);
    throw;
  }
  // No free slot on this rank: its peers would wait for this call's collectives.
  handle h;
  abort_peers_on_failure(*comm_, [&] { h = acquire(x.rows()); });
  const int i = slot_of(h);
  slot_type& s = slot(i);
  s.args.x = x;
  s.args.ids = ids;
  s.args.weights = weights;
  s.args.hooks = hooks;
  self().on_dispatch(s);
  start(i, false, compute, comm);
  return h;
}

template <class Derived, class Traits>
moe_chunk_range<Derived> moe_exchange_base<Derived, Traits>::chunks(handle& h, token_view y) {
  const int i = slot_for_call(h);
  slot_type& s = slot(i);
  abort_peers_on_failure(*comm_, [&] {
    expect_phase(s, moe_phase::dispatched, "chunks with an output");
    check_rows(y, "output", s.tokens);
    check_same_output(s, s.args.y, y, "chunks");
  });
  if (!s.output_known) // once given, finishes on the stream may be reading it
    s.args.y = y;
  s.output_known = true;
  return detail::moe_access::make_range(self(), i);
}

template <class Derived, class Traits>
moe_chunk_range<Derived> moe_exchange_base<Derived, Traits>::chunks(handle& h, token_view dx,
                                                                    std::span<float> dw) {
  const int i = slot_for_call(h);
  slot_type& s = slot(i);
  abort_peers_on_failure(*comm_, [&] {
    expect_phase(s, moe_phase::gradients_dispatched, "chunks with outputs");
    check_backward_outputs(s, dx, dw);
    check_same_output(s, s.args.dx, dx, "chunks");
  });
  if (!s.output_known) { // once given, finishes on the stream may be reading them
    s.args.dx = dx;
    s.args.dw = dw;
  }
  s.output_known = true;
  return detail::moe_access::make_range(self(), i);
}

template <class Derived, class Traits>
void moe_exchange_base<Derived, Traits>::combine(handle& h, token_view y, stream_arg compute,
                                                 stream_arg comm) {
  const int i = slot_for_call(h);
  slot_type& s = slot(i);
  // Misuse, or a bad output (bad input): the peers, waiting in this call's collectives, learn
  // it at once.
  abort_peers_on_failure(*comm_, [&] {
    expect_phase(s, moe_phase::dispatched, "combine");
    check_comm(s, comm, "combine");
    check_same_output(s, s.args.y, y, "combine");
    check_rows(y, "output", s.tokens);
  });
  if (!s.output_known) // one given to `chunks` is already read by finishes on the stream
    s.args.y = y;
  finish_phase(i, compute, moe_phase::combined);
}

template <class Derived, class Traits>
void moe_exchange_base<Derived, Traits>::combine_backward(handle& h, const_token_view dy,
                                                          stream_arg compute, stream_arg comm) {
  abort_peers_on_failure(*comm_, [&] {
    WEAVE_EXPECT(options_.save_for_backward, errc::invalid_state,
                 "the backward needs moe_options.save_for_backward");
  });
  const int i = slot_for_call(h);
  slot_type& s = slot(i);
  // The backward has no count exchange to carry a bad argument or a misuse: the peers learn it
  // by abort.
  abort_peers_on_failure(*comm_, [&] {
    expect_phase(s, moe_phase::combined, "combine_backward");
    check_rows(dy, "output gradient", s.tokens);
  });
  s.args.dy = dy;
  start(i, true, compute, comm);
}

template <class Derived, class Traits>
void moe_exchange_base<Derived, Traits>::dispatch_backward(handle& h, token_view dx,
                                                           std::span<float> dw, stream_arg compute,
                                                           stream_arg comm) {
  const int i = slot_for_call(h);
  slot_type& s = slot(i);
  abort_peers_on_failure(*comm_, [&] {
    expect_phase(s, moe_phase::gradients_dispatched, "dispatch_backward");
    check_comm(s, comm, "dispatch_backward");
    check_same_output(s, s.args.dx, dx, "dispatch_backward");
    WEAVE_EXPECT(!s.output_known || dw.data() == s.args.dw.data(), errc::invalid_argument,
                 "dispatch_backward: other gate gradients than chunks(h, dx, dw) was given");
    check_backward_outputs(s, dx, dw);
  });
  if (!s.output_known) { // ones given to `chunks` are already read by finishes on the stream
    s.args.dx = dx;
    s.args.dw = dw;
  }
  finish_phase(i, compute, moe_phase::finished);
}

template <class Derived, class Traits>
void moe_exchange_base<Derived, Traits>::forward(const_token_view x,
                                                 std::span<const std::int32_t> ids,
                                                 std::span<const float> weights, token_view y,
                                                 experts_fn experts, stream_arg compute,
                                                 stream_arg comm, const hooks_type* hooks) {
  abort_peers_on_failure(*comm_, [&] { self().ensure_initialized(compute); });
  try {
    check_rows(y, "output", x.rows());
  } catch (...) {
    reject(std::current_exception(), compute, comm);
    throw;
  }
  last_.reset(); // its backward will not come; its slot may serve this call
  handle h = dispatch(x, ids, weights, compute, comm, hooks);
  slot_type& s = slot(slot_of(h));
  s.args.experts = std::move(experts);
  for (const chunk c : chunks(h, y))
    self().enqueue_experts_callback(s, c.index(), compute);
  combine(h, y, compute, comm);
  if (options_.save_for_backward)
    last_ = std::move(h);
}

template <class Derived, class Traits>
void moe_exchange_base<Derived, Traits>::backward(const_token_view dy, token_view dx,
                                                  std::span<float> dw, experts_grad_fn experts_grad,
                                                  stream_arg compute, stream_arg comm) {
  abort_peers_on_failure(*comm_, [&] {
    WEAVE_EXPECT(options_.save_for_backward, errc::invalid_state,
                 "backward needs moe_options.save_for_backward");
    WEAVE_EXPECT(last_.valid(), errc::invalid_state,
                 "backward needs a forward first (each forward has one backward)");
    check_rows(dx, "input gradient", slot(slot_of(last_)).tokens);
  });
  slot_type& s = slot(slot_of(last_));
  combine_backward(last_, dy, compute, comm);
  s.args.experts_grad = std::move(experts_grad);
  for (const chunk c : chunks(last_, dx, dw))
    self().enqueue_experts_callback(s, c.index(), compute);
  dispatch_backward(last_, dx, dw, compute, comm);
  last_.reset();
}

template <class Derived, class Traits>
void moe_exchange_base<Derived, Traits>::synchronize(stream_arg compute, stream_arg comm) {
  try {
    self().synchronize_layer(compute, comm);
  } catch (...) {
    if (usable())
      end_calls_in_flight();
    throw;
  }
}

WEAVE_NAMESPACE_END
