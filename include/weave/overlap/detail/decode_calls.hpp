//! \file
//! `basic_decode_exchange`'s calls, out of the class: construction and workspace, `dispatch`,
//! `combine`, the waits and errors, and what the expert view reads. Included by
//! `decode_exchange.hpp`.
#pragma once

#include "weave/core/retain.hpp"
#include "weave/overlap/decode_exchange.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <utility>

WEAVE_NAMESPACE_BEGIN

template <execution_space Space, decode_communicator<Space> Comm, class T>
basic_decode_exchange<Space, Comm, T>::basic_decode_exchange(Comm& comm, placement where,
                                                             decode_options options)
    : comm_(&comm)
    , abandoned_(abandoned_flag_of(comm))
    , serial_(detail::agree_on_decode(comm, where, options, dtype_of_v<T>, "decode_exchange"))
    , where_(std::move(where))
    , options_(options)
    , rank_(comm.rank())
    , table_host_(detail::replica_table(where_, comm.rank())) {
  const auto D = static_cast<std::size_t>(comm.size());
  const std::size_t M = options_.max_tokens_per_rank;
  const std::size_t choices =
      std::min(static_cast<std::size_t>(options_.k), static_cast<std::size_t>(spd()));
  if (options_.fp8_dispatch)
    wire_ = quantized_row_layout::of(options_.hidden, options_.fp8_dispatch->blocks.block);
  const std::size_t row = checked_mul(options_.hidden, sizeof(T), "row bytes");
  dispatch_at_ = detail::decode_wire::dispatch(
      comm.size(), M, choices, options_.fp8_dispatch ? wire_.stride : row, options_.partial_sums);
  combine_at_ = detail::decode_wire::combine(
      comm.size(), options_.partial_sums ? M : checked_mul(M, choices, "pairs"), row);
  const auto own = static_cast<std::size_t>(rank_);
  for (std::size_t d = 0; d < D; ++d) {
    const auto header = static_cast<std::int64_t>(sizeof(decode_header));
    dispatch_displs_.push_back(static_cast<std::int64_t>(dispatch_at_.start(d)));
    combine_displs_.push_back(static_cast<std::int64_t>(combine_at_.start(d)));
    dispatch_send_.push_back(d == own ? header
                                      : static_cast<std::int64_t>(dispatch_at_.room_bytes()));
    combine_send_.push_back(d == own ? header
                                     : static_cast<std::int64_t>(combine_at_.room_bytes()));
  }
  dispatch_recv_ = dispatch_send_;
  combine_recv_ = combine_send_;
  received_.assign(D, 0);
  for (int l = 0; l < spd(); ++l)
    local_experts_.push_back(where_.expert_of_slot(rank_ * spd() + l));
}

template <execution_space Space, decode_communicator<Space> Comm, class T>
basic_decode_exchange<Space, Comm, T>::~basic_decode_exchange() {
  if (held_ && !combined_ && !communicator_aborted(*comm_) &&
      failed_call_.load(std::memory_order_acquire) != calls_)
    try {
      abort_peers(*comm_,
                  std::make_exception_ptr(
                      error(errc::invalid_state,
                            "a decode_exchange was destroyed between a dispatch and its combine")));
    } catch (...) {
    }
  detail::wait_at_end(last_);
  life_->alive.store(false, std::memory_order_release);
  if (abandoned(abandoned_)) // MPI may still write into the messages (until MPI_Finalize)
    detail::retain_value_until_exit(std::move(owned_));
}

