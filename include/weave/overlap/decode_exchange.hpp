//! \file
//! `decode_exchange`: the low-latency MoE exchange for decoding (1 to a few hundred tokens per
//! rank), on host streams (local_world, MPI). The protocol of DeepEP's low-latency mode:
//! - every (local expert slot, source rank) pair has a fixed receive slot of
//!   `max_tokens_per_rank` rows, allocated at construction;
//! - each slot's row count travels in the header of its message (`decode_header`), so a layer
//!   is one all-to-all of fixed-size messages for the dispatch and one for the combine, with
//!   no count exchange and no allocation per call;
//! - rows are sent once per (token, expert) pair; the gate weights stay on the source rank,
//!   which sums the returned expert outputs in token order (choice order within a token).
//!
//! With `decode_options::fp8_dispatch` the dispatch sends each token quantised to FP8 with one
//! scale per block (codes, then scales, in one wire row) and the experts get codes, scales and,
//! on request, the dequantised rows; the combine keeps T.
//!
//! Full slots cannot happen: a token sends at most one row to each expert slot (its k experts
//! are distinct, and a slot holds one expert), so a slot receives at most as many rows as its
//! source has tokens. A call of more than `max_tokens_per_rank` tokens is refused with
//! `errc::invalid_argument` before anything is copied, never truncated.
//!
//! Fail-stop without a side channel: a rank whose inputs are bad (a shape, more tokens than
//! the slots hold, an expert id outside [-1, E), an expert chosen twice, a non-finite weight)
//! still sends every message, with the status word `failed` and the cause in the headers. Its
//! own stream then fails with the original typed error, and every peer's with
//! `errc::peer_failure` naming the rank and the cause; nobody waits for a message that never
//! comes.
#pragma once

#include "weave/comm/communicator.hpp"
#include "weave/comm/fail_stop.hpp"
#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/core/dtype.hpp"
#include "weave/core/error.hpp"
#include "weave/core/failure.hpp"
#include "weave/core/retain.hpp"
#include "weave/core/tensor.hpp"
#include "weave/exec/stream.hpp"
#include "weave/overlap/decode_handle.hpp"
#include "weave/overlap/decode_options.hpp"
#include "weave/overlap/layer_life.hpp"
#include "weave/placement/placement.hpp"
#include "weave/routing/dispatch_plan.hpp"
#include "weave/routing/quantize.hpp"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

WEAVE_NAMESPACE_BEGIN

//! The low-latency exchange of rank `comm.rank()` (see the file comment) for rows of `T`
//! (`float`, `bfloat16` or `half`; sums are accumulated in f32). One handle is alive at a
//! time: `dispatch` -> the caller's experts -> `combine`; the next call may be enqueued at
//! once. Calls only enqueue, all on one host stream (the first call's; another is
//! `errc::invalid_argument`); arguments are borrowed until the stream has run them.
template <communicator Comm, class T>
requires host_executor<typename Comm::stream_type>
class decode_exchange {
 public:
  using stream_type = typename Comm::stream_type;
  using element_type = T;
  using handle = decode_handle<decode_exchange>;

