//! \file
//! `device_counts_with_status<Space>`: the status-carrying count exchange (see
//! `status_exchange.hpp`) for algorithms whose counts live in memory of an execution space,
//! as `basic_moe_exchange`'s do.
//!
//! Beside its count for every peer, each rank sends its status, built where the data is:
//! - a failure its stream holds (host space), or a call it rejected on the host (CUDA: a
//!   record copied to memory of the space, see `report`), as a `failure_record`;
//! - else the error flags its device steps set before the exchange (bad expert ids, non-finite
//!   weights, an overflowing static slot), which the receiver turns into a record with the
//!   owner's `describe`;
//! - else nothing.
//! With dynamic shapes (`raise_flags`) every rank fails at the exchange of the chunk where a
//! rank failed: on host streams there, with CUDA where the host reads the counts (`failure`).
//! With static shapes nothing waits on the host: flagged failures of peers are reported by
//! `peer_failure` after `take` (the owner's `check_errors`), failures on host streams fail the
//! streams.
#pragma once

#include "weave/comm/call_tag.hpp"
#include "weave/comm/communicator.hpp"
#include "weave/comm/fail_stop.hpp"
#include "weave/comm/status_exchange.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/failure.hpp"
#include "weave/exec/host_mirror.hpp"
#include "weave/exec/space.hpp"

#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

WEAVE_NAMESPACE_BEGIN

namespace detail {

// A status word with `device_flags_status` (core/failure.hpp) carries device flags, not a
// failure record: it is exactly (sender + 1) << 32 | device_flags_status, the next word holds the
// flags (non-zero, 32 bits), and every other word is zero.

// The flags of rank `sender`'s flags status `words` (`failure_words`), checked: throws
// `errc::protocol` naming the sender for words no sender writes (another rank in the tag, flags
// of zero, past 32 bits or outside `known`, a word set past the flags).
inline std::uint32_t device_flags_of(std::span<const std::int64_t> words, int sender,
                                     std::uint32_t known) {
  const auto refuse = [&](const auto&... why) {
    WEAVE_THROW(errc::protocol, "rank ", sender,
                " sent a device flags status no weave rank writes (status word ",
                hex(static_cast<std::uint64_t>(words[0])), ", flags ",
                hex(static_cast<std::uint64_t>(words[1])), ": ", why..., ")");
  };
  const std::int64_t tag = (static_cast<std::int64_t>(sender) + 1) << 32 | device_flags_status;
  if (words[0] != tag)
    refuse("not the tag of rank ", sender);
  const auto flags = static_cast<std::uint64_t>(words[1]);
  if (flags == 0 || flags > 0xFFFFFFFFu)
    refuse("flags of zero or wider than 32 bits");
  if ((flags & ~static_cast<std::uint64_t>(known)) != 0)
    refuse("unknown flags ", hex(flags & ~static_cast<std::uint64_t>(known)));
  for (std::size_t i = 2; i < words.size(); ++i)
    if (words[i] != 0)
      refuse("word ", i, " set");
  return static_cast<std::uint32_t>(flags);
}

// The words of one peer's block: its counts (`width`), the call's tag, the status.
WEAVE_HOST_DEVICE constexpr std::int64_t status_block_stride(std::int64_t width) noexcept {
  return width + 1 + static_cast<std::int64_t>(failure_words);
}

// Per peer j: its counts (`width` of them: `counts[j]`, then `second[j]`), the call's tag, then
// this rank's status (a reported record, else its flags).
struct pack_status_step {
  const std::int64_t *counts, *second;         // second: null when width is 1
  const std::uint32_t *flags_low, *flags_high; // either may be null
  const std::int64_t* reported;                // failure_words, or null
  std::int64_t flags_tag;                      // (rank + 1) << 32 | device_flags_status
  std::int64_t* send;
  std::int64_t width;
  std::int64_t call; // the call_tag's bits (0: untagged)

