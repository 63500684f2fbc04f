//! \file
//! `counts_with_status`: a count exchange that also carries every rank's health, so a rank
//! that failed before the exchange tells its peers there, in the message they wait for anyway.
//!
//! Beside its k counts per peer, every rank sends its status (`encode_failure`: a status word
//! and the start of the message) to every peer. Every rank then holds every rank's status,
//! so all take the same decision at the same step: all carry on, or all fail together
//! (the failing rank with its own error, its peers with a `peer_error` naming it, its code and
//! its message), and the communicator stays consistent (no collective is left half-joined).
//!
//! Host streams: the status is the stream's pending failure (the work before the exchange
//! failed, e.g. planning a chunk with a bad expert id); the exchange runs even on a failed
//! stream. After a failure the peers already learnt, later exchanges move nothing (every rank
//! skips them alike) until the streams are synchronized. A call rejected before it enqueued
//! anything (bad arguments) still takes its turn, with `enqueue_failed_call`, so the peers learn
//! it at the same exchange.
#pragma once

#include "weave/comm/communicator.hpp"
#include "weave/comm/fail_stop.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/failure.hpp"
#include "weave/exec/stream.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

WEAVE_NAMESPACE_BEGIN

namespace detail {

// The protocol around a status-carrying exchange on a host stream, shared by the host and the
// device (host space) forms: it remembers the last failure every rank learnt, so that later
// exchanges, which every rank skips alike while its stream holds that failure, move nothing.
// `comm.deferred_exchange_counts(send, recv)`, carrying `tag` where the communicator checks tags.
template <class Comm>
auto deferred_counts(Comm& comm, std::span<const std::int64_t> send, std::span<std::int64_t> recv,
                     call_tag tag) {
  if constexpr (has_tagged_collectives<Comm>)
    return comm.deferred_exchange_counts(send, recv, tag);
  else
    return comm.deferred_exchange_counts(send, recv);
}

class status_protocol {
 public:
  status_protocol()
      : agreed_(std::make_shared<agreed_failure>()) {}

  // Enqueues on `s`, as one task: `pack(pending)` (writes this rank's status for the failure
  // `pending`, null when healthy), the exchange (`exchange(failure)`, a deferred count exchange:
  // see `has_deferred_exchange_counts`), and `decide(own)`, which reads what arrived and returns
  // the stream's failure from then on (`own`: this rank's failure, else a peer's, else null). A
  // failure of the exchange itself keeps the earlier cause.
  template <class Stream, class Pack, class Exchange, class Decide>
  void enqueue_deferred(Stream& s, Pack pack, Exchange exchange, Decide decide) {
    s.submit_always([agreed = agreed_, pack = std::move(pack), exchange = std::move(exchange),
                     decide = std::move(decide)](std::exception_ptr pending) mutable {
      if (pending && pending == agreed->get())
        return exchange(pending); // every rank knows it and skips this exchange too
      pack(pending);
      std::exception_ptr failed;
      try {
        exchange(nullptr);
      } catch (...) {
        failed = std::current_exception();
      }
      std::exception_ptr result = failed ? (pending ? pending : failed) : decide(pending);
      if (result)
        agreed->set(result);
      return result;
    });
  }

  // As above, for communicators that only enqueue: `exchange()` enqueues the exchange, which
  // then runs between a packing task and a deciding task, on a cleared stream; `stash` holds this
  // rank's failure in between.
  template <class Stream, class Pack, class Exchange, class Decide>
  void enqueue(Stream& s, std::exception_ptr* stash, Pack pack, Exchange&& exchange,
               Decide decide) {
    s.submit_always([agreed = agreed_, stash, pack = std::move(pack)](
                        std::exception_ptr pending) mutable -> std::exception_ptr {
      if (pending && pending == agreed->get())
        return pending; // every rank knows it and skips this exchange too
      *stash = pending;
      pack(pending);
      return nullptr;
    });
    std::forward<Exchange>(exchange)();
    s.submit_always(
        [agreed = agreed_, stash, decide = std::move(decide)](std::exception_ptr failed) mutable {
          std::exception_ptr own = std::exchange(*stash, nullptr);
          std::exception_ptr result = failed ? (own ? own : failed) : decide(own);
          if (result)
            agreed->set(result);
          return result;
        });
  }