  //! Allocates every buffer for `options.max_tokens_per_rank` tokens now. Collective: checks
  //! with one small all-gather that every rank builds the layer alike (placement, k, hidden,
  //! row type, `max_tokens_per_rank`): `errc::config_mismatch` on every rank naming the first
  //! field that differs otherwise. Throws `errc::invalid_argument` for bad options or a
  //! placement of another device count (and its peers a `peer_error` naming this rank).
  decode_exchange(Comm& comm, placement where, decode_options options)
      : comm_(&comm)
      , abandoned_(abandoned_flag_of(comm))
      , serial_(detail::agree_on_decode(comm, where, options, dtype_of_v<T>, "decode_exchange"))
      , where_(std::move(where))
      , options_(options)
      , rank_(comm.rank())
      , plan_(where_, options.k, comm.rank()) {
    const auto D = static_cast<std::size_t>(comm.size());
    const auto spd = static_cast<std::size_t>(where_.slots_per_device());
    const auto k = static_cast<std::size_t>(options_.k);
    const std::size_t row_bytes = checked_mul(options_.hidden, sizeof(T), "row bytes");
    dispatch_ = phase_of(detail::decode_wire_row_bytes(options_, row_bytes), D, spd);
    combine_ = phase_of(row_bytes, D, spd);
    const std::size_t peer_bytes = std::max(dispatch_.bytes_per_peer(), combine_.bytes_per_peer());
    send_.assign(checked_mul(D, peer_bytes, "send bytes"), std::byte{0});
    recv_.assign(send_.size(), std::byte{0});
    const std::size_t pairs = checked_mul(options_.max_tokens_per_rank, k, "pairs");
    pair_slot_.assign(pairs, -1);
    pair_pos_.assign(pairs, 0);
    fill_.assign(checked_mul(D, spd, "slots"), 0);
    received_.assign(spd * D, 0);
    expert_rows_.assign(spd, 0);
    slot_rows_ = checked_mul(D, options_.max_tokens_per_rank, "rows per expert");
    const std::size_t expert_elems =
        checked_mul(checked_mul(spd, slot_rows_, "expert rows"), options_.hidden, "elements");
    expert_in_.assign(expert_elems, T{});
    expert_out_.assign(expert_elems, T{});
    if (options_.fp8_dispatch) {
      wire_ = quantized_row_layout::of(options_.hidden, options_.fp8_dispatch->blocks.block);
      token_wire_.assign(checked_mul(options_.max_tokens_per_rank, wire_.stride, "wire bytes"),
                         std::byte{0});
      expert_wire_.assign(checked_mul(spd * slot_rows_, wire_.stride, "wire bytes"), std::byte{0});
    }
    sum_.assign(options_.hidden, 0.0f);
    // Sizes the plan's buffers for the largest call (every token choosing k experts spread over
    // as many devices as it can): later builds do not allocate.
    std::vector<std::int32_t> spread;
    for (std::size_t j = 0; spread.size() < k && j < D * spd; ++j) {
      const int e = where_.expert_of_slot(static_cast<int>((j % D) * spd + j / D));
      if (std::find(spread.begin(), spread.end(), e) == spread.end())
        spread.push_back(e);
    }
    std::vector<std::int32_t> ids(pairs);
    for (std::size_t p = 0; p < pairs; ++p)
      ids[p] = spread[p % k];
    plan_.build(ids, std::vector<float>(pairs, 0.0f));
  }

  decode_exchange(const decode_exchange&) = delete;
  decode_exchange& operator=(const decode_exchange&) = delete;

  //! Waits for the work the layer queued (its buffers must outlive it); with a handle alive
  //! between its dispatch and its combine, aborts the communicator first: the peers, waiting in
  //! that combine, fail at once with a `peer_error` naming it. Handles and views that outlive
  //! the layer are stale (`errc::invalid_state`; releasing a handle does nothing).
  ~decode_exchange() {
    if (held_ && !combined_)
      if constexpr (requires { comm_->abort(std::string()); })
        if (!communicator_aborted(*comm_))
          comm_->abort("a decode_exchange was destroyed between a dispatch and its combine");
    detail::wait_at_end(last_);
    life_->alive.store(false, std::memory_order_release);
    if (abandoned(abandoned_)) { // MPI may still write into them (until MPI_Finalize)
      detail::retain_value_until_exit(std::move(send_));
      detail::retain_value_until_exit(std::move(recv_));
    }
  }

  const decode_options& options() const noexcept { return options_; }
  const placement& where() const noexcept { return where_; }
  //! Bytes this rank sends to each peer in a dispatch (FP8 rows with an FP8 dispatch).
  std::size_t dispatch_bytes_per_peer() const noexcept { return dispatch_.bytes_per_peer(); }
  //! Bytes this rank sends to each peer in a combine (rows of T).
  std::size_t combine_bytes_per_peer() const noexcept { return combine_.bytes_per_peer(); }

  //! Enqueues the dispatch of `x` (tokens x hidden rows of T) routed by `ids` / `weights`
  //! (k per token, id -1 = none) on `s`: one all-to-all. Bad inputs do not throw here: they
  //! fail the call on every rank as the file comment says. Throws `errc::invalid_state` when
  //! a handle of this exchange is still alive. When `s` is idle the steps run on the calling
  //! thread (`host_stream::run_inline_or_submit`), and so does the all-to-all where the
  //! communicator runs small ones inline (`mpi_options::inline_max_bytes`): a decode call then
  //! returns complete, without a hand-off to the stream's worker. Combine likewise.
  handle dispatch(std::span<const T> x, std::span<const std::int32_t> ids,
                  std::span<const float> weights, stream_type& s) {
    WEAVE_EXPECT(!held_, errc::invalid_state,
                 "decode_exchange: a handle is alive; combine it (or release it) first");
    bind_stream(s);
    const std::uint64_t call = ++calls_; // tasks of several calls may be queued at once
    held_ = true;
    combined_ = false;
    run_inline_or_submit(s, [this, x, ids, weights] { pack_dispatch(x, ids, weights); });
    exchange(s, dispatch_);
    run_inline_or_submit(s, [this, call] { unpack_dispatch(call); });
    s.record(last_);
    return handle(this, call, life_);
  }

