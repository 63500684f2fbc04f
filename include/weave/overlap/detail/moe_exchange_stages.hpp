//! \file
//! The receiving half of `basic_moe_exchange`'s stages, as the exchange's base issues them (see
//! `moe_exchange_base.hpp` for the order, `moe_exchange.hpp` for the class): a chunk's experts
//! opened (its expert plan, the rows moved into its layout) and closed (the local merge), its
//! combine and finish, and the expert batches the caller reads. A compute stage's steps are one
//! `Space::launch`: on host streams one task, whose steps run within it, at the stream's point
//! (host code there sees what the steps before it computed); where host code runs at enqueue
//! time, the steps are enqueued at once. Included by `moe_exchange.hpp`.
#pragma once

#include "weave/overlap/moe_exchange.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <tuple>

WEAVE_NAMESPACE_BEGIN

template <execution_space Space, exchange_communicator<Space> Comm>
std::size_t basic_moe_exchange<Space, Comm>::visible_rows(const chunk_state& ch, int c,
                                                          int direction) const {
  if constexpr (Space::runs_later) {
    WEAVE_EXPECT(ch.ready[direction].get(), errc::invalid_state, "chunk ", c, "'s ",
                 direction == 0 ? "expert" : "gradient",
                 " rows are not ready: read them in a task on the compute stream (after the "
                 "chunk was opened), or after synchronizing it");
    return static_cast<std::size_t>(*ch.experts.epd_rows_count());
  } else {
    (void)c, (void)direction;
    return ch.experts.max_epd_rows();
  }
}

template <execution_space Space, exchange_communicator<Space> Comm>
basic_expert_batch<Space> basic_moe_exchange<Space, Comm>::experts_of(const slot_type& s,
                                                                      int c) const {
  const chunk_state& ch = s.state.chunks[static_cast<std::size_t>(c)];
  const std::size_t epd = visible_rows(ch, c, 0);
  return {c,
          this->rank_,
          ch.experts.expert_offsets(),
          local_experts_,
          layout_.inputs_of(ch, epd),
          rows_view(ch.epd_out, epd),
          base::arg_of(s.phase_compute[0]),
          layout_.codes_of(ch, epd),
          layout_.scales_of(ch, epd)};
}

template <execution_space Space, exchange_communicator<Space> Comm>
basic_expert_grad_batch<Space> basic_moe_exchange<Space, Comm>::experts_grad_of(const slot_type& s,
                                                                                int c) const {
  const chunk_state& ch = s.state.chunks[static_cast<std::size_t>(c)];
  const std::size_t epd = visible_rows(ch, c, 1);
  return {c,
          this->rank_,
          ch.experts.expert_offsets(),
          local_experts_,
          layout_.inputs_of(ch, epd),
          rows_view(s.state.grad_scaled, epd),
          rows_view(ch.epd_out, epd),
          base::arg_of(s.phase_compute[1]),
          layout_.codes_of(ch, epd),
          layout_.scales_of(ch, epd)};
}

template <execution_space Space, exchange_communicator<Space> Comm>
std::span<const std::int64_t> basic_moe_exchange<Space, Comm>::chunk_expert_rows(int slot,
                                                                                 int c) const {
  const chunk_state& ch = this->slot(slot).state.chunks[static_cast<std::size_t>(c)];
  if constexpr (Space::runs_later)
    (void)visible_rows(ch, c, 0);
  return {ch.expert_rows, ch.count * static_cast<std::size_t>(k_)};
}

template <execution_space Space, exchange_communicator<Space> Comm>
void basic_moe_exchange<Space, Comm>::on_start(slot_type& s, stream_type& compute) {
  bool capturing = false;
  if constexpr (requires { Space::is_capturing(compute); })
    capturing = Space::is_capturing(compute);
  WEAVE_EXPECT(!capturing || this->options_.static_shape, errc::invalid_state,
               "a call with dynamic shapes cannot be captured in a CUDA graph (it waits for the "
               "GPU once per chunk): set moe_options::static_shape");
  s.pipeline().set_captured(capturing);
  if (s.backward && sized_at_call()) // the forward's counts size the backward's buffers
    layout_.reserve_grads(s.state, allocator_, compute);
}