template <execution_space Space, decode_communicator<Space> Comm, class T>
template <class Self>
workspace_carver& basic_decode_exchange<Space, Comm, T>::carve(Self& self, workspace_carver& c) {
  const auto set = carve_into<Self>(c);
  const decode_options& o = self.options_;
  const auto D = static_cast<std::size_t>(self.dispatch_at_.D);
  const auto L = static_cast<std::size_t>(self.spd());
  const std::size_t M = o.max_tokens_per_rank,
                    pairs = checked_mul(M, std::size_t{1} * o.k, "pairs");
  const std::size_t pool = self.pool_rows(), choices = self.dispatch_at_.choices;
  const detail::decode_call_arrays& a = self.a_;
  // The replica table (`detail::replica_table`: 2E + 1 entries and a slot each), sized for the
  // most experts the slots can hold, so that a layer's size follows from its shape alone.
  set(self.table_, 3 * D * L + 1);
  set(self.words_, std::size_t{word_count});
  set(self.kept_, 1);
  set(self.send_, self.buffer_bytes());
  set(self.recv_, self.buffer_bytes());
  if (self.has_inputs() && !o.gathered_inputs)
    set(self.pool_in_, checked_mul(pool, self.row_bytes(), "expert rows"));
  set(self.pool_out_, checked_mul(pool, self.row_bytes(), "expert rows"));
  if (o.fp8_dispatch) {
    set(self.pool_wire_, checked_mul(pool, self.wire_.stride, "expert rows"));
    set(self.bad_token_, 1);
  }
  set(a.pair_slot, pairs);
  set(a.pair_pos, pairs);
  set(a.records, D);
  set(a.pairs_to, D);
  set(a.send_index, self.dispatch_at_.rows());
  set(a.token_rows, pairs);
  set(a.own_token, M);
  set(a.arrived, D);
  set(a.slot_rows, L + 1);
  set(a.first, L + 1);
  set(a.source_rows, L * D);
  set(a.source_first, L * D);
  set(a.busy, L + 1);
  set(a.from_peer, pool);
  set(a.from_own, pool);
  set(a.own_index, checked_mul(M, choices, "pairs"));
  if (o.partial_sums) {
    set(a.merge_index, checked_mul(self.combine_at_.rows(), choices, "merge entries"));
    set(a.merge_weight, checked_mul(self.combine_at_.rows(), choices, "merge entries"));
    set(a.own_weight, checked_mul(M, choices, "pairs"));
  } else {
    set(a.return_index, self.combine_at_.rows());
  }
  set(a.final_rows, pairs);
  if (o.gathered_inputs)
    set(a.row_ptr, pool);
  set(a.block, L);
  set(self.scratch_, 2 * D + L);
  set(self.fed_, (L + 63) / 64);
  set(self.scan_temp_,
      std::max<std::size_t>(Space::scan_temp_bytes(static_cast<std::int64_t>(L) + 1), 1));
  return c;
}

template <execution_space Space, decode_communicator<Space> Comm, class T>
std::size_t basic_decode_exchange<Space, Comm, T>::workspace_size(std::size_t ranks,
                                                                  std::size_t local_experts,
                                                                  const decode_options& o) {
  // The carving of a layer of that shape, without its communicator: the sizes only.
  struct shape {
    decode_options options_;
    detail::decode_wire dispatch_at_, combine_at_;
    quantized_row_layout wire_;
    std::vector<std::int32_t> table_host_;
    std::size_t L;
    detail::decode_call_arrays a_;
    std::int32_t* table_ = nullptr;
    std::uint32_t* words_ = nullptr;
    detail::decode_kept* kept_ = nullptr;
    std::byte *send_ = nullptr, *recv_ = nullptr, *pool_in_ = nullptr, *pool_out_ = nullptr,
              *pool_wire_ = nullptr;
    std::int64_t *bad_token_ = nullptr, *scratch_ = nullptr;
    std::uint64_t* fed_ = nullptr;
    std::byte* scan_temp_ = nullptr;
    std::int64_t spd() const { return static_cast<std::int64_t>(L); }
    bool has_inputs() const {
      return !options_.fp8_dispatch || options_.fp8_dispatch->dequantized_inputs;
    }
    std::size_t row_bytes() const { return options_.hidden * sizeof(T); }
    std::size_t pool_rows() const {
      return static_cast<std::size_t>(dispatch_at_.D * dispatch_at_.M * dispatch_at_.choices);
    }
    std::size_t buffer_bytes() const {
      return std::max(dispatch_at_.buffer_bytes(), combine_at_.buffer_bytes());
    }
  };
  const shape s = [&] {
    shape x;
    x.options_ = o;
    x.L = local_experts;
    const std::size_t choices = std::min(static_cast<std::size_t>(o.k), local_experts);
    if (o.fp8_dispatch)
      x.wire_ = quantized_row_layout::of(o.hidden, o.fp8_dispatch->blocks.block);
    const std::size_t row = checked_mul(o.hidden, sizeof(T), "row bytes");
    x.dispatch_at_ =
        detail::decode_wire::dispatch(static_cast<int>(ranks), o.max_tokens_per_rank, choices,
                                      o.fp8_dispatch ? x.wire_.stride : row, o.partial_sums);
    x.combine_at_ = detail::decode_wire::combine(
        static_cast<int>(ranks),
        o.partial_sums ? o.max_tokens_per_rank
                       : checked_mul(o.max_tokens_per_rank, choices, "pairs"),
        row);
    return x;
  }();
  workspace_carver measure;
  return basic_decode_exchange::carve(s, measure).used();
}

