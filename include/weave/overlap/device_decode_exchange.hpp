//! \file
//! `basic_device_decode_exchange<Space, Comm, T>`: the low-latency decode exchange
//! (docs/decode.md) with every step where the data lives and no host synchronisation, so a
//! call can be captured in a CUDA graph. `cuda_decode_exchange` (`cuda_decode_exchange.cuh`) is
//! this class in `cuda_space`; in `host_space` the same steps run as host-stream tasks (include
//! `weave/routing/host_row_moves.hpp` and `host_quant_moves.hpp`), which is how CI checks it
//! against the host `decode_exchange` and a naive reference.
//!
//! The protocol is `decode_exchange`'s: one message per (source, destination device) with room
//! for `max_tokens_per_rank` token records (the token's row, sent once to each device it is
//! routed to, and its local expert choices there in a side table), the record count and status
//! in a header inside the message, one all-to-all each way. What changes on a device: the
//! routes, records, headers and received layout are computed by steps (kernels) of the space, so
//! the host never waits for the stream inside a call, and every message is sent whole (the
//! host does not know the counts): the combine returns a row per (record, choice) in a message
//! of `max_tokens_per_rank` x min(k, local experts) rows (with `decode_options::partial_sums`,
//! each record's sum in a message of `max_tokens_per_rank` rows). The caller's experts read the
//! received rows and their counts from memory of the space, in stream order
//! (`device_decode_steps.hpp` has the wire layout).
//!
//! Fail-stop, without waiting for the device: a rank whose call is bad (shapes or more tokens
//! than the slots hold, found on the host; ids, weights or, with an FP8 dispatch, a non-finite
//! token, found by a step) sends every message with the status `failed`; every rank that
//! receives one marks the call failed, so its expert rows are empty and its output is all-ones
//! bytes (NaN), and `check_errors` then throws on each rank: the rank's own typed error, else a
//! `peer_error` naming the first failed peer and its cause. The next call works. Calls never throw
//! for bad data; they throw only for misuse that is local and stops before any collective (a second
//! live handle, another stream).
#pragma once

#include "weave/comm/communicator.hpp"
#include "weave/comm/fail_stop.hpp"
#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/core/dtype.hpp"
#include "weave/core/error.hpp"
#include "weave/core/failure.hpp"
#include "weave/core/tensor.hpp"
#include "weave/core/workspace.hpp"
#include "weave/exec/host_mirror.hpp"
#include "weave/exec/space.hpp"
#include "weave/overlap/decode_handle.hpp"
#include "weave/overlap/decode_options.hpp"
#include "weave/overlap/detail/device_decode_steps.hpp"
#include "weave/overlap/detail/layer_life.hpp"
#include "weave/placement/placement.hpp"
#include "weave/routing/device_dispatch_plan.hpp"
#include "weave/routing/quantize.hpp"
#include "weave/routing/row_moves.hpp"

#include <algorithm>
#include <concepts>
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

//! The decode exchange of rank `comm.rank()` in `Space` for rows of `T` (`float`, `bfloat16`,
//! `half`; sums in f32): see the file comment. Construct, allocate `workspace_size()` bytes of
//! memory of the space (256-byte aligned), `initialize` once; calls then allocate nothing. One
//! handle is alive at a time (`dispatch` -> the caller's experts -> `combine`); every call runs
//! on one stream (the first call's); `x`, `ids`, `weights` and `y` are memory of the space,
//! borrowed until the stream has run the call's combine.
template <execution_space Space, communicator Comm, class T>
requires std::same_as<typename Comm::stream_type, typename Space::stream_type> &&
    has_all_to_all_v<Comm>
class basic_device_decode_exchange {
 public:
  using space = Space;
  using stream_arg = typename Space::stream_arg;
  using element_type = T;
  using handle = decode_handle<basic_device_decode_exchange>;

