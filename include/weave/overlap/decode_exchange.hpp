//! \file
//! `basic_decode_exchange<Space, Comm, T>`: the low-latency MoE exchange for decoding (1 to a few
//! hundred tokens per rank), written once for every execution space. `decode_exchange<Comm, T>`
//! is this class on host streams (`host_space`: local_world, MPI), `cuda_decode_exchange<Comm,
//! T>` on CUDA streams (`weave/overlap/cuda_decode_exchange.cuh`). DeepEP's low-latency shape
//! (fixed buffers, counts inside the messages), sending what is routed:
//! - one message per (source rank, destination device) and phase, in a fixed room for
//!   `max_tokens_per_rank` token records (`detail/decode_wire.hpp`): a token's row, sent once to
//!   each device it is routed to, with its local expert choices there;
//! - the record count travels in the message's header (`decode_header`), so a dispatch is one
//!   all-to-all and the combine another, with no count exchange and no allocation per call;
//! - the combine returns one row per record (`decode_options::partial_sums`, the default: the
//!   device sums its choices' outputs, the source sums its devices' rows, the dynamic exchange's
//!   sums) or per (token, expert) pair (the source sums them in choice order);
//! - a rank's messages to itself are headers: its records' rows are read from the caller's
//!   tokens, its own combine rows written where it reads them.
//! On host streams, which know the counts when they send, a dispatch message sends only its
//! records where the communicator takes bounded receives (`has_bounded_all_to_all`), and the
//! combine's messages have their exact sizes; on CUDA every message is sent whole, so that no
//! call waits for the GPU and a call can be captured in a CUDA graph. The experts get a pool of
//! their rows, each slot's together; a slot fed one row by a peer reads it where it arrived, and
//! with `decode_options::gathered_inputs` every row is read where it arrived.
//!
//! Fail-stop, without a side channel: a rank whose call is bad (shapes, more tokens than the
//! messages hold, an expert id outside [-1, E), one chosen twice, a non-finite weight or, with an
//! FP8 dispatch, a non-finite token) still sends every message, with the status `failed` and the
//! cause in its headers. On host streams every rank's stream then fails at the dispatch (the
//! culprit with its typed error, the peers with a `peer_error` naming it); on CUDA the call's
//! expert rows are empty and its output all-ones bytes (NaN), and `check_errors` throws on every
//! rank. `synchronize` is the one wait that reports it, in every space. The next call works.
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
#include "weave/exec/host_space.hpp"
#include "weave/exec/space.hpp"
#include "weave/exec/stream.hpp"
#include "weave/exec/stream_allocator.hpp"
#include "weave/overlap/decode_handle.hpp"
#include "weave/overlap/decode_options.hpp"
#include "weave/overlap/detail/decode_pool_steps.hpp"
#include "weave/overlap/detail/decode_serial_steps.hpp"
#include "weave/overlap/detail/decode_wire.hpp"
#include "weave/overlap/detail/layer_life.hpp"
#include "weave/placement/placement.hpp"
#include "weave/routing/device_dispatch_plan.hpp"
#include "weave/routing/host_quant_moves.hpp"
#include "weave/routing/host_row_moves.hpp"
#include "weave/routing/quantize.hpp"
#include "weave/routing/row_moves.hpp"

#include <algorithm>
#include <atomic>
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

//! A communicator a decode exchange in `Space` runs over: its streams are the space's, and it
//! moves all-to-alls of variable sizes.
template <class Comm, class Space>
concept decode_communicator = communicator<Comm> &&
    std::same_as<typename Comm::stream_type, typename Space::stream_type> && has_all_to_all_v<Comm>;

//! The decode exchange of rank `comm.rank()` in `Space` for rows of `T` (`float`, `bfloat16`,
//! `half`; sums in f32): see the file comment. One handle is alive at a time (`dispatch` -> the
//! caller's experts -> `combine`); the next call may be enqueued at once. Every call runs on one
//! stream (the first call's); `x`, `ids`, `weights` and `y` are memory of the space, borrowed
//! until the stream has run the call's combine.
template <execution_space Space, decode_communicator<Space> Comm, class T>
class basic_decode_exchange {
 public:
  using space = Space;
  using stream_type = typename Space::stream_type;
  using stream_arg = typename Space::stream_arg;
  using element_type = T;
  using handle = decode_handle<basic_decode_exchange>;
  using experts_view = decode_experts<basic_decode_exchange>;