  //! Enqueues the combine of `h` on `s`: one all-to-all returns every expert output to its
  //! source, which writes y[t] = sum over t's kept choices j (in order) of
  //! weights[t, j] * output(ids[t, j], x[t]) into `y` (tokens x hidden). Releases `h`. A
  //! `y` of the wrong size fails the call on every rank, as in the dispatch.
  void combine(handle& h, std::span<T> y, stream_type& s) {
    WEAVE_EXPECT(h.ex_ == this, errc::invalid_argument,
                 "decode_exchange::combine: a handle of another exchange (or an empty one)");
    bind_stream(s);
    combined_ = true;
    run_inline_or_submit(s, [this, y, call = h.call_] { pack_combine(y, call); });
    exchange(s, combine_);
    run_inline_or_submit(s, [this, y] { unpack_combine(y); });
    s.record(last_);
    h.reset();
  }

 private:
  friend handle;
  friend class decode_experts<decode_exchange>;

  decode_experts<decode_exchange> experts_of(std::uint64_t call) const {
    return {this, call, life_};
  }

  // Every call runs on the stream of the first: stream order alone keeps a call's queued
  // work off the next call's buffers, and every rank's calls fail or run alike.
  void bind_stream(stream_type& s) {
    if (stream_ == nullptr)
      stream_ = &s;
    WEAVE_EXPECT(stream_ == &s, errc::invalid_argument,
                 "decode_exchange: every call runs on the stream of the first call");
  }

  // The messages of a phase: one per (slot, source), of a fixed size, so counts never change.
  struct phase_layout {
    std::size_t message_bytes = 0;
    std::vector<std::int64_t> counts, displs; // bytes per peer
    std::size_t bytes_per_peer() const noexcept { return static_cast<std::size_t>(counts[0]); }
  };
  phase_layout phase_of(std::size_t row_bytes, std::size_t D, std::size_t spd) const {
    phase_layout p;
    p.message_bytes = detail::decode_message_bytes(options_, row_bytes);
    const std::size_t peer = checked_mul(spd, p.message_bytes, "bytes per peer");
    for (std::size_t d = 0; d < D; ++d) {
      p.counts.push_back(static_cast<std::int64_t>(peer));
      p.displs.push_back(static_cast<std::int64_t>(checked_mul(d, peer, "displacement")));
    }
    return p;
  }

  // The one all-to-all of a phase.
  void exchange(stream_type& s, const phase_layout& p) {
    weave::all_to_all_v(*comm_, s, send_.data(), p.counts, p.displs, recv_.data(), p.counts,
                        p.displs, 1);
  }

  std::size_t spd() const noexcept { return static_cast<std::size_t>(where_.slots_per_device()); }
  std::size_t world() const noexcept { return dispatch_.counts.size(); }
  static std::byte* message(std::vector<std::byte>& buf, std::size_t at, const phase_layout& p) {
    return buf.data() + at * p.message_bytes;
  }
  std::byte* message(std::vector<std::byte>& buf, std::size_t rank, std::size_t l,
                     const phase_layout& p) noexcept {
    return message(buf, rank * spd() + l, p);
  }
  std::byte* payload(std::vector<std::byte>& buf, std::size_t rank, std::size_t l,
                     const phase_layout& p) noexcept {
    return message(buf, rank, l, p) + sizeof(decode_header);
  }
  decode_header header(std::size_t rank, std::size_t l, const phase_layout& p) noexcept {
    decode_header h;
    std::memcpy(&h, message(recv_, rank, l, p), sizeof h);
    return h;
  }
  void put_header(std::size_t rank, std::size_t l, const decode_header& h,
                  const phase_layout& p) noexcept {
    std::memcpy(message(send_, rank, l, p), &h, sizeof h);
  }