template <execution_space Space, decode_communicator<Space> Comm, class T>
void basic_decode_exchange<Space, Comm, T>::initialize(void* workspace, std::size_t bytes,
                                                       stream_arg stream) {
  WEAVE_EXPECT(workspace != nullptr, errc::invalid_argument, "null workspace");
  WEAVE_EXPECT(!held_, errc::invalid_state, "decode_exchange::initialize with a handle alive");
  if (workspace != owned_.data())
    owned_.release(&static_cast<stream_type&>(stream));
  carve_and_initialize(workspace, bytes, stream);
}

template <execution_space Space, decode_communicator<Space> Comm, class T>
void basic_decode_exchange<Space, Comm, T>::carve_and_initialize(void* workspace, std::size_t bytes,
                                                                 stream_arg s) {
  workspace_carver carver(workspace, bytes);
  carve(*this, carver);
  const auto L = static_cast<std::size_t>(spd()), D = static_cast<std::size_t>(world());
  Space::copy_from_host(s, table_, table_host_.data(), table_host_.size() * sizeof(std::int32_t));
  Space::fill(s, words_, 0, word_count * sizeof(std::uint32_t));
  Space::fill(s, kept_, 0, sizeof(detail::decode_kept));
  Space::fill(s, send_, 0, buffer_bytes());
  Space::fill(s, recv_, 0, buffer_bytes());
  Space::fill(s, a_.slot_rows, 0, (L + 1) * sizeof(std::int64_t));
  Space::fill(s, a_.first, 0, (L + 1) * sizeof(std::int64_t));
  Space::fill(s, a_.source_rows, 0, L * D * sizeof(std::int64_t));
  Space::fill(s, a_.source_first, 0, L * D * sizeof(std::int64_t));
  Space::fill(s, a_.busy, 0, (L + 1) * sizeof(std::int64_t));
  Space::fill(s, a_.block, 0, L * sizeof(void*));
  if (bad_token_ != nullptr)
    Space::fill(s, bad_token_, 0xFF, sizeof(std::int64_t));
  // No wait: the upload reads this object's table, which outlives the work queued (and a first
  // call may be made within the caller's claim of the stream, which a wait would refuse).
  initialized_ = true;
}

template <execution_space Space, decode_communicator<Space> Comm, class T>
void basic_decode_exchange<Space, Comm, T>::ensure_initialized(stream_arg s) {
  if (initialized_)
    return;
  const std::size_t bytes = workspace_size();
  owned_.replace(allocator_, bytes, s);
  carve_and_initialize(owned_.data(), bytes, s);
}