  //! Collective: every rank must build the layer alike (`errc::config_mismatch` on every rank
  //! naming the first field that differs); bad options throw `errc::invalid_argument` here and
  //! a `peer_error` on the peers.
  basic_device_decode_exchange(Comm& comm, placement where, decode_options options)
      : comm_(&comm)
      , serial_(detail::agree_on_decode(comm, where, options, dtype_of_v<T>,
                                        "device_decode_exchange", false))
      , where_(std::move(where))
      , options_(options)
      , rank_(comm.rank())
      , table_host_(detail::replica_table(where_, comm.rank())) {
    const std::size_t row_bytes = checked_mul(options_.hidden, sizeof(T), "row bytes");
    const auto spd = where_.slots_per_device();
    const std::size_t M = options_.max_tokens_per_rank;
    const std::size_t choices =
        std::min(static_cast<std::size_t>(options_.k), static_cast<std::size_t>(spd));
    const std::size_t row_stride = checked_add(row_bytes, std::size_t{15}, "row bytes") / 16 * 16;
    if (options_.fp8_dispatch)
      wire_ = quantized_row_layout::of(options_.hidden, options_.fp8_dispatch->blocks.block);
    const bool partial = options_.partial_sums;
    at_ = detail::decode_layout::combine(comm.size(), M, partial ? 1 : choices, row_stride);
    dispatch_at_ = detail::decode_layout::dispatch(
        comm.size(), M, choices, options_.fp8_dispatch ? wire_.stride : row_stride, partial);
    for (std::int64_t d = 0; d < at_.D; ++d) { // fixed: rows per peer
      counts_.push_back(at_.block_rows);
      displs_.push_back(d * at_.block_rows);
      dispatch_counts_.push_back(dispatch_at_.block_rows);
      dispatch_displs_.push_back(d * dispatch_at_.block_rows);
    }
    for (int l = 0; l < spd; ++l)
      local_experts_.push_back(where_.expert_of_slot(rank_ * spd + l));
  }

  //! Waits for the work the layer queued (its workspace must outlive it); with a handle alive
  //! between its dispatch and its combine, aborts the communicator first: the peers, waiting in
  //! that combine, fail at once with a `peer_error` naming it. Handles that outlive the layer are
  //! stale (`errc::invalid_state`; releasing one does nothing).
  ~basic_device_decode_exchange() {
    if (held_ && !combined_ && !communicator_aborted(*comm_))
      try {
        abort_peers(*comm_, std::make_exception_ptr(error(errc::invalid_state,
                                                          "a device_decode_exchange was destroyed "
                                                          "between a dispatch and its combine")));
      } catch (...) {
      }
    detail::wait_at_end(last_);
    life_->alive.store(false, std::memory_order_release);
  }

  basic_device_decode_exchange(const basic_device_decode_exchange&) = delete;
  basic_device_decode_exchange& operator=(const basic_device_decode_exchange&) = delete;

  const decode_options& options() const noexcept { return options_; }
  const placement& where() const noexcept { return where_; }
  //! Bytes this rank sends to each peer in a dispatch (FP8 rows with an FP8 dispatch).
  std::size_t dispatch_bytes_per_peer() const noexcept { return dispatch_at_.bytes_per_peer(); }
  //! Bytes this rank sends to each peer in a combine (rows of T).
  std::size_t combine_bytes_per_peer() const noexcept { return at_.bytes_per_peer(); }

  //! Bytes of memory of the space `initialize` needs.
  std::size_t workspace_size() const {
    workspace_carver measure;
    return carve(*this, measure).used();
  }

  //! Carves every buffer out of `workspace`, uploads the replica table and clears the status
  //! words on `stream`, and waits for it. Throws `errc::size_mismatch` for a workspace too small.
  void initialize(void* workspace, std::size_t bytes, stream_arg stream) {
    WEAVE_EXPECT(workspace != nullptr, errc::invalid_argument, "null workspace");
    workspace_carver carver(workspace, bytes);
    carve(*this, carver);
    Space::copy_from_host(stream, table_, table_host_.data(),
                          table_host_.size() * sizeof(std::int32_t));
    Space::fill(stream, words_, 0, word_count * sizeof(std::uint32_t));
    Space::fill(stream, kept_, 0, sizeof(detail::decode_kept));
    Space::fill(stream, send_, 0, buffer_bytes());
    Space::fill(stream, recv_, 0, buffer_bytes());
    wait_watched(*comm_, stream);
    initialized_ = true;
  }

