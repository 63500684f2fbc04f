//! \file
//! `moe_exchange`: an MoE layer's communication around the caller's experts, exact and
//! pipelined.
//!
//! Forward, per chunk of tokens (Occult's exact mode, one row per (token, device) both ways):
//!   prepare  plan the chunk (capacity, replicas, SFD layout) and gather ORI -> SFD;
//!   dispatch exchange counts, then all_to_all_v the rows and their routing metadata;
//!   experts  build the EPD layout, scatter, run the caller's experts on contiguous per-expert
//!            row ranges, merge each received row's local experts (gate-weighted);
//!   combine  all_to_all_v the merged rows back;
//!   finish   merge each token's returned rows (ascending device order) into the output.
//! `chunk_pipeline` overlaps chunk c+1's dispatch with chunk c's experts and chunk c's combine
//! with chunk c+1's experts. Results are bitwise identical for every chunk count: each token's
//! sums run in the same order whatever the chunking (given experts that compute each row
//! independently of the other rows in their batch), and capacity fills cumulatively across
//! chunks so drops equal the unchunked batch's.
//!
//! Backward mirrors it: the output gradient is dispatched like the input (one row per token and
//! device), the expert device computes gate-weight gradients against the saved expert outputs,
//! runs the caller's expert backward on the gate-scaled gradients, sums each row's local input
//! gradients, and sends them back with the gate gradients.
//!
//! Host path: the communicator's stream type is a `host_stream` (local_world, MPI). Calls
//! return once enqueued; the caller keeps every tensor, span and callback alive until both
//! streams are synchronized. Calls on the same two streams are ordered by them; a forward
//! issued while the previous forward's work is still queued first waits for it (likewise for
//! backward), since each direction keeps one set of call arguments. One exchange serves one
//! layer: its buffers hold the last forward's state for the backward.
//!
//! Fail-stop (docs/faults.md): the ranks agree on the layer's configuration at construction; a
//! rank's failure before a chunk's dispatch travels in-band with that chunk's count exchange
//! (every rank fails there, the layer stays usable); later failures abort the communicator.
//! `synchronize` is the one wait that reports the root cause.
#pragma once

#include "weave/comm/communicator.hpp"
#include "weave/comm/fail_stop.hpp"
#include "weave/comm/status_exchange.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/tensor.hpp"
#include "weave/exec/stream.hpp"
#include "weave/overlap/layer_agreement.hpp"
#include "weave/overlap/moe_options.hpp"
#include "weave/overlap/pipeline.hpp"
#include "weave/overlap/row_buffer.hpp"
#include "weave/placement/placement.hpp"
#include "weave/routing/capacity.hpp"
#include "weave/routing/dispatch_plan.hpp"
#include "weave/routing/expert_plan.hpp"
#include "weave/routing/kernels_host.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

WEAVE_NAMESPACE_BEGIN

template <communicator Comm>
requires host_executor<typename Comm::stream_type> && has_exchange_counts<Comm>
class moe_exchange {
 public:
  using stream_type = typename Comm::stream_type;
  using experts_fn = std::function<void(const expert_batch&)>;
  using experts_grad_fn = std::function<void(const expert_grad_batch&)>;