 private:
  struct agreed_failure {
    std::mutex mutex;
    std::exception_ptr failure;
    std::exception_ptr get() {
      std::lock_guard lock(mutex);
      return failure;
    }
    void set(std::exception_ptr f) {
      std::lock_guard lock(mutex);
      failure = std::move(f);
    }
  };

  std::shared_ptr<agreed_failure> agreed_;
};

// The receive layout of rows announced by peers: rank src sends `counts[src]` rows, placed one
// rank after the other from row 0 (`displs[src]`: its first row); returns the total. Each count
// is checked before it is added, so that no sum overflows and no wrapped sum passes: a negative
// count, or one that takes the total past `bound` (the rows the receiver planned for), throws
// `errc::size_mismatch` naming its rank; `what` names the receiver.
inline std::size_t receive_displacements(std::span<const std::int64_t> counts,
                                         std::span<std::int64_t> displs, std::size_t bound,
                                         const char* what) {
  WEAVE_EXPECT(displs.size() == counts.size(), errc::internal, what, ": ", counts.size(),
               " counts and ", displs.size(), " displacements");
  std::size_t total = 0;
  for (std::size_t src = 0; src < counts.size(); ++src) {
    const std::int64_t n = counts[src];
    WEAVE_EXPECT(n >= 0 && static_cast<std::uint64_t>(n) <= bound - total, errc::size_mismatch,
                 what, ": rank ", src, " announced ", n, " rows, outside [0, ", bound - total,
                 "]: the rows left of the ", bound, " this rank planned for after ", total,
                 " from the ranks before it (a rank passed more tokens, or the ranks' options "
                 "differ)");
    displs[src] = static_cast<std::int64_t>(total);
    total += static_cast<std::size_t>(n);
  }
  return total;
}

} // namespace detail

//! The buffers of one status-carrying count exchange in host memory (one per exchange that may
//! be in flight, e.g. per chunk of a call): per peer, its counts and then a status.
struct status_block {
  std::vector<std::int64_t> send, recv;
  std::exception_ptr stashed; // this rank's failure while an enqueued exchange runs
};

//! A count exchange carrying every rank's status, on host streams (see the file comment).
//! `exchange` allocates nothing: it uses the `status_block` it is given.
template <communicator Comm>
requires host_executor<typename Comm::stream_type> && has_exchange_counts<Comm>
class counts_with_status {
 public:
  using stream_type = typename Comm::stream_type;

  //! For rank `rank` of `ranks`, `k` counts per peer; `what` names the owner in peers' errors
  //! ("moe_exchange").
  counts_with_status(int ranks, int rank, std::size_t k, std::string what)
      : ranks_(ranks)
      , rank_(rank)
      , k_(k)
      , what_(std::move(what)) {}

  //! The buffers of one exchange (allocates: make them when their owner is built).
  status_block make_block() const {
    status_block b;
    b.send.assign(static_cast<std::size_t>(ranks_) * (k_ + failure_words), 0);
    b.recv.assign(b.send.size(), 0);
    return b;
  }

