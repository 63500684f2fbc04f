//! \file
//! The sending half of `basic_moe_exchange`'s stages: a chunk's prepare (capacity, its plan,
//! statistics, the send layout) and its dispatch (the count exchange carrying every rank's
//! status, the receive layout, the all-to-alls of routes and rows), and the counts the
//! all-to-alls read. Included by `moe_exchange.hpp`.
#pragma once

#include "weave/overlap/moe_exchange.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <tuple>
#include <utility>

WEAVE_NAMESPACE_BEGIN

template <execution_space Space, exchange_communicator<Space> Comm>
std::span<std::int64_t> basic_moe_exchange<Space, Comm>::send_counts(chunk_state& ch) const {
  if constexpr (Space::runs_later)
    return {const_cast<std::int64_t*>(ch.plan.send_counts().data()), ch.send_counts_h.size()};
  else
    return ch.send_counts_h;
}
template <execution_space Space, exchange_communicator<Space> Comm>
std::span<std::int64_t> basic_moe_exchange<Space, Comm>::send_displs(chunk_state& ch) const {
  if constexpr (Space::runs_later)
    return {const_cast<std::int64_t*>(ch.plan.send_offsets().data()), ch.send_displs_h.size()};
  else
    return ch.send_displs_h;
}
template <execution_space Space, exchange_communicator<Space> Comm>
std::span<std::int64_t> basic_moe_exchange<Space, Comm>::recv_counts(chunk_state& ch) const {
  if constexpr (Space::runs_later)
    return {ch.recv_counts, ch.recv_counts_h.size()};
  else
    return ch.recv_counts_h;
}
template <execution_space Space, exchange_communicator<Space> Comm>
std::span<std::int64_t> basic_moe_exchange<Space, Comm>::recv_displs(chunk_state& ch) const {
  if constexpr (Space::runs_later)
    return {ch.recv_displs, ch.recv_displs_h.size()};
  else
    return ch.recv_displs_h;
}
template <execution_space Space, exchange_communicator<Space> Comm>
template <class F>
void basic_moe_exchange<Space, Comm>::launch_fail_stop(stream_type& s, bool before_dispatch, F f) {
  if (before_dispatch && Space::runs_later)
    Space::launch(s, std::move(f));
  else
    Space::launch(s, [this, f = std::move(f)](stream_arg ls) mutable {
      abort_peers_on_failure(*this->comm_, [&] { f(ls); });
    });
}
template <execution_space Space, exchange_communicator<Space> Comm>
template <class F>
void basic_moe_exchange<Space, Comm>::compute_stage(stream_type& s, F f) {
  if constexpr (Space::runs_later)
    Space::launch(s, [this, f = std::move(f)](stream_arg ls) mutable {
      abort_peers_on_failure(*this->comm_, [&] { f(ls); });
    });
  else
    f(s);
}
template <execution_space Space, exchange_communicator<Space> Comm>
void basic_moe_exchange<Space, Comm>::enqueue_prepare(slot_type& s, int c, stream_type& st) {
  chunk_state& ch = s.state.chunks[static_cast<std::size_t>(c)];
  if (s.backward) {
    Space::launch(st, [this, &ch, dy = s.args.dy.subrows(ch.first, ch.count)](stream_arg ls) {
      gather_send(ch, ls, dy);
    });
    return;
  }
  // Set here, not in the task: the issuing thread reads them (a backward reuses them).
  std::tie(ch.first, ch.count) = this->chunk_range(s.tokens, c);
  // A failure here travels with the chunk's count exchange (host streams: the stream fails).
  Space::launch(st, [this, &s, c](stream_arg ls) { prepare(s, c, ls); });
}