  //! An exchange for rank `comm.rank()` of a world of `comm.size()` devices placed by `where`.
  //! Allocates every communication buffer for `options.max_tokens` tokens now; expert-layout
  //! buffers grow to the largest chunk seen and are then reused. Collective: checks that every
  //! rank builds the layer alike (`agree_on_layer`: `errc::config_mismatch` on every rank
  //! otherwise); throws `errc::invalid_argument` for a placement of another device count or
  //! bad options (and its peers a `peer_error` naming this rank).
  moe_exchange(Comm& comm, placement where, moe_options options)
      : comm_(&agree_on_layer(comm, "moe_exchange", where, options,
                              [&] {
                                WEAVE_EXPECT(!options.static_shape, errc::not_supported,
                                             "moe_options.static_shape is a mode of the device "
                                             "exchange (basic_device_exchange, cuda_moe_exchange)");
                              }))
      , placement_(std::move(where))
      , options_(options)
      , pipeline_(options.chunks) {
    rank_ = comm.rank();
    const auto D = static_cast<std::size_t>(comm.size());
    const auto k = static_cast<std::size_t>(options_.k);
    const auto chunks = static_cast<std::size_t>(options_.chunks);
    const std::size_t chunk_tokens = (options_.max_tokens + chunks - 1) / chunks;
    send_bound_ = checked_mul(chunk_tokens, std::min(k, D), "send rows");
    recv_bound_ = checked_mul(chunk_tokens, D, "receive rows");
    const int spd = placement_.slots_per_device();
    for (int l = 0; l < spd; ++l)
      local_experts_.push_back(placement_.expert_of_slot(rank_ * spd + l));
    keep_.resize(checked_mul(options_.max_tokens, k, "pairs"));
    grad_scratch_ = row_buffer(options_.hidden, options_.element);
    grad_scaled_ = row_buffer(options_.hidden, options_.element);
    chunks_.resize(chunks);
    for (chunk_state& c : chunks_) {
      c.plan = dispatch_plan(placement_, options_.k, rank_);
      c.experts = expert_plan(spd, options_.k);
      c.send_counts.assign(D, 0);
      c.send_displs.assign(D, 0);
      c.recv_counts.assign(D, 0);
      c.recv_displs.assign(D, 0);
      for (row_buffer* b : {&c.send, &c.recv, &c.back, &c.returned, &c.epd_in, &c.epd_out})
        *b = row_buffer(options_.hidden, options_.element);
      c.send.reserve(send_bound_);
      c.returned.reserve(send_bound_);
      c.recv.reserve(recv_bound_);
      c.back.reserve(recv_bound_);
      c.send_routes.resize(send_bound_ * k);
      c.recv_routes.resize(recv_bound_ * k);
      c.send_dw.resize(recv_bound_ * k);
      c.returned_dw.resize(send_bound_ * k);
    }
    status_ = counts_with_status<Comm>(comm.size(), rank_, 1, chunks, "moe_exchange");
  }

  moe_exchange(const moe_exchange&) = delete;
  moe_exchange& operator=(const moe_exchange&) = delete;

  const moe_options& options() const noexcept { return options_; }
  const placement& where() const noexcept { return placement_; }
  //! The pipeline of the last call, for stage timings (`began`/`ended` events).
  const chunk_pipeline<stream_type>& pipeline() const noexcept { return pipeline_; }
  //! What the last completed forward moved (read after synchronizing its streams).
  const moe_stats& stats() const noexcept { return stats_; }
  //! Bytes of the buffers this exchange holds now.
  std::size_t buffer_bytes() const noexcept {
    std::size_t total = keep_.size();
    for (const chunk_state& c : chunks_)
      total += c.send.bytes() + c.recv.bytes() + c.back.bytes() + c.returned.bytes() +
               c.epd_in.bytes() + c.epd_out.bytes() +
               (c.send_routes.size() + c.recv_routes.size()) * sizeof(route_entry) +
               (c.send_dw.size() + c.returned_dw.size()) * sizeof(float);
    return total;
  }

  //! Enqueues the forward of `x` (T rows) routed by `ids`/`weights` (k per token, id -1 = none)
  //! into `y` (T rows): y[t] = sum over kept choices j of weights[t, j] * expert(ids[t, j])(x[t]).
  //! `experts` runs on `compute`'s thread once per chunk. Throws `errc::size_mismatch` for
  //! shapes that disagree with the options, `errc::invalid_argument` for T > max_tokens or
  //! equal streams (and its peers fail at the call's first count exchange with a `peer_error`
  //! naming it); bad ids or weights fail the streams of every rank (surfacing at synchronize)
  //! with `out_of_range`/`invalid_argument` here and `peer_failure` on the peers. `hooks`
  //! (optional, borrowed) partitions the operators around the layer into the same chunks (see
  //! `moe_chunk_hooks`).
  void forward(const_token_view x, std::span<const std::int32_t> ids,
               std::span<const float> weights, token_view y, experts_fn experts,
               stream_type& compute, stream_type& comm, const moe_chunk_hooks* hooks = nullptr) {
    const std::size_t T = x.rows();
    try {
      WEAVE_EXPECT(&compute != &comm, errc::invalid_argument,
                   "the compute and comm streams must differ");
      detail::check_hooks(hooks, options_);
      check_rows(x, "input");
      check_rows(y, "output");
      WEAVE_EXPECT(x.rows() == y.rows(), errc::size_mismatch, "forward: ", x.rows(),
                   " input rows but ", y.rows(), " output rows");
      const auto k = static_cast<std::size_t>(options_.k);
      WEAVE_EXPECT(ids.size() == T * k && weights.size() == T * k, errc::size_mismatch,
                   "forward: ", ids.size(), " ids and ", weights.size(), " weights for ", T,
                   " tokens with k = ", k);
    } catch (...) { // fail-stop: the rejected call still takes its turn, carrying the error
      enqueue_failed_call(*comm_, compute, comm, std::current_exception(), [&] {
        begin_call(false, compute);
        pipeline_.run(compute, comm, *this);
      });
      throw;
    }
    begin_call(false, compute);
    calls_[0] = {x, y, ids, weights, {}, std::move(experts), {}, T, hooks};
    pipeline_.run(compute, comm, *this);
    compute.record(call_done_[0]);
  }