  //! Enqueues on `s` the exchange of `send` (`k` counts per peer, peer-major) into `recv` and
  //! of every rank's status, through `b` (which must not be in use by another exchange in
  //! flight). Afterwards `s` holds this rank's own failure if it had one (its peers now know
  //! it), else a `peer_error` if a peer had one, else nothing, on every rank alike. `send` and
  //! `recv` are read and written when the stream gets there. `tag`: the call it belongs to
  //! (checked by communicators with tagged collectives).
  void exchange(Comm& comm, stream_type& s, status_block& b, std::span<const std::int64_t> send,
                std::span<std::int64_t> recv, call_tag tag = {}) {
    WEAVE_EXPECT(send.size() == k_ * std::size_t(ranks_) && recv.size() == send.size() &&
                     b.send.size() == std::size_t(ranks_) * (k_ + failure_words) &&
                     b.recv.size() == b.send.size(),
                 errc::size_mismatch, what_, ": ", send.size(), " counts to send and ", recv.size(),
                 " to receive for ", ranks_, " ranks with ", k_, " per peer");
    block_io io{this, &b, send, recv};
    const auto pack = [io](const std::exception_ptr& pending) { io.pack(pending); };
    // Bytes no peer writes may reach this rank alone: its peers must not wait for it.
    const auto decide = [io, &comm](std::exception_ptr own) {
      return abort_peers_on_protocol_error(comm, io.decide(std::move(own)));
    };
    const std::span<const std::int64_t> wire_send(b.send);
    const std::span<std::int64_t> wire_recv(b.recv);
    if constexpr (has_deferred_exchange_counts<Comm>) // one task, as the plain exchange
      protocol_.enqueue_deferred(s, pack, detail::deferred_counts(comm, wire_send, wire_recv, tag),
                                 decide);
    else
      protocol_.enqueue(
          s, &b.stashed, pack, [&] { weave::exchange_counts(comm, s, wire_send, wire_recv, tag); },
          decide);
  }

 private:
  // What the stream tasks of one exchange read and write.
  struct block_io {
    const counts_with_status* self;
    status_block* b;
    std::span<const std::int64_t> send;
    std::span<std::int64_t> recv;

    std::size_t stride() const noexcept { return self->k_ + failure_words; }

    void pack(const std::exception_ptr& pending) const {
      const failure_record record = pending ? record_of(pending, self->rank_) : failure_record{};
      for (std::size_t j = 0; j < static_cast<std::size_t>(self->ranks_); ++j) {
        const std::span<std::int64_t> to = std::span(b->send).subspan(j * stride(), stride());
        std::copy_n(send.begin() + static_cast<std::ptrdiff_t>(j * self->k_), self->k_, to.begin());
        encode_failure(pending ? &record : nullptr, to.subspan(self->k_));
      }
    }

    std::exception_ptr decide(std::exception_ptr own) const {
      for (std::size_t j = 0; j < static_cast<std::size_t>(self->ranks_); ++j)
        std::copy_n(b->recv.begin() + static_cast<std::ptrdiff_t>(j * stride()), self->k_,
                    recv.begin() + static_cast<std::ptrdiff_t>(j * self->k_));
      return own ? own
                 : detail::peer_failure_in(
                       std::span<const std::int64_t>(b->recv), self->k_, self->ranks_, self->rank_,
                       self->what_ + " count exchange", detail::status_decoder(self->ranks_));
    }
  };

  int ranks_ = 0, rank_ = 0;
  std::size_t k_ = 0;
  std::string what_;
  detail::status_protocol protocol_;
};

//! Enqueues a call that was rejected on the host (bad arguments) in its place in the collective
//! schedule: runs `enqueue_call()` with both streams failed by `failure`, so the call's status
//! exchanges carry it to the peers (who fail at the same step) and every other collective of the
//! call is skipped alike on every rank. Both streams are healthy again after the call (the
//! caller throws `failure` itself); a failure they held before stays. A call that cannot run at
//! all (one stream given twice) aborts `comm` instead.
template <communicator Comm, host_executor Stream, class EnqueueCall>
void enqueue_failed_call(Comm& comm, Stream& compute, Stream& comm_stream,
                         const std::exception_ptr& failure, EnqueueCall&& enqueue_call) {
  if (&compute == &comm_stream) {
    abort_peers(comm, failure);
    return;
  }
  for (Stream* s : {&compute, &comm_stream})
    s->submit_always([failure](std::exception_ptr pending) { return pending ? pending : failure; });
  std::exception_ptr thrown;
  try {
    std::forward<EnqueueCall>(enqueue_call)();
  } catch (...) {
    thrown = std::current_exception();
  }
  for (Stream* s : {&compute, &comm_stream})
    s->submit_always([failure](std::exception_ptr pending) {
      return pending == failure ? std::exception_ptr{} : pending;
    });
  if (thrown)
    std::rethrow_exception(thrown);
}

WEAVE_NAMESPACE_END