template <execution_space Space, exchange_communicator<Space> Comm>
void basic_moe_exchange<Space, Comm>::check_rows(const const_token_view& v,
                                                 const char* what) const {
  WEAVE_EXPECT(v.cols() == this->options_.hidden && v.element_type() == this->options_.element,
               errc::size_mismatch, "moe_exchange ", what, " rows of ", v.cols(), " ",
               v.element_type(), " for an exchange of ", this->options_.hidden, " ",
               this->options_.element);
  WEAVE_EXPECT(Space::memory == memory_space::host ? host_accessible(v.space())
                                                   : device_accessible(v.space()),
               errc::invalid_argument, "moe_exchange ", what, " rows in ", v.space(),
               " memory for a space of ", Space::memory, " memory");
}

template <execution_space Space, exchange_communicator<Space> Comm>
void basic_moe_exchange<Space, Comm>::exchange_back(chunk_state& ch, stream_type& s,
                                                    std::byte* from, std::byte* to,
                                                    std::size_t unit, call_tag tag) {
  if (this->options_.static_shape)
    all_to_all_v(*this->comm_, s, from, uniform_counts_, uniform_displs_, to, uniform_counts_,
                 uniform_displs_, unit, tag);
  else
    all_to_all_v(*this->comm_, s, from, recv_counts(ch), recv_displs(ch), to, send_counts(ch),
                 send_displs(ch), unit, tag);
}

template <execution_space Space, exchange_communicator<Space> Comm>
void basic_moe_exchange<Space, Comm>::enqueue_open_experts(slot_type& s, int c, stream_type& st) {
  compute_stage(st, [this, &s, c, backward = s.backward](stream_arg ls) {
    backward ? open_backward(s, c, ls) : open_forward(s, c, ls);
  });
}

template <execution_space Space, exchange_communicator<Space> Comm>
void basic_moe_exchange<Space, Comm>::open_forward(slot_type& s, int c, stream_type& st) {
  chunk_state& ch = s.state.chunks[static_cast<std::size_t>(c)];
  const auto k = static_cast<std::size_t>(k_);
  if (layout_.in_stream()) { // what arrived is known here, in the stream
    ch.rows = 0;
    for (const std::int64_t n : recv_counts(ch))
      ch.rows += static_cast<std::size_t>(n);
  }
  ch.experts.build(st, std::span<const route_entry>(ch.recv_routes, ch.rows_cap * k),
                   ch.recv_counts, receive_displs(ch), built_rows(ch));
  Space::for_each(st, 1,
                  detail::received_rows_step{ch.recv_counts, D_, ch.experts.epd_rows_count(),
                                             ch.recv_total, s.state.counters});
  std::size_t epd = ch.experts.max_epd_rows();
  if constexpr (Space::runs_later) { // the plan has run: its rows are known
    epd = std::min(
        epd, static_cast<std::size_t>(std::max<std::int64_t>(*ch.experts.epd_rows_count(), 0)));
    if (layout_.in_stream())
      layout_.reserve_expert_rows(ch, epd, allocator_, st);
  }
  const std::int64_t* count = ch.experts.epd_rows_count();
  const std::int64_t* received = this->options_.static_shape ? nullptr : ch.recv_total;
  if (this->options_.fp8_dispatch)
    scatter_quantized(ch, st, epd);
  else
    layout_move<Space>(st, rows_view(ch.recv, ch.rows_cap), rows_view(ch.epd_in, epd),
                       ch.experts.epd_row_source().data(), nullptr, count,
                       ch.experts.row_epd().data(), k_, nullptr, received);
  Space::for_each(st, static_cast<std::int64_t>(ch.count * k),
                  detail::pair_expert_rows_step{
                      s.args.ids.data() + ch.first * k, ch.plan.kept_experts().data(),
                      ch.plan.pair_devices().data(), ch.plan.token_rows().data(),
                      ch.plan.send_offsets().data(), receive_displs(ch),
                      ch.experts.row_epd().data(), k_, this->rank_,
                      static_cast<std::int64_t>(layout_.slot_rows()), ch.expert_rows});
  if constexpr (Space::runs_later) {
    ch.ready[1].set(false);
    ch.ready[0].set(true);
  }
}