  //! Enqueues the backward of the last forward (which needs `save_for_backward`): from the
  //! output gradient `dy` (T rows) it writes the input gradient `dx` (T rows) and the gate
  //! gradients `dw` (k per token; 0 for dropped or absent choices). `experts_grad` runs the
  //! experts' backward on `compute`'s thread once per chunk. Bad arguments throw here and abort
  //! the communicator (the backward has no count exchange to carry them).
  void backward(const_token_view dy, token_view dx, std::span<float> dw,
                experts_grad_fn experts_grad, stream_type& compute, stream_type& comm) {
    const std::size_t T = calls_[0].tokens;
    abort_peers_on_failure(*comm_, [&] {
      WEAVE_EXPECT(options_.save_for_backward, errc::invalid_state,
                   "backward needs moe_options.save_for_backward");
      check_rows(dy, "output gradient");
      check_rows(dx, "input gradient");
      WEAVE_EXPECT(dy.rows() == T && dx.rows() == T && dw.size() == T * options_.k,
                   errc::size_mismatch, "backward: ", dy.rows(), " dy rows, ", dx.rows(),
                   " dx rows and ", dw.size(), " gate gradients for a forward of ", T, " tokens");
    });
    begin_call(true, compute);
    calls_[1] = {dy, dx, calls_[0].ids, calls_[0].weights, dw, {}, std::move(experts_grad), T};
    pipeline_.run(compute, comm, *this);
    compute.record(call_done_[1]);
  }

  //! The one wait: waits for both streams of the layer's calls and rethrows the root cause (this
  //! rank's own error, else a peer's failure naming its rank, code and message), observing the
  //! failures of both streams. Afterwards the layer is usable again unless `usable()` is false.
  void synchronize(stream_type& compute, stream_type& comm) {
    synchronize_streams(*comm_, compute, comm);
  }

  //! False once the communicator was aborted (a failure after a dispatch, a timeout): every
  //! later call fails; rebuild the communicator and the layer. In-band failures (bad input found
  //! before a dispatch) leave it true.
  bool usable() const { return !communicator_aborted(*comm_); }

  //! The stage hook `chunk_pipeline` calls (not for direct use).
  void enqueue(pipeline_stage stage, int c, stream_type& s) {
    chunk_state& ch = chunks_[static_cast<std::size_t>(c)];
    const bool bwd = direction_;
    switch (stage) {
    case pipeline_stage::prepare:
      s.submit([this, c, bwd] { // a forward's failure travels with the count exchange
        bwd ? detail::abort_peers_on_failure(*comm_, [&] { prepare_backward(c); }) : prepare(c);
      });
      break;
    case pipeline_stage::dispatch:
      if (!bwd) {
        status_.exchange(*comm_, s, static_cast<std::size_t>(c), ch.send_counts, ch.recv_counts);
        s.submit([this, c] { detail::abort_peers_on_failure(*comm_, [&] { plan_receive(c); }); });
        all_to_all_v(*comm_, s, ch.send_routes.data(), ch.send_counts, ch.send_displs,
                     ch.recv_routes.data(), ch.recv_counts, ch.recv_displs,
                     static_cast<std::size_t>(options_.k) * sizeof(route_entry));
      }
      all_to_all_v(*comm_, s, ch.send.data(), ch.send_counts, ch.send_displs, ch.recv.data(),
                   ch.recv_counts, ch.recv_displs, ch.send.row_bytes());
      break;
    case pipeline_stage::experts:
      s.submit([this, c, bwd] {
        detail::abort_peers_on_failure(*comm_,
                                       [&] { bwd ? experts_backward(c) : experts_forward(c); });
      });
      break;
    case pipeline_stage::combine:
      all_to_all_v(*comm_, s, ch.back.data(), ch.recv_counts, ch.recv_displs, ch.returned.data(),
                   ch.send_counts, ch.send_displs, ch.back.row_bytes());
      if (bwd)
        all_to_all_v(*comm_, s, ch.send_dw.data(), ch.recv_counts, ch.recv_displs,
                     ch.returned_dw.data(), ch.send_counts, ch.send_displs,
                     static_cast<std::size_t>(options_.k) * sizeof(float));
      break;
    case pipeline_stage::finish:
      s.submit([this, c, bwd] {
        detail::abort_peers_on_failure(*comm_, [&] { bwd ? finish_backward(c) : finish(c); });
      });
      break;
    }
  }