  WEAVE_HOST_DEVICE void operator()(std::int64_t j) const {
    std::int64_t* block = send + j * status_block_stride(width);
    block[0] = counts[j];
    if (width > 1)
      block[1] = second[j];
    block[width] = call;
    std::int64_t* status = block + width + 1;
    const std::uint32_t flags =
        (flags_low ? *flags_low : 0u) | (flags_high ? *flags_high << 16 : 0u);
    for (std::size_t i = 0; i < failure_words; ++i)
      status[i] = reported ? reported[i] : 0;
    if (!reported && flags != 0) {
      status[0] = flags_tag;
      status[1] = static_cast<std::int64_t>(flags);
    }
  }
};

// Per peer j: the counts it sent.
struct unpack_counts_step {
  const std::int64_t* recv;
  std::int64_t *counts, *second; // second: null when width is 1
  std::int64_t width;
  WEAVE_HOST_DEVICE void operator()(std::int64_t j) const {
    const std::int64_t* block = recv + j * status_block_stride(width);
    counts[j] = block[0];
    if (width > 1)
      second[j] = block[1];
  }
};

} // namespace detail

//! The buffers of one status-carrying count exchange of an execution space (one per exchange
//! that may be in flight, e.g. per chunk of a call): per peer a count and a status, sent and
//! received in memory of the space (carved from the owner's workspace), and the host's copy
//! (pinned on CUDA: the host reads it after a wait that goes through the communicator).
template <class Space>
struct device_status_block {
  std::int64_t *send = nullptr, *recv = nullptr;
  host_mirror<Space, std::int64_t> host; // what the host read of `recv`
  std::exception_ptr stashed;            // host streams: this rank's failure while an exchange runs
};

//! The count exchange of an algorithm in `Space`, carrying each rank's status (see the file
//! comment).
template <execution_space Space>
class device_counts_with_status {
 public:
  using stream_arg = typename Space::stream_arg;
  //! Names what the flags `flags` of rank `rank` mean (e.g. by calling the thrower of the step
  //! that set them inside `record_of_call`).
  using describe_fn = std::function<failure_record(int rank, std::uint32_t flags)>;

  //! For rank `rank` of `ranks`; `raise_flags`: fail every rank at the exchange when a rank's
  //! flags are set (dynamic shapes); `what` names the owner in peers' errors; `width`: counts
  //! per peer (1, or 2 for a second count beside the first); `known_flags`: the flags a sender
  //! may set (the low word's bits, and the high word's shifted by 16): others are refused as
  //! `errc::protocol`.
  device_counts_with_status(int ranks, int rank, bool raise_flags, std::string what,
                            describe_fn describe, int width = 1,
                            std::uint32_t known_flags = 0xFFFFFFFFu)
      : ranks_(ranks)
      , rank_(rank)
      , width_(width)
      , raise_flags_(raise_flags)
      , known_flags_(known_flags)
      , what_(std::move(what))
      , describe_(std::move(describe)) {
    WEAVE_EXPECT(width == 1 || width == 2, errc::invalid_argument, "counts per peer = ", width);
  }

  //! 64-bit words of each buffer of a block (and of a reported record: `failure_words`).
  std::size_t words() const noexcept { return static_cast<std::size_t>(ranks_) * stride(); }
  //! Sizes `b`'s host copy (allocates: at construction of its owner); `carve` its buffers.
  void size_block(device_status_block<Space>& b) const {
    b.host = host_mirror<Space, std::int64_t>(words());
  }
  //! Carves `b`'s buffers: `set(pointer, count)` as in `carve_into`.
  template <class Set>
  void carve(const device_status_block<Space>& b, Set&& set) const {
    set(b.send, words());
    set(b.recv, words());
  }