  // Runs `fill`, which writes the send messages of phase `p`; on failure every header says so
  // instead, and the failure is kept for this rank's own stream.
  template <class F>
  void pack(F&& fill, const phase_layout& p) noexcept {
    local_failure_ = nullptr;
    try {
      fill();
      return;
    } catch (const error& e) {
      local_failure_ = std::current_exception();
      mark_failed(e.code(), e.message(), p);
    } catch (const std::exception& e) {
      local_failure_ = std::current_exception();
      mark_failed(errc::internal, e.what(), p);
    }
  }
  void mark_failed(errc code, const std::string& what, const phase_layout& p) noexcept {
    const decode_header h = detail::failed_header(rank_, code, what);
    for (std::size_t d = 0; d < world(); ++d)
      for (std::size_t l = 0; l < spd(); ++l)
        put_header(d, l, h, p);
  }

  // Checks every received header of phase `p`: this rank's own failure first (the root
  // cause), then the lowest failed peer's (a failed header in any slot), or a header no sender
  // writes. A failure its peers may not know (a header no sender writes, a sender that failed in
  // some of its headers only) aborts the communicator, so that no peer waits for this rank in a
  // later collective.
  void check_headers(const phase_layout& p) {
    if (local_failure_)
      std::rethrow_exception(local_failure_);
    const detail::decode_headers_verdict verdict = detail::check_decode_headers(
        world(), spd(), static_cast<std::int64_t>(options_.max_tokens_per_rank), 0,
        "decode_exchange", [&](std::size_t d, std::size_t l) { return header(d, l, p); },
        [](const decode_header& h) {
          return failure_record{h.source, static_cast<errc>(h.code), true,
                                std::string(h.cause, ::strnlen(h.cause, sizeof h.cause))};
        });
    if (!verdict.failure)
      return;
    if (!verdict.told)
      abort_peers(*comm_, verdict.failure);
    std::rethrow_exception(verdict.failure);
  }

  // Bytes of a dispatched row: T elements, or an FP8 row (codes, then scales).
  std::size_t wire_row() const noexcept {
    return options_.fp8_dispatch ? wire_.stride : options_.hidden * sizeof(T);
  }
  std::pair<token_view, token_view> wire_views(std::byte* base, std::size_t rows) const {
    return wire_.views(base, rows, options_.fp8_dispatch->format);
  }

  void pack_dispatch(std::span<const T> x, std::span<const std::int32_t> ids,
                     std::span<const float> weights) {
    pack(
        [&] {
          const std::size_t H = options_.hidden, k = static_cast<std::size_t>(options_.k);
          const std::size_t tokens = detail::decode_call_tokens(options_, x.size(), ids.size(),
                                                                weights.size(), "decode_exchange");
          plan_.build(ids, weights); // the exchanges' one validation of ids and weights
          weights_ = weights;
          const auto* rows = reinterpret_cast<const std::byte*>(x.data());
          if (options_.fp8_dispatch) { // each token once; a NaN or an inf fails the call
            const auto [codes, scales] = wire_views(token_wire_.data(), tokens);
            quantize_rows(const_token_view(rows, tokens, H, dtype_of_v<T>), codes, scales,
                          options_.fp8_dispatch->blocks);
            rows = token_wire_.data();
          }
          const std::size_t row = wire_row();
          const std::span<const std::int32_t> kept = plan_.kept_experts();
          std::fill(fill_.begin(), fill_.end(), 0);
          for (std::size_t p = 0; p < tokens * k; ++p) {
            pair_slot_[p] = -1;
            if (kept[p] < 0)
              continue;
            const int slot = where_.slot_for(kept[p], p / k, rank_);
            const std::int64_t pos = fill_[static_cast<std::size_t>(slot)]++;
            pair_slot_[p] = slot;
            pair_pos_[p] = pos;
            const auto d = static_cast<std::size_t>(slot) / spd(),
                       l = static_cast<std::size_t>(slot) % spd();
            std::memcpy(payload(send_, d, l, dispatch_) + static_cast<std::size_t>(pos) * row,
                        rows + (p / k) * row, row);
          }
          put_counts(fill_, dispatch_);
          tokens_ = tokens;
        },
        dispatch_);
  }

  // Headers of a successful pack: `rows[d * spd + l]` rows for slot l of rank d.
  void put_counts(std::span<const std::int64_t> rows, const phase_layout& p) noexcept {
    for (std::size_t d = 0; d < world(); ++d)
      for (std::size_t l = 0; l < spd(); ++l) {
        decode_header h;
        h.rows = rows[d * spd() + l];
        h.source = rank_;
        put_header(d, l, h, p);
      }
  }

