//! \file
//! The stages of `basic_device_exchange` (prepare, dispatch with its count exchange, experts
//! open and close, combine, finish), as the exchange's base issues them (see
//! `moe_exchange_base.hpp` for the order, `device_exchange.hpp` for the class). Included by
//! `device_exchange.hpp`.
#pragma once

#include "weave/overlap/device_exchange.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <tuple>

WEAVE_NAMESPACE_BEGIN

template <execution_space Space, communicator Comm>
requires std::same_as<typename Comm::stream_type, typename Space::stream_type> &&
    has_exchange_counts<Comm> && has_all_to_all_v<Comm>
void basic_device_exchange<Space, Comm>::enqueue_prepare(slot_type& s, int c, stream_type& st) {
  chunk_state& ch = s.state.chunks[static_cast<std::size_t>(c)];
  if (s.backward)
    gather_send(ch, st, s.args.dy.subrows(ch.first, ch.count));
  else
    prepare(s, c, st);
}

template <execution_space Space, communicator Comm>
requires std::same_as<typename Comm::stream_type, typename Space::stream_type> &&
    has_exchange_counts<Comm> && has_all_to_all_v<Comm>
void basic_device_exchange<Space, Comm>::prepare(slot_type& s, int c, stream_type& st) {
  call_state& cs = s.state;
  chunk_state& ch = cs.chunks[static_cast<std::size_t>(c)];
  const auto& args = s.args;
  const auto k = static_cast<std::size_t>(k_);
  std::tie(ch.first, ch.count) = this->chunk_range(s.tokens, c);
  const bool produced = args.hooks != nullptr && static_cast<bool>(args.hooks->produce);
  if (produced)
    launch_fail_stop(st, true,
                     [hooks = args.hooks, first = ch.first, count = ch.count](stream_arg ls) {
                       hooks->produce(first, count, ls);
                     });
  const std::span<std::uint8_t> keep =
      cs.filter ? std::span<std::uint8_t>(cs.keep + ch.first * k, ch.count * k)
                : std::span<std::uint8_t>{};
  if (c == 0)
    Space::fill(st, cs.counters, 0, counter_count * sizeof(std::int64_t));
  if (cs.filter && produced) { // choices arrive chunk by chunk: admit them in position order
    if (c == 0)
      cs.filter->reset(st, s.tokens);
    cs.filter->admit(st, args.ids.subspan(ch.first * k, ch.count * k), keep);
  } else if (cs.filter && c == 0) { // the whole batch at once: every chunk reads its slice
    cs.filter->decide(st, args.ids, args.weights, std::span(cs.keep, s.tokens * k));
  }
  if (cs.filter)
    Space::copy(st, cs.counters + counter_dropped, cs.filter->dropped_count(),
                sizeof(std::int64_t));
  ch.plan.build(st, args.ids.subspan(ch.first * k, ch.count * k),
                args.weights.subspan(ch.first * k, ch.count * k),
                std::span<const std::uint8_t>(keep), ch.first);
  Space::for_each(st, static_cast<std::int64_t>(ch.count * k),
                  detail::routed_pairs_step{ch.plan.kept_experts().data(), cs.counters});
  Space::for_each(st, 1,
                  detail::sent_rows_step{ch.plan.send_counts().data(),
                                         ch.plan.send_offsets().data(), D_, this->rank_,
                                         cs.counters});
  if (this->options_.static_shape) {
    const auto S = static_cast<std::int64_t>(layout_.slot_rows());
    Space::for_each(
        st, static_cast<std::int64_t>(layout_.send_cap()),
        detail::slot_layout_step{ch.plan.send_counts().data(), ch.plan.send_offsets().data(),
                                 ch.plan.row_token().data(), ch.plan.row_routes().data(), S, k_,
                                 ch.slot_row_token, ch.send_routes});
    Space::for_each(
        st, D_,
        detail::slot_counts_step{ch.plan.send_counts().data(), S, ch.slot_counts, ch.error});
    Space::for_each(st, static_cast<std::int64_t>(ch.count * k),
                    detail::layout_token_rows_step{ch.plan.token_rows().data(),
                                                   ch.plan.send_offsets().data(), D_, S,
                                                   ch.layout_rows});
  }
  if (this->options_.fp8_dispatch)
    quantize_send(ch, st, args.x.subrows(ch.first, ch.count));
  else
    gather_send(ch, st, args.x.subrows(ch.first, ch.count));
}