template <execution_space Space, decode_communicator<Space> Comm, class T>
void basic_decode_exchange<Space, Comm, T>::begin_call(stream_arg s, bool dispatching) {
  WEAVE_EXPECT(!dispatching || !held_, errc::invalid_state,
               "decode_exchange: a handle is alive; combine it (or release it) first");
  const void* id = &static_cast<stream_type&>(s);
  if constexpr (requires { s.get(); })
    id = static_cast<const void*>(s.get());
  if (stream_ == nullptr)
    stream_ = id;
  WEAVE_EXPECT(stream_ == id, errc::invalid_argument,
               "decode_exchange: every call runs on the stream of the first call");
  ensure_initialized(s);
}

template <execution_space Space, decode_communicator<Space> Comm, class T>
auto basic_decode_exchange<Space, Comm, T>::dispatch(std::span<const T> x,
                                                     std::span<const std::int32_t> ids,
                                                     std::span<const float> weights, stream_arg s)
    -> handle {
  begin_call(s, true);
  const std::uint64_t call = ++calls_; // tasks of several calls may be queued at once
  held_ = true;
  combined_ = false;
  issue(
      s, [this, x, ids, weights, call](stream_arg ls) { pack_dispatch(ls, x, ids, weights, call); },
      [this](stream_arg ls) { exchange_dispatch(ls); },
      [this, call](stream_arg ls) { unpack_dispatch(ls, call); });
  return handle(this, call, life_);
}

template <execution_space Space, decode_communicator<Space> Comm, class T>
void basic_decode_exchange<Space, Comm, T>::combine(handle& h, std::span<T> y, stream_arg s) {
  WEAVE_EXPECT(h.ex_ == this, errc::invalid_argument,
               "decode_exchange::combine: a handle of another exchange (or an empty one)");
  begin_call(s, false);
  combined_ = true;
  issue(
      s, [this, y, call = h.call_](stream_arg ls) { pack_combine(ls, y, call); },
      [this](stream_arg ls) { exchange_combine(ls); },
      [this, y](stream_arg ls) { unpack_combine(ls, y); });
  h.reset();
}

template <execution_space Space, decode_communicator<Space> Comm, class T>
template <class Pack, class Exchange, class Unpack>
void basic_decode_exchange<Space, Comm, T>::issue(stream_arg s, Pack&& pack, Exchange&& exchange,
                                                  Unpack&& unpack) {
  bool done = false;
  {
    const auto claim = claim_if_idle(static_cast<stream_type&>(s));
    Space::launch(s, std::forward<Pack>(pack));
    exchange(s); // from here: the communicator orders it in the stream (not a step of a task)
    Space::launch(s, std::forward<Unpack>(unpack));
    done = claim.all_ran_here();
  }
  bool capturing = false;
  if constexpr (requires { Space::is_capturing(s); })
    capturing = Space::is_capturing(s);
  if (!done && !capturing) // captured work runs when the graph is launched
    record_unless_idle(static_cast<stream_type&>(s), last_);
}

template <execution_space Space, decode_communicator<Space> Comm, class T>
void basic_decode_exchange<Space, Comm, T>::release_handle(std::uint64_t call) noexcept {
  if (held_ && !combined_ && failed_call_.load(std::memory_order_acquire) != call)
    if constexpr (requires { comm_->abort(std::string()); })
      comm_->abort("a decode_exchange handle was released without its combine");
  held_ = false;
}

template <execution_space Space, decode_communicator<Space> Comm, class T>
void basic_decode_exchange<Space, Comm, T>::synchronize(stream_arg s) {
  check_errors(s); // on host streams its wait rethrows a failed call's error first
}

