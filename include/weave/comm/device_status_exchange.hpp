//! \file
//! `device_counts_with_status<Space>`: the status-carrying count exchange (see
//! `status_exchange.hpp`) for algorithms whose counts live in memory of an execution space,
//! as the device exchange's do.
//!
//! Beside its count for every peer, each rank sends its status, built where the data is:
//! - a failure its stream holds (host space), or a call it rejected on the host (`fail_call`),
//!   as a `failure_record`;
//! - else the error flags its device steps set before the exchange (bad expert ids, non-finite
//!   weights, an overflowing static slot), which the receiver turns into a record with the
//!   owner's `describe`;
//! - else nothing.
//! With dynamic shapes (`raise_flags`) every rank fails at the exchange of the chunk where a
//! rank failed: on host streams there, with CUDA where the host reads the counts (`raise`).
//! With static shapes nothing waits on the host: flagged failures of peers are reported by
//! `check_peers` (the owner's `check_errors`), failures on host streams fail the streams.
#pragma once

#include "weave/comm/communicator.hpp"
#include "weave/comm/fail_stop.hpp"
#include "weave/comm/status_exchange.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/failure.hpp"
#include "weave/exec/space.hpp"

#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <span>
#include <string>
#include <utility>
#include <vector>

WEAVE_NAMESPACE_BEGIN

namespace detail {

// A status word with this bit carries device flags (in the next word), not a failure record.
inline constexpr std::int64_t device_flags_status = std::int64_t{1} << 17;
inline constexpr std::size_t status_stride = 1 + failure_words; // per peer: a count, the status

// Per peer j: its count, then this rank's status (a reported record, else its flags).
struct pack_status_step {
  const std::int64_t* counts;
  const std::uint32_t *flags_low, *flags_high; // either may be null
  const std::int64_t* reported;                // failure_words, or null
  std::int64_t flags_tag;                      // (rank + 1) << 32 | device_flags_status
  std::int64_t* send;

  WEAVE_HOST_DEVICE void operator()(std::int64_t j) const {
    std::int64_t* block = send + j * static_cast<std::int64_t>(status_stride);
    block[0] = counts[j];
    const std::uint32_t flags =
        (flags_low ? *flags_low : 0u) | (flags_high ? *flags_high << 16 : 0u);
    for (std::size_t i = 0; i < failure_words; ++i)
      block[1 + i] = reported ? reported[i] : 0;
    if (!reported && flags != 0) {
      block[1] = flags_tag;
      block[2] = static_cast<std::int64_t>(flags);
    }
  }
};

// Per peer j: the count it sent.
struct unpack_counts_step {
  const std::int64_t* recv;
  std::int64_t* counts;
  WEAVE_HOST_DEVICE void operator()(std::int64_t j) const {
    counts[j] = recv[j * static_cast<std::int64_t>(status_stride)];
  }
};

} // namespace detail

//! The count exchange of an algorithm in `Space`, carrying each rank's status (see the file
//! comment). Its buffers are carved from the owner's workspace (`carve`).
template <execution_space Space>
class device_counts_with_status {
 public:
  using stream_arg = typename Space::stream_arg;
  //! Names what the flags `flags` of rank `rank` mean (e.g. by calling the thrower of the step
  //! that set them inside `record_of_call`).
  using describe_fn = std::function<failure_record(int rank, std::uint32_t flags)>;

  device_counts_with_status() = default;

  //! For rank `rank` of `ranks`, `slots` exchanges in flight at once; `raise_flags`: fail every
  //! rank at the exchange when a rank's flags are set (dynamic shapes); `what` names the owner
  //! in peers' errors.
  device_counts_with_status(int ranks, int rank, std::size_t slots, bool raise_flags,
                            std::string what, describe_fn describe)
      : ranks_(ranks)
      , rank_(rank)
      , raise_flags_(raise_flags)
      , what_(std::move(what))
      , describe_(std::move(describe))
      , protocol_(slots)
      , slots_(slots)
      , reported_host_(failure_words, 0) {
    for (slot& s : slots_)
      s.host.assign(words(), 0);
  }

  //! Carves the buffers: `set(pointer, count)` as in `carve_into`.
  template <class Set>
  void carve(Set&& set) const {
    for (const slot& s : slots_) {
      set(s.send, words());
      set(s.recv, words());
    }
    set(reported_, failure_words);
  }

  //! Enqueues on `s` the exchange of `counts` (one per peer, memory of the space) into
  //! `recv_counts`, and of every rank's status; this rank's flags are the words at `flags_low`
  //! (bits 0-15) and `flags_high` (bits 16-31), either may be null.
  template <communicator Comm>
  void exchange(Comm& comm, stream_arg s, std::size_t slot_index, const std::int64_t* counts,
                std::int64_t* recv_counts, const std::uint32_t* flags_low,
                const std::uint32_t* flags_high) {
    slot* sl = &slots_.at(slot_index);
    const auto D = static_cast<std::int64_t>(ranks_);
    const std::span<const std::int64_t> send(sl->send, words());
    const std::span<std::int64_t> recv(sl->recv, words());
    if constexpr (Space::runs_later) { // host streams: the protocol of `counts_with_status`
      const auto pack = [=, this](const std::exception_ptr& pending) {
        const failure_record record = pending ? record_of(pending, rank_) : failure_record{};
        std::int64_t words_of[failure_words];
        encode_failure(pending ? &record : nullptr, words_of);
        const detail::pack_status_step step{
            counts, flags_low, flags_high, pending ? words_of : nullptr, flags_tag(), sl->send};
        for (std::int64_t j = 0; j < D; ++j)
          step(j);
      };
      const auto decide = [=, this](std::exception_ptr own) {
        for (std::int64_t j = 0; j < D; ++j)
          detail::unpack_counts_step{sl->recv, recv_counts}(j);
        return own ? own : failure_in(std::span<const std::int64_t>(sl->recv, words()), true);
      };
      if constexpr (has_deferred_exchange_counts<Comm>) // one task, as the plain exchange
        protocol_.enqueue_deferred(s, pack, comm.deferred_exchange_counts(send, recv), decide);
      else
        protocol_.enqueue(
            s, slot_index, pack, [&] { comm.exchange_counts(s, send, recv); }, decide);
    } else {
      if (reporting_)
        Space::copy_from_host(s, reported_, reported_host_.data(),
                              failure_words * sizeof(std::int64_t));
      Space::for_each(s, D,
                      detail::pack_status_step{counts, flags_low, flags_high,
                                               reporting_ ? reported_ : nullptr, flags_tag(),
                                               sl->send});
      comm.exchange_counts(s, send, recv);
      Space::for_each(s, D, detail::unpack_counts_step{sl->recv, recv_counts});
      if (raise_flags_)
        Space::copy_to_host(s, sl->host.data(), sl->recv, words() * sizeof(std::int64_t));
    }
  }