  //! Enqueues on `s` the exchange of `counts` (one per peer, memory of the space) into
  //! `recv_counts`, and of every rank's status, through `b`; this rank's flags are the words at
  //! `flags_low` (bits 0-15) and `flags_high` (bits 16-31), either may be null. `reported`
  //! (memory of the space, `failure_words`, or null): a rejected call's record (see `report`),
  //! sent instead of the flags. With a width of 2, `second` (one per peer) arrives in
  //! `recv_second` too.
  template <communicator Comm>
  void exchange(Comm& comm, stream_arg s, device_status_block<Space>& b, const std::int64_t* counts,
                std::int64_t* recv_counts, const std::uint32_t* flags_low,
                const std::uint32_t* flags_high, const std::int64_t* reported,
                const std::int64_t* second = nullptr, std::int64_t* recv_second = nullptr,
                call_tag tag = {}) {
    WEAVE_EXPECT(width_ == 1 || (second != nullptr && recv_second != nullptr), errc::internal,
                 "a count exchange of two counts per peer without its second counts");
    device_status_block<Space>* block = &b;
    const auto D = static_cast<std::int64_t>(ranks_);
    const std::int64_t w = width_;
    const std::span<const std::int64_t> send(b.send, words());
    const std::span<std::int64_t> recv(b.recv, words());
    if constexpr (Space::runs_later) { // host streams: the protocol of `counts_with_status`
      const auto pack = [=, this](const std::exception_ptr& pending) {
        const failure_record record = pending ? record_of(pending, rank_) : failure_record{};
        std::int64_t words_of[failure_words];
        encode_failure(pending ? &record : nullptr, words_of);
        const detail::pack_status_step step{counts,
                                            second,
                                            flags_low,
                                            flags_high,
                                            pending ? words_of : nullptr,
                                            flags_tag(),
                                            block->send,
                                            w,
                                            static_cast<std::int64_t>(tag.bits)};
        for (std::int64_t j = 0; j < D; ++j)
          step(j);
      };
      const auto decide = [=, this, &comm](std::exception_ptr own) {
        for (std::int64_t j = 0; j < D; ++j)
          detail::unpack_counts_step{block->recv, recv_counts, recv_second, w}(j);
        if (own)
          return own;
        const std::span<const std::int64_t> received(block->recv, words());
        if (std::exception_ptr mismatch = call_mismatch_in(received)) {
          abort_peers(comm, mismatch); // the ranks' collectives are out of step from here
          return mismatch;
        }
        return abort_peers_on_protocol_error(comm, failure_in(received, true));
      };
      if constexpr (has_deferred_exchange_counts<Comm>) // one task, as the plain exchange
        protocol_.enqueue_deferred(s, pack, detail::deferred_counts(comm, send, recv, tag), decide);
      else
        protocol_.enqueue(
            s, &b.stashed, pack, [&] { weave::exchange_counts(comm, s, send, recv, tag); }, decide);
    } else {
      Space::for_each(s, D,
                      detail::pack_status_step{counts, second, flags_low, flags_high, reported,
                                               flags_tag(), b.send, w,
                                               static_cast<std::int64_t>(tag.bits)});
      weave::exchange_counts(comm, s, send, recv, tag);
      Space::for_each(s, D, detail::unpack_counts_step{b.recv, recv_counts, recv_second, w});
      if (raise_flags_)
        Space::copy_to_host(s, b.host.data(), b.recv, words() * sizeof(std::int64_t));
    }
  }

  //! Dynamic shapes, on the host once the stream passed `b`'s exchange (CUDA: inside
  //! `on_host`): this rank's flagged error, or a `peer_error` for a peer's failure, or null.
  //! Host streams decide on the stream instead: always null there.
  std::exception_ptr failure(const device_status_block<Space>& b) const {
    if constexpr (!Space::runs_later) {
      const std::span<const std::int64_t> received(b.host);
      if (std::exception_ptr mismatch = call_mismatch_in(received))
        return mismatch;
      return failure_in(received, true);
    } else {
      (void)b;
      return nullptr;
    }
  }

  //! Enqueues on `s` the copy of what `b` received since the last `take` to the host, and clears
  //! it; `peer_failure(b)` reads the copy once `s` is waited for.
  void take(stream_arg s, device_status_block<Space>& b) const {
    Space::copy_to_host(s, b.host.data(), b.recv, words() * sizeof(std::int64_t));
    Space::fill(s, b.recv, 0, words() * sizeof(std::int64_t));
  }

  //! A `peer_error` for a peer's failure (a record, or flags) in what `take` copied, or null.
  std::exception_ptr peer_failure(const device_status_block<Space>& b) const {
    return failure_in(std::span<const std::int64_t>(b.host), false);
  }