template <execution_space Space, communicator Comm>
requires std::same_as<typename Comm::stream_type, typename Space::stream_type> &&
    has_exchange_counts<Comm> && has_all_to_all_v<Comm>
void basic_device_exchange<Space, Comm>::quantize_send(chunk_state& ch, stream_type& s,
                                                       const const_token_view& ori) {
  const auto [codes, scales] = layout_.wire_views(ch.send_fp8, layout_.send_cap());
  const fp8_dispatch_options& f = *this->options_.fp8_dispatch;
  if (this->options_.static_shape)
    quant::quantize(s, ori, codes, scales, ch.slot_row_token, nullptr, f.blocks, ch.quant_status);
  else
    quant::quantize(s, ori, codes, scales, ch.plan.row_token().data(),
                    ch.plan.send_offsets().data() + D_, f.blocks, ch.quant_status);
}

template <execution_space Space, communicator Comm>
requires std::same_as<typename Comm::stream_type, typename Space::stream_type> &&
    has_exchange_counts<Comm> && has_all_to_all_v<Comm>
void basic_device_exchange<Space, Comm>::gather_send(chunk_state& ch, stream_type& s,
                                                     const const_token_view& ori) {
  if (this->options_.static_shape)
    moves::gather(s, ori, rows_view(ch.send, layout_.send_cap()), ch.slot_row_token, nullptr,
                  nullptr);
  else
    moves::gather(s, ori, rows_view(ch.send, layout_.send_cap()), ch.plan.row_token().data(),
                  nullptr, ch.plan.send_offsets().data() + D_);
}

template <execution_space Space, communicator Comm>
requires std::same_as<typename Comm::stream_type, typename Space::stream_type> &&
    has_exchange_counts<Comm> && has_all_to_all_v<Comm>
bool basic_device_exchange<Space, Comm>::enqueue_dispatch(slot_type& s, int c, stream_type& st) {
  chunk_state& ch = s.state.chunks[static_cast<std::size_t>(c)];
  if (!s.backward) {
    exchange_chunk_counts(s, ch, st, this->tag_of(s, c, false)); // the stage's first collective
#ifndef WEAVE_EAGER_COUNT_READS // (defined only to measure the order before the deferral)
    if (!Space::runs_later && !this->options_.static_shape)
      return true;
#endif
  }
  complete_dispatch(s, c, st);
  return false;
}

template <execution_space Space, communicator Comm>
requires std::same_as<typename Comm::stream_type, typename Space::stream_type> &&
    has_exchange_counts<Comm> && has_all_to_all_v<Comm>
void basic_device_exchange<Space, Comm>::complete_dispatch(slot_type& s, int c, stream_type& st) {
  chunk_state& ch = s.state.chunks[static_cast<std::size_t>(c)];
  const bool fixed = this->options_.static_shape;
  if (!s.backward && !fixed)
    read_counts(s, ch, st);
  const bool fp8 = !s.backward && this->options_.fp8_dispatch; // the backward keeps T
  const std::size_t row =
      fp8 ? layout_.wire().stride : this->options_.hidden * size_of(this->options_.element);
  std::byte* send = fp8 ? ch.send_fp8 : ch.send;
  std::byte* recv = fp8 ? ch.recv_fp8 : ch.recv;
  if (!s.backward) {
    if (fixed)
      all_to_all_v(*this->comm_, st, ch.send_routes, uniform_counts_, uniform_displs_,
                   ch.recv_routes, uniform_counts_, uniform_displs_,
                   static_cast<std::size_t>(k_) * 8);
    else
      all_to_all_v(*this->comm_, st, ch.plan.row_routes().data(), ch.send_counts_h,
                   ch.send_displs_h, ch.recv_routes, ch.recv_counts_h, ch.recv_displs_h,
                   static_cast<std::size_t>(k_) * 8);
  }
  // The backward's dispatch has no count exchange: its rows carry the stage's call tag.
  const call_tag tag = s.backward ? this->tag_of(s, c, false) : call_tag{};
  exchange_stage_tag(ch, st, tag);
  if (fixed)
    all_to_all_v(*this->comm_, st, send, uniform_counts_, uniform_displs_, recv, uniform_counts_,
                 uniform_displs_, row, tag);
  else
    all_to_all_v(*this->comm_, st, send, ch.send_counts_h, ch.send_displs_h, recv, ch.recv_counts_h,
                 ch.recv_displs_h, row, tag);
}

template <execution_space Space, communicator Comm>
requires std::same_as<typename Comm::stream_type, typename Space::stream_type> &&
    has_exchange_counts<Comm> && has_all_to_all_v<Comm>