template <execution_space Space, exchange_communicator<Space> Comm>
void basic_moe_exchange<Space, Comm>::open_backward(slot_type& s, int c, stream_type& st) {
  chunk_state& ch = s.state.chunks[static_cast<std::size_t>(c)];
  call_state& cs = s.state;
  std::size_t epd = ch.experts.max_epd_rows();
  if constexpr (Space::runs_later) {
    epd = std::min(
        epd, static_cast<std::size_t>(std::max<std::int64_t>(*ch.experts.epd_rows_count(), 0)));
    if (layout_.in_stream())
      layout_.reserve_grads(cs, allocator_, st, epd);
  }
  const std::int64_t* count = ch.experts.epd_rows_count();
  const std::int64_t* received = this->options_.static_shape ? nullptr : ch.recv_total;
  const std::size_t g = sized_at_call() || layout_.in_stream() ? std::min(epd, cs.grads_cap) : epd;
  const auto rows = rows_view(ch.recv, ch.rows_cap);
  const auto source = ch.experts.epd_row_source().data();
  const auto row_epd = ch.experts.row_epd().data();
  layout_move<Space>(st, rows, rows_view(cs.grad_dy, g), source, nullptr, count, row_epd, k_,
                     nullptr, received);
  layout_move<Space>(st, rows, rows_view(cs.grad_scaled, g), source, ch.experts.epd_weight().data(),
                     count, row_epd, k_, ch.experts.row_weight().data(), received);
  // dL/dw of each EPD row: <dy, expert output>, before the outputs make room for dL/dx.
  moves::dot(st, rows_view(cs.grad_dy, g), rows_view(ch.epd_out, g), cs.grad_dot, count);
  Space::for_each(st, static_cast<std::int64_t>(built_rows(ch) * static_cast<std::size_t>(k_)),
                  detail::entry_dw_step{ch.experts.row_epd().data(), cs.grad_dot, ch.send_dw});
  if constexpr (Space::runs_later) {
    ch.ready[0].set(false);
    ch.ready[1].set(true);
  }
}

template <execution_space Space, exchange_communicator<Space> Comm>
void basic_moe_exchange<Space, Comm>::scatter_quantized(chunk_state& ch, stream_type& st,
                                                        std::size_t epd) {
  const auto [codes, scales] = layout_.wire_views(ch.recv_fp8, ch.rows_cap);
  const std::int64_t* source = ch.experts.epd_row_source().data();
  const std::int64_t* count = ch.experts.epd_rows_count();
  const std::int64_t* row_epd = ch.experts.row_epd().data();
  const std::int64_t* received = this->options_.static_shape ? nullptr : ch.recv_total;
  layout_move<Space>(st, codes, layout_.codes_view(ch.epd_codes, epd), source, nullptr, count,
                     row_epd, k_, nullptr, received);
  layout_move<Space>(st, scales, layout_.scales_view(ch.epd_scales, epd), source, nullptr, count,
                     row_epd, k_, nullptr, received);
  const fp8_dispatch_options& f = *this->options_.fp8_dispatch;
  if (f.dequantized_inputs)
    quant::dequantize(st, layout_.codes_view(ch.epd_codes, epd),
                      layout_.scales_view(ch.epd_scales, epd), rows_view(ch.epd_in, epd), nullptr,
                      count, f.blocks);
}

