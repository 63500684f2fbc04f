//! \file
//! `device_call_tags<Space>`: the call check of a collective that has no count exchange of its
//! own (a combine, a backward pass), on communicators whose collectives carry no tag (NCCL, or
//! one of your own: `has_tagged_collectives` is false). Tagged communicators check the tag inside
//! the collective; these cannot, so right before it every rank sends every peer its `call_tag`
//! (one 64-bit word per peer: every rank receives every rank's tag, so all decide alike) and
//! compares what arrived with its own where the data lives:
//! - on host streams the comparison is a task of the stream: a mismatch aborts the communicator
//!   and fails the stream with `errc::call_mismatch` naming both calls, so no rank posts the
//!   collective's data;
//! - where host code runs at enqueue time (CUDA) a step keeps the first mismatch in memory of the
//!   space until the owner's `check_errors` reads it (`take`, then `mismatch`). The collective's
//!   data is posted before anyone reads that verdict: with equal sizes it carries another call's
//!   rows, found at the owner's next check; with other sizes it is NCCL's undefined behaviour (a
//!   truncated receive, which the check reports, or a hang, which the watchdog ends). Unless the
//!   owner asks the host to wait for the tags (`wait_on_host`): then the host reads them (a wait
//!   through the communicator) and fails before it posts the data, as host streams do.
#pragma once

#include "weave/comm/call_tag.hpp"
#include "weave/comm/communicator.hpp"
#include "weave/comm/fail_stop.hpp"
#include "weave/core/config.hpp"
#include "weave/exec/host_mirror.hpp"
#include "weave/exec/space.hpp"

#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <string>
#include <utility>

WEAVE_NAMESPACE_BEGIN

//! One tag exchange's buffers (memory of the space, carved from the owner's workspace): the tag
//! sent to each peer, the tags received, and the first mismatch found (peer + 1, its tag, this
//! rank's tag; zero when none), with the host's copy of the last; where the host waits for the
//! tags, its copy of them and the event it waits on.
template <class Space>
struct device_tag_block {
  std::int64_t *send = nullptr, *recv = nullptr, *mismatch = nullptr;
  host_mirror<Space, std::int64_t> host, received;
  typename Space::stream_type::event_type ready{};
};

namespace detail {

inline constexpr std::size_t tag_mismatch_words = 3;

// Per peer j: this rank's tag.
struct fill_call_tag_step {
  std::int64_t* send;
  std::int64_t tag;
  WEAVE_HOST_DEVICE void operator()(std::int64_t j) const { send[j] = tag; }
};

// One thread: the lowest peer whose tag differs from this rank's, unless a mismatch is kept
// already (the first explains the rest: the ranks are out of step from there).
struct check_call_tags_step {
  const std::int64_t* recv;
  std::int64_t* mismatch;
  std::int64_t peers, tag;
  WEAVE_HOST_DEVICE void operator()(std::int64_t) const {
    if (mismatch[0] != 0)
      return;
    for (std::int64_t j = 0; j < peers; ++j)
      if (recv[j] != tag) {
        mismatch[0] = j + 1;
        mismatch[1] = recv[j];
        mismatch[2] = tag;
        return;
      }
  }
};

} // namespace detail

//! The tag exchanges of an algorithm in `Space` (see the file comment). Constructed disabled
//! (for a communicator with tagged collectives) it carves nothing and issues nothing.
template <execution_space Space>
class device_call_tags {
 public:
  using stream_arg = typename Space::stream_arg;

  //! For rank `rank` of `ranks`; `what` names the owner in errors. `wait_on_host`: where host
  //! code runs at enqueue time, the host reads the tags before the data is posted.
  device_call_tags(int ranks, int rank, bool enabled, std::string what, bool wait_on_host = false)
      : ranks_(ranks)
      , rank_(rank)
      , enabled_(enabled)
      , wait_on_host_(enabled && wait_on_host && !Space::runs_later)
      , what_(std::move(what)) {}

  bool enabled() const noexcept { return enabled_; }