template <execution_space Space, decode_communicator<Space> Comm, class T>
void basic_decode_exchange<Space, Comm, T>::check_errors(stream_arg stream) {
  if (!initialized_)
    return; // no call yet
  std::uint32_t flags = 0;
  detail::decode_kept kept;
  if constexpr (exact) { // host memory: read once the stream has run (no steps to enqueue)
    wait_watched(*comm_, stream);
    flags = std::exchange(words_[sticky_error], 0u);
    kept = std::exchange(*kept_, detail::decode_kept{});
  } else { // copied into pinned memory on CUDA: the host blocks only in the watched wait
    take_error_word<Space>(stream, &checked_.data()->flags, words_ + sticky_error);
    Space::copy_to_host(stream, &checked_.data()->kept, kept_, sizeof(detail::decode_kept));
    Space::fill(stream, kept_, 0, sizeof(detail::decode_kept));
    wait_watched(*comm_, stream);
    flags = checked_.data()->flags;
    kept = checked_.data()->kept;
  }
  if (pending_)
    std::rethrow_exception(std::exchange(pending_, nullptr));
  throw_flagged(flags);
  if (kept.peer_claimed != 0)
    throw peer_error(peer_record(kept.peer), "decode_exchange");
  if (kept.bad_claimed != 0)
    WEAVE_THROW(errc::protocol, "decode_exchange: rank ", kept.bad_sender,
                " sent a header no weave rank writes (",
                detail::describe_header_fault(static_cast<decode_header_fault>(kept.bad_fault),
                                              kept.bad, kept.bad_limit),
                ")");
  if (kept.record_claimed != 0)
    throw detail::bad_decode_record("decode_exchange", static_cast<std::size_t>(kept.record_sender),
                                    static_cast<std::size_t>(kept.record),
                                    static_cast<std::size_t>(kept.record_choice), kept.record_value,
                                    static_cast<std::size_t>(spd()));
  WEAVE_EXPECT((flags & decode_bad_message_flag) == 0, errc::size_mismatch,
               "decode_exchange: a peer returned other rows than were sent to it (its dispatch "
               "failed)");
}

template <execution_space Space, decode_communicator<Space> Comm, class T>
decode_header basic_decode_exchange<Space, Comm, T>::reject(std::exception_ptr failure) {
  const failure_record r = record_of(failure, rank_);
  if (!pending_)
    pending_ = std::move(failure);
  return detail::failed_header(rank_, r.code, r.message);
}

template <execution_space Space, decode_communicator<Space> Comm, class T>
void basic_decode_exchange<Space, Comm, T>::throw_flagged(std::uint32_t flags) const {
  device_dispatch_plan<Space>::throw_plan_errors(flags & 0xFFu, where_.num_experts());
  WEAVE_EXPECT((flags & decode_nonfinite_flag) == 0, errc::invalid_argument,
               "a token holds a NaN or an infinity: the FP8 dispatch "
               "(decode_options::fp8_dispatch) cannot scale it, and the call failed");
}

template <execution_space Space, decode_communicator<Space> Comm, class T>
failure_record basic_decode_exchange<Space, Comm, T>::peer_record(const decode_header& h) const {
  const std::size_t n = ::strnlen(h.cause, sizeof h.cause);
  if (n > 0 || h.flags == 0)
    return {h.source, static_cast<errc>(h.code), true, std::string(h.cause, n)};
  return record_of_call(h.source, [&] { throw_flagged(static_cast<std::uint32_t>(h.flags)); });
}

// --- what the view reads ---------------------------------------------------------------------

template <execution_space Space, decode_communicator<Space> Comm, class T>
void basic_decode_exchange<Space, Comm, T>::expect_arrived(std::uint64_t call) const {
  if constexpr (exact)
    WEAVE_EXPECT(arrived_.load(std::memory_order_acquire) == call, errc::invalid_state,
                 "decode_exchange: the dispatch has not run (read the expert rows in a task "
                 "enqueued after it, or after synchronizing its stream), or it failed, or its "
                 "combine has been issued");
  else
    (void)call;
}

template <execution_space Space, decode_communicator<Space> Comm, class T>
void basic_decode_exchange<Space, Comm, T>::check_local(int l) const {
  WEAVE_EXPECT(l >= 0 && l < spd(), errc::out_of_range, "local slot ", l, " outside [0, ", spd(),
               ")");
}

