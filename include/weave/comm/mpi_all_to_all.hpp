//! \file
//! How `mpi_communicator` moves an all-to-all's blocks: point to point, a receive and a send per
//! peer, and a tagged call's headers (posted with the blocks, small blocks inside them, checked
//! before any block is taken). Out of the class; included by `mpi_communicator.hpp`.
#pragma once

#include "weave/comm/mpi_communicator.hpp"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

WEAVE_NAMESPACE_BEGIN

// Posts the receive of every peer's header message (the first size - 1 of `requests_`).
inline void mpi_communicator::receive_headers(const char* what) {
  messages_.prepare(static_cast<std::size_t>(size_));
  for (int i = 1; i < size_; ++i) {
    const int peer = (rank_ + size_ - i) % size_;
    requests_.push_back(MPI_REQUEST_NULL);
    check(MPI_Irecv(messages_.receive_buffer(static_cast<std::size_t>(peer)), messages_.capacity(),
                    MPI_BYTE, peer, header_tag, comm_, &requests_.back()),
          "MPI_Irecv", what);
  }
}

// Sends this rank's header message to every peer, with the blocks small enough to travel inside.
inline void mpi_communicator::send_headers(call_tag tag, std::int64_t kind, const std::byte* send,
                                           std::span<const std::int64_t> send_counts,
                                           std::span<const std::int64_t> send_displs,
                                           std::size_t unit, const char* what) {
  for (int i = 1; i < size_; ++i) {
    const int peer = (rank_ + i) % size_;
    const auto j = static_cast<std::size_t>(peer);
    const auto [message, length] =
        messages_.write(j, tag, kind, header::size_of(kind, send_counts[j], unit),
                        send + send_displs[j] * static_cast<std::int64_t>(unit),
                        static_cast<std::size_t>(send_counts[j]) * unit);
    requests_.push_back(MPI_REQUEST_NULL);
    check(MPI_Isend(message, length, MPI_BYTE, peer, header_tag, comm_, &requests_.back()),
          "MPI_Isend", what);
  }
}

// Waits for the peers' header messages (`receive_headers`) and checks every one against this
// rank's tag, kind and receive sizes before any block is copied out or waited for. A mismatch
// aborts the communicator (the peers find theirs too), leaves this rank's sends and its
// posted receives with MPI (abandoned) and throws: the header names the cause, whatever MPI
// made of the blocks. Then copies the blocks that came inside their header, and posts the
// receive (`receive_from`) of a block this rank expected inside that came alone (ranks with
// other `tagged_inline_bytes`); the others' receives were posted with the headers'.
template <class Receive>
void mpi_communicator::check_headers(call_tag tag, std::int64_t kind, std::byte* recv,
                                     std::span<const std::int64_t> recv_counts,
                                     std::span<const std::int64_t> recv_displs, std::size_t unit,
                                     const char* what, Receive&& receive_from) {
  if (size_ == 1)
    return;
  const auto peers = static_cast<std::size_t>(size_ - 1);
  wait_all(std::span<MPI_Request>(requests_.data(), peers), what);
  try {
    for (std::size_t r = 0; r < peers; ++r) { // requests_[r] received from rank - 1 - r
      const int peer = (rank_ + size_ - 1 - static_cast<int>(r)) % size_;
      const auto j = static_cast<std::size_t>(peer);
      int length = 0;
      MPI_Get_count(&statuses_[r], MPI_BYTE, &length);
      messages_.check(j, length, rank_, peer, tag, kind,
                      header::size_of(kind, recv_counts[j], unit),
                      static_cast<std::size_t>(recv_counts[j]) * unit, what);
    }
  } catch (...) { // `step` aborts; the posted sends and receives stay with MPI
    abandoned_->store(true, std::memory_order_release);
    throw;
  }
  for (int i = 1; i < size_; ++i) {
    const int peer = (rank_ + size_ - i) % size_;
    const auto j = static_cast<std::size_t>(peer);
    const auto bytes = static_cast<std::size_t>(recv_counts[j]) * unit;
    if (messages_.inside(j))
      messages_.copy_block(j, recv + recv_displs[j] * static_cast<std::int64_t>(unit), bytes);
    else if (messages_.travels_inside(bytes))
      receive_from(peer);
  }
}