  //! Sizes `b`'s host copy (allocates: at construction of its owner).
  void size_block(device_tag_block<Space>& b) const {
    if (enabled_)
      b.host = host_mirror<Space, std::int64_t>(detail::tag_mismatch_words);
    if (wait_on_host_)
      b.received = host_mirror<Space, std::int64_t>(static_cast<std::size_t>(ranks_));
  }
  //! Carves `b`'s buffers: `set(pointer, count)` as in `carve_into`.
  template <class Set>
  void carve(const device_tag_block<Space>& b, Set&& set) const {
    if (!enabled_)
      return;
    set(b.send, static_cast<std::size_t>(ranks_));
    set(b.recv, static_cast<std::size_t>(ranks_));
    set(b.mismatch, detail::tag_mismatch_words);
  }
  //! Clears `b`'s mismatch (once, after `carve`).
  void initialize(stream_arg s, device_tag_block<Space>& b) const {
    if (enabled_)
      Space::fill(s, b.mismatch, 0, detail::tag_mismatch_words * sizeof(std::int64_t));
  }

  //! Enqueues on `s` the exchange of `tag` through `b` and its check (see the file comment);
  //! where the host waits for the tags, throws `errc::call_mismatch` (after aborting `comm`).
  template <communicator Comm>
  requires has_exchange_counts<Comm>
  void exchange(Comm& comm, typename Space::stream_type& s, device_tag_block<Space>& b,
                call_tag tag) {
    if (!enabled_ || !tag.tagged())
      return;
    const auto D = static_cast<std::int64_t>(ranks_);
    const auto bits = static_cast<std::int64_t>(tag.bits);
    Space::for_each(s, D, detail::fill_call_tag_step{b.send, bits});
    weave::exchange_counts(comm, s,
                           std::span<const std::int64_t>(b.send, static_cast<std::size_t>(D)),
                           std::span<std::int64_t>(b.recv, static_cast<std::size_t>(D)));
    if constexpr (Space::runs_later) {
      Space::on_host(s, [this, &comm, recv = b.recv, tag] { check_on_host(comm, recv, tag); });
    } else if (wait_on_host_) {
      Space::copy_to_host(s, b.received.data(), b.recv, static_cast<std::size_t>(D) * 8);
      s.record(b.ready);
      wait_watched(comm, b.ready);
      check_on_host(comm, b.received.data(), tag);
    } else {
      Space::for_each(s, 1, detail::check_call_tags_step{b.recv, b.mismatch, D, bits});
    }
  }

  //! Enqueues on `s` the copy of `b`'s mismatch to the host, and clears it; `mismatch(b)` reads
  //! the copy once `s` is waited for.
  void take(stream_arg s, device_tag_block<Space>& b) const {
    if (!enabled_)
      return;
    constexpr std::size_t bytes = detail::tag_mismatch_words * sizeof(std::int64_t);
    Space::copy_to_host(s, b.host.data(), b.mismatch, bytes);
    Space::fill(s, b.mismatch, 0, bytes);
  }

  //! An `errc::call_mismatch` error naming both calls if what `take` copied holds a mismatch,
  //! else null.
  std::exception_ptr mismatch(const device_tag_block<Space>& b) const {
    if (!enabled_ || b.host.size() < detail::tag_mismatch_words || b.host[0] == 0)
      return nullptr;
    const std::int64_t peer = b.host[0] - 1;
    return mismatch_error(peer >= 0 && peer < ranks_ ? static_cast<int>(peer) : -1,
                          call_tag{static_cast<std::uint64_t>(b.host[1])},
                          call_tag{static_cast<std::uint64_t>(b.host[2])});
  }

 private:
  // Throws `errc::call_mismatch` for the lowest rank whose tag in `recv` differs from `tag`,
  // after aborting `comm` (the ranks' collectives are out of step from here).
  template <communicator Comm>
  void check_on_host(Comm& comm, const std::int64_t* recv, call_tag tag) const {
    for (int r = 0; r < ranks_; ++r)
      if (recv[r] != static_cast<std::int64_t>(tag.bits)) {
        const std::exception_ptr e =
            mismatch_error(r, call_tag{static_cast<std::uint64_t>(recv[r])}, tag);
        abort_peers(comm, e);
        std::rethrow_exception(e);
      }
  }

  std::exception_ptr mismatch_error(int peer, call_tag theirs, call_tag mine) const {
    return detail::call_mismatch_error((what_ + " call tag exchange").c_str(), rank_, mine, peer,
                                       theirs);
  }

  int ranks_ = 0, rank_ = 0;
  bool enabled_ = false, wait_on_host_ = false;
  std::string what_;
};

WEAVE_NAMESPACE_END