  //! Enqueues the dispatch of `x` (tokens x hidden) routed by `ids` / `weights` (k per token,
  //! id -1 = none) on `s`: a few steps and one all-to-all. Bad inputs do not throw: they fail
  //! the call on every rank (file comment). Throws `errc::invalid_state` before `initialize`
  //! or while a handle is alive, `errc::invalid_argument` for another stream.
  handle dispatch(std::span<const T> x, std::span<const std::int32_t> ids,
                  std::span<const float> weights, stream_arg s) {
    begin_call(s);
    decode_header rejected;
    std::size_t tokens = 0;
    try {
      tokens = detail::decode_call_tokens(options_, x.size(), ids.size(), weights.size(),
                                          "device_decode_exchange");
    } catch (...) {
      rejected = reject(std::current_exception());
    }
    tokens_ = tokens;
    rejected_ = rejected.status != decode_status::ok;
    weights_ = weights.data();
    static_assert(call_failed == call_flags + 1); // the two per-call words, cleared together
    Space::fill(s, words_ + call_flags, 0, 2 * sizeof(std::uint32_t));
    Space::fill(s, send_index_, 0xFF, dispatch_at_.rows() * sizeof(std::int64_t));
    if (options_.fp8_dispatch)
      Space::fill(s, bad_token_, 0xFF, sizeof(std::int64_t)); // -1: every token finite
    if (options_.partial_sums)
      Space::fill(s, merge_index_, 0xFF, merge_entries() * sizeof(std::int64_t));
    else
      Space::fill(s, return_index_, 0xFF, at_.rows() * sizeof(std::int64_t));
    const auto n = static_cast<std::int64_t>(tokens);
    if (n > 0)
      Space::for_each(s, n,
                      detail::decode_route_step{
                          ids.data(), weights.data(), options_.k, where_.num_experts(), table_,
                          table_ + where_.num_experts(), table_ + 2 * where_.num_experts() + 1,
                          pair_slot_, words_ + call_flags});
    Space::for_each(s, at_.D,
                    detail::decode_position_step{dispatch_at_, n, options_.k, spd(), pair_slot_,
                                                 options_.partial_sums ? weights.data() : nullptr,
                                                 send_, pair_pos_, records_, pairs_to_,
                                                 send_index_});
    if (n > 0)
      send_rows(s, rows(reinterpret_cast<const std::byte*>(x.data()), tokens));
    send_headers(s, dispatch_at_, rejected, records_);
    Space::for_each(s, at_.D,
                    detail::decode_receive_step{dispatch_at_, recv_, known_flags, spd(), nullptr,
                                                arrived_, words_ + call_failed,
                                                words_ + sticky_error, kept_});
    Space::for_each(s, spd(),
                    detail::decode_slot_layout_step{
                        dispatch_at_, at_, recv_, words_ + call_failed, source_rows_,
                        source_offsets_, expert_rows_, expert_index_, return_index_,
                        options_.partial_sums ? merge_index_ : nullptr, merge_weight_});
    receive_rows(s);
    note_enqueued(s);
    return handle(this, calls_, life_);
  }