  //! Dynamic shapes, on the host once the stream passed slot `slot_index`'s exchange (CUDA:
  //! inside `on_host`): throws this rank's flagged error, or a `peer_error` for a peer's
  //! failure. Host streams decide on the stream instead: a no-op there.
  void raise(std::size_t slot_index) const {
    if constexpr (!Space::runs_later)
      if (std::exception_ptr f =
              failure_in(std::span<const std::int64_t>(slots_.at(slot_index).host), true))
        std::rethrow_exception(f);
  }

  //! Waits for `s` (through `comm`) after reading the statuses every exchange received since
  //! the last check, clears them, and throws a `peer_error` for a peer's failure among them
  //! (static shapes report flagged failures of peers only here).
  template <communicator Comm>
  void check_peers(Comm& comm, stream_arg s) {
    for (slot& sl : slots_) {
      Space::copy_to_host(s, sl.host.data(), sl.recv, words() * sizeof(std::int64_t));
      Space::fill(s, sl.recv, 0, words() * sizeof(std::int64_t));
    }
    wait_watched(comm, s);
    for (const slot& sl : slots_)
      if (std::exception_ptr f = failure_in(std::span<const std::int64_t>(sl.host), false))
        std::rethrow_exception(f);
  }

  //! A call rejected on the host (bad arguments) still takes its turn: `run()` enqueues the call
  //! with no tokens; its exchanges carry `failure` to the peers, who fail as at any other
  //! failure (host streams: see `enqueue_failed_call`). Whatever `run` throws is dropped: the
  //! caller rethrows `failure`.
  template <communicator Comm, class Run>
  void fail_call(Comm& comm, stream_arg compute, stream_arg comm_stream,
                 const std::exception_ptr& failure, Run&& run) {
    try {
      if constexpr (Space::runs_later) {
        enqueue_failed_call(comm, compute, comm_stream, failure, std::forward<Run>(run));
      } else {
        const failure_record record = record_of(failure, rank_);
        encode_failure(&record, reported_host_);
        reporting_ = true;
        std::forward<Run>(run)();
      }
    } catch (...) {
    }
    reporting_ = false;
  }

 private:
  struct slot {
    std::int64_t *send = nullptr, *recv = nullptr; // memory of the space, from the workspace
    std::vector<std::int64_t> host;                // what the host read of `recv`
  };

  std::size_t words() const noexcept {
    return static_cast<std::size_t>(ranks_) * detail::status_stride;
  }
  std::int64_t flags_tag() const noexcept {
    return (static_cast<std::int64_t>(rank_) + 1) << 32 | detail::device_flags_status;
  }

  // The failure a received block reports: this rank's own (when `own`), else the lowest failing
  // peer's. Flags count only with raise_flags_ or outside an exchange (`!own`).
  std::exception_ptr failure_in(std::span<const std::int64_t> received, bool own) const {
    const auto status = [&](int r) {
      return received.subspan(static_cast<std::size_t>(r) * detail::status_stride + 1,
                              failure_words);
    };
    const auto flagged = [](std::span<const std::int64_t> w) {
      return (w[0] & detail::device_flags_status) != 0;
    };
    const auto describe = [&](int r, std::span<const std::int64_t> w) {
      return flagged(w) ? describe_(r, static_cast<std::uint32_t>(w[1]))
                        : detail::decode_status(r, w);
    };
    // This rank's own status: its flags where they count, or a call it rejected (which must stop
    // it at this exchange as it stops its peers).
    const std::span<const std::int64_t> mine = status(rank_);
    if (own && mine[0] != 0 && (raise_flags_ || !flagged(mine))) {
      const failure_record r = describe(rank_, mine);
      return std::make_exception_ptr(error(r.code, r.message));
    }
    // Peers: failure records always; flags where they count.
    const bool flags_count = raise_flags_ || !own;
    return detail::peer_failure_in(
        received, 1, ranks_, rank_, what_ + " count exchange", describe,
        [&](std::span<const std::int64_t> w) { return flags_count || !flagged(w); });
  }

  int ranks_ = 0, rank_ = 0;
  bool raise_flags_ = false, reporting_ = false;
  std::string what_;
  describe_fn describe_;
  detail::status_protocol protocol_;
  std::vector<slot> slots_;
  std::int64_t* reported_ = nullptr; // a rejected call's record, memory of the space
  std::vector<std::int64_t> reported_host_;
};

WEAVE_NAMESPACE_END