// Every peer block goes point to point at its own address (a receive, then a send per peer,
// in pieces of at most `max_chunk_units` units) and this rank's own block by memcpy: the
// messages of Open MPI's linear MPI_Alltoallv, without a non-blocking collective's schedule
// per call (1.1-1.3x faster than MPI_Ialltoallv at 1-4 KiB per peer; docs/perf.md), and no
// `int` displacement to overflow. Pieces of one pair share (source, tag, communicator), and a
// stream issues its operations in order, so MPI matches every message to its receive.
// Tagged: each peer's header message leaves with the data, carrying the block itself when it is
// small (`mpi_options::tagged_inline_bytes`); a larger block's receive is posted with the
// headers' and waited for once every header checked (`check_headers`): one round trip, and no
// rendezvous waiting for a check. A failed call may thus have written into `recv`.
inline void
mpi_communicator::run_all_to_all_v(const std::byte* send, std::span<const std::int64_t> send_counts,
                                   std::span<const std::int64_t> send_displs, std::byte* recv,
                                   std::span<const std::int64_t> recv_counts,
                                   std::span<const std::int64_t> recv_displs, std::size_t unit,
                                   call_tag tag, std::int64_t kind, const char* what) {
  detail::check_layout(size_, send_counts, send_displs, unit, "send");
  detail::check_layout(size_, recv_counts, recv_displs, unit, "receive");
  const auto self = static_cast<std::size_t>(rank_);
  WEAVE_EXPECT(send_counts[self] == recv_counts[self], errc::size_mismatch,
               "mpi_communicator rank ", rank_, ": ", what, " sends ", send_counts[self],
               " units to itself but receives ", recv_counts[self]);
  // Counts as MPI_INT64_T: the cached unit type stays the rows' (no type rebuilt per call).
  const MPI_Datatype type = kind == header::counts ? MPI_INT64_T : unit_type(unit);
  const std::int64_t limit = options_.max_chunk_units;
  const auto bytes = static_cast<std::int64_t>(unit);
  requests_.clear();
  auto post = [&](std::int64_t count, auto&& one) {
    for (std::int64_t done = 0; done < count; done += limit) {
      requests_.push_back(MPI_REQUEST_NULL);
      one(done, static_cast<int>(std::min(limit, count - done)), &requests_.back());
    }
  };
  const auto receive_from = [&](int peer) {
    const auto j = static_cast<std::size_t>(peer);
    post(recv_counts[j], [&](std::int64_t at, int count, MPI_Request* request) {
      check(MPI_Irecv(recv + (recv_displs[j] + at) * bytes, count, type, peer, block_tag, comm_,
                      request),
            "MPI_Irecv", what);
    });
  };
  const bool tagged = tag.tagged();
  if (tagged)
    receive_headers(what);
  for (int i = 1; i < size_; ++i) { // receives first: messages find them posted
    const int peer = (rank_ + size_ - i) % size_;
    const auto j = static_cast<std::size_t>(peer);
    if (!tagged || !messages_.travels_inside(static_cast<std::size_t>(recv_counts[j]) * unit))
      receive_from(peer);
  }
  if (tagged)
    send_headers(tag, kind, send, send_counts, send_displs, unit, what);
  for (int i = 1; i < size_; ++i) { // each rank starts with a different peer
    const int peer = (rank_ + i) % size_;
    const auto j = static_cast<std::size_t>(peer);
    if (tagged && messages_.travels_inside(static_cast<std::size_t>(send_counts[j]) * unit))
      continue; // inside the header's message
    post(send_counts[j], [&](std::int64_t at, int count, MPI_Request* request) {
      check(MPI_Isend(send + (send_displs[j] + at) * bytes, count, type, peer, block_tag, comm_,
                      request),
            "MPI_Isend", what);
    });
  }
  if (tagged) // a failed call takes nothing out of its headers, nor its own block
    check_headers(tag, kind, recv, recv_counts, recv_displs, unit, what, receive_from);
  if (send_counts[self] > 0)
    std::memmove(recv + recv_displs[self] * bytes, send + send_displs[self] * bytes,
                 static_cast<std::size_t>(send_counts[self] * bytes));
  wait_all(requests_, what); // with none (no peer traffic), a test of the notices alone
}

