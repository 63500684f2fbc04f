//! \file
//! The engine behind `local_world`: its options, and the rendezvous every operation of its ranks
//! meets at (`detail::local_world_state`: posts, matching, copies, the emulated link's delays,
//! timeouts and aborts). See `local_world.hpp` for the behaviour it gives.
#pragma once

#include "weave/comm/communicator.hpp"
#include "weave/comm/emulated_link.hpp"
#include "weave/comm/local_world_shrink.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/failure.hpp"
#include "weave/exec/host_stream.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

WEAVE_NAMESPACE_BEGIN
//! Settings of a `local_world`.
struct local_world_options {
  //! How long a rank waits for its peers at each step of an operation.
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
  //! The link between every pair of distinct ranks (default: none, completion is immediate).
  emulated_link link{};
  //! An operation moving at most this many bytes on a rank (sent plus received) runs on the
  //! calling thread when its stream is idle, as `mpi_options::inline_max_bytes` says; the call
  //! then returns once every rank completed it, so each rank must issue from its own thread
  //! (as `local_world::run` does). 0 (the default): every operation runs on its stream's worker
  //! and returns at once, as an NCCL call does, which is what a local_world usually stands in
  //! for: a wrapper that watches only `synchronize` (NCCL's way to give up on a peer) would
  //! otherwise wait inside the call, past its watch.
  std::size_t inline_max_bytes = 0;
};

namespace detail {

enum class local_op : int {
  none,
  all_to_all_v,
  all_to_all_v_bounded,
  send_recv,
  exchange_counts,
  all_reduce,
  barrier
};

constexpr const char* to_string(local_op op) noexcept {
  switch (op) {
  case local_op::all_to_all_v:
    return "all_to_all_v";
  case local_op::all_to_all_v_bounded:
    return "all_to_all_v_bounded";
  case local_op::send_recv:
    return "send_recv";
  case local_op::exchange_counts:
    return "exchange_counts";
  case local_op::all_reduce:
    return "all_reduce";
  case local_op::barrier:
    return "barrier";
  case local_op::none:
    break;
  }
  return "none";
}

template <class T>
constexpr int reduce_type_id() noexcept {
  if constexpr (std::is_same_v<T, float>)
    return 1;
  else if constexpr (std::is_same_v<T, double>)
    return 2;
  else if constexpr (std::is_same_v<T, std::int32_t>)
    return 3;
  else
    return 4;
}

//! What one rank posts for one operation; every pointer stays valid until all ranks finished.
struct local_post {
  std::uint64_t order = 0; // place in the enqueue order of its communicator (from 1)
  std::uint64_t seq = 0;   // place in the order operations ran on its rank (0: none yet)
  local_op op = local_op::none;
  const std::byte* send = nullptr;
  std::byte* recv = nullptr;
  std::span<const std::int64_t> send_counts, send_displs, recv_counts, recv_displs;
  std::span<std::int64_t> received;         // all_to_all_v_bounded: each block's length (units)
  std::size_t unit = 1;                     // all_to_all_v unit; exchange_counts: counts per peer
  std::span<const peer_transfer> transfers; // send_recv
  std::size_t count = 0;                    // all_reduce elements
  int type = 0;                             // all_reduce element type
  reduce_op reduction = reduce_op::sum;
  call_tag tag{}; // the call it belongs to (every rank's must be equal)
};

class local_world_state {
 public:
  local_world_state(int size, const local_world_options& options)
      : size_(size)
      , options_(options)
      , shrink_(size)
      , links_(static_cast<std::size_t>(size) * static_cast<std::size_t>(size), options.link)
      , posts_(static_cast<std::size_t>(size))
      , finished_(static_cast<std::size_t>(size), 0)
      , taken_(static_cast<std::size_t>(size), 0) {
    for (int r = 0; r < size; ++r)
      links_[index(r, r)] = emulated_link{}; // a rank's copy to itself is local
  }