  //! Collective: checks with one small all-gather that every rank builds the layer alike
  //! (placement, k, hidden, row type, `max_tokens_per_rank`, ...): `errc::config_mismatch` on
  //! every rank naming the first field that differs otherwise. Throws `errc::invalid_argument`
  //! for bad options or a placement of another device count (and its peers a `peer_error`
  //! naming this rank). Allocates no memory of the space: the workspace comes with `initialize`,
  //! or from the space's stream-ordered allocation at the first call.
  basic_decode_exchange(Comm& comm, placement where, decode_options options);

  //! Waits for the work the layer queued (its workspace must outlive it); with a handle alive
  //! between its dispatch and its combine, aborts the communicator first: the peers, waiting in
  //! that combine, fail at once with a `peer_error` naming it. Handles and views that outlive
  //! the layer are stale (`errc::invalid_state`; releasing a handle does nothing).
  ~basic_decode_exchange();

  basic_decode_exchange(const basic_decode_exchange&) = delete;
  basic_decode_exchange& operator=(const basic_decode_exchange&) = delete;

  const decode_options& options() const noexcept { return options_; }
  const placement& where() const noexcept { return where_; }
  //! Bytes this rank sends a peer in a dispatch at most (a whole message: header, records of
  //! `max_tokens_per_rank` tokens, their side table); FP8 rows with an FP8 dispatch.
  std::size_t dispatch_bytes_per_peer() const noexcept { return at_.dispatch.room_bytes(); }
  //! Bytes this rank sends a peer in a combine at most (rows of T).
  std::size_t combine_bytes_per_peer() const noexcept { return at_.combine.room_bytes(); }

  //! Bytes of memory of the space the layer's workspace takes: its messages' buffers, the
  //! expert pool and the call's arrays (`workspace_size(ranks, local_experts, options)`: the
  //! same without building the layer).
  std::size_t workspace_size() const { return carve(options_, at_, nullptr); }
  static std::size_t workspace_size(std::size_t ranks, std::size_t local_experts,
                                    const decode_options& options) {
    return carve(options, shape(ranks, local_experts, options), nullptr);
  }

  //! Optional, before the first call: carves every buffer out of `workspace` (`workspace_size()`
  //! bytes, 256-byte aligned) and initialises it on `stream`, in stream order. Without it the
  //! first call takes the workspace from the space's stream-ordered allocation, on its stream.
  void initialize(void* workspace, std::size_t bytes, stream_arg stream) {
    WEAVE_EXPECT(workspace != nullptr, errc::invalid_argument, "null workspace");
    WEAVE_EXPECT(!held_, errc::invalid_state, "decode_exchange::initialize with a handle alive");
    if (workspace != owned_.data())
      owned_.release(&static_cast<stream_type&>(stream));
    carve_and_initialize(workspace, bytes, stream);
  }

  //! Enqueues the dispatch of `x` (tokens x hidden rows of T) routed by `ids` / `weights` (k per
  //! token, id -1 = none) on `s`: one all-to-all. Bad inputs do not throw here: they fail the
  //! call on every rank as the file comment says. Throws `errc::invalid_state` when a handle of
  //! this exchange is still alive, `errc::invalid_argument` for another stream than the first
  //! call's. On host streams, when `s` is idle the steps run on the calling thread under one
  //! claim of it (`host_stream::claim_if_idle`), and so does the all-to-all where the
  //! communicator runs small ones inline: a decode call then returns complete.
  handle dispatch(std::span<const T> x, std::span<const std::int32_t> ids,
                  std::span<const float> weights, stream_arg s);