template <execution_space Space, exchange_communicator<Space> Comm>
void basic_moe_exchange<Space, Comm>::prepare(slot_type& s, int c, stream_type& st) {
  call_state& cs = s.state;
  chunk_state& ch = cs.chunks[static_cast<std::size_t>(c)];
  const auto& args = s.args;
  const auto k = static_cast<std::size_t>(k_);
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
  const auto ids = args.ids.subspan(ch.first * k, ch.count * k);
  const auto weights = args.weights.subspan(ch.first * k, ch.count * k);
  ch.plan.build(st, ids, weights, std::span<const std::uint8_t>(keep), ch.first);
  if constexpr (Space::runs_later) {
    // Host code runs here, after the plan: a flagged pair fails the stream with the error
    // naming it, which the chunk's count exchange carries to every rank (as a record, message
    // included); its flags are cleared, as they are reported so.
    if (std::uint32_t* flags = ch.plan.error_word(); *flags != 0) {
      const std::uint32_t flagged = std::exchange(*flags, 0u);
      detail::check_routing(ids, weights, k, this->placement_.num_experts(), ch.first);
      device_dispatch_plan<Space>::throw_plan_errors(flagged, this->placement_.num_experts());
    }
  }
  Space::for_each(st, static_cast<std::int64_t>(ch.count * k),
                  detail::routed_pairs_step{ch.plan.kept_experts().data(), cs.counters});
  Space::for_each(st, 1,
                  detail::sent_rows_step{ch.plan.send_counts().data(),
                                         ch.plan.send_offsets().data(), D_, this->rank_,
                                         cs.counters});
  if (this->options_.static_shape) {
    const auto S = static_cast<std::int64_t>(layout_.slot_rows());
    Space::for_each(st, static_cast<std::int64_t>(layout_.send_cap()),
                    detail::slot_layout_step{ch.plan.send_counts().data(),
                                             ch.plan.send_offsets().data(),
                                             ch.plan.row_token().data(), ch.plan.route_entries(), S,
                                             k_, ch.slot_row_token, ch.send_routes});
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

template <execution_space Space, exchange_communicator<Space> Comm>
void basic_moe_exchange<Space, Comm>::quantize_send(chunk_state& ch, stream_type& s,
                                                    const const_token_view& ori) {
  const auto [codes, scales] = layout_.wire_views(ch.send_fp8, layout_.send_cap());
  const fp8_dispatch_options& f = *this->options_.fp8_dispatch;
  if (this->options_.static_shape)
    quant::quantize(s, ori, codes, scales, ch.slot_row_token, nullptr, f.blocks, ch.quant_status);
  else
    quant::quantize(s, ori, codes, scales, ch.plan.row_token().data(),
                    ch.plan.send_offsets().data() + D_, f.blocks, ch.quant_status);
}

template <execution_space Space, exchange_communicator<Space> Comm>
void basic_moe_exchange<Space, Comm>::gather_send(chunk_state& ch, stream_type& s,
                                                  const const_token_view& ori) {
  // Each SFD row from its token; serial spaces scatter each token to its rows instead.
  const token_view send = rows_view(ch.send, layout_.send_cap());
  if (this->options_.static_shape)
    layout_move<Space>(s, ori, send, ch.slot_row_token, nullptr, nullptr, ch.layout_rows, k_,
                       nullptr, nullptr);
  else
    layout_move<Space>(s, ori, send, ch.plan.row_token().data(), nullptr,
                       ch.plan.send_offsets().data() + D_, ch.plan.token_rows().data(), k_, nullptr,
                       nullptr);
}

template <execution_space Space, exchange_communicator<Space> Comm>
bool basic_moe_exchange<Space, Comm>::enqueue_dispatch(slot_type& s, int c, stream_type& st) {
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

template <execution_space Space, exchange_communicator<Space> Comm>
void basic_moe_exchange<Space, Comm>::complete_dispatch(slot_type& s, int c, stream_type& st) {
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
      all_to_all_v(*this->comm_, st, ch.plan.route_entries(), send_counts(ch), send_displs(ch),
                   ch.recv_routes, recv_counts(ch), recv_displs(ch),
                   static_cast<std::size_t>(k_) * 8);
  }
  // The backward's dispatch has no count exchange: its rows carry the stage's call tag.
  const call_tag tag = s.backward ? this->tag_of(s, c, false) : call_tag{};
  exchange_stage_tag(ch, st, tag);
  if (fixed)
    all_to_all_v(*this->comm_, st, send, uniform_counts_, uniform_displs_, recv, uniform_counts_,
                 uniform_displs_, row, tag);
  else
    all_to_all_v(*this->comm_, st, send, send_counts(ch), send_displs(ch), recv, recv_counts(ch),
                 recv_displs(ch), row, tag);
}

template <execution_space Space, exchange_communicator<Space> Comm>
void basic_moe_exchange<Space, Comm>::exchange_chunk_counts(slot_type& s, chunk_state& ch,
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
  if constexpr (Space::runs_later)
    return; // the tasks that read the counts read them where they are (host memory)
  Space::copy_to_host(st, ch.send_counts_h.data(), ch.plan.send_counts().data(), D * 8);
  Space::copy_to_host(st, ch.send_displs_h.data(), ch.plan.send_offsets().data(), D * 8);
  Space::copy_to_host(st, ch.recv_counts_h.data(), ch.recv_counts, D * 8);
  if constexpr (!Space::runs_later)
    st.record(ch.counts_ready);
}

template <execution_space Space, exchange_communicator<Space> Comm>
void basic_moe_exchange<Space, Comm>::read_counts(slot_type& s, chunk_state& ch, stream_type& st) {
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
  if constexpr (!Space::runs_later) // host streams planned them in place
    Space::copy_from_host(st, ch.recv_displs, ch.recv_displs_h.data(),
                          static_cast<std::size_t>(D_) * 8);
}

template <execution_space Space, exchange_communicator<Space> Comm>
void basic_moe_exchange<Space, Comm>::size_receive(chunk_state& ch, stream_type& st) {
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

template <execution_space Space, exchange_communicator<Space> Comm>
void basic_moe_exchange<Space, Comm>::plan_receive(chunk_state& ch) {
  detail::receive_displacements(recv_counts(ch), recv_displs(ch), layout_.recv_cap(),
                                "device exchange chunk receive");
}

WEAVE_NAMESPACE_END