void basic_device_exchange<Space, Comm>::exchange_chunk_counts(slot_type& s, chunk_state& ch,
                                                               stream_type& st, call_tag tag) {
  const auto D = static_cast<std::size_t>(D_);
  const std::int64_t* reported = s.state.rejected ? s.state.reported : nullptr;
  if (this->options_.static_shape) {
    status_.exchange(*this->comm_, st, ch.status, ch.slot_counts, ch.recv_counts,
                     ch.plan.error_word(), ch.error, reported, nullptr, nullptr, tag);
    Space::for_each(st, D_,
                    detail::received_counts_step{
                        ch.recv_counts, static_cast<std::int64_t>(layout_.slot_rows()), ch.error});
    return;
  }
  if (sized_at_call()) { // the pairs each peer sends size the expert rows
    Space::for_each(st, D_,
                    detail::device_pairs_step{ch.plan.slot_loads().data(),
                                              this->placement_.slots_per_device(), ch.send_pairs});
    status_.exchange(*this->comm_, st, ch.status, ch.plan.send_counts().data(), ch.recv_counts,
                     ch.plan.error_word(), ch.error, reported, ch.send_pairs, ch.recv_pairs, tag);
    Space::copy_to_host(st, ch.recv_pairs_h.data(), ch.recv_pairs, D * 8);
  } else {
    status_.exchange(*this->comm_, st, ch.status, ch.plan.send_counts().data(), ch.recv_counts,
                     ch.plan.error_word(), ch.error, reported, nullptr, nullptr, tag);
  }
  Space::copy_to_host(st, ch.send_counts_h.data(), ch.plan.send_counts().data(), D * 8);
  Space::copy_to_host(st, ch.send_displs_h.data(), ch.plan.send_offsets().data(), D * 8);
  Space::copy_to_host(st, ch.recv_counts_h.data(), ch.recv_counts, D * 8);
  if constexpr (!Space::runs_later)
    st.record(ch.counts_ready);
}

template <execution_space Space, communicator Comm>
requires std::same_as<typename Comm::stream_type, typename Space::stream_type> &&
    has_exchange_counts<Comm> && has_all_to_all_v<Comm>
void basic_device_exchange<Space, Comm>::read_counts(slot_type& s, chunk_state& ch,
                                                     stream_type& st) {
  const auto decide = [this, &ch, &s] {
    if (std::exception_ptr failed = status_.failure(ch.status)) {
      // Every rank raises it here, unless it is in bytes this rank alone may have received or
      // a call mismatch (the ranks' collectives are out of step): then the caller aborts.
      s.failed_together = !is_protocol_error(failed) && !is_call_mismatch(failed);
      if constexpr (!Space::runs_later) {
        // The call ends here, reported: its sender flags must not fail the slot's next call
        // (host streams clear them at `synchronize`, where they surface). On the compute
        // stream, after the chunk plans that set them.
        for (chunk_state& c : s.state.chunks) {
          Space::fill(this->load(s.compute), c.plan.error_word(), 0, sizeof(std::uint32_t));
          Space::fill(this->load(s.compute), c.error, 0, sizeof(std::uint32_t));
        }
      }
      std::rethrow_exception(failed);
    }
    abort_peers_on_failure(*this->comm_, [&] { plan_receive(ch); });
  };
  if constexpr (Space::runs_later) {
    Space::on_host(st, decide);
  } else {
    wait_watched(*this->comm_, ch.counts_ready);
    decide();
    abort_peers_on_failure(*this->comm_, [&] { size_receive(ch, st); });
  }
  Space::copy_from_host(st, ch.recv_displs, ch.recv_displs_h.data(),
                        static_cast<std::size_t>(D_) * 8);
}

template <execution_space Space, communicator Comm>
requires std::same_as<typename Comm::stream_type, typename Space::stream_type> &&
    has_exchange_counts<Comm> && has_all_to_all_v<Comm>