  //! Enqueues the combine of `h` on `s`: one all-to-all returns every expert output to its
  //! source, which writes y[t] = sum over t's kept choices j (in order) of
  //! weights[t, j] * output(ids[t, j], x[t]) into `y` (tokens x hidden); with `partial_sums`
  //! the sum over t's devices (ascending) of each device's sum over its choices, rounded to T.
  //! Releases `h`. A `y` of the wrong size fails the call on every rank, as in the dispatch.
  void combine(handle& h, std::span<T> y, stream_arg s);

  //! The one wait: waits for `s` (through the communicator: a dead peer ends in its timeout)
  //! and throws the root cause of what failed since the last check (`check_errors`; on host
  //! streams the stream's own failure first).
  void synchronize(stream_arg s) { check_errors(s); }

  //! Waits for `s`, then throws for what failed since the last check: this rank's own failure
  //! first (a call refused with its typed error; flagged ids or weights: `errc::out_of_range` /
  //! `errc::invalid_argument`), else the first failed header's sender (`peer_error` naming it
  //! and its cause), else a header or a token record no sender writes (`errc::protocol` naming
  //! its sender), else a combine message that returned other rows than were sent
  //! (`errc::size_mismatch`). Clears what it reported.
  void check_errors(stream_arg s);

 private:
  friend handle;
  friend experts_view;
  using moves = row_moves<Space>;
  using quant = quant_moves<Space>;
  enum word : std::size_t { call_flags, call_failed, sticky_error, word_count };
  // The flags a failed header may carry: a dispatch plan's, and a non-finite FP8 token.
  static constexpr std::uint32_t known_flags = device_plan_bad_expert | device_plan_duplicate |
                                               device_plan_bad_weight | decode_nonfinite_flag;
  // Host streams send what they know they send (the counts are in host memory there).
  static constexpr bool exact = Space::runs_later;
  static constexpr bool bounded = exact && has_bounded_all_to_all<Comm>;

  // What a layer's sizes follow from: ranks, local slots and options (no layer needed).
  struct shape {
    detail::decode_wire dispatch, combine; // the two phases' messages
    quantized_row_layout wire;             // FP8 dispatch: a row's codes, then its scales
    std::size_t L;                         // local slots
    shape(std::size_t ranks, std::size_t local_slots, const decode_options& o);
    std::size_t pool_rows() const noexcept {
      return static_cast<std::size_t>(dispatch.D * dispatch.M * dispatch.choices);
    }
  };
  // The workspace's arrays, taken from `c` in order (pointed to from `self` unless it is null):
  // returns the bytes they take.
  static std::size_t carve(const decode_options& o, const shape& s, basic_decode_exchange* self,
                           workspace_carver c = {});

  experts_view experts_of(std::uint64_t call) const { return {this, call, life_}; }
  void release_handle(std::uint64_t call) noexcept {
    if (held_ && !combined_ && failed_call_.load(std::memory_order_acquire) != call)
      if constexpr (requires { comm_->abort(std::string()); })
        comm_->abort("a decode_exchange handle was released without its combine");
    held_ = false;
  }