  //! Enqueues the combine of `h` on `s`: one all-to-all returns every expert output to its
  //! source, which writes y[t] = sum over t's kept choices j (in order) of
  //! weights[t, j] * output(ids[t, j], x[t]) (f32 sums, one rounding) into `y`. Releases `h`.
  //! A `y` of the wrong size fails the call on every rank, as in the dispatch.
  void combine(handle& h, std::span<T> y, stream_arg s) {
    WEAVE_EXPECT(h.ex_ == this, errc::invalid_argument,
                 "device_decode_exchange::combine: a handle of another exchange (or an empty one)");
    bind_stream(s);
    combined_ = true;
    decode_header rejected;
    const std::size_t H = options_.hidden;
    try {
      WEAVE_EXPECT(rejected_ || y.size() == tokens_ * H, errc::size_mismatch,
                   "device_decode_exchange::combine: an output of ", y.size(), " elements for ",
                   tokens_, " tokens of hidden = ", H);
    } catch (...) {
      rejected = reject(std::current_exception());
    }
    Space::fill(s, words_ + call_flags, 0, sizeof(std::uint32_t));
    if (options_.partial_sums) // each record's expert outputs, summed into its combine row
      moves::merge(s, experts_rows(expert_out_), buffer(send_, at_), merge_index_,
                   static_cast<int>(dispatch_at_.choices), merge_weight_, nullptr, true);
    else
      moves::gather(s, experts_rows(expert_out_), buffer(send_, at_), return_index_, nullptr,
                    nullptr);
    send_headers(s, at_, rejected, arrived_);
    Space::for_each(s, at_.D,
                    detail::decode_receive_step{at_, recv_, known_flags, spd(),
                                                options_.partial_sums ? records_ : pairs_to_,
                                                nullptr, words_ + call_failed,
                                                words_ + sticky_error, kept_});
    const bool sums = !rejected_ && rejected.status == decode_status::ok && tokens_ > 0;
    if (sums && options_.partial_sums) {
      const int per_token = std::min(static_cast<int>(at_.D), options_.k);
      Space::for_each(s, static_cast<std::int64_t>(tokens_),
                      detail::decode_token_rows_step{at_, spd(), options_.k, per_token, pair_slot_,
                                                     pair_pos_, words_ + call_failed, pair_row_});
      moves::merge(s, buffer(recv_, at_), rows(reinterpret_cast<std::byte*>(y.data()), tokens_),
                   pair_row_, per_token, nullptr, nullptr, false);
    } else if (sums) {
      const auto pairs = static_cast<std::int64_t>(tokens_) * options_.k;
      Space::for_each(s, pairs,
                      detail::decode_pair_row_step{at_, spd(), pair_slot_, pair_pos_,
                                                   words_ + call_failed, pair_row_});
      moves::merge(s, buffer(recv_, at_), rows(reinterpret_cast<std::byte*>(y.data()), tokens_),
                   pair_row_, options_.k, weights_, nullptr, false);
    }
    Space::for_each(s, 1,
                    detail::decode_poison_step{words_ + call_failed,
                                               reinterpret_cast<std::byte*>(y.data()),
                                               static_cast<std::int64_t>(y.size_bytes())});
    note_enqueued(s);
    h.reset();
  }

  //! Waits for `stream`, then throws for what failed since the last check: this rank's own
  //! failure first (a call refused on the host with its typed error; flagged ids or weights:
  //! `errc::out_of_range` / `errc::invalid_argument`), else the first failed header's sender
  //! (`peer_error` naming it and its cause), else a header or a token record no sender writes
  //! (`errc::protocol` naming its sender), else a combine message that returned other rows than
  //! were sent (`errc::size_mismatch`). Clears what it reported.
  void check_errors(stream_arg stream) {
    WEAVE_EXPECT(initialized_, errc::invalid_state, "device_decode_exchange is not initialised");
    // Copied into pinned memory on CUDA: the host blocks only in the watched wait.
    take_error_word<Space>(stream, &checked_.data()->flags, words_ + sticky_error);
    Space::copy_to_host(stream, &checked_.data()->kept, kept_, sizeof(detail::decode_kept));
    Space::fill(stream, kept_, 0, sizeof(detail::decode_kept));
    wait_watched(*comm_, stream);
    const std::uint32_t flags = checked_.data()->flags;
    const detail::decode_kept kept = checked_.data()->kept;
    if (pending_)
      std::rethrow_exception(std::exchange(pending_, nullptr));
    throw_flagged(flags);
    if (kept.peer_claimed != 0)
      throw peer_error(peer_record(kept.peer), "device_decode_exchange");
    if (kept.bad_claimed != 0)
      WEAVE_THROW(errc::protocol, "device_decode_exchange: rank ", kept.bad_sender,
                  " sent a header no weave rank writes (",
                  detail::describe_header_fault(static_cast<decode_header_fault>(kept.bad_fault),
                                                kept.bad, kept.bad_limit),
                  ")");
    if (kept.record_claimed != 0)
      throw detail::bad_decode_record(
          "device_decode_exchange", static_cast<std::size_t>(kept.record_sender),
          static_cast<std::size_t>(kept.record), static_cast<std::size_t>(kept.record_choice),
          kept.record_value, spd());
    WEAVE_EXPECT((flags & device_decode_bad_message) == 0, errc::size_mismatch,
                 "device_decode_exchange: a peer returned other rows than were sent to it "
                 "(its dispatch failed)");
  }

 private:
  friend handle;
  using moves = row_moves<Space>;
  using quant = quant_moves<Space>;
  enum word : std::size_t { call_flags, call_failed, sticky_error, word_count };
  // The flags a failed header may carry: a dispatch plan's, and a non-finite FP8 token.
  static constexpr std::uint32_t known_flags = device_plan_bad_expert | device_plan_duplicate |
                                               device_plan_bad_weight | device_decode_nonfinite;