void basic_device_exchange<Space, Comm>::size_receive(chunk_state& ch, stream_type& st) {
  const auto L = static_cast<std::size_t>(this->placement_.slots_per_device());
  const std::size_t most_per_row = std::min(static_cast<std::size_t>(k_), L);
  std::size_t rows = 0, epd = 0;
  for (std::size_t src = 0; src < ch.recv_counts_h.size(); ++src) {
    const std::int64_t n = ch.recv_counts_h[src], pairs = ch.recv_pairs_h[src];
    WEAVE_EXPECT(pairs >= 0 && static_cast<std::uint64_t>(pairs) <=
                                   static_cast<std::uint64_t>(n) * most_per_row,
                 errc::size_mismatch, "rank ", src, " announced ", pairs, " expert rows for ", n,
                 " rows with k = ", k_, " and ", L, " local experts");
    rows += static_cast<std::size_t>(n);
    epd += static_cast<std::size_t>(pairs);
  }
  ch.rows = rows;
  ch.epd = epd;
  layout_.reserve_receive(ch, std::max<std::size_t>(rows, 1), std::max<std::size_t>(epd, 1),
                          allocator_, st);
}

template <execution_space Space, communicator Comm>
requires std::same_as<typename Comm::stream_type, typename Space::stream_type> &&
    has_exchange_counts<Comm> && has_all_to_all_v<Comm>
void basic_device_exchange<Space, Comm>::plan_receive(chunk_state& ch) {
  detail::receive_displacements(ch.recv_counts_h, ch.recv_displs_h, layout_.recv_cap(),
                                "device exchange chunk receive");
}

template <execution_space Space, communicator Comm>
requires std::same_as<typename Comm::stream_type, typename Space::stream_type> &&
    has_exchange_counts<Comm> && has_all_to_all_v<Comm>
void basic_device_exchange<Space, Comm>::exchange_back(chunk_state& ch, stream_type& s,
                                                       std::byte* from, std::byte* to,
                                                       std::size_t unit, call_tag tag) {
  if (this->options_.static_shape)
    all_to_all_v(*this->comm_, s, from, uniform_counts_, uniform_displs_, to, uniform_counts_,
                 uniform_displs_, unit, tag);
  else
    all_to_all_v(*this->comm_, s, from, ch.recv_counts_h, ch.recv_displs_h, to, ch.send_counts_h,
                 ch.send_displs_h, unit, tag);
}

template <execution_space Space, communicator Comm>
requires std::same_as<typename Comm::stream_type, typename Space::stream_type> &&
    has_exchange_counts<Comm> && has_all_to_all_v<Comm>
void basic_device_exchange<Space, Comm>::enqueue_open_experts(slot_type& s, int c,
                                                              stream_type& st) {
  chunk_state& ch = s.state.chunks[static_cast<std::size_t>(c)];
  const std::size_t epd = ch.experts.max_epd_rows();
  const std::int64_t* count = ch.experts.epd_rows_count();
  if (s.backward) {
    call_state& cs = s.state;
    const std::size_t g = sized_at_call() ? std::min(epd, cs.grads_cap) : epd;
    const auto received = rows_view(ch.recv, ch.rows_cap);
    moves::gather(st, received, rows_view(cs.grad_dy, g), ch.experts.epd_row_source().data(),
                  nullptr, count);
    moves::gather(st, received, rows_view(cs.grad_scaled, g), ch.experts.epd_row_source().data(),
                  ch.experts.epd_weight().data(), count);
    // dL/dw of each EPD row: <dy, expert output>, before the outputs make room for dL/dx.
    moves::dot(st, rows_view(cs.grad_dy, g), rows_view(ch.epd_out, g), cs.grad_dot, count);
    Space::for_each(st, static_cast<std::int64_t>(built_rows(ch) * static_cast<std::size_t>(k_)),
                    detail::entry_dw_step{ch.experts.row_epd().data(), cs.grad_dot, ch.send_dw});
    return;
  }
  const auto k = static_cast<std::size_t>(k_);
  ch.experts.build(st, std::span<const route_entry>(ch.recv_routes, ch.rows_cap * k),
                   ch.recv_counts, receive_displs(ch), built_rows(ch));
  Space::for_each(st, 1,
                  detail::received_rows_step{ch.recv_counts, D_, ch.experts.epd_rows_count(),
                                             ch.recv_total, s.state.counters});
  if (this->options_.fp8_dispatch)
    scatter_quantized(ch, st, epd);
  else
    moves::gather(st, rows_view(ch.recv, ch.rows_cap), rows_view(ch.epd_in, epd),
                  ch.experts.epd_row_source().data(), nullptr, count);
  Space::for_each(st, static_cast<std::int64_t>(ch.count * k),
                  detail::pair_expert_rows_step{
                      s.args.ids.data() + ch.first * k, ch.plan.kept_experts().data(),
                      ch.plan.pair_devices().data(), ch.plan.token_rows().data(),
                      ch.plan.send_offsets().data(), receive_displs(ch),
                      ch.experts.row_epd().data(), k_, this->rank_,
                      static_cast<std::int64_t>(layout_.slot_rows()), ch.expert_rows});
}