  // --- the phases (detail/decode_phases.hpp) -------------------------------------------------
  void ensure_initialized(stream_arg s) {
    if (initialized_)
      return;
    const std::size_t bytes = workspace_size();
    owned_.replace(allocator_, bytes, s);
    carve_and_initialize(owned_.data(), bytes, s);
  }
  void carve_and_initialize(void* workspace, std::size_t bytes, stream_arg s);
  // The checks of a call (a dispatch: no handle alive), its stream bound, the workspace taken.
  void begin_call(stream_arg s, bool dispatching);
  // A phase's three parts: on host streams under one claim of `s` when it is idle, so that they
  // run here; the end is recorded unless all ran.
  template <class Pack, class Exchange, class Unpack>
  void issue(stream_arg s, Pack&& pack, Exchange&& exchange, Unpack&& unpack);
  void pack_dispatch(stream_arg s, std::span<const T> x, std::span<const std::int32_t> ids,
                     std::span<const float> weights);
  // Routes a call (host code and steps): the records, their rows, the headers (`rejected`: a
  // call refused on the host, sent instead). Throws for bad shapes (and on host streams for a
  // bad pair or a non-finite FP8 token, named).
  void route(stream_arg s, std::span<const T> x, std::span<const std::int32_t> ids,
             std::span<const float> weights, const decode_header& rejected);
  void unpack_dispatch(stream_arg s, std::uint64_t call);
  void deliver(stream_arg s);
  void pack_combine(stream_arg s, std::span<T> y, std::uint64_t call);
  void unpack_combine(stream_arg s, std::span<T> y);
  // The headers of a phase's messages (`rows` per destination).
  void send_headers(stream_arg s, const detail::decode_wire& at, const decode_header& rejected,
                    const std::int64_t* rows);
  // Host streams: throws for what the received headers (and records) of a phase say, after
  // this rank's own failure in its pack; aborts the peers where they may not know it.
  void throw_received(bool dispatch);
  // A call refused on the host: keeps its error (host streams: raised at the unpack; CUDA: at
  // the next check, the first one kept) and returns the header sent instead.
  decode_header reject(std::exception_ptr failure) {
    const failure_record r = record_of(failure, rank_);
    if constexpr (exact)
      local_failure_ = std::move(failure);
    else if (!pending_)
      pending_ = std::move(failure);
    return detail::failed_header(rank_, r.code, r.message);
  }
  void throw_flagged(std::uint32_t flags) const {
    device_dispatch_plan<Space>::throw_plan_errors(flags & 0xFFu, where_.num_experts());
    WEAVE_EXPECT((flags & decode_nonfinite_flag) == 0, errc::invalid_argument,
                 "a token holds a NaN or an infinity: the FP8 dispatch "
                 "(decode_options::fp8_dispatch) cannot scale it, and the call failed");
  }
  // A failed header's sender and cause (its flags' error when it has no cause).
  failure_record peer_record(const decode_header& h) const {
    const std::size_t n = ::strnlen(h.cause, sizeof h.cause);
    if (n > 0 || h.flags == 0)
      return {h.source, static_cast<errc>(h.code), true, std::string(h.cause, n)};
    return record_of_call(h.source, [&] { throw_flagged(static_cast<std::uint32_t>(h.flags)); });
  }

  // --- what the view reads ------------------------------------------------------------------
  const detail::decode_call_arrays& arrays() const noexcept { return a_; }
  void expect_arrived([[maybe_unused]] std::uint64_t call) const {
    if constexpr (exact)
      WEAVE_EXPECT(arrived_.load(std::memory_order_acquire) == call, errc::invalid_state,
                   "decode_exchange: the dispatch has not run (read the expert rows in a task "
                   "enqueued after it, or after synchronizing its stream), or it failed, or its "
                   "combine has been issued");
  }
  void check_local(int l) const {
    WEAVE_EXPECT(l >= 0 && l < spd(), errc::out_of_range, "local slot ", l, " outside [0, ", spd(),
                 ")");
  }
  void check_source(int source) const {
    WEAVE_EXPECT(source >= 0 && source < world(), errc::out_of_range, "source rank ", source,
                 " outside [0, ", world(), ")");
  }
  int expert_of_local(int l) const {
    check_local(l);
    return where_.expert_of_slot(rank_ * where_.slots_per_device() + l);
  }
  std::int64_t world() const noexcept { return at_.dispatch.D; }
  const T* pool_in() const noexcept {
    return has_inputs() ? reinterpret_cast<const T*>(pool_in_) : nullptr;
  }
  T* pool_out() const noexcept { return reinterpret_cast<T*>(pool_out_); }
  // Local slot `l`'s pool rows: [first, first + n).
  std::pair<std::size_t, std::size_t> slot(int l) const {
    check_local(l);
    return {static_cast<std::size_t>(a_.first[l]), static_cast<std::size_t>(a_.slot_rows[l])};
  }
  std::span<const T> expert_input(int l) const;
  std::span<const T* const> expert_input_rows(int l) const;
  std::pair<const_token_view, const_token_view> expert_wire(int l) const;
  std::span<T> expert_output(int l) const {
    const auto [first, n] = slot(l);
    return {pool_out() + first * options_.hidden, n * options_.hidden};
  }

