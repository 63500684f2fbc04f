//! \file
//! `moe_exchange`: an MoE layer's communication around the caller's experts, exact and
//! pipelined, on host streams (local_world, MPI).
//!
//! Forward, per chunk of tokens (Occult's exact mode, one row per (token, device) both ways):
//!   prepare  plan the chunk (capacity, replicas, SFD layout) and gather ORI -> SFD;
//!   dispatch exchange counts, then all_to_all_v the rows and their routing metadata;
//!   experts  build the EPD layout and scatter the received rows to it; the caller's experts
//!            run on contiguous per-expert row ranges; merge each received row's local experts
//!            (gate-weighted);
//!   combine  all_to_all_v the merged rows back;
//!   finish   merge each token's returned rows (ascending device order) into the output.
//! Chunks are pipelined as `moe_exchange_base` describes. Results are bitwise identical for
//! every chunk count: each token's sums run in the same order whatever the chunking (given
//! experts that compute each row independently of the other rows in their batch), and capacity
//! fills cumulatively across chunks so drops equal the unchunked batch's.
//!
//! Backward mirrors it: the output gradient is dispatched like the input (one row per token and
//! device), the expert device computes gate-weight gradients against the saved expert outputs,
//! the caller's expert backward runs on the gate-scaled gradients, each row's local input
//! gradients are summed and sent back with the gate gradients.
//!
//! Every step runs as a task on the call's streams. A step that fails before a chunk's dispatch
//! (planning with a bad id or weight) fails the stream, and the chunk's count exchange carries
//! the failure to every rank (all fail there; docs/faults.md); a step that fails later aborts
//! the communicator so that peers fail with `peer_failure` instead of waiting. The expert rows of a
//! chunk
//! (`moe_chunk::experts()`) are readable in a task enqueued on the compute stream after the
//! chunk was opened, or after synchronizing it. EPD buffers grow to the largest chunk seen and
//! are then reused; every other buffer is allocated at construction, for `max_in_flight` calls.
#pragma once

#include "weave/comm/communicator.hpp"
#include "weave/comm/fail_stop.hpp"
#include "weave/comm/status_exchange.hpp"
#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/float_bits.hpp"
#include "weave/core/tensor.hpp"
#include "weave/exec/stream.hpp"
#include "weave/overlap/moe_exchange_base.hpp"
#include "weave/overlap/moe_host_state.hpp"
#include "weave/overlap/moe_options.hpp"
#include "weave/placement/placement.hpp"
#include "weave/routing/capacity.hpp"
#include "weave/routing/dispatch_plan.hpp"
#include "weave/routing/expert_plan.hpp"
#include "weave/routing/kernels_host.hpp"
#include "weave/routing/quantize.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <mutex>
#include <span>
#include <tuple>
#include <utility>
#include <vector>

WEAVE_NAMESPACE_BEGIN

namespace detail {
template <class Comm>
struct host_exchange_traits {
  using comm_type = Comm;
  using stream_type = typename Comm::stream_type;
  using stream_arg = stream_type&;
  using hooks_type = moe_chunk_hooks;
  using experts_fn = std::function<void(const expert_batch&)>;
  using experts_grad_fn = std::function<void(const expert_grad_batch&)>;
  using state_type = host_call_state;
  static constexpr bool runs_later = true; // every step is a task on a stream
};
} // namespace detail