  int size() const noexcept { return size_; }
  //! The options the world was made with (its links are `link`).
  const local_world_options& options() const noexcept { return options_; }
  //! The world's one shrink agreement (`local_communicator::shrink`).
  local_shrink_round& shrink_round() noexcept { return shrink_; }
  std::chrono::milliseconds timeout() const noexcept { return options_.timeout; }
  //! Whether operations may run on the calling thread at all.
  bool inline_enabled() const noexcept { return options_.inline_max_bytes > 0; }
  //! Whether an operation moving `bytes` on a rank may run on the calling thread.
  bool runs_inline(std::size_t bytes) const noexcept {
    return options_.inline_max_bytes > 0 && bytes <= options_.inline_max_bytes;
  }
  emulated_link& link(int src, int dst) { return links_[index(src, dst)]; }

  //! Marks the world failed because of `why.rank`; every waiting and later operation throws.
  void abort(const failure_record& why) {
    {
      std::lock_guard lock(mutex_);
      fail(why);
    }
    changed_.notify_all();
  }

  int failed_rank() const {
    std::lock_guard lock(mutex_);
    return failed_ ? failure_.rank : -1;
  }

  //! `post` will not run (its stream had failed): it only takes its place in the order.
  void skip(int rank, const local_post& post) {
    std::unique_lock lock(mutex_);
    take_turn(lock, rank, post);
  }

  //! Runs `post` (made by `rank`) as one step of the world; throws on any failure.
  void execute(int rank, local_post post) {
    try {
      check_own(post);
    } catch (const std::exception&) {
      abort(record_of(std::current_exception(), rank));
      throw;
    }
    const auto r = static_cast<std::size_t>(rank);
    std::unique_lock lock(mutex_);
    take_turn(lock, rank, post);
    post.seq = posts_[r].seq + 1; // ranks' operations match in the order they run
    posts_[r] = post;
    changed_.notify_all();
    await(lock, rank, post, true, [&] {
      return std::all_of(posts_.begin(), posts_.end(),
                         [&](const local_post& p) { return p.seq >= post.seq; });
    });
    ++in_transfer_;
    lock.unlock();
    // Posts of this sequence number cannot change until every rank has finished below.
    std::exception_ptr failure;
    try {
      transfer(rank, post);
    } catch (...) {
      failure = std::current_exception();
    }
    lock.lock();
    --in_transfer_;
    if (failure) {
      fail(record_of(failure, rank));
      changed_.notify_all();
      changed_.wait(lock, [&] { return in_transfer_ == 0; });
      std::rethrow_exception(failure);
    }
    finished_[r] = post.seq;
    changed_.notify_all();
    await(lock, rank, post, false, [&] {
      return std::all_of(finished_.begin(), finished_.end(),
                         [&](std::uint64_t f) { return f >= post.seq; });
    });
  }

 private:
  // Under mutex_: checks that `post` is the next operation its communicator enqueued (on one
  // stream, or on streams ordered so) and records that it was taken.
  void take_turn(std::unique_lock<std::mutex>& lock, int rank, const local_post& post) {
    const auto r = static_cast<std::size_t>(rank);
    if (!failed_ && taken_[r] + 1 != post.order) {
      const std::string message =
          detail::concat("local_world rank ", rank, ": operation #", post.order, " (",
                         to_string(post.op), ") ran after #", taken_[r],
                         "; one communicator's operations must run in the order "
                         "they were enqueued (use one stream, or order the streams)");
      lock.unlock();
      abort({rank, errc::invalid_state, true, message});
      WEAVE_THROW(errc::invalid_state, message);
    }
    taken_[r] = post.order;
  }

  // Under mutex_: the first failure wins.
  void fail(const failure_record& why) {
    if (!failed_) {
      failed_ = true;
      failure_ = why;
    }
  }

  std::size_t index(int src, int dst) const noexcept {
    return static_cast<std::size_t>(src) * static_cast<std::size_t>(size_) +
           static_cast<std::size_t>(dst);
  }