template <execution_space Space, exchange_communicator<Space> Comm>
void basic_moe_exchange<Space, Comm>::enqueue_experts_callback(slot_type& s, int c,
                                                               stream_type& st) {
  const bool backward = s.backward; // host spaces run it later, maybe in the next phase
  launch_fail_stop(st, false, [this, &s, c, backward](stream_arg) {
    if (backward)
      s.args.experts_grad(experts_grad_of(s, c));
    else
      s.args.experts(experts_of(s, c));
  });
}

template <execution_space Space, exchange_communicator<Space> Comm>
void basic_moe_exchange<Space, Comm>::enqueue_close_experts(slot_type& s, int c, stream_type& st) {
  compute_stage(st, [this, &s, c, backward = s.backward](stream_arg ls) {
    chunk_state& ch = s.state.chunks[static_cast<std::size_t>(c)];
    const bool fixed = this->options_.static_shape;
    moves::merge(
        ls, rows_view(ch.epd_out, layout_.in_stream() ? ch.epd_cap : ch.experts.max_epd_rows()),
        rows_view(ch.back, ch.rows_cap), ch.experts.row_epd().data(), k_,
        backward ? nullptr : ch.experts.row_weight().data(), fixed ? nullptr : ch.recv_total,
        fixed);
  });
}

template <execution_space Space, exchange_communicator<Space> Comm>
void basic_moe_exchange<Space, Comm>::enqueue_combine(slot_type& s, int c, stream_type& st) {
  chunk_state& ch = s.state.chunks[static_cast<std::size_t>(c)];
  const call_tag tag = this->tag_of(s, c, true); // the stage's first collective carries it
  exchange_stage_tag(ch, st, tag);
  exchange_back(ch, st, ch.back, ch.returned,
                this->options_.hidden * size_of(this->options_.element), tag);
  if (s.backward)
    exchange_back(ch, st, reinterpret_cast<std::byte*>(ch.send_dw),
                  reinterpret_cast<std::byte*>(ch.returned_dw),
                  static_cast<std::size_t>(k_) * sizeof(float));
}

template <execution_space Space, exchange_communicator<Space> Comm>
void basic_moe_exchange<Space, Comm>::enqueue_finish(slot_type& s, int c, stream_type& st) {
  const chunk_state& ch = s.state.chunks[static_cast<std::size_t>(c)];
  const auto& args = s.args;
  const token_view out = (s.backward ? args.dx : args.y).subrows(ch.first, ch.count);
  const auto* hooks = s.backward ? nullptr : args.hooks;
  const std::span<float> dw = s.backward ? args.dw : std::span<float>{};
  // The forward's last finish marks its statistics complete.
  std::int64_t* const done =
      !s.backward && c + 1 == this->options_.chunks ? s.state.counters : nullptr;
  const auto call = static_cast<std::int64_t>(s.call);
  compute_stage(st, [this, &ch, out, hooks, dw, done, call, backward = s.backward](stream_arg ls) {
    const std::int64_t* token_rows =
        this->options_.static_shape ? ch.layout_rows : ch.plan.token_rows().data();
    moves::merge(ls, rows_view(ch.returned, layout_.send_cap()), out, token_rows, k_, nullptr,
                 nullptr, false);
    if (hooks != nullptr && hooks->consume)
      launch_fail_stop(ls, false, [hooks, first = ch.first, count = ch.count](stream_arg hs) {
        hooks->consume(first, count, hs);
      });
    if (backward)
      Space::for_each(
          ls, static_cast<std::int64_t>(ch.count),
          detail::token_dw_step{ch.plan.kept_experts().data(), ch.plan.pair_devices().data(),
                                ch.plan.token_rows().data(), ch.plan.send_offsets().data(), k_, D_,
                                static_cast<std::int64_t>(layout_.slot_rows()), ch.returned_dw,
                                dw.data() + ch.first * static_cast<std::size_t>(k_)});
    if (done != nullptr)
      Space::for_each(ls, 1, detail::stats_done_step{done, call});
  });
}
WEAVE_NAMESPACE_END
