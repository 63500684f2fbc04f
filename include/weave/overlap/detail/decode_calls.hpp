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
    , at_(static_cast<std::size_t>(comm.size()), static_cast<std::size_t>(spd()), options_)
    , table_host_(detail::replica_table(where_, comm.rank())) {
  const auto header = static_cast<std::int64_t>(sizeof(decode_header));
  for (std::int64_t d = 0; d < world(); ++d) {
    dispatch_displs_.push_back(static_cast<std::int64_t>(at_.dispatch.start(d)));
    combine_displs_.push_back(static_cast<std::int64_t>(at_.combine.start(d)));
    dispatch_send_.push_back(d == rank_ ? header
                                        : static_cast<std::int64_t>(at_.dispatch.room_bytes()));
    combine_send_.push_back(d == rank_ ? header
                                       : static_cast<std::int64_t>(at_.combine.room_bytes()));
  }
  dispatch_recv_ = dispatch_send_;
  combine_recv_ = combine_send_;
  received_.assign(dispatch_send_.size(), 0);
}

template <execution_space Space, decode_communicator<Space> Comm, class T>
basic_decode_exchange<Space, Comm, T>::shape::shape(std::size_t ranks, std::size_t local_slots,
                                                    const decode_options& o)
    : L(local_slots) {
  const std::size_t M = o.max_tokens_per_rank, choices = std::min(std::size_t{1} * o.k, L);
  const std::size_t row = checked_mul(o.hidden, sizeof(T), "row bytes");
  if (o.fp8_dispatch)
    wire = quantized_row_layout::of(o.hidden, o.fp8_dispatch->blocks.block);
  dispatch = detail::decode_wire::dispatch(static_cast<int>(ranks), M, choices,
                                           o.fp8_dispatch ? wire.stride : row, o.partial_sums);
  combine = detail::decode_wire::combine(
      static_cast<int>(ranks), o.partial_sums ? M : checked_mul(M, choices, "pairs"), row);
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
std::size_t basic_decode_exchange<Space, Comm, T>::carve(const decode_options& o, const shape& s,
                                                         basic_decode_exchange* self,
                                                         workspace_carver c) {
  using X = basic_decode_exchange;
  using A = detail::decode_call_arrays;
  const auto set = [&]<class Of, class P>(P* Of::*field, std::size_t count) {
    P* const taken = c.take<P>(count).data();
    if (self == nullptr)
      return;
    if constexpr (std::same_as<Of, A>)
      self->a_.*field = taken;
    else
      self->*field = taken;
  };
  const auto D = static_cast<std::size_t>(s.dispatch.D), L = s.L;
  const std::size_t M = o.max_tokens_per_rank,
                    pairs = checked_mul(M, std::size_t{1} * o.k, "pairs");
  const std::size_t pool = s.pool_rows(), choices = s.dispatch.choices;
  const std::size_t row = o.hidden * sizeof(T);
  const std::size_t buffer = std::max(s.dispatch.buffer_bytes(), s.combine.buffer_bytes());
  // The replica table (`detail::replica_table`: 2E + 1 entries and a slot each), sized for the
  // most experts the slots can hold, so that a layer's size follows from its shape alone.
  set(&X::table_, 3 * D * L + 1);
  // What is read before a call writes it, from `words_` to `a_.block`: zeroed by one fill.
  set(&X::words_, std::size_t{word_count});
  set(&X::kept_, 1);
  set(&X::send_, buffer);
  set(&X::recv_, buffer);
  set(&A::slot_rows, L + 1);
  set(&A::first, L + 1);
  set(&A::source_rows, L * D);
  set(&A::source_first, L * D);
  set(&A::busy, L + 1);
  set(&A::block, L);
  if ((!o.fp8_dispatch || o.fp8_dispatch->dequantized_inputs) && !o.gathered_inputs)
    set(&X::pool_in_, checked_mul(pool, row, "expert rows"));
  set(&X::pool_out_, checked_mul(pool, row, "expert rows"));
  if (o.fp8_dispatch) {
    set(&X::pool_wire_, checked_mul(pool, s.wire.stride, "expert rows"));
    set(&X::bad_token_, 1);
  }
  set(&A::pair_slot, pairs);
  set(&A::pair_pos, pairs);
  set(&A::records, D);
  set(&A::pairs_to, D);
  set(&A::send_index, s.dispatch.rows());
  set(&A::token_rows, pairs);
  set(&A::own_token, M);
  set(&A::arrived, D);
  set(&A::from_peer, pool);
  set(&A::from_own, pool);
  set(&A::own_index, checked_mul(M, choices, "pairs"));
  if (o.partial_sums) {
    set(&A::merge_index, checked_mul(s.combine.rows(), choices, "merge entries"));
    set(&A::merge_weight, checked_mul(s.combine.rows(), choices, "merge entries"));
    set(&A::own_weight, checked_mul(M, choices, "pairs"));
  } else {
    set(&A::return_index, s.combine.rows());
  }
  set(&A::final_rows, pairs);
  if (o.gathered_inputs)
    set(&A::row_ptr, pool);
  set(&X::scratch_, 2 * D + L);
  set(&X::fed_, (L + 63) / 64);
  set(&X::scan_temp_, std::max<std::size_t>(Space::scan_temp_bytes(std::int64_t(L) + 1), 1));
  return c.used();
}

template <execution_space Space, decode_communicator<Space> Comm, class T>
void basic_decode_exchange<Space, Comm, T>::carve_and_initialize(void* workspace, std::size_t bytes,
                                                                 stream_arg s) {
  carve(options_, at_, this, workspace_carver(workspace, bytes));
  Space::copy_from_host(s, table_, table_host_.data(), table_host_.size() * sizeof(std::int32_t));
  const auto end = reinterpret_cast<std::byte*>(a_.block + spd()); // see `carve`
  Space::fill(s, words_, 0, static_cast<std::size_t>(end - reinterpret_cast<std::byte*>(words_)));
  if (bad_token_ != nullptr)
    Space::fill(s, bad_token_, 0xFF, sizeof(std::int64_t));
  // No wait (a first call may be made within the caller's claim of the stream, which a wait would
  // refuse): the upload reads this object's table, so the destructor waits for this event.
  record_unless_idle(static_cast<stream_type&>(s), last_);
  initialized_ = true;
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
      s, [this, x, ids, weights](stream_arg ls) { pack_dispatch(ls, x, ids, weights); },
      [this](stream_arg ls) {
        if constexpr (bounded)
          comm_->all_to_all_v_bounded(ls, send_, dispatch_send_, dispatch_displs_, recv_,
                                      dispatch_recv_, dispatch_displs_,
                                      std::span<std::int64_t>(received_), 1);
        else
          weave::all_to_all_v(*comm_, ls, send_, dispatch_send_, dispatch_displs_, recv_,
                              dispatch_recv_, dispatch_displs_, 1);
      },
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
      [this](stream_arg ls) {
        weave::all_to_all_v(*comm_, ls, send_, combine_send_, combine_displs_, recv_, combine_recv_,
                            combine_displs_, 1);
      },
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
    throw kept.bad_header();
  if (kept.record_claimed != 0)
    throw kept.bad_record(spd());
  WEAVE_EXPECT((flags & decode_bad_message_flag) == 0, errc::size_mismatch,
               "decode_exchange: a peer returned other rows than were sent to it (its dispatch "
               "failed)");
}

// --- what the view reads ---------------------------------------------------------------------

template <execution_space Space, decode_communicator<Space> Comm, class T>
std::span<const T> basic_decode_exchange<Space, Comm, T>::expert_input(int l) const {
  const auto [first, n] = slot(l);
  WEAVE_EXPECT(!options_.gathered_inputs, errc::invalid_state,
               "decode_exchange: with gathered_inputs the experts read input_rows (the rows are "
               "not copied into one block)");
  WEAVE_EXPECT(has_inputs(), errc::invalid_state,
               "decode_exchange: an FP8 dispatch without dequantized_inputs delivers codes and "
               "scales only (input_codes, input_scales)");
  const std::size_t H = options_.hidden;
  if (n == 1 && a_.block[l] != nullptr) // a peer's one row, where it arrived
    return {reinterpret_cast<const T*>(a_.block[l]), H};
  return {pool_in() + first * H, n * H};
}

template <execution_space Space, decode_communicator<Space> Comm, class T>
std::span<const T* const> basic_decode_exchange<Space, Comm, T>::expert_input_rows(int l) const {
  const auto [first, n] = slot(l);
  WEAVE_EXPECT(options_.gathered_inputs, errc::invalid_state,
               "decode_exchange: input_rows needs decode_options::gathered_inputs (read input)");
  // Each entry is a row's address; held as `const std::byte*`, read as `const T*`.
  return {reinterpret_cast<const T* const*>(a_.row_ptr) + first, n};
}

template <execution_space Space, decode_communicator<Space> Comm, class T>
auto basic_decode_exchange<Space, Comm, T>::expert_wire(int l) const
    -> std::pair<const_token_view, const_token_view> {
  const auto [first, n] = slot(l);
  WEAVE_EXPECT(options_.fp8_dispatch.has_value(), errc::invalid_state,
               "decode_exchange: codes and scales exist with an FP8 dispatch only");
  const auto [codes, scales] = wire_views(pool_wire_ + first * at_.wire.stride, n);
  return {codes, scales};
}

WEAVE_NAMESPACE_END