template <execution_space Space, communicator Comm>
requires std::same_as<typename Comm::stream_type, typename Space::stream_type> &&
    has_exchange_counts<Comm> && has_all_to_all_v<Comm>
void basic_device_exchange<Space, Comm>::scatter_quantized(chunk_state& ch, stream_type& st,
                                                           std::size_t epd) {
  const auto [codes, scales] = layout_.wire_views(ch.recv_fp8, ch.rows_cap);
  const std::int64_t* source = ch.experts.epd_row_source().data();
  const std::int64_t* count = ch.experts.epd_rows_count();
  moves::gather(st, codes, layout_.codes_view(ch.epd_codes, epd), source, nullptr, count);
  moves::gather(st, scales, layout_.scales_view(ch.epd_scales, epd), source, nullptr, count);
  const fp8_dispatch_options& f = *this->options_.fp8_dispatch;
  if (f.dequantized_inputs)
    quant::dequantize(st, layout_.codes_view(ch.epd_codes, epd),
                      layout_.scales_view(ch.epd_scales, epd), rows_view(ch.epd_in, epd), nullptr,
                      count, f.blocks);
}

template <execution_space Space, communicator Comm>
requires std::same_as<typename Comm::stream_type, typename Space::stream_type> &&
    has_exchange_counts<Comm> && has_all_to_all_v<Comm>
void basic_device_exchange<Space, Comm>::enqueue_experts_callback(slot_type& s, int c,
                                                                  stream_type& st) {
  const bool backward = s.backward; // host spaces run it later, maybe in the next phase
  launch_fail_stop(st, false, [this, &s, c, backward](stream_arg) {
    if (backward)
      s.args.experts_grad(experts_grad_of(s, c));
    else
      s.args.experts(experts_of(s, c));
  });
}

template <execution_space Space, communicator Comm>
requires std::same_as<typename Comm::stream_type, typename Space::stream_type> &&
    has_exchange_counts<Comm> && has_all_to_all_v<Comm>
void basic_device_exchange<Space, Comm>::enqueue_close_experts(slot_type& s, int c,
                                                               stream_type& st) {
  chunk_state& ch = s.state.chunks[static_cast<std::size_t>(c)];
  const bool fixed = this->options_.static_shape;
  moves::merge(st, rows_view(ch.epd_out, ch.experts.max_epd_rows()),
               rows_view(ch.back, ch.rows_cap), ch.experts.row_epd().data(), k_,
               s.backward ? nullptr : ch.experts.row_weight().data(),
               fixed ? nullptr : ch.recv_total, fixed);
}

template <execution_space Space, communicator Comm>
requires std::same_as<typename Comm::stream_type, typename Space::stream_type> &&
    has_exchange_counts<Comm> && has_all_to_all_v<Comm>
void basic_device_exchange<Space, Comm>::enqueue_combine(slot_type& s, int c, stream_type& st) {
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

template <execution_space Space, communicator Comm>
requires std::same_as<typename Comm::stream_type, typename Space::stream_type> &&
    has_exchange_counts<Comm> && has_all_to_all_v<Comm>
void basic_device_exchange<Space, Comm>::enqueue_finish(slot_type& s, int c, stream_type& st) {
  chunk_state& ch = s.state.chunks[static_cast<std::size_t>(c)];
  const auto& args = s.args;
  const std::int64_t* token_rows =
      this->options_.static_shape ? ch.layout_rows : ch.plan.token_rows().data();
  moves::merge(st, rows_view(ch.returned, layout_.send_cap()),
               (s.backward ? args.dx : args.y).subrows(ch.first, ch.count), token_rows, k_, nullptr,
               nullptr, false);
  if (!s.backward && args.hooks != nullptr && args.hooks->consume)
    launch_fail_stop(st, false,
                     [hooks = args.hooks, first = ch.first, count = ch.count](stream_arg ls) {
                       hooks->consume(first, count, ls);
                     });
  if (s.backward)
    Space::for_each(
        st, static_cast<std::int64_t>(ch.count),
        detail::token_dw_step{ch.plan.kept_experts().data(), ch.plan.pair_devices().data(),
                              ch.plan.token_rows().data(), ch.plan.send_offsets().data(), k_, D_,
                              static_cast<std::int64_t>(layout_.slot_rows()), ch.returned_dw,
                              args.dw.data() + ch.first * static_cast<std::size_t>(k_)});
}

WEAVE_NAMESPACE_END