template <communicator Comm>
requires host_executor<typename Comm::stream_type> && has_exchange_counts<Comm>
class moe_exchange
    : public moe_exchange_base<moe_exchange<Comm>, detail::host_exchange_traits<Comm>> {
  using base = moe_exchange_base<moe_exchange<Comm>, detail::host_exchange_traits<Comm>>;

 public:
  using typename base::handle;
  using typename base::stream_type;

  //! An exchange for rank `comm.rank()` of a world of `comm.size()` devices placed by `where`.
  //! Allocates every communication buffer for `options.max_tokens` tokens and
  //! `options.max_in_flight` calls now. Collective: checks that every rank builds the layer
  //! alike (`agree_on_layer`: `errc::config_mismatch` on every rank otherwise). Throws
  //! `errc::invalid_argument` for a placement of another device count or bad options (among
  //! them an `fp8_dispatch` block that does not divide `hidden`), `errc::not_supported` for
  //! `static_shape` (and its peers a `peer_error` naming this rank).
  moe_exchange(Comm& comm, placement where, moe_options options)
      : base(comm, std::move(where), options, "moe_exchange",
             [&] {
               WEAVE_EXPECT(!options.static_shape, errc::not_supported,
                            "moe_options.static_shape is a mode of the device exchange "
                            "(basic_device_exchange, cuda_moe_exchange)");
             })
      , status_(comm.size(), comm.rank(), 1, "moe_exchange") {
    const auto D = static_cast<std::size_t>(comm.size());
    const auto k = static_cast<std::size_t>(options.k);
    const auto chunks = static_cast<std::size_t>(options.chunks);
    const std::size_t chunk_tokens = (options.max_tokens + chunks - 1) / chunks;
    send_bound_ = checked_mul(chunk_tokens, std::min(k, D), "send rows");
    recv_bound_ = checked_mul(chunk_tokens, D, "receive rows");
    const int spd = this->placement_.slots_per_device();
    for (int l = 0; l < spd; ++l)
      local_experts_.push_back(this->placement_.expert_of_slot(this->rank_ * spd + l));
    if (options.fp8_dispatch)
      wire_ = quantized_row_layout::of(options.hidden, options.fp8_dispatch->blocks.block);
    for (const auto& s : this->slots()) {
      s->state.allocate(this->placement_, options, this->rank_, send_bound_, recv_bound_);
      for (chunk_state& ch : s->state.chunks)
        ch.status = status_.make_block();
    }
  }

  //! Waits for the work the layer queued (its state must outlive it); with calls in flight
  //! (half issued, or a backward due), aborts the communicator first so the peers fail at once
  //! with a `peer_error` naming it. Handles that outlive the layer are stale.
  ~moe_exchange() { this->shutdown(); }

  //! What the last completed forward moved (read after synchronizing its streams).
  moe_stats stats() const {
    std::lock_guard lock(stats_mutex_);
    return stats_;
  }
  //! What `h`'s forward moved: valid once its streams ran the combine (`errc::invalid_state`
  //! before).
  moe_stats stats(const handle& h) const {
    const auto& st = this->slot(this->slot_of(h)).state;
    WEAVE_EXPECT(st.stats_ready.load(std::memory_order_acquire), errc::invalid_state,
                 "the handle's combine has not run yet (synchronize its streams first)");
    return st.stats;
  }
  //! Bytes of the buffers this exchange holds now.
  std::size_t buffer_bytes() const noexcept {
    std::size_t total = 0;
    for (const auto& s : this->slots())
      total += s->state.bytes();
    return total;
  }

 private:
  friend base;
  friend struct detail::moe_access;
  using slot_type = typename base::slot_type;
  using chunk_state = detail::host_chunk;

  // --- checks and accessors (called by the base and by moe_chunk) ---------------------------

  void check_rows(const const_token_view& v, const char* what) const {
    WEAVE_EXPECT(v.cols() == this->options_.hidden && v.element_type() == this->options_.element,
                 errc::size_mismatch, "moe_exchange ", what, " rows of ", v.cols(), " ",
                 v.element_type(), " for an exchange of ", this->options_.hidden, " ",
                 this->options_.element);
    WEAVE_EXPECT(host_accessible(v.space()), errc::invalid_argument, "moe_exchange ", what, " in ",
                 v.space(), " memory on the host path");
  }

  const chunk_state& ready_chunk(const slot_type& slot, int c, int direction) const {
    const chunk_state& ch = slot.state.chunks[static_cast<std::size_t>(c)];
    WEAVE_EXPECT(ch.ready[direction].load(std::memory_order_acquire), errc::invalid_state, "chunk ",
                 c, "'s ", direction == 0 ? "expert" : "gradient",
                 " rows are not ready: read them in a task on the compute stream (after the "
                 "chunk was opened), or after synchronizing it");
    return ch;
  }

  expert_batch chunk_experts(int slot, int c) const { return experts_of(this->slot(slot), c); }
  expert_grad_batch chunk_experts_grad(int slot, int c) const {
    return experts_grad_of(this->slot(slot), c);
  }
  std::span<const std::int64_t> chunk_expert_rows(int slot, int c) const {
    return ready_chunk(this->slot(slot), c, 0).expert_rows;
  }

  expert_batch experts_of(const slot_type& slot, int c) const {
    const chunk_state& ch = ready_chunk(slot, c, 0);
    const auto epd = static_cast<std::size_t>(ch.experts.epd_rows());
    auto& mut = const_cast<chunk_state&>(ch); // views of the slot's buffers, not of this object
    return {c,
            this->rank_,
            ch.experts.expert_offsets(),
            local_experts_,
            inputs_of(mut, epd),
            mut.epd_out.view(epd),
            codes_of(mut, epd),
            scales_of(mut, epd)};
  }

  // The expert inputs in the element type (empty for an FP8 dispatch that keeps only codes),
  // and an FP8 dispatch's codes and scales.
  bool has_inputs() const noexcept {
    return !this->options_.fp8_dispatch || this->options_.fp8_dispatch->dequantized_inputs;
  }
  const_token_view inputs_of(chunk_state& ch, std::size_t epd) const {
    return has_inputs() ? const_token_view(ch.epd_in.view(epd)) : const_token_view{};
  }
  const_token_view codes_of(chunk_state& ch, std::size_t epd) const {
    return this->options_.fp8_dispatch ? const_token_view(ch.epd_codes.view(epd))
                                       : const_token_view{};
  }
  const_token_view scales_of(chunk_state& ch, std::size_t epd) const {
    return this->options_.fp8_dispatch ? const_token_view(ch.epd_scales.view(epd))
                                       : const_token_view{};
  }

  expert_grad_batch experts_grad_of(const slot_type& slot, int c) const {
    const chunk_state& ch = ready_chunk(slot, c, 1);
    const auto epd = static_cast<std::size_t>(ch.experts.epd_rows());
    auto& mut = const_cast<chunk_state&>(ch);
    return {c,
            this->rank_,
            ch.experts.expert_offsets(),
            local_experts_,
            inputs_of(mut, epd),
            mut.grad_scaled.view(epd),
            mut.epd_out.view(epd),
            codes_of(mut, epd),
            scales_of(mut, epd)};
  }

  // --- stages (issued by the base; each runs as tasks on `s`) -------------------------------

  template <class F>
  void task(stream_type& s, F f) {
    s.submit([this, f] { abort_peers_on_failure(*this->comm_, f); });
  }

  // A rejected call's turn (see `moe_exchange_base::reject`): both streams carry `failure`
  // while `issue` enqueues it, so its count exchanges tell the peers.
  template <class Issue>
  void enqueue_rejected(slot_type&, const std::exception_ptr& failure, stream_type& compute,
                        stream_type& comm, Issue&& issue) {
    enqueue_failed_call(*this->comm_, compute, comm, failure, std::forward<Issue>(issue));
  }

  void synchronize_layer(stream_type& compute, stream_type& comm) {
    synchronize_streams(*this->comm_, compute, comm);
  }

  void on_start(slot_type&, stream_type&) {}

  void on_dispatch(slot_type& slot) {
    slot.state.stats_ready.store(false, std::memory_order_relaxed);
    for (chunk_state& ch : slot.state.chunks)
      for (auto& r : ch.ready)
        r.store(false, std::memory_order_relaxed);
  }

  void enqueue_prepare(slot_type& slot, int c, stream_type& s) {
    if (slot.backward)
      task(s, [&slot, c] {
        chunk_state& ch = slot.state.chunks[static_cast<std::size_t>(c)];
        dispatch_gather(ch.plan, slot.args.dy.subrows(ch.first, ch.count),
                        ch.send.view(static_cast<std::size_t>(ch.plan.rows())));
      });
    else
      s.submit([this, &slot, c] { prepare(slot, c); }); // travels with the count exchange
  }

  // Returns false: nothing waits on the host (the receive layout is planned on the stream).
  bool enqueue_dispatch(slot_type& slot, int c, stream_type& s) {
    chunk_state& ch = slot.state.chunks[static_cast<std::size_t>(c)];
    // The stage's first collective carries its call tag (the forward's count exchange, the
    // backward's rows); the ones after it in the stage follow on every rank alike.
    const call_tag tag = this->tag_of(slot, c, false);
    if (!slot.backward) {
      exchange_chunk_counts(ch, s, tag);
      all_to_all_v(*this->comm_, s, ch.send_routes.data(), ch.send_counts, ch.send_displs,
                   ch.recv_routes.data(), ch.recv_counts, ch.recv_displs,
                   static_cast<std::size_t>(this->options_.k) * sizeof(route_entry));
    }
    const bool fp8 = !slot.backward && this->options_.fp8_dispatch; // the backward keeps T
    row_buffer& send = fp8 ? ch.send_fp8 : ch.send;
    row_buffer& recv = fp8 ? ch.recv_fp8 : ch.recv;
    all_to_all_v(*this->comm_, s, send.data(), ch.send_counts, ch.send_displs, recv.data(),
                 ch.recv_counts, ch.recv_displs, send.row_bytes(),
                 slot.backward ? tag : call_tag{});
    return false;
  }
  void complete_dispatch(slot_type&, int, stream_type&) {}

  // The count exchange of a chunk (every path's one place), then the receive layout from it.
  void exchange_chunk_counts(chunk_state& ch, stream_type& s, call_tag tag) {
    status_.exchange(*this->comm_, s, ch.status, ch.send_counts, ch.recv_counts, tag);
    task(s, [this, &ch] { plan_receive(ch); });
  }

  void enqueue_open_experts(slot_type& slot, int c, stream_type& s) {
    const bool backward = slot.backward; // tasks run later, maybe in the next phase
    task(s,
         [this, &slot, c, backward] { backward ? open_backward(slot, c) : open_forward(slot, c); });
  }

  void enqueue_close_experts(slot_type& slot, int c, stream_type& s) {
    const bool backward = slot.backward;
    task(s, [&slot, c, backward] {
      chunk_state& ch = slot.state.chunks[static_cast<std::size_t>(c)];
      const auto epd = static_cast<std::size_t>(ch.experts.epd_rows());
      expert_merge(ch.experts, ch.epd_out.view(epd), ch.back.view(ch.received()),
                   /*weighted=*/!backward);
    });
  }

  void enqueue_experts_callback(slot_type& slot, int c, stream_type& s) {
    const bool backward = slot.backward;
    task(s, [this, &slot, c, backward] {
      if (backward)
        slot.args.experts_grad(experts_grad_of(slot, c));
      else
        slot.args.experts(experts_of(slot, c));
    });
  }

  void enqueue_combine(slot_type& slot, int c, stream_type& s) {
    chunk_state& ch = slot.state.chunks[static_cast<std::size_t>(c)];
    all_to_all_v(*this->comm_, s, ch.back.data(), ch.recv_counts, ch.recv_displs,
                 ch.returned.data(), ch.send_counts, ch.send_displs, ch.back.row_bytes(),
                 this->tag_of(slot, c, true));
    if (slot.backward)
      all_to_all_v(*this->comm_, s, ch.send_dw.data(), ch.recv_counts, ch.recv_displs,
                   ch.returned_dw.data(), ch.send_counts, ch.send_displs,
                   static_cast<std::size_t>(this->options_.k) * sizeof(float));
  }

  void enqueue_finish(slot_type& slot, int c, stream_type& s) {
    const bool backward = slot.backward;
    task(s, [this, &slot, c, backward] { backward ? finish_backward(slot, c) : finish(slot, c); });
  }

  // --- stage bodies (on the stream threads) -------------------------------------------------

  void prepare(slot_type& slot, int c) {
    detail::host_call_state& st = slot.state;
    chunk_state& ch = st.chunks[static_cast<std::size_t>(c)];
    const auto k = static_cast<std::size_t>(this->options_.k);
    std::tie(ch.first, ch.count) = this->chunk_range(slot.tokens, c);
    const auto& args = slot.args;
    if (args.hooks != nullptr && args.hooks->produce)
      args.hooks->produce(ch.first, ch.count);
    const auto ids = args.ids.subspan(ch.first * k, ch.count * k);
    const auto weights = args.weights.subspan(ch.first * k, ch.count * k);
    const std::span<std::uint8_t> keep = std::span(st.keep).subspan(ch.first * k, ch.count * k);
    if (c == 0)
      decide_capacity(slot);
    if (this->options_.capacity.order == drop_order::position)
      st.filter.admit(ids, keep); // cumulative across chunks: Lancet's rule
    ch.plan.build(ids, weights, keep, ch.first);
    const auto counts = ch.plan.send_counts();
    const auto offsets = ch.plan.send_offsets();
    std::copy(counts.begin(), counts.end(), ch.send_counts.begin());
    std::copy(offsets.begin(), offsets.end() - 1, ch.send_displs.begin());
    const auto rows = static_cast<std::size_t>(ch.plan.rows());
    WEAVE_EXPECT(rows <= send_bound_, errc::internal, "chunk ", c, " sends ", rows,
                 " rows, planned for ", send_bound_);
    std::copy(ch.plan.row_routes().begin(), ch.plan.row_routes().end(), ch.send_routes.begin());
    if (this->options_.fp8_dispatch)
      quantize_send(ch, args.x.subrows(ch.first, ch.count), rows);
    else
      dispatch_gather(ch.plan, args.x.subrows(ch.first, ch.count), ch.send.view(rows));
  }

  // FP8 dispatch: each token quantised once into its packed send rows. A token that cannot be
  // quantised fails the call (this task aborts the communicator, so the peers fail too).
  void quantize_send(chunk_state& ch, const const_token_view& ori, std::size_t rows) {
    const fp8_dispatch_options& f = *this->options_.fp8_dispatch;
    const auto [codes, scales] = wire_.views(ch.send_fp8.data(), rows, f.format);
    const std::int64_t bad = dispatch_quantize(ch.plan, ori, codes, scales, f.blocks);
    WEAVE_EXPECT(bad < 0, errc::invalid_argument, "token ",
                 ch.first + static_cast<std::size_t>(bad),
                 " holds a NaN or an infinity: the FP8 dispatch (moe_options::fp8_dispatch) "
                 "cannot quantise it");
  }

  void decide_capacity(slot_type& slot) {
    detail::host_call_state& st = slot.state;
    const auto k = static_cast<std::size_t>(this->options_.k);
    const std::size_t T = slot.tokens;
    if (st.filter_tokens != T || st.filter.num_experts() == 0) {
      st.filter = capacity_filter(this->placement_.num_experts(), this->options_.k, T,
                                  this->options_.capacity);
      st.filter_tokens = T;
    }
    st.filter.reset();
    if (this->options_.capacity.order == drop_order::position)
      return; // decided chunk by chunk
    st.priority.resize(T);
    for (std::size_t t = 0; t < T; ++t) {
      // A NaN weight (refused by the plan later) is skipped on its bits: under fast math
      // std::max may return it, and the filter would name the priority, not the weight.
      float best = -std::numeric_limits<float>::infinity();
      for (std::size_t j = 0; j < k; ++j) {
        const float w = slot.args.weights[t * k + j];
        if (slot.args.ids[t * k + j] >= 0 && !detail::is_nan(w))
          best = std::max(best, w);
      }
      st.priority[t] = best;
    }
    st.filter.decide(slot.args.ids, st.priority, std::span(st.keep).first(T * k));
  }

  void plan_receive(chunk_state& ch) { // on the comm stream, between the counts and the rows
    detail::receive_displacements(ch.recv_counts, ch.recv_displs, recv_bound_,
                                  "moe_exchange chunk receive");
  }

  void open_forward(slot_type& slot, int c) {
    chunk_state& ch = slot.state.chunks[static_cast<std::size_t>(c)];
    const std::size_t R = ch.received();
    const auto k = static_cast<std::size_t>(this->options_.k);
    ch.experts.build(std::span<const route_entry>(ch.recv_routes).first(R * k), ch.recv_counts);
    const auto epd = static_cast<std::size_t>(ch.experts.epd_rows());
    if (has_inputs())
      ch.epd_in.reserve(epd);
    ch.epd_out.reserve(epd);
    if (this->options_.fp8_dispatch)
      scatter_quantized(ch, R, epd);
    else
      expert_scatter(ch.experts, ch.recv.view(R), ch.epd_in.view(epd));
    map_expert_rows(slot, ch);
    ch.ready[1].store(false, std::memory_order_relaxed);
    ch.ready[0].store(true, std::memory_order_release);
  }

  // FP8 dispatch: the received codes and scales into the expert layout, and their dequantised
  // values when asked for.
  void scatter_quantized(chunk_state& ch, std::size_t R, std::size_t epd) {
    const fp8_dispatch_options& f = *this->options_.fp8_dispatch;
    const auto [codes, scales] = wire_.views(ch.recv_fp8.data(), R, f.format);
    ch.epd_codes.reserve(epd);
    ch.epd_scales.reserve(epd);
    expert_scatter(ch.experts, codes, ch.epd_codes.view(epd));
    expert_scatter(ch.experts, scales, ch.epd_scales.view(epd));
    if (f.dequantized_inputs)
      dequantize_rows(ch.epd_codes.view(epd), ch.epd_scales.view(epd), ch.epd_in.view(epd),
                      f.blocks);
  }

  // (token, choice) -> this device's EPD row: a pair served here arrived in the rows this rank
  // sent itself, which start at recv_displs[rank].
  void map_expert_rows(const slot_type& slot, chunk_state& ch) const {
    const auto k = static_cast<std::size_t>(this->options_.k);
    const auto kept = ch.plan.kept_experts();
    const auto offsets = ch.plan.send_offsets();
    const auto own = static_cast<std::size_t>(this->rank_);
    const auto row_epd = ch.experts.row_epd();
    ch.expert_rows.resize(ch.count * k);
    for (std::size_t t = 0; t < ch.count; ++t)
      for (std::size_t j = 0; j < k; ++j) {
        std::int64_t& out = ch.expert_rows[t * k + j];
        if (kept[t * k + j] < 0) {
          out = slot.args.ids[(ch.first + t) * k + j] < 0 ? expert_row_none : expert_row_dropped;
          continue;
        }
        const detail::pair_route r = detail::route_of_pair(ch.plan, this->placement_, t, j);
        if (r.device != this->rank_) {
          out = expert_row_remote;
          continue;
        }
        const std::int64_t received = ch.recv_displs[own] + (r.row - offsets[own]);
        out = row_epd[static_cast<std::size_t>(received) * k + r.entry];
      }
  }

  void open_backward(slot_type& slot, int c) {
    chunk_state& ch = slot.state.chunks[static_cast<std::size_t>(c)];
    const std::size_t R = ch.received();
    const auto epd = static_cast<std::size_t>(ch.experts.epd_rows());
    const auto k = static_cast<std::size_t>(this->options_.k);
    ch.grad_dy.reserve(epd);
    ch.grad_scaled.reserve(epd);
    expert_scatter(ch.experts, ch.recv.view(R), ch.grad_dy.view(epd), /*gate_scaled=*/false);
    expert_scatter(ch.experts, ch.recv.view(R), ch.grad_scaled.view(epd), /*gate_scaled=*/true);
    // dL/dw of each EPD row: <dy, expert output>, fp32, fixed order; then the expert outputs
    // make room for the input gradients.
    ch.grad_dot.resize(epd);
    const const_token_view out = ch.epd_out.view(epd), g = ch.grad_dy.view(epd);
    const std::size_t H = this->options_.hidden;
    detail::visit_float(this->options_.element, "gate gradients", [&]<class T>(T*) {
      for (std::size_t i = 0; i < epd; ++i) {
        const T* a = reinterpret_cast<const T*>(g.row(i));
        const T* b = reinterpret_cast<const T*>(out.row(i));
        float acc = 0.0f;
        for (std::size_t h = 0; h < H; ++h)
          acc += static_cast<float>(a[h]) * static_cast<float>(b[h]);
        ch.grad_dot[i] = acc;
      }
    });
    const auto row_epd = ch.experts.row_epd();
    for (std::size_t r = 0; r < R * k; ++r)
      ch.send_dw[r] = row_epd[r] >= 0 ? ch.grad_dot[static_cast<std::size_t>(row_epd[r])] : 0.0f;
    ch.ready[0].store(false, std::memory_order_relaxed);
    ch.ready[1].store(true, std::memory_order_release);
  }

  void finish(slot_type& slot, int c) {
    detail::host_call_state& st = slot.state;
    chunk_state& ch = st.chunks[static_cast<std::size_t>(c)];
    combine_merge(ch.plan, ch.returned.view(static_cast<std::size_t>(ch.plan.rows())),
                  slot.args.y.subrows(ch.first, ch.count));
    if (c == 0)
      st.pending = moe_stats{slot.tokens,
                             0,
                             0,
                             0,
                             0,
                             0,
                             0,
                             slot.args.x.row_bytes(),
                             detail::dispatch_row_bytes(this->options_)};
    st.pending.dropped_pairs += static_cast<std::int64_t>(ch.plan.dropped().size());
    st.pending.sent_rows += ch.plan.rows();
    st.pending.local_rows += ch.send_counts[static_cast<std::size_t>(this->rank_)];
    st.pending.received_rows += static_cast<std::int64_t>(ch.received());
    st.pending.expert_rows += ch.experts.epd_rows();
    for (const std::int32_t e : ch.plan.kept_experts())
      st.pending.routed_pairs += e >= 0 ? 1 : 0;
    if (c + 1 == this->options_.chunks) {
      st.stats = st.pending;
      st.stats_ready.store(true, std::memory_order_release);
      std::lock_guard lock(stats_mutex_);
      stats_ = st.pending;
    }
    if (slot.args.hooks != nullptr && slot.args.hooks->consume)
      slot.args.hooks->consume(ch.first, ch.count);
  }

  void finish_backward(slot_type& slot, int c) {
    chunk_state& ch = slot.state.chunks[static_cast<std::size_t>(c)];
    combine_merge(ch.plan, ch.returned.view(static_cast<std::size_t>(ch.plan.rows())),
                  slot.args.dx.subrows(ch.first, ch.count));
    // A choice's gate gradient comes back in the entry of its device's row that carried it.
    const auto k = static_cast<std::size_t>(this->options_.k);
    for (std::size_t t = 0; t < ch.count; ++t)
      for (std::size_t j = 0; j < k; ++j) {
        const detail::pair_route r = detail::route_of_pair(ch.plan, this->placement_, t, j);
        slot.args.dw[(ch.first + t) * k + j] =
            r.device < 0 ? 0.0f : ch.returned_dw[static_cast<std::size_t>(r.row) * k + r.entry];
      }
  }

  std::size_t send_bound_ = 0, recv_bound_ = 0;
  quantized_row_layout wire_; // FP8 dispatch: one packed row of codes and scales
  std::vector<std::int32_t> local_experts_;
  mutable std::mutex stats_mutex_;
  moe_stats stats_;
  counts_with_status<Comm> status_; // the count exchanges, carrying each rank's failure
};

WEAVE_NAMESPACE_END