// The bounded all-to-all: one receive per peer for its whole room, one send per peer of its
// block, then each block's length from its receive's status.
inline void mpi_communicator::run_bounded_all_to_all_v(
    const std::byte* send, std::span<const std::int64_t> send_counts,
    std::span<const std::int64_t> send_displs, std::byte* recv,
    std::span<const std::int64_t> recv_counts, std::span<const std::int64_t> recv_displs,
    std::span<std::int64_t> received, std::size_t unit) {
  const char* what = "all_to_all_v_bounded";
  detail::check_layout(size_, send_counts, send_displs, unit, "send");
  detail::check_layout(size_, recv_counts, recv_displs, unit, "receive");
  const auto self = static_cast<std::size_t>(rank_);
  WEAVE_EXPECT(received.size() == static_cast<std::size_t>(size_), errc::size_mismatch,
               "mpi_communicator rank ", rank_, ": ", what, ": ", received.size(),
               " received lengths for ", size_, " ranks");
  WEAVE_EXPECT(send_counts[self] <= recv_counts[self], errc::size_mismatch,
               "mpi_communicator rank ", rank_, ": ", what, " sends ", send_counts[self],
               " units to itself into room for ", recv_counts[self]);
  const auto one_message = [&](std::int64_t count) {
    WEAVE_EXPECT(count <= INT_MAX, errc::size_overflow, "mpi_communicator rank ", rank_, ": ", what,
                 ": a block of ", count, " units (one message: at most INT_MAX)");
    return static_cast<int>(count);
  };
  const MPI_Datatype type = unit_type(unit);
  const auto bytes = static_cast<std::int64_t>(unit);
  requests_.clear();
  for (int i = 1; i < size_; ++i) { // receives first; request i - 1 receives from rank - i
    const int peer = (rank_ + size_ - i) % size_;
    const auto j = static_cast<std::size_t>(peer);
    requests_.push_back(MPI_REQUEST_NULL);
    check(MPI_Irecv(recv + recv_displs[j] * bytes, one_message(recv_counts[j]), type, peer,
                    block_tag, comm_, &requests_.back()),
          "MPI_Irecv", what);
  }
  for (int i = 1; i < size_; ++i) {
    const int peer = (rank_ + i) % size_;
    const auto j = static_cast<std::size_t>(peer);
    requests_.push_back(MPI_REQUEST_NULL);
    check(MPI_Isend(send + send_displs[j] * bytes, one_message(send_counts[j]), type, peer,
                    block_tag, comm_, &requests_.back()),
          "MPI_Isend", what);
  }
  if (send_counts[self] > 0)
    std::memmove(recv + recv_displs[self] * bytes, send + send_displs[self] * bytes,
                 static_cast<std::size_t>(send_counts[self] * bytes));
  received[self] = send_counts[self];
  wait_all(requests_, what);
  for (int i = 1; i < size_; ++i) {
    int count = 0;
    check(MPI_Get_count(&statuses_[static_cast<std::size_t>(i - 1)], type, &count), "MPI_Get_count",
          what);
    WEAVE_EXPECT(count != MPI_UNDEFINED, errc::size_mismatch, "mpi_communicator rank ", rank_, ": ",
                 what, ": rank ", (rank_ + size_ - i) % size_,
                 " sent a block that is not a whole number of units of ", unit, " bytes");
    received[static_cast<std::size_t>((rank_ + size_ - i) % size_)] = count;
  }
}

WEAVE_NAMESPACE_END