  device_decode_experts<T> experts_of(std::uint64_t) const {
    device_decode_experts<T> v;
    v.local_experts = static_cast<int>(spd());
    v.sources = static_cast<int>(at_.D);
    v.hidden = options_.hidden;
    v.rows_per_expert = static_cast<std::size_t>(at_.D * at_.M);
    const bool fp8 = options_.fp8_dispatch.has_value();
    v.input = fp8 && !options_.fp8_dispatch->dequantized_inputs
                  ? nullptr
                  : reinterpret_cast<const T*>(expert_in_);
    v.codes = expert_codes_;
    v.scales = expert_scales_;
    v.scales_per_row = scales_per_row();
    v.output = reinterpret_cast<T*>(expert_out_);
    v.rows = expert_rows_;
    v.source_rows = source_rows_;
    v.source_offsets = source_offsets_;
    v.experts = local_experts_;
    return v;
  }

  // Marks the end of a call's work for the layer's destruction (not while capturing: the
  // captured work runs when the graph is launched, and captured events cannot be waited for).
  void note_enqueued(stream_arg s) {
    if constexpr (requires { Space::is_capturing(s); })
      if (Space::is_capturing(s))
        return;
    typename Space::stream_type& st = s;
    st.record(last_);
  }

  void begin_call(stream_arg s) {
    WEAVE_EXPECT(initialized_, errc::invalid_state, "device_decode_exchange is not initialised");
    WEAVE_EXPECT(!held_, errc::invalid_state,
                 "device_decode_exchange: a handle is alive; combine it first");
    bind_stream(s);
    ++calls_;
    held_ = true;
    combined_ = false;
  }

  // Every call runs on one stream: stream order keeps a call's queued steps off the next
  // call's buffers.
  void bind_stream(stream_arg s) {
    const void* id = stream_identity(s);
    if (stream_ == nullptr)
      stream_ = id;
    WEAVE_EXPECT(stream_ == id, errc::invalid_argument,
                 "device_decode_exchange: every call runs on the stream of the first call");
  }
  static const void* stream_identity(stream_arg s) {
    if constexpr (requires { s.get(); })
      return static_cast<const void*>(s.get());
    else
      return static_cast<const void*>(&s);
  }

  // A call refused on the host: kept for this rank's `check_errors` (the first one), sent to
  // the peers in the call's headers.
  decode_header reject(std::exception_ptr failure) {
    const failure_record r = record_of(failure, rank_);
    if (!pending_)
      pending_ = std::move(failure);
    return detail::failed_header(rank_, r.code, r.message);
  }

  // Throws for a sender's flags (this rank's, or a failed peer's header's).
  void throw_flagged(std::uint32_t flags) const {
    device_dispatch_plan<Space>::throw_plan_errors(flags & 0xFFu, where_.num_experts());
    WEAVE_EXPECT((flags & device_decode_nonfinite) == 0, errc::invalid_argument,
                 "a token holds a NaN or an infinity: the FP8 dispatch "
                 "(decode_options::fp8_dispatch) cannot scale it, and the call failed");
  }

  // A failed peer's header (one a sender writes) as its failure: the cause it sent, or the one
  // its flags name.
  failure_record peer_record(const decode_header& h) const {
    const std::size_t n = ::strnlen(h.cause, sizeof h.cause);
    if (n > 0 || h.flags == 0)
      return {h.source, static_cast<errc>(h.code), true, std::string(h.cause, n)};
    return record_of_call(h.source, [&] { throw_flagged(static_cast<std::uint32_t>(h.flags)); });
  }

  // The headers of a phase's messages (`rows` per destination), then its one all-to-all of
  // fixed-size messages.
  void send_headers(stream_arg s, const detail::decode_layout& at, const decode_header& rejected,
                    const std::int64_t* rows) {
    const bool dispatch = &at == &dispatch_at_;
    Space::for_each(s, at.D,
                    detail::decode_header_step{
                        at, send_, rejected, rows, words_ + call_flags,
                        dispatch && options_.fp8_dispatch ? bad_token_ : nullptr,
                        dispatch ? nullptr : words_ + call_failed, words_ + sticky_error, rank_});
    const std::vector<std::int64_t>& c = dispatch ? dispatch_counts_ : counts_;
    const std::vector<std::int64_t>& d = dispatch ? dispatch_displs_ : displs_;
    all_to_all_v(*comm_, s, send_, c, d, recv_, c, d, at.stride);
  }