  //! An `errc::call_mismatch` error when a peer's exchange in what `take` (or, with dynamic
  //! shapes, the exchange) copied belongs to another call than this rank's, naming both; else
  //! null. The tag travels in the counts' block itself, so communicators whose collectives carry
  //! no tag (NCCL) are checked too.
  std::exception_ptr call_mismatch(const device_status_block<Space>& b) const {
    return call_mismatch_in(std::span<const std::int64_t>(b.host));
  }

  //! Enqueues on `s` the copy of `failure`'s record (as this rank's) from `host_words` (kept
  //! alive and unchanged until `s` ran the copy) to `device_words` (memory of the space), for
  //! `exchange`'s `reported`: a call rejected on the host still takes its turn, carrying it.
  void report(stream_arg s, const std::exception_ptr& failure, std::span<std::int64_t> host_words,
              std::int64_t* device_words) const {
    const failure_record record = record_of(failure, rank_);
    encode_failure(&record, host_words);
    Space::copy_from_host(s, device_words, host_words.data(), failure_words * sizeof(std::int64_t));
  }

 private:
  std::int64_t flags_tag() const noexcept {
    return (static_cast<std::int64_t>(rank_) + 1) << 32 | detail::device_flags_status;
  }

  // A call_mismatch error for the lowest peer whose block carries another tag than this rank's
  // own (which it sent itself); none when this rank's is untagged (a block not written since
  // `take` cleared it, or a user's own exchange).
  std::exception_ptr call_mismatch_in(std::span<const std::int64_t> received) const {
    const auto tag_of = [&](int r) {
      return call_tag{static_cast<std::uint64_t>(
          received[static_cast<std::size_t>(r) * stride() + static_cast<std::size_t>(width_)])};
    };
    const call_tag mine = tag_of(rank_);
    if (!mine.tagged())
      return nullptr;
    for (int r = 0; r < ranks_; ++r)
      if (tag_of(r) != mine)
        return detail::call_mismatch_error((what_ + " count exchange").c_str(), rank_, mine, r,
                                           tag_of(r));
    return nullptr;
  }

  // The failure a received block reports: this rank's own (when `own`), else the lowest failing
  // peer's. Flags count only with raise_flags_ or outside an exchange (`!own`). A status no
  // sender writes is an `errc::protocol` error naming its sender.
  std::exception_ptr failure_in(std::span<const std::int64_t> received, bool own) const {
    const auto status = [&](int r) {
      return received.subspan(static_cast<std::size_t>(r) * stride() +
                                  static_cast<std::size_t>(width_) + 1,
                              failure_words);
    };
    const auto flagged = [](std::span<const std::int64_t> w) {
      return (w[0] & detail::device_flags_status) != 0;
    };
    const bool flags_count = raise_flags_ || !own;
    // A rank's status: its record, or its flags' where they count (here: `count_flags`).
    const auto describe = [&](int r, std::span<const std::int64_t> w,
                              bool count_flags) -> std::optional<failure_record> {
      if (!flagged(w))
        return decode_failure(w, r, ranks_);
      const std::uint32_t flags = detail::device_flags_of(w, r, known_flags_);
      if (!count_flags)
        return std::nullopt;
      return describe_(r, flags);
    };
    // This rank's own status: its flags where they count, or a call it rejected (which must stop
    // it at this exchange as it stops its peers).
    if (own) {
      std::optional<failure_record> mine;
      try {
        mine = describe(rank_, status(rank_), raise_flags_);
      } catch (...) {
        return std::current_exception();
      }
      if (mine)
        return std::make_exception_ptr(error(mine->code, mine->message));
    }
    return detail::peer_failure_in(
        received, static_cast<std::size_t>(width_) + 1, ranks_, rank_, what_ + " count exchange",
        [&](int r, std::span<const std::int64_t> w) { return describe(r, w, flags_count); });
  }

  std::size_t stride() const noexcept {
    return static_cast<std::size_t>(detail::status_block_stride(width_));
  }

  int ranks_ = 0, rank_ = 0, width_ = 1;
  bool raise_flags_ = false;
  std::uint32_t known_flags_ = 0xFFFFFFFFu;
  std::string what_;
  describe_fn describe_;
  detail::status_protocol protocol_;
};

WEAVE_NAMESPACE_END