  void unpack_dispatch(std::uint64_t call) {
    try {
      check_headers(dispatch_);
    } catch (...) {
      failed_call_.store(call, std::memory_order_release); // every rank knows: no combine
      throw;
    }
    const bool fp8 = options_.fp8_dispatch.has_value();
    const std::size_t row = wire_row();
    for (std::size_t l = 0; l < spd(); ++l) {
      std::size_t at = 0;
      std::byte* in =
          (fp8 ? expert_wire_.data() : reinterpret_cast<std::byte*>(expert_in_.data())) +
          l * slot_rows_ * row;
      for (std::size_t d = 0; d < world(); ++d) {
        const auto n = static_cast<std::size_t>(header(d, l, dispatch_).rows);
        received_[l * world() + d] = static_cast<std::int64_t>(n);
        std::memcpy(in + at * row, payload(recv_, d, l, dispatch_), n * row);
        at += n;
      }
      expert_rows_[l] = static_cast<std::int64_t>(at);
      if (fp8 && options_.fp8_dispatch->dequantized_inputs) {
        const auto [codes, scales] = wire_views(in, at);
        dequantize_rows(codes, scales, expert_rows_view(expert_in_.data(), l, at),
                        options_.fp8_dispatch->blocks);
      }
    }
    arrived_.store(call, std::memory_order_release);
  }
  token_view expert_rows_view(T* base, std::size_t l, std::size_t rows) const {
    return token_view(reinterpret_cast<std::byte*>(base + l * slot_rows_ * options_.hidden), rows,
                      options_.hidden, dtype_of_v<T>);
  }

  void pack_combine(std::span<T> y, std::uint64_t call) {
    pack(
        [&] {
          WEAVE_EXPECT(arrived_.load(std::memory_order_acquire) == call, errc::invalid_state,
                       "decode_exchange::combine after a dispatch that failed");
          WEAVE_EXPECT(y.size() == tokens_ * options_.hidden, errc::size_mismatch,
                       "decode_exchange::combine: an output of ", y.size(), " elements for ",
                       tokens_, " tokens of hidden = ", options_.hidden);
          const std::size_t H = options_.hidden;
          for (std::size_t l = 0; l < spd(); ++l) {
            std::size_t at = 0;
            const T* out = expert_out_.data() + l * slot_rows_ * H;
            for (std::size_t d = 0; d < world(); ++d) {
              const auto n = static_cast<std::size_t>(received_[l * world() + d]);
              std::memcpy(payload(send_, d, l, combine_), out + at * H, n * H * sizeof(T));
              fill_[d * spd() + l] = static_cast<std::int64_t>(n);
              at += n;
            }
          }
          put_counts(fill_, combine_);
        },
        combine_);
  }

  // The weighted sum of each token's returned rows, in choice order.
  void unpack_combine(std::span<T> y) {
    check_headers(combine_);
    const std::size_t H = options_.hidden, k = static_cast<std::size_t>(options_.k);
    for (std::size_t t = 0; t < tokens_; ++t) {
      std::fill(sum_.begin(), sum_.end(), 0.0f);
      for (std::size_t j = 0; j < k; ++j) {
        const std::int32_t slot = pair_slot_[t * k + j];
        if (slot < 0)
          continue;
        const auto d = static_cast<std::size_t>(slot) / spd(),
                   l = static_cast<std::size_t>(slot) % spd();
        const std::int64_t returned = header(d, l, combine_).rows;
        WEAVE_EXPECT(pair_pos_[t * k + j] < returned, errc::size_mismatch,
                     "decode_exchange::combine: rank ", d, " returned ", returned, " rows of slot ",
                     l, ", fewer than were sent");
        const float w = weights_[t * k + j];
        const T* row = reinterpret_cast<const T*>(payload(recv_, d, l, combine_)) +
                       static_cast<std::size_t>(pair_pos_[t * k + j]) * H;
        for (std::size_t i = 0; i < H; ++i)
          sum_[i] += w * static_cast<float>(row[i]);
      }
      for (std::size_t i = 0; i < H; ++i)
        y[t * H + i] = T(sum_[i]);
    }
  }