  // The dispatch's rows into their slots: copied, or quantised (each token once per slot).
  void send_rows(stream_arg s, const const_token_view& x) {
    if (!options_.fp8_dispatch) {
      moves::gather(s, x, buffer(send_, dispatch_at_), send_index_, nullptr, nullptr);
      return;
    }
    const auto [codes, scales] =
        wire_.views(send_, dispatch_at_.rows(), options_.fp8_dispatch->format, Space::memory);
    quant::quantize(s, x, codes, scales, send_index_, nullptr, options_.fp8_dispatch->blocks,
                    bad_token_);
  }

  // The received rows into the experts' layout: rows of T; with an FP8 dispatch codes and
  // scales, and their dequantised rows when asked for.
  void receive_rows(stream_arg s) {
    const auto capacity = static_cast<std::size_t>(expert_capacity());
    if (!options_.fp8_dispatch) {
      moves::gather(s, buffer(recv_, dispatch_at_), experts_rows(expert_in_), expert_index_,
                    nullptr, nullptr);
      return;
    }
    const fp8_dispatch_options& f = *options_.fp8_dispatch;
    const auto [codes, scales] = wire_.views(recv_, dispatch_at_.rows(), f.format, Space::memory);
    moves::gather(s, codes,
                  token_view(expert_codes_, capacity, options_.hidden, f.format, Space::memory),
                  expert_index_, nullptr, nullptr);
    moves::gather(s, scales,
                  token_view(reinterpret_cast<std::byte*>(expert_scales_), capacity,
                             scales_per_row(), dtype::f32, Space::memory),
                  expert_index_, nullptr, nullptr);
    if (f.dequantized_inputs)
      quant::dequantize(s, codes, scales, experts_rows(expert_in_), expert_index_, nullptr,
                        f.blocks);
  }

  void release_handle(std::uint64_t) noexcept {
    if (held_ && !combined_) // the peers wait in this call's combine: nobody can know it failed
      if constexpr (requires { comm_->abort(std::string()); })
        comm_->abort("a device_decode_exchange handle was released without its combine");
    held_ = false;
  }

  std::size_t buffer_bytes() const noexcept {
    return std::max(at_.rows() * at_.stride, dispatch_at_.rows() * dispatch_at_.stride);
  }
  std::size_t scales_per_row() const noexcept {
    return options_.fp8_dispatch ? options_.hidden / options_.fp8_dispatch->blocks.block : 0;
  }
  std::int64_t spd() const noexcept { return where_.slots_per_device(); }
  // Partial sums: the combine merge's entries, `choices` per combine buffer row.
  std::size_t merge_entries() const noexcept {
    return at_.rows() * static_cast<std::size_t>(dispatch_at_.choices);
  }
  std::int64_t expert_capacity() const noexcept { return spd() * at_.D * at_.M; }
  template <class Byte>
  basic_token_view<Byte> rows(Byte* p, std::size_t n) const {
    return basic_token_view<Byte>(p, n, options_.hidden, dtype_of_v<T>, Space::memory);
  }
  token_view buffer(std::byte* p, const detail::decode_layout& at) const {
    return token_view(p, at.rows(), options_.hidden, dtype_of_v<T>, Space::memory, -1, at.stride);
  }
  token_view experts_rows(std::byte* p) const {
    return rows(p, static_cast<std::size_t>(expert_capacity()));
  }

