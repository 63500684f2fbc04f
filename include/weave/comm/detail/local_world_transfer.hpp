//! \file
//! How `detail::local_world_state` moves an operation's data once every rank posted it, out of
//! the class: the checks of a rank's own post (its layouts, counts and groups), the checks
//! against its peers' posts (the same call, operation and sizes), the copies from their buffers
//! with the emulated link's delays, and the element-wise reductions. Included by
//! `local_world_state.hpp`.
#pragma once

#include "weave/comm/communicator.hpp"
#include "weave/comm/local_world_state.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <thread>

WEAVE_NAMESPACE_BEGIN

namespace detail {

inline void local_world_state::check_own(const local_post& post) const {
  switch (post.op) {
  case local_op::all_to_all_v:
  case local_op::all_to_all_v_bounded:
    check_layout(size_, post.send_counts, post.send_displs, post.unit, "send");
    check_layout(size_, post.recv_counts, post.recv_displs, post.unit, "receive");
    WEAVE_EXPECT(post.op == local_op::all_to_all_v ||
                     post.received.size() == static_cast<std::size_t>(size_),
                 errc::size_mismatch, "all_to_all_v_bounded: ", post.received.size(),
                 " received lengths for ", size_, " ranks");
    break;
  case local_op::exchange_counts:
    WEAVE_EXPECT(post.unit > 0 && post.send_counts.size() == post.unit * std::size_t(size_) &&
                     post.recv_counts.size() == post.send_counts.size(),
                 errc::size_mismatch, "exchange_counts: ", post.send_counts.size(), " send and ",
                 post.recv_counts.size(), " receive counts for ", size_,
                 " ranks (need the same non-zero multiple of the group size)");
    break;
  case local_op::send_recv:
    for (std::size_t i = 0; i < post.transfers.size(); ++i) {
      const peer_transfer& t = post.transfers[i];
      WEAVE_EXPECT(t.peer >= 0 && t.peer < size_, errc::out_of_range, "send_recv: peer ", t.peer,
                   " outside a group of ", size_);
      WEAVE_EXPECT(t.send_bytes >= 0 && t.recv_bytes >= 0, errc::invalid_argument,
                   "send_recv: negative size with peer ", t.peer);
      for (std::size_t k = 0; k < i; ++k)
        WEAVE_EXPECT(post.transfers[k].peer != t.peer, errc::invalid_argument, "send_recv: peer ",
                     t.peer, " appears twice in one group");
    }
    break;
  default:
    break;
  }
}

inline const peer_transfer* local_world_state::find(std::span<const peer_transfer> group,
                                                    int peer) {
  for (const peer_transfer& t : group)
    if (t.peer == peer)
      return &t;
  return nullptr;
}

inline void local_world_state::transfer(int rank, const local_post& post) {
  const auto r = static_cast<std::size_t>(rank);
  for (int peer = 0; peer < size_; ++peer) {
    const local_post& other = posts_[static_cast<std::size_t>(peer)];
    if (other.tag != post.tag) // another call: nothing of it may be delivered
      detail::throw_call_mismatch("local_world", rank, post.tag, peer, other.tag);
    WEAVE_EXPECT(other.op == post.op, errc::invalid_state, "local_world: collective #", post.seq,
                 " is ", to_string(post.op), " on rank ", rank, " but ", to_string(other.op),
                 " on rank ", peer);
  }
  const auto start = std::chrono::steady_clock::now();
  auto arrival = start;
  auto arrive = [&](int peer, std::int64_t bytes) {
    if (peer != rank)
      arrival = std::max(arrival, start + link(peer, rank).transfer_time(bytes));
  };
  switch (post.op) {
  case local_op::all_to_all_v:
  case local_op::all_to_all_v_bounded: { // bounded: a block up to its room, its length reported
    const bool bounded = post.op == local_op::all_to_all_v_bounded;
    const auto unit = static_cast<std::int64_t>(post.unit);
    for (int peer = 0; peer < size_; ++peer) {
      const auto p = static_cast<std::size_t>(peer);
      const local_post& from = posts_[p];
      const std::int64_t sent = from.send_counts[r] * static_cast<std::int64_t>(from.unit);
      const std::int64_t room = post.recv_counts[p] * unit;
      if (bounded)
        WEAVE_EXPECT(sent <= room && sent % unit == 0, errc::size_mismatch,
                     "all_to_all_v_bounded #", post.seq, ": rank ", peer, " sends ", sent,
                     " bytes to rank ", rank, ", which has room for ", room, " in units of ", unit);
      else
        WEAVE_EXPECT(sent == room, errc::size_mismatch, "all_to_all_v #", post.seq, ": rank ", peer,
                     " sends ", sent, " bytes to rank ", rank, " but rank ", rank, " expects ",
                     room, " bytes from it");
      if (sent > 0)
        std::memcpy(post.recv + post.recv_displs[p] * unit,
                    from.send + from.send_displs[r] * static_cast<std::int64_t>(from.unit),
                    static_cast<std::size_t>(sent));
      if (bounded)
        post.received[p] = sent / unit;
      arrive(peer, sent);
    }
    break;
  }
  case local_op::exchange_counts:
    for (int peer = 0; peer < size_; ++peer) {
      const auto p = static_cast<std::size_t>(peer);
      const local_post& from = posts_[p];
      WEAVE_EXPECT(from.unit == post.unit, errc::size_mismatch, "exchange_counts #", post.seq,
                   ": rank ", peer, " sends ", from.unit, " counts per peer but rank ", rank,
                   " receives ", post.unit);
      const std::size_t k = post.unit;
      std::memcpy(post.recv + p * k * sizeof(std::int64_t), from.send_counts.data() + r * k,
                  k * sizeof(std::int64_t));
      arrive(peer, static_cast<std::int64_t>(k * sizeof(std::int64_t)));
    }
    break;
  case local_op::send_recv:
    for (int peer = 0; peer < size_; ++peer) {
      const peer_transfer* mine = find(post.transfers, peer);
      const peer_transfer* theirs = find(posts_[static_cast<std::size_t>(peer)].transfers, rank);
      const std::int64_t sent = theirs ? theirs->send_bytes : 0;
      const std::int64_t expected = mine ? mine->recv_bytes : 0;
      WEAVE_EXPECT(sent == expected, errc::size_mismatch, "send_recv #", post.seq, ": rank ", peer,
                   " sends ", sent, " bytes to rank ", rank, " but rank ", rank, " expects ",
                   expected, " bytes from it");
      if (sent > 0)
        std::memcpy(mine->recv, theirs->send, static_cast<std::size_t>(sent));
      if (mine || theirs)
        arrive(peer, sent);
    }
    break;
  case local_op::all_reduce:
    for (int peer = 0; peer < size_; ++peer) {
      const local_post& other = posts_[static_cast<std::size_t>(peer)];
      WEAVE_EXPECT(
          other.count == post.count && other.type == post.type && other.reduction == post.reduction,
          errc::size_mismatch, "all_reduce #", post.seq, ": rank ", peer, " reduces ", other.count,
          " elements (type ", other.type, ", ", to_string(other.reduction), ") but rank ", rank,
          " reduces ", post.count, " (type ", post.type, ", ", to_string(post.reduction), ")");
    }
    switch (post.type) {
    case 1:
      reduce_slice<float>(rank, post);
      break;
    case 2:
      reduce_slice<double>(rank, post);
      break;
    case 3:
      reduce_slice<std::int32_t>(rank, post);
      break;
    default:
      reduce_slice<std::int64_t>(rank, post);
      break;
    }
    for (int peer = 0; peer < size_; ++peer)
      arrive(peer, static_cast<std::int64_t>(post.count * 8 / std::size_t(size_)));
    break;
  case local_op::barrier:
    for (int peer = 0; peer < size_; ++peer)
      arrive(peer, 0);
    break;
  case local_op::none:
    break;
  }
  if (arrival > std::chrono::steady_clock::now())
    std::this_thread::sleep_until(arrival); // the emulated wire is busy; the CPU is not
}

//! Rank r reduces elements [r*count/n, (r+1)*count/n) of every rank's input, in rank order,
//! and writes the result to every rank's output. Each element is read from all inputs before
//! any output is written, so in-place reductions (in == out) are safe.
template <class T>
void local_world_state::reduce_slice(int rank, const local_post& post) {
  const std::size_t n = static_cast<std::size_t>(size_);
  const std::size_t begin = post.count * static_cast<std::size_t>(rank) / n;
  const std::size_t end = post.count * (static_cast<std::size_t>(rank) + 1) / n;
  for (std::size_t e = begin; e < end; ++e) {
    T acc = reinterpret_cast<const T*>(posts_[0].send)[e];
    for (std::size_t peer = 1; peer < n; ++peer) {
      const T v = reinterpret_cast<const T*>(posts_[peer].send)[e];
      acc = post.reduction == reduce_op::sum ? static_cast<T>(acc + v) : std::max(acc, v);
    }
    for (std::size_t peer = 0; peer < n; ++peer)
      reinterpret_cast<T*>(posts_[peer].recv)[e] = acc;
  }
}

} // namespace detail

WEAVE_NAMESPACE_END