  // --- what the handle reads -----------------------------------------------------------------
  void expect_arrived(std::uint64_t call) const {
    WEAVE_EXPECT(arrived_.load(std::memory_order_acquire) == call, errc::invalid_state,
                 "decode_exchange: the dispatch has not run (read the expert rows in a task "
                 "enqueued after it, or after synchronizing its stream), or it failed, or its "
                 "combine has been issued");
  }
  void check_local(int l) const {
    WEAVE_EXPECT(l >= 0 && static_cast<std::size_t>(l) < spd(), errc::out_of_range, "local slot ",
                 l, " outside [0, ", spd(), ")");
  }
  int expert_of_local(int l) const {
    check_local(l);
    return where_.expert_of_slot(rank_ * where_.slots_per_device() + l);
  }
  std::int64_t received_rows(int l, int source) const {
    check_local(l);
    WEAVE_EXPECT(source >= 0 && static_cast<std::size_t>(source) < world(), errc::out_of_range,
                 "source rank ", source, " outside [0, ", world(), ")");
    return received_[static_cast<std::size_t>(l) * world() + static_cast<std::size_t>(source)];
  }
  std::int64_t received_rows(int l) const {
    check_local(l);
    return expert_rows_[static_cast<std::size_t>(l)];
  }
  std::span<const T> expert_input(int l) const {
    WEAVE_EXPECT(!options_.fp8_dispatch || options_.fp8_dispatch->dequantized_inputs,
                 errc::invalid_state,
                 "decode_exchange: an FP8 dispatch without dequantized_inputs delivers codes and "
                 "scales only (input_codes, input_scales)");
    const auto n = static_cast<std::size_t>(received_rows(l));
    return {expert_in_.data() + static_cast<std::size_t>(l) * slot_rows_ * options_.hidden,
            n * options_.hidden};
  }
  std::pair<const_token_view, const_token_view> expert_wire(int l) const {
    WEAVE_EXPECT(options_.fp8_dispatch.has_value(), errc::invalid_state,
                 "decode_exchange: codes and scales exist with an FP8 dispatch only");
    const auto n = static_cast<std::size_t>(received_rows(l));
    auto* base = const_cast<std::byte*>(expert_wire_.data()) + // read-only views
                 static_cast<std::size_t>(l) * slot_rows_ * wire_.stride;
    const auto [codes, scales] = wire_views(base, n);
    return {codes, scales};
  }
  std::span<T> expert_output(int l) const {
    const auto n = static_cast<std::size_t>(received_rows(l));
    auto* out = const_cast<T*>(expert_out_.data()); // the handle's view of this exchange's rows
    return {out + static_cast<std::size_t>(l) * slot_rows_ * options_.hidden, n * options_.hidden};
  }

  void release_handle(std::uint64_t call) noexcept {
    if (held_ && !combined_ && failed_call_.load(std::memory_order_acquire) != call)
      if constexpr (requires { comm_->abort(std::string()); })
        comm_->abort("a decode_exchange handle was released without its combine");
    held_ = false;
  }

  Comm* comm_;
  std::shared_ptr<const std::atomic<bool>> abandoned_; // the communicator's (abandoned_flag_of)
  std::uint32_t serial_ = 0; // the layer on its communicator (agreed at construction)
  placement where_;
  decode_options options_;
  int rank_ = 0;
  dispatch_plan plan_;
  std::size_t slot_rows_ = 0, tokens_ = 0;
  phase_layout dispatch_, combine_;       // the two all-to-alls' messages
  std::vector<std::byte> send_, recv_;    // [rank][local slot][message] of the larger phase
  quantized_row_layout wire_;             // FP8 dispatch: a row's codes, then its scales
  std::vector<std::byte> token_wire_;     // FP8 dispatch: the call's tokens quantised
  std::vector<std::byte> expert_wire_;    // FP8 dispatch: [local slot][D * max tokens][wire row]
  std::vector<std::int32_t> pair_slot_;   // (token, choice) -> physical slot, or -1
  std::vector<std::int64_t> pair_pos_;    // (token, choice) -> row in its slot's message
  std::vector<std::int64_t> fill_;        // rows per (rank, local slot) being sent
  std::vector<std::int64_t> received_;    // rows per (local slot, source)
  std::vector<std::int64_t> expert_rows_; // rows per local slot
  std::vector<T> expert_in_, expert_out_; // [local slot][D * max_tokens_per_rank][hidden]
  std::vector<float> sum_;                // one token's f32 accumulator
  std::span<const float> weights_;        // the call's gate weights
  std::exception_ptr local_failure_;
  std::uint64_t calls_ = 0;                                // dispatches issued
  std::atomic<std::uint64_t> arrived_{0}, failed_call_{0}; // the last dispatch that ran, failed
  bool held_ = false, combined_ = false;
  stream_type* stream_ = nullptr;         // the stream of every call
  typename stream_type::event_type last_; // the end of the last call's work (destruction waits)
  std::shared_ptr<detail::layer_life> life_ = std::make_shared<detail::layer_life>();
};

WEAVE_NAMESPACE_END