 private:
  struct chunk_state {
    std::size_t first = 0, count = 0; // token range of the chunk
    dispatch_plan plan;               // sender half (ORI <-> SFD)
    expert_plan experts;              // receiver half (SFD <-> EPD)
    std::vector<std::int64_t> send_counts, send_displs, recv_counts, recv_displs;
    row_buffer send, recv, back, returned, epd_in, epd_out;
    std::vector<route_entry> send_routes, recv_routes;
    std::vector<float> send_dw, returned_dw; // backward: gate gradients per route entry
  };

  using call_arguments = detail::moe_call_arguments<experts_fn, experts_grad_fn, moe_chunk_hooks>;

  // Each direction has one argument slot: wait until the previous call of that direction has
  // run (its end event completes even if a stream failed; the failure surfaces at the caller's
  // synchronize, so it is not rethrown here).
  void begin_call(bool backward, stream_type&) {
    try {
      call_done_[backward ? 1 : 0].synchronize();
    } catch (...) {
    }
    direction_ = backward;
  }

  void check_rows(const const_token_view& v, const char* what) const {
    WEAVE_EXPECT(v.cols() == options_.hidden && v.element_type() == options_.element,
                 errc::size_mismatch, "moe_exchange ", what, " rows of ", v.cols(), " ",
                 v.element_type(), " for an exchange of ", options_.hidden, " ", options_.element);
    WEAVE_EXPECT(host_accessible(v.space()), errc::invalid_argument, "moe_exchange ", what, " in ",
                 v.space(), " memory on the host path");
    WEAVE_EXPECT(v.rows() <= options_.max_tokens, errc::invalid_argument, "moe_exchange ", what,
                 " of ", v.rows(), " tokens exceeds max_tokens = ", options_.max_tokens);
  }

  std::pair<std::size_t, std::size_t> chunk_range(int c) const noexcept {
    const std::size_t T = calls_[0].tokens, C = chunks_.size(), i = static_cast<std::size_t>(c);
    return {T * i / C, T * (i + 1) / C - T * i / C};
  }

  void prepare(int c) {
    chunk_state& ch = chunks_[static_cast<std::size_t>(c)];
    const auto k = static_cast<std::size_t>(options_.k);
    std::tie(ch.first, ch.count) = chunk_range(c);
    if (calls_[0].hooks != nullptr && calls_[0].hooks->produce)
      calls_[0].hooks->produce(ch.first, ch.count);
    const auto ids = calls_[0].ids.subspan(ch.first * k, ch.count * k);
    const auto weights = calls_[0].weights.subspan(ch.first * k, ch.count * k);
    const std::span<std::uint8_t> keep = std::span(keep_).subspan(ch.first * k, ch.count * k);
    if (c == 0)
      decide_capacity();
    if (options_.capacity.order == drop_order::position)
      filter_.admit(ids, keep); // cumulative across chunks: Lancet's rule
    ch.plan.build(ids, weights, keep, ch.first);
    const auto counts = ch.plan.send_counts();
    const auto offsets = ch.plan.send_offsets();
    std::copy(counts.begin(), counts.end(), ch.send_counts.begin());
    std::copy(offsets.begin(), offsets.end() - 1, ch.send_displs.begin());
    const auto rows = static_cast<std::size_t>(ch.plan.rows());
    WEAVE_EXPECT(rows <= send_bound_, errc::internal, "chunk ", c, " sends ", rows,
                 " rows, planned for ", send_bound_);
    std::copy(ch.plan.row_routes().begin(), ch.plan.row_routes().end(), ch.send_routes.begin());
    dispatch_gather(ch.plan, calls_[0].x.subrows(ch.first, ch.count), ch.send.view(rows));
  }