  template <class Ready>
  void await(std::unique_lock<std::mutex>& lock, int rank, const local_post& post, bool arriving,
             Ready ready) {
    const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
    // A failing rank leaves only once no peer is still copying from buffers that the caller
    // may free as soon as the failure surfaces.
    auto drain = [&] { changed_.wait(lock, [&] { return in_transfer_ == 0; }); };
    for (;;) {
      // Once every rank has finished reading, the operation is complete even if the world
      // failed meanwhile; before that, a failure wins, so nobody reads a departed rank's buffers.
      if (!arriving && ready())
        return;
      if (failed_) {
        drain();
        throw peer_error(failure_, detail::concat("local_world rank ", rank, ": ",
                                                  to_string(post.op), " #", post.seq, " aborted"));
      }
      if (ready())
        return;
      if (changed_.wait_until(lock, deadline) == std::cv_status::timeout && !ready() && !failed_) {
        std::string missing;
        for (int peer = 0; peer < size_; ++peer) {
          const auto p = static_cast<std::size_t>(peer);
          const bool late = arriving ? posts_[p].seq < post.seq : finished_[p] < post.seq;
          if (late) {
            missing += (missing.empty() ? "" : ", ") + std::to_string(peer);
            shrink_.depart(peer); // a later shrink does not wait for it again
          }
        }
        const std::string message = detail::concat(
            "local_world rank ", rank, ": ", to_string(post.op), " #", post.seq,
            " timed out after ", options_.timeout.count(), " ms waiting for rank(s) ", missing,
            arriving ? " to arrive at it" : " to complete it");
        fail({rank, errc::timeout, true, message});
        changed_.notify_all();
        drain();
        WEAVE_THROW(errc::timeout, message);
      }
    }
  }

  void check_own(const local_post& post) const {
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

  static const peer_transfer* find(std::span<const peer_transfer> group, int peer) {
    for (const peer_transfer& t : group)
      if (t.peer == peer)
        return &t;
    return nullptr;
  }

  void transfer(int rank, const local_post& post) {
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
                       " bytes to rank ", rank, ", which has room for ", room, " in units of ",
                       unit);
        else
          WEAVE_EXPECT(sent == room, errc::size_mismatch, "all_to_all_v #", post.seq, ": rank ",
                       peer, " sends ", sent, " bytes to rank ", rank, " but rank ", rank,
                       " expects ", room, " bytes from it");
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
        WEAVE_EXPECT(sent == expected, errc::size_mismatch, "send_recv #", post.seq, ": rank ",
                     peer, " sends ", sent, " bytes to rank ", rank, " but rank ", rank,
                     " expects ", expected, " bytes from it");
        if (sent > 0)
          std::memcpy(mine->recv, theirs->send, static_cast<std::size_t>(sent));
        if (mine || theirs)
          arrive(peer, sent);
      }
      break;
    case local_op::all_reduce:
      for (int peer = 0; peer < size_; ++peer) {
        const local_post& other = posts_[static_cast<std::size_t>(peer)];
        WEAVE_EXPECT(other.count == post.count && other.type == post.type &&
                         other.reduction == post.reduction,
                     errc::size_mismatch, "all_reduce #", post.seq, ": rank ", peer, " reduces ",
                     other.count, " elements (type ", other.type, ", ", to_string(other.reduction),
                     ") but rank ", rank, " reduces ", post.count, " (type ", post.type, ", ",
                     to_string(post.reduction), ")");
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
  void reduce_slice(int rank, const local_post& post) {
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

  int size_;
  local_world_options options_; // its `link` is every link's start; `links_` holds them
  local_shrink_round shrink_;
  std::vector<emulated_link> links_; // links_[src * size + dst]; set before any operation
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<local_post> posts_;       // under mutex_ while being posted
  std::vector<std::uint64_t> finished_; // last sequence number each rank finished reading
  std::vector<std::uint64_t> taken_;    // last enqueue order each rank ran or skipped
  int in_transfer_ = 0;                 // ranks copying between the two rendezvous
  bool failed_ = false;
  failure_record failure_; // why the world failed (its rank is the origin)
};

// The stream task of one operation: runs it, or on a failed stream only takes its turn (see
// the file comment).
struct local_task {
  std::shared_ptr<local_world_state> state;
  int rank = 0;
  local_post post;

  std::exception_ptr operator()(std::exception_ptr failure) const {
    if (!failure) {
      state->execute(rank, post);
      return failure;
    }
    try {
      state->skip(rank, post);
    } catch (...) {
    } // the stream keeps its own, earlier failure
    return failure;
  }
};

} // namespace detail

WEAVE_NAMESPACE_END