  // Measures (const self) or carves and records every buffer; the same code for both.
  template <class Self>
  static workspace_carver& carve(Self& self, workspace_carver& c) {
    const auto set = carve_into<Self>(c);
    const auto pairs =
        self.options_.max_tokens_per_rank * static_cast<std::size_t>(self.options_.k);
    const auto D = static_cast<std::size_t>(self.at_.D);
    const std::size_t expert_bytes = checked_mul(static_cast<std::size_t>(self.expert_capacity()),
                                                 self.options_.hidden * sizeof(T), "expert rows");
    set(self.table_, self.table_host_.size());
    set(self.words_, std::size_t{word_count});
    set(self.kept_, 1);
    set(self.send_, self.buffer_bytes());
    set(self.recv_, self.buffer_bytes());
    set(self.expert_in_, expert_bytes);
    set(self.expert_out_, expert_bytes);
    set(self.pair_slot_, pairs);
    set(self.pair_pos_, pairs);
    set(self.pair_row_, pairs);
    const auto slots = static_cast<std::size_t>(self.spd()) * D;
    set(self.records_, D);
    set(self.pairs_to_, D);
    set(self.arrived_, D);
    set(self.source_rows_, slots);
    set(self.source_offsets_, slots);
    set(self.expert_rows_, static_cast<std::size_t>(self.spd()));
    set(self.send_index_, self.dispatch_at_.rows());
    if (self.options_.partial_sums) {
      set(self.merge_index_, self.merge_entries());
      set(self.merge_weight_, self.merge_entries());
    } else {
      set(self.return_index_, self.at_.rows());
    }
    if (self.options_.fp8_dispatch) {
      const auto capacity = static_cast<std::size_t>(self.expert_capacity());
      set(self.bad_token_, 1);
      set(self.expert_codes_, checked_mul(capacity, self.options_.hidden, "codes"));
      set(self.expert_scales_, checked_mul(capacity, self.scales_per_row(), "scales"));
    }
    set(self.expert_index_, static_cast<std::size_t>(self.expert_capacity()));
    return c;
  }

  Comm* comm_;
  std::uint32_t serial_ = 0; // the layer on its communicator (agreed at construction)
  placement where_;
  decode_options options_;
  int rank_ = 0;
  detail::decode_layout at_, dispatch_at_; // the combine's messages (rows of T), the dispatch's
  quantized_row_layout wire_;              // FP8 dispatch: a row's codes, then its scales
  // What `check_errors` reads back: the sticky flags and the headers kept.
  struct checked_words {
    detail::decode_kept kept;
    std::uint32_t flags;
  };
  host_mirror<Space, checked_words> checked_{1};
  std::vector<std::int32_t> table_host_, local_experts_;
  std::vector<std::int64_t> counts_, displs_;                   // combine: rows per peer
  std::vector<std::int64_t> dispatch_counts_, dispatch_displs_; // dispatch: rows per peer
  // Memory of the space, carved by `initialize`.
  std::int32_t* table_ = nullptr;
  std::uint32_t* words_ = nullptr;      // call flags, call failed, sticky error
  detail::decode_kept* kept_ = nullptr; // the headers kept since the last check
  std::byte *send_ = nullptr, *recv_ = nullptr, *expert_in_ = nullptr, *expert_out_ = nullptr;
  std::int32_t* pair_slot_ = nullptr;
  std::int64_t *pair_pos_ = nullptr, *pair_row_ = nullptr; // per (token, choice)
  // Per rank: records and pairs sent, pairs received.
  std::int64_t *records_ = nullptr, *pairs_to_ = nullptr, *arrived_ = nullptr;
  std::int64_t *source_rows_ = nullptr, *source_offsets_ = nullptr, *expert_rows_ = nullptr;
  std::int64_t *send_index_ = nullptr, *return_index_ = nullptr, *expert_index_ = nullptr;
  std::int64_t* merge_index_ = nullptr; // partial sums: [combine row][choice] -> expert row
  float* merge_weight_ = nullptr;       // and its gate weight
  std::int64_t* bad_token_ = nullptr;   // FP8 dispatch: the call's first non-finite token, or -1
  std::byte* expert_codes_ = nullptr;   // FP8 dispatch: [slot][D * max tokens][hidden]
  float* expert_scales_ = nullptr;      // FP8 dispatch: [slot][D * max tokens][hidden / block]
  // The call in flight, as the host issued it.
  std::size_t tokens_ = 0;
  bool rejected_ = false, held_ = false, combined_ = false, initialized_ = false;
  const float* weights_ = nullptr;
  std::exception_ptr pending_; // this rank's first refused call since the last check
  std::uint64_t calls_ = 0;
  const void* stream_ = nullptr;
  typename Space::stream_type::event_type last_{}; // the end of the last call's work
  std::shared_ptr<detail::layer_life> life_ = std::make_shared<detail::layer_life>();
};

WEAVE_NAMESPACE_END