  void decide_capacity() {
    const auto k = static_cast<std::size_t>(options_.k);
    const std::size_t T = calls_[0].tokens;
    if (filter_tokens_ != T || filter_.num_experts() == 0) {
      filter_ = capacity_filter(placement_.num_experts(), options_.k, T, options_.capacity);
      filter_tokens_ = T;
    }
    filter_.reset();
    if (options_.capacity.order == drop_order::position)
      return; // decided chunk by chunk
    priority_.resize(T);
    for (std::size_t t = 0; t < T; ++t) {
      float best = -std::numeric_limits<float>::infinity();
      for (std::size_t j = 0; j < k; ++j)
        if (calls_[0].ids[t * k + j] >= 0)
          best = std::max(best, calls_[0].weights[t * k + j]);
      priority_[t] = best;
    }
    filter_.decide(calls_[0].ids, priority_, std::span(keep_).first(T * k));
  }

  void plan_receive(int c) { // on the comm stream, between the count exchange and the rows
    chunk_state& ch = chunks_[static_cast<std::size_t>(c)];
    std::int64_t total = 0;
    for (std::size_t src = 0; src < ch.recv_counts.size(); ++src) {
      ch.recv_displs[src] = total;
      total += ch.recv_counts[src];
    }
    WEAVE_EXPECT(static_cast<std::size_t>(total) <= recv_bound_, errc::size_mismatch, "chunk ", c,
                 " would receive ", total, " rows, more than the ", recv_bound_,
                 " planned from max_tokens = ", options_.max_tokens,
                 " (a rank passed more tokens, or the ranks' options differ)");
  }

  std::size_t received_rows(const chunk_state& ch) const noexcept {
    return static_cast<std::size_t>(ch.recv_displs.back() + ch.recv_counts.back());
  }

  expert_batch batch_of(int c, chunk_state& ch) {
    const auto epd = static_cast<std::size_t>(ch.experts.epd_rows());
    return {c,
            rank_,
            ch.experts.expert_offsets(),
            local_experts_,
            ch.epd_in.view(epd),
            ch.epd_out.view(epd)};
  }

  void experts_forward(int c) {
    chunk_state& ch = chunks_[static_cast<std::size_t>(c)];
    const std::size_t R = received_rows(ch);
    const auto k = static_cast<std::size_t>(options_.k);
    ch.experts.build(std::span<const route_entry>(ch.recv_routes).first(R * k), ch.recv_counts);
    const auto epd = static_cast<std::size_t>(ch.experts.epd_rows());
    ch.epd_in.reserve(epd);
    ch.epd_out.reserve(epd);
    expert_scatter(ch.experts, ch.recv.view(R), ch.epd_in.view(epd));
    calls_[0].experts(batch_of(c, ch));
    expert_merge(ch.experts, ch.epd_out.view(epd), ch.back.view(R), /*weighted=*/true);
  }

  void finish(int c) {
    chunk_state& ch = chunks_[static_cast<std::size_t>(c)];
    combine_merge(ch.plan, ch.returned.view(static_cast<std::size_t>(ch.plan.rows())),
                  calls_[0].y.subrows(ch.first, ch.count));
    if (c == 0)
      pending_ = moe_stats{calls_[0].tokens, 0, 0, 0, 0, 0, 0, calls_[0].x.row_bytes()};
    pending_.dropped_pairs += static_cast<std::int64_t>(ch.plan.dropped().size());
    pending_.sent_rows += ch.plan.rows();
    pending_.local_rows += ch.send_counts[static_cast<std::size_t>(rank_)];
    pending_.received_rows += static_cast<std::int64_t>(received_rows(ch));
    pending_.expert_rows += ch.experts.epd_rows();
    for (const std::int32_t e : ch.plan.kept_experts())
      pending_.routed_pairs += e >= 0 ? 1 : 0;
    if (c + 1 == static_cast<int>(chunks_.size()))
      stats_ = pending_;
    if (calls_[0].hooks != nullptr && calls_[0].hooks->consume)
      calls_[0].hooks->consume(ch.first, ch.count);
  }

  void prepare_backward(int c) {
    chunk_state& ch = chunks_[static_cast<std::size_t>(c)];
    dispatch_gather(ch.plan, calls_[1].x.subrows(ch.first, ch.count),
                    ch.send.view(static_cast<std::size_t>(ch.plan.rows())));
  }