template <execution_space Space, decode_communicator<Space> Comm, class T>
void basic_decode_exchange<Space, Comm, T>::check_source(int source) const {
  WEAVE_EXPECT(source >= 0 && source < world(), errc::out_of_range, "source rank ", source,
               " outside [0, ", world(), ")");
}

template <execution_space Space, decode_communicator<Space> Comm, class T>
int basic_decode_exchange<Space, Comm, T>::expert_of_local(int l) const {
  check_local(l);
  return where_.expert_of_slot(rank_ * where_.slots_per_device() + l);
}

template <execution_space Space, decode_communicator<Space> Comm, class T>
std::span<const T> basic_decode_exchange<Space, Comm, T>::expert_input(int l) const {
  check_local(l);
  WEAVE_EXPECT(!options_.gathered_inputs, errc::invalid_state,
               "decode_exchange: with gathered_inputs the experts read input_rows (the rows are "
               "not copied into one block)");
  WEAVE_EXPECT(has_inputs(), errc::invalid_state,
               "decode_exchange: an FP8 dispatch without dequantized_inputs delivers codes and "
               "scales only (input_codes, input_scales)");
  const auto n = static_cast<std::size_t>(a_.slot_rows[l]);
  const std::size_t H = options_.hidden;
  if (n == 1 && a_.block[l] != nullptr) // a peer's one row, where it arrived
    return {reinterpret_cast<const T*>(a_.block[l]), H};
  return {reinterpret_cast<const T*>(pool_in_) + static_cast<std::size_t>(a_.first[l]) * H, n * H};
}

template <execution_space Space, decode_communicator<Space> Comm, class T>
std::span<const T* const> basic_decode_exchange<Space, Comm, T>::expert_input_rows(int l) const {
  check_local(l);
  WEAVE_EXPECT(options_.gathered_inputs, errc::invalid_state,
               "decode_exchange: input_rows needs decode_options::gathered_inputs (read input)");
  // Each entry is a row's address; held as `const void*`, read as `const T*`.
  return {reinterpret_cast<const T* const*>(a_.row_ptr) + a_.first[l],
          static_cast<std::size_t>(a_.slot_rows[l])};
}

template <execution_space Space, decode_communicator<Space> Comm, class T>
auto basic_decode_exchange<Space, Comm, T>::expert_wire(int l) const
    -> std::pair<const_token_view, const_token_view> {
  check_local(l);
  WEAVE_EXPECT(options_.fp8_dispatch.has_value(), errc::invalid_state,
               "decode_exchange: codes and scales exist with an FP8 dispatch only");
  const auto [codes, scales] =
      wire_views(pool_wire_ + static_cast<std::size_t>(a_.first[l]) * wire_.stride,
                 static_cast<std::size_t>(a_.slot_rows[l]), wire_.stride);
  return {codes, scales};
}

template <execution_space Space, decode_communicator<Space> Comm, class T>
std::span<T> basic_decode_exchange<Space, Comm, T>::expert_output(int l) const {
  check_local(l);
  const std::size_t H = options_.hidden;
  return {reinterpret_cast<T*>(pool_out_) + static_cast<std::size_t>(a_.first[l]) * H,
          static_cast<std::size_t>(a_.slot_rows[l]) * H};
}

template <execution_space Space, decode_communicator<Space> Comm, class T>
auto basic_decode_exchange<Space, Comm, T>::wire_views(std::byte* p, std::size_t n,
                                                       std::size_t stride) const
    -> std::pair<token_view, token_view> {
  const fp8_dispatch_options& f = *options_.fp8_dispatch;
  const std::size_t scales = wire_.scale_bytes / sizeof(float);
  return {token_view(p, n, options_.hidden, f.format, Space::memory, -1, stride),
          token_view(p + wire_.scale_offset, n, scales, dtype::f32, Space::memory, -1, stride)};
}

WEAVE_NAMESPACE_END
