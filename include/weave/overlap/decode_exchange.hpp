//! \file
//! `decode_exchange`: the low-latency MoE exchange for decoding (1 to a few hundred tokens per
//! rank), on host streams (local_world, MPI). Fixed buffers and counts inside the messages, as
//! DeepEP's low-latency mode, sending what is routed:
//! - every (source rank, destination device) pair has one fixed receive message with room for
//!   `max_tokens_per_rank` token records, allocated at construction; a record is the token's
//!   row, sent once to each device it is routed to, and its local expert choices there (a side
//!   table after the rows: `min(k, local experts)` slots, -1 after the last);
//! - the record count travels in the message's header (`decode_header`), so a dispatch is one
//!   all-to-all into fixed receive messages, with no count exchange and no allocation per call;
//!   where the communicator takes bounded receives (`has_bounded_all_to_all`) a message sends
//!   only its header and records, else it is sent whole;
//! - the combine returns one row per record (`decode_options::partial_sums`, the default: the
//!   weights travel with the records, each device sums its choices' outputs and the source sums
//!   them by device) or per (token, expert) pair (the source sums them in choice order): both
//!   sides know the counts from the dispatch, so it is one all-to-all of exact sizes, again
//!   with no count exchange.
//!
//! With `decode_options::fp8_dispatch` the dispatch sends each token quantised to FP8 with one
//! scale per block (codes, then scales, in one wire row) and the experts get codes, scales and,
//! on request, the dequantised rows; the combine keeps T.
//!
//! Full messages cannot happen: a token sends at most one record to a device, so a message
//! holds at most as many records as its source has tokens. A call of more than
//! `max_tokens_per_rank` tokens is refused with `errc::invalid_argument` before anything is
//! copied, never truncated.
//!
//! Fail-stop without a side channel: a rank whose inputs are bad (a shape, more tokens than
//! the messages hold, an expert id outside [-1, E), an expert chosen twice, a non-finite weight)
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
#include "weave/core/tensor.hpp"
#include "weave/exec/stream.hpp"
#include "weave/overlap/decode_handle.hpp"
#include "weave/overlap/decode_options.hpp"
#include "weave/overlap/detail/decode_arrivals.hpp"
#include "weave/overlap/detail/decode_input_rows.hpp"
#include "weave/overlap/detail/decode_mailbox.hpp"
#include "weave/overlap/detail/decode_records.hpp"
#include "weave/overlap/detail/decode_routes.hpp"
#include "weave/overlap/detail/layer_life.hpp"
#include "weave/placement/placement.hpp"
#include "weave/routing/dispatch_plan.hpp"
#include "weave/routing/kernels_host.hpp"
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
      , serial_(
            detail::agree_on_decode(comm, where, options, dtype_of_v<T>, "decode_exchange", true))
      , where_(std::move(where))
      , options_(options)
      , rank_(comm.rank()) {
    const auto D = static_cast<std::size_t>(comm.size());
    const auto spd = static_cast<std::size_t>(where_.slots_per_device());
    const auto k = static_cast<std::size_t>(options_.k);
    const std::size_t row_bytes = checked_mul(options_.hidden, sizeof(T), "row bytes");
    const std::size_t M = options_.max_tokens_per_rank;
    records_layout_ = detail::decode_record_layout::of(options_, row_bytes, spd);
    // This rank's own messages carry their header only: the records' rows stay in the caller's
    // tokens and the returned rows in the pool (see `deliver_records`, `unpack_combine`).
    dispatch_ = phase_layout::of(records_layout_.dispatch_bytes, D, own());
    received_.assign(D, 0);
    combine_ = phase_layout::of(records_layout_.combine_bytes, D, own());
    const auto sizes = records_layout_.buffers_for(D, k, !options_.gathered_inputs);
    // The send buffer also holds the pool's inputs (`expert_in`); the receive buffer the pool's
    // outputs after the messages, a whole number of rows in, so that one row view addresses the
    // returned rows and this rank's own (`returned_rows_view`).
    mail_ = detail::decode_mailbox(rank_, sizes.send_bytes, sizes.recv_bytes);
    pool_out_row_ = sizes.pool_out_row;
    routes_ = detail::decode_routes(D, M, k);
    arrivals_ = detail::decode_arrivals(D, spd, records_layout_, options_.partial_sums);
    pool_rows_ = sizes.pool_rows; // every local expert's rows, each expert's together
    using input_mode = typename detail::decode_input_rows<T>::mode;
    inputs_ = detail::decode_input_rows<T>(options_.gathered_inputs ? input_mode::gathered
                                           : options_.fp8_dispatch  ? input_mode::copied
                                                                    : input_mode::blocks,
                                           pool_rows_, spd);
    if (options_.fp8_dispatch) {
      wire_ = quantized_row_layout::of(options_.hidden, options_.fp8_dispatch->blocks.block);
      token_wire_.assign(checked_mul(options_.max_tokens_per_rank, wire_.stride, "wire bytes"),
                         std::byte{0});
      expert_wire_.assign(checked_mul(pool_rows_, wire_.stride, "wire bytes"), std::byte{0});
    }
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
    if (abandoned(abandoned_)) // MPI may still write into the messages (until MPI_Finalize)
      mail_.retain_until_exit();
  }

  const decode_options& options() const noexcept { return options_; }
  const placement& where() const noexcept { return where_; }
  //! Bytes this rank sends to each peer in a dispatch (FP8 rows with an FP8 dispatch): one
  //! message of room for `max_tokens_per_rank` tokens and their local choices.
  std::size_t dispatch_bytes_per_peer() const noexcept { return dispatch_.stride; }
  //! The most bytes this rank sends to a peer in a combine (rows of T): a combine sends the
  //! header and one row per (token, expert) pair that peer dispatched here (per token record
  //! with `partial_sums`), no more.
  std::size_t combine_bytes_per_peer() const noexcept { return combine_.stride; }

  //! Bytes of the message buffers and the expert rows' pool (inputs, outputs, FP8 rows): what
  //! the layer allocates at construction for `max_tokens_per_rank`, beside the routing plan's
  //! per-pair arrays. With `gathered_inputs` the pool has no inputs: with partial sums the send
  //! buffer holds the messages alone.
  std::size_t buffer_bytes() const noexcept {
    return mail_.send_buffer().size() + mail_.recv_buffer().size() + token_wire_.size() +
           expert_wire_.size();
  }
  //! `buffer_bytes()` of a layer of `ranks` ranks and `local_experts` slots per rank built with
  //! `options`, without building it.
  static std::size_t buffer_bytes(std::size_t ranks, std::size_t local_experts,
                                  const decode_options& options) {
    return detail::decode_record_layout::buffer_bytes(
        ranks, local_experts, options, checked_mul(options.hidden, sizeof(T), "row bytes"));
  }

  //! Enqueues the dispatch of `x` (tokens x hidden rows of T) routed by `ids` / `weights`
  //! (k per token, id -1 = none) on `s`: one all-to-all. Bad inputs do not throw here: they
  //! fail the call on every rank as the file comment says. Throws `errc::invalid_state` when
  //! a handle of this exchange is still alive. When `s` is idle the steps run on the calling
  //! thread under one claim of it (`host_stream::claim_if_idle`), and so does the all-to-all
  //! where the communicator runs small ones inline (`mpi_options::inline_max_bytes`): a decode
  //! call then returns complete, without a hand-off to the stream's worker. Combine likewise.
  handle dispatch(std::span<const T> x, std::span<const std::int32_t> ids,
                  std::span<const float> weights, stream_type& s) {
    WEAVE_EXPECT(!held_, errc::invalid_state,
                 "decode_exchange: a handle is alive; combine it (or release it) first");
    bind_stream(s);
    const std::uint64_t call = ++calls_; // tasks of several calls may be queued at once
    held_ = true;
    combined_ = false;
    issue(
        s, [this, x, ids, weights] { pack_dispatch(x, ids, weights); }, dispatch_,
        [this, call] { unpack_dispatch(call); });
    return handle(this, call, life_);
  }

  //! Enqueues the combine of `h` on `s`: one all-to-all returns every expert output to its
  //! source, which writes y[t] = sum over t's kept choices j (in order) of
  //! weights[t, j] * output(ids[t, j], x[t]) into `y` (tokens x hidden); with `partial_sums`
  //! the sum over t's devices (ascending) of each device's sum over its choices, rounded to T.
  //! Releases `h`. A `y` of the wrong size fails the call on every rank, as in the dispatch.
  void combine(handle& h, std::span<T> y, stream_type& s) {
    WEAVE_EXPECT(h.ex_ == this, errc::invalid_argument,
                 "decode_exchange::combine: a handle of another exchange (or an empty one)");
    bind_stream(s);
    combined_ = true;
    issue(
        s, [this, y, call = h.call_] { pack_combine(y, call); }, combine_,
        [this, y] { unpack_combine(y); });
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

  using arrival = detail::decode_arrivals::arrival;

  using phase_layout = detail::decode_phase;
  // Whether a dispatch sends only its messages' occupied part (`has_bounded_all_to_all`);
  // elsewhere each message is sent whole.
  static constexpr bool bounded = has_bounded_all_to_all<Comm>;
  // The index, in rows of T from the start of the receive buffer, of row r of peer d's combine.
  std::int64_t returned_row(std::size_t d, std::int64_t r) const noexcept {
    return combine_.row_of(d, r, options_.hidden * sizeof(T));
  }
  const_token_view returned_rows_view() const {
    const std::size_t row = options_.hidden * sizeof(T);
    const auto& recv = mail_.recv_buffer();
    return const_token_view(recv.data(), recv.size() / row, options_.hidden, dtype_of_v<T>);
  }
  // A combine message of `rows` rows, to or from a peer.
  std::int64_t combine_bytes(std::size_t rows) const {
    return phase_layout::message_bytes(rows, options_.hidden * sizeof(T));
  }

  // A phase's three steps (pack, its one all-to-all, unpack) under one claim of `s` when it is
  // idle, so that they run here without claiming it each; the end is recorded unless all ran.
  template <class Pack, class Unpack>
  void issue(stream_type& s, Pack pack_step, const phase_layout& p, Unpack unpack_step) {
    bool done = false;
    {
      const auto claim = claim_if_idle(s);
      run_inline_or_submit(s, std::move(pack_step));
      exchange(s, p);
      run_inline_or_submit(s, std::move(unpack_step));
      done = claim.all_ran_here();
    }
    if (!done)
      record_unless_idle(s, last_);
  }

  // Phase p's all-to-all; a dispatch sends only its records where the communicator takes
  // bounded receives (each receive keeps room for a full message).
  void exchange(stream_type& s, const phase_layout& p) {
    std::byte* const send = mail_.send_buffer().data();
    std::byte* const recv = mail_.recv_buffer().data();
    if constexpr (bounded)
      if (&p == &dispatch_)
        return comm_->all_to_all_v_bounded(s, send, p.send_counts, p.send_displs, recv,
                                           p.recv_counts, p.recv_displs,
                                           std::span<std::int64_t>(received_), 1);
    weave::all_to_all_v(*comm_, s, send, p.send_counts, p.send_displs, recv, p.recv_counts,
                        p.recv_displs, 1);
  }

  std::size_t spd() const noexcept { return static_cast<std::size_t>(where_.slots_per_device()); }
  std::size_t own() const noexcept { return static_cast<std::size_t>(rank_); }
  std::size_t world() const noexcept { return dispatch_.send_counts.size(); }
  std::byte* sent(std::size_t d, const phase_layout& p) noexcept { return mail_.sent(d, p); }
  std::byte* received(std::size_t d, const phase_layout& p) noexcept {
    return mail_.received(d, p);
  }
  decode_header header(std::size_t d, const phase_layout& p) noexcept { return mail_.header(d, p); }
  void put_header(std::size_t d, const decode_header& h, const phase_layout& p) noexcept {
    mail_.put_header(d, h, p);
  }
  template <class F>
  void pack(F&& fill, const phase_layout& p) noexcept {
    mail_.pack(std::forward<F>(fill), p);
  }
  void check_headers(const phase_layout& p, std::size_t max_rows) {
    mail_.check_headers(*comm_, p, max_rows, "decode_exchange");
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
    if constexpr (bounded) // a failed pack sends its headers alone
      for (std::size_t d = 0; d < world(); ++d)
        dispatch_.send_counts[d] = sizeof(decode_header);
    pack(
        [&] {
          const std::size_t H = options_.hidden, k = static_cast<std::size_t>(options_.k);
          const std::size_t tokens = detail::decode_call_tokens(options_, x.size(), ids.size(),
                                                                weights.size(), "decode_exchange");
          // The exchanges' one validation of ids and weights (the dynamic exchange's plan's).
          detail::check_routing(ids, weights, k, where_.num_experts());
          weights_ = weights;
          const auto* rows = reinterpret_cast<const std::byte*>(x.data());
          if (options_.fp8_dispatch) { // each token once; a NaN or an inf fails the call
            const auto [codes, scales] = wire_views(token_wire_.data(), tokens);
            quantize_rows(const_token_view(rows, tokens, H, dtype_of_v<T>), codes, scales,
                          options_.fp8_dispatch->blocks);
            rows = token_wire_.data();
          }
          // One record per (token, device): the row once, then the token's local slots there.
          routes_.route(ids, weights, tokens, where_, own(), records_layout_, options_.partial_sums,
                        rows, wire_row(), [this](std::size_t d) { return sent(d, dispatch_); });
          for (std::size_t d = 0; d < world(); ++d) {
            const auto n = static_cast<std::size_t>(routes_.records()[d]);
            records_layout_.compact(sent(d, dispatch_), n); // the side table after the rows
            if (bounded && d != own())
              dispatch_.send_counts[d] = static_cast<std::int64_t>(records_layout_.sent_bytes(n));
            decode_header h;
            h.rows = routes_.records()[d];
            h.source = rank_;
            put_header(d, h, dispatch_);
            if (d != own())
              combine_.recv_counts[d] = combine_bytes(static_cast<std::size_t>(returned_rows(d)));
          }
          // The combine's receive displacements; this rank's own message gets room for its rows
          // too: with partial sums they are merged there.
          combine_.place_receives(options_.partial_sums ? routes_.records() : routes_.pairs(),
                                  options_.hidden * sizeof(T));
          tokens_ = tokens;
          dispatch_rows_ = rows;
        },
        dispatch_);
  }

  void unpack_dispatch(std::uint64_t call) {
    try {
      check_headers(dispatch_, options_.max_tokens_per_rank);
      if constexpr (bounded) // each message as long as its header's records make it
        mail_.check_lengths(
            *comm_, dispatch_, received_,
            [this](std::size_t n) { return records_layout_.sent_bytes(n); }, "decode_exchange");
      deliver_records();
    } catch (...) {
      failed_call_.store(call, std::memory_order_release); // every rank knows: no combine
      throw;
    }
    if (options_.fp8_dispatch && options_.fp8_dispatch->dequantized_inputs) { // the whole pool
      std::size_t rows = 0;
      for (const int l : arrivals_.slots().busy())
        rows += static_cast<std::size_t>(arrivals_.slots().rows(static_cast<std::size_t>(l)));
      const auto [codes, scales] = wire_views(expert_wire_.data(), rows);
      dequantize_rows(codes, scales,
                      token_view(reinterpret_cast<std::byte*>(expert_in()), rows, options_.hidden,
                                 dtype_of_v<T>),
                      options_.fp8_dispatch->blocks);
    }
    arrived_.store(call, std::memory_order_release);
  }

  // Copies every received record's row to each local expert it names, each expert's rows
  // together in (source, record) order (`decode_input_rows`: a block of one row a peer sent is
  // read where it arrived), and notes where each pair's row went for the combine.
  // First the side tables (checked: one no sender writes, with no choice, a slot outside
  // [0, spd), a slot twice or a choice after the end, is a protocol error, and the peers, which
  // may wait in the combine, are told), then the rows.
  void deliver_records() {
    const std::size_t row = wire_row();
    arrivals_.begin();
    for (std::size_t d = 0; d < world(); ++d) { // this rank's side tables never left `sent`
      const std::byte* message = d == own() ? sent(d, dispatch_) : received(d, dispatch_);
      const auto n = static_cast<std::size_t>(header(d, dispatch_).rows);
      const std::size_t pairs =
          arrivals_.read(d, message, n, [&](std::size_t r, std::size_t c, std::int32_t l) {
            bad_record(d, r, c, l);
          });
      if (d != own())
        combine_.send_counts[d] = combine_bytes(options_.partial_sums ? n : pairs);
    }
    combine_.place_sends();
    arrivals_.finish();
    std::byte* in =
        options_.fp8_dispatch ? expert_wire_.data() : reinterpret_cast<std::byte*>(expert_in());
    for (std::size_t d = 0; d < world(); ++d) {
      std::byte* message = received(d, dispatch_);
      for (const arrival& a : arrivals_.pairs(d)) {
        const auto r = static_cast<std::size_t>(a.record);
        const std::byte* from = d == own() ? dispatch_rows_ + routes_.own_token(r) * row
                                           : records_layout_.row(message, r);
        const auto slot = static_cast<std::size_t>(a.slot);
        inputs_.place(in, arrivals_.pool_row(a), slot, arrivals_.slots().rows(slot), from, row,
                      d == own());
      }
    }
  }
  // The rows peer d returns in this call's combine: one per pair sent to it, or per record.
  std::int64_t returned_rows(std::size_t d) const noexcept {
    return options_.partial_sums ? routes_.records()[d] : routes_.pairs()[d];
  }
  [[noreturn]] void bad_record(std::size_t d, std::size_t r, std::size_t c, std::int32_t l) {
    const auto failure =
        std::make_exception_ptr(detail::bad_decode_record("decode_exchange", d, r, c, l, spd()));
    abort_peers(*comm_, failure);
    std::rethrow_exception(failure);
  }
  void pack_combine(std::span<T> y, std::uint64_t call) {
    pack(
        [&] {
          WEAVE_EXPECT(arrived_.load(std::memory_order_acquire) == call, errc::invalid_state,
                       "decode_exchange::combine after a dispatch that failed");
          WEAVE_EXPECT(y.size() == tokens_ * options_.hidden, errc::size_mismatch,
                       "decode_exchange::combine: an output of ", y.size(), " elements for ",
                       tokens_, " tokens of hidden = ", options_.hidden);
          const std::size_t H = options_.hidden, row = H * sizeof(T);
          for (std::size_t d = 0; d < world(); ++d) { // each pair's output, in arrival order
            std::byte* out = sent(d, combine_) + sizeof(decode_header);
            const std::span<const arrival> pairs = arrivals_.pairs(d);
            if (options_.partial_sums) { // this rank's own sums where the source reads them
              merge_records(d, d == own() ? received(d, combine_) + sizeof(decode_header) : out);
            } else if (d != own()) { // this rank reads its own pairs in the pool
              for (std::size_t i = 0; i < pairs.size(); ++i)
                std::memcpy(out + i * row, pool_out() + arrivals_.pool_row(pairs[i]) * H, row);
            }
            decode_header h;
            h.rows = static_cast<std::int64_t>(options_.partial_sums ? arrivals_.records(d)
                                                                     : pairs.size());
            h.source = rank_;
            put_header(d, h, combine_);
          }
        },
        combine_);
  }

  // Partial sums: each of source d's records becomes the gate-weighted sum of its choices'
  // expert outputs (f32 in choice order, rounded to T), into `out`, in record order.
  void merge_records(std::size_t d, std::byte* out) {
    const auto [index, weight] = arrivals_.record_rows(d);
    merge(const_token_view(reinterpret_cast<const std::byte*>(pool_out()), pool_rows_,
                           options_.hidden, dtype_of_v<T>),
          token_view(out, arrivals_.records(d), options_.hidden, dtype_of_v<T>), index,
          records_layout_.choices, weight);
  }
  // `merge_rows` without its argument checks (a pass over every index, a few hundred cycles
  // of a one-token layer): the layer builds the indices from records it checked on arrival.
  static void merge(const const_token_view& src, const token_view& dst, const std::int64_t* index,
                    std::size_t k, const float* weight = nullptr) {
    detail::merge_rows_host(src, dst, index, k, weight, dst.rows(), false);
  }

  // The weighted sum of each token's returned rows, in choice order; with partial sums, the sum
  // of its devices' rows in ascending device order.
  void unpack_combine(std::span<T> y) {
    check_headers(combine_, records_layout_.pairs());
    for (std::size_t d = 0; d < world(); ++d) {
      const std::int64_t returned = header(d, combine_).rows;
      WEAVE_EXPECT(returned == returned_rows(d), errc::size_mismatch,
                   "decode_exchange::combine: rank ", d, " returned ", returned, " rows for the ",
                   returned_rows(d), options_.partial_sums ? " token records" : " pairs",
                   " sent to it");
    }
    const auto returned_at = [this](std::size_t d, std::int64_t r) { return returned_row(d, r); };
    if (options_.partial_sums) { // each token's devices' rows, in ascending device order
      const std::size_t per_token = std::min(world(), static_cast<std::size_t>(options_.k));
      merge(returned_rows_view(), output_view(y),
            routes_.device_rows(tokens_, per_token, returned_at), per_token);
      return;
    }
    const std::span<const arrival> own_pairs = arrivals_.pairs(own());
    const std::int64_t* rows = routes_.pair_rows(tokens_, [&](std::size_t d, std::int64_t pos) {
      return d == own() // the pool's output row, in the same view (`pool_out_row_`)
                 ? static_cast<std::int64_t>(
                       pool_out_row_ + arrivals_.pool_row(own_pairs[static_cast<std::size_t>(pos)]))
                 : returned_at(d, pos);
    });
    merge(returned_rows_view(), output_view(y), rows, static_cast<std::size_t>(options_.k),
          weights_.data());
  }
  token_view output_view(std::span<T> y) const {
    return token_view(reinterpret_cast<std::byte*>(y.data()), tokens_, options_.hidden,
                      dtype_of_v<T>);
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
    return arrivals_.slots().rows(static_cast<std::size_t>(l), static_cast<std::size_t>(source));
  }
  std::int64_t received_rows(int l) const {
    check_local(l);
    return arrivals_.slots().rows(static_cast<std::size_t>(l));
  }
  std::span<const int> busy_slots() const noexcept { return arrivals_.slots().busy(); }
  std::span<const T> expert_input(int l) const {
    WEAVE_EXPECT(!options_.fp8_dispatch || options_.fp8_dispatch->dequantized_inputs,
                 errc::invalid_state,
                 "decode_exchange: an FP8 dispatch without dequantized_inputs delivers codes and "
                 "scales only (input_codes, input_scales)");
    const auto n = static_cast<std::size_t>(received_rows(l));
    return inputs_.block(expert_in(), static_cast<std::size_t>(l), first_row(l), n,
                         options_.hidden);
  }
  std::span<const T* const> expert_input_rows(int l) const {
    const auto n = static_cast<std::size_t>(received_rows(l));
    return inputs_.gathered(first_row(l), n);
  }
  std::pair<const_token_view, const_token_view> expert_wire(int l) const {
    WEAVE_EXPECT(options_.fp8_dispatch.has_value(), errc::invalid_state,
                 "decode_exchange: codes and scales exist with an FP8 dispatch only");
    const auto n = static_cast<std::size_t>(received_rows(l));
    auto* base = const_cast<std::byte*>(expert_wire_.data()) + // read-only views
                 first_row(l) * wire_.stride;
    const auto [codes, scales] = wire_views(base, n);
    return {codes, scales};
  }
  std::span<T> expert_output(int l) const {
    const auto n = static_cast<std::size_t>(received_rows(l));
    auto* out = const_cast<T*>(pool_out()); // the handle's view of this exchange's rows
    return {out + first_row(l) * options_.hidden, n * options_.hidden};
  }
  // The pool's inputs live in the send buffer, idle from the dispatch's end to the combine's
  // pack (which the experts precede in stream order); a view read later is refused as stale.
  T* expert_in() noexcept { return reinterpret_cast<T*>(mail_.send_buffer().data()); }
  const T* expert_in() const noexcept {
    return reinterpret_cast<const T*>(mail_.send_buffer().data());
  }
  // The pool's outputs: `pool_rows_` rows after the messages received (row `pool_out_row_`).
  const T* pool_out() const noexcept {
    return reinterpret_cast<const T*>(mail_.recv_buffer().data()) + pool_out_row_ * options_.hidden;
  }
  std::size_t first_row(int l) const noexcept {
    return static_cast<std::size_t>(arrivals_.slots().first(static_cast<std::size_t>(l)));
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
  std::size_t pool_rows_ = 0, tokens_ = 0;
  phase_layout dispatch_, combine_;    // the two all-to-alls' messages
  std::vector<std::int64_t> received_; // a bounded dispatch: the bytes each peer sent
  detail::decode_mailbox mail_;  // the messages (send: then the pool's inputs; receive: outputs)
  std::size_t pool_out_row_ = 0; // the pool's outputs' first row in the receive buffer
  const std::byte* dispatch_rows_ = nullptr;    // the call's token rows (FP8: `token_wire_`)
  detail::decode_record_layout records_layout_; // the messages' wire format
  quantized_row_layout wire_;                   // FP8 dispatch: a row's codes, then its scales
  std::vector<std::byte> token_wire_;           // FP8 dispatch: the call's tokens quantised
  std::vector<std::byte> expert_wire_;          // FP8 dispatch: the pool's wire rows
  detail::decode_input_rows<T> inputs_;         // where the experts' input rows are
  detail::decode_routes routes_;                // where this rank's pairs went
  detail::decode_arrivals arrivals_;            // where the pairs received went
  std::span<const float> weights_;              // the call's gate weights
  std::uint64_t calls_ = 0;                     // dispatches issued
  std::atomic<std::uint64_t> arrived_{0}, failed_call_{0}; // the last dispatch that ran, failed
  bool held_ = false, combined_ = false;
  stream_type* stream_ = nullptr; // the stream of every call
  // The end of the last call's work left queued (destruction waits for it).
  typename stream_type::event_type last_;
  std::shared_ptr<detail::layer_life> life_ = std::make_shared<detail::layer_life>();
};

WEAVE_NAMESPACE_END