  // --- sizes and views ----------------------------------------------------------------------
  bool has_inputs() const noexcept {
    return !options_.fp8_dispatch || options_.fp8_dispatch->dequantized_inputs;
  }
  std::int64_t spd() const noexcept { return where_.slots_per_device(); }
  template <class Byte>
  basic_token_view<Byte> rows(Byte* p, std::size_t n) const {
    return basic_token_view<Byte>(p, n, options_.hidden, dtype_of_v<T>, Space::memory);
  }
  token_view buffer(std::byte* p, const detail::decode_wire& at) const {
    return token_view(p, at.rows(), options_.hidden, dtype_of_v<T>, Space::memory, -1, at.row);
  }
  // FP8 dispatch: `n` packed rows at `p` as their codes and scales.
  std::pair<token_view, token_view> wire_views(std::byte* p, std::size_t n) const {
    return at_.wire.views(p, n, options_.fp8_dispatch->format, Space::memory);
  }

  Comm* comm_;
  std::shared_ptr<const std::atomic<bool>> abandoned_; // the communicator's (abandoned_flag_of)
  std::uint32_t serial_ = 0; // the layer on its communicator (agreed at construction)
  placement where_;
  decode_options options_;
  int rank_ = 0;
  shape at_;
  std::vector<std::int32_t> table_host_;
  // The all-to-alls' bytes per peer (counts set per call on host streams) and displacements.
  std::vector<std::int64_t> dispatch_send_, dispatch_recv_, combine_send_, combine_recv_,
      dispatch_displs_, combine_displs_, received_;
  // Memory of the space, carved from the workspace.
  std::int32_t* table_ = nullptr;
  std::uint32_t* words_ = nullptr;      // call flags, call failed, sticky error
  detail::decode_kept* kept_ = nullptr; // the headers kept since the last check
  std::byte *send_ = nullptr, *recv_ = nullptr, *pool_in_ = nullptr, *pool_out_ = nullptr;
  std::byte* pool_wire_ = nullptr;    // FP8 dispatch: the pool's rows as they arrived
  std::int64_t* bad_token_ = nullptr; // FP8 dispatch: the call's first non-finite token, or -1
  std::int64_t* scratch_ = nullptr;   // serial steps: per-device and per-slot counters
  std::uint64_t* fed_ = nullptr;      // serial steps: the fed slots' bits
  std::byte* scan_temp_ = nullptr;    // the slots' scan (CUB's scratch on CUDA)
  const std::byte* x_ = nullptr;      // the call's tokens (this rank's own records' rows)
  detail::decode_call_arrays a_;
  struct checked_words { // what `check_errors` reads back
    detail::decode_kept kept;
    std::uint32_t flags;
  };
  host_mirror<Space, checked_words> checked_{1};
  stream_allocator<Space> allocator_ = stream_allocator<Space>::space_default();
  stream_block<Space> owned_; // the workspace, when the layer took it (after `allocator_`)
  // The call in flight, as the host issued it.
  std::size_t tokens_ = 0;
  bool rejected_ = false, held_ = false, combined_ = false, initialized_ = false;
  const float* weights_ = nullptr;
  std::exception_ptr pending_;       // a call refused on the host, not yet reported (CUDA)
  std::exception_ptr local_failure_; // host streams: this rank's failure in the last pack
  std::uint64_t calls_ = 0;
  std::atomic<std::uint64_t> arrived_{0}, failed_call_{0}; // host streams: the last dispatch
  const void* stream_ = nullptr;
  typename stream_type::event_type last_{}; // the end of the last call's work left queued
  std::shared_ptr<detail::layer_life> life_ = std::make_shared<detail::layer_life>();
};

//! The decode exchange on host streams (`host_space`): over `local_world`'s communicators or MPI.
template <communicator Comm, class T>
using decode_exchange = basic_decode_exchange<host_space, Comm, T>;

WEAVE_NAMESPACE_END

#include "weave/overlap/detail/decode_calls.hpp"  // the calls and the view's reads
#include "weave/overlap/detail/decode_phases.hpp" // the phases' steps