  void experts_backward(int c) {
    chunk_state& ch = chunks_[static_cast<std::size_t>(c)];
    const std::size_t R = received_rows(ch);
    const auto epd = static_cast<std::size_t>(ch.experts.epd_rows());
    const auto k = static_cast<std::size_t>(options_.k);
    row_buffer& dy = grad_scratch_;
    row_buffer& scaled = grad_scaled_;
    dy.reserve(epd);
    scaled.reserve(epd);
    expert_scatter(ch.experts, ch.recv.view(R), dy.view(epd), /*gate_scaled=*/false);
    expert_scatter(ch.experts, ch.recv.view(R), scaled.view(epd), /*gate_scaled=*/true);
    // dL/dw of each EPD row: <dy, expert output>, fp32, fixed order.
    grad_dot_.resize(epd);
    const const_token_view out = ch.epd_out.view(epd), g = dy.view(epd);
    for (std::size_t i = 0; i < epd; ++i) {
      float acc = 0.0f;
      for (std::size_t h = 0; h < options_.hidden; ++h)
        acc += load_as_float(g.row(i), h, options_.element) *
               load_as_float(out.row(i), h, options_.element);
      grad_dot_[i] = acc;
    }
    const auto row_epd = ch.experts.row_epd();
    for (std::size_t r = 0; r < R * k; ++r)
      ch.send_dw[r] = row_epd[r] >= 0 ? grad_dot_[static_cast<std::size_t>(row_epd[r])] : 0.0f;
    // The experts' input gradients land in epd_out (its forward values are no longer needed).
    calls_[1].experts_grad({c, rank_, ch.experts.expert_offsets(), local_experts_,
                            ch.epd_in.view(epd), scaled.view(epd), ch.epd_out.view(epd)});
    expert_merge(ch.experts, ch.epd_out.view(epd), ch.back.view(R), /*weighted=*/false);
  }

  void finish_backward(int c) {
    chunk_state& ch = chunks_[static_cast<std::size_t>(c)];
    combine_merge(ch.plan, ch.returned.view(static_cast<std::size_t>(ch.plan.rows())),
                  calls_[1].y.subrows(ch.first, ch.count));
    // Route entries of an SFD row are the token's kept choices on that device, in rank order.
    const auto k = static_cast<std::size_t>(options_.k);
    const auto kept = ch.plan.kept_experts();
    const auto offsets = ch.plan.send_offsets();
    const auto token_rows = ch.plan.token_rows();
    const int spd = placement_.slots_per_device();
    for (std::size_t t = 0; t < ch.count; ++t) {
      float* dw = calls_[1].dw.data() + (ch.first + t) * k;
      for (std::size_t j = 0; j < k; ++j) {
        dw[j] = 0.0f;
        const std::int32_t e = kept[t * k + j];
        if (e < 0)
          continue;
        const int device = placement_.slot_for(e, ch.first + t, rank_) / spd;
        std::size_t entry = 0;
        for (std::size_t i = 0; i < j; ++i)
          if (kept[t * k + i] >= 0 &&
              placement_.slot_for(kept[t * k + i], ch.first + t, rank_) / spd == device)
            ++entry;
        for (std::size_t i = 0; i < k; ++i) {
          const std::int64_t row = token_rows[t * k + i];
          if (row >= offsets[static_cast<std::size_t>(device)] &&
              row < offsets[static_cast<std::size_t>(device) + 1]) {
            dw[j] = ch.returned_dw[static_cast<std::size_t>(row) * k + entry];
            break;
          }
        }
      }
    }
  }

  Comm* comm_;
  placement placement_;
  moe_options options_;
  chunk_pipeline<stream_type> pipeline_;
  int rank_ = 0;
  std::size_t send_bound_ = 0, recv_bound_ = 0;
  std::vector<std::int32_t> local_experts_;
  std::vector<chunk_state> chunks_;
  std::vector<std::uint8_t> keep_;
  std::vector<float> priority_;
  std::vector<float> grad_dot_;
  capacity_filter filter_;
  std::size_t filter_tokens_ = 0;
  call_arguments calls_[2];                       // [0] forward, [1] backward
  typename stream_type::event_type call_done_[2]; // end of the last call of each direction
  bool direction_ = false;                        // of the call being enqueued
  row_buffer grad_scratch_, grad_scaled_;         // backward EPD scratch, shared by the chunks
  moe_stats pending_, stats_;
  counts_with_status<Comm> status_; // the count exchange, carrying each rank's failure
};

WEAVE_NAMESPACE_END
