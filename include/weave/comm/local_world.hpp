//! \file
//! `local_world`: N ranks of one process (one thread each) exchanging through shared memory.
//!
//! Every operation is a rendezvous: each rank posts a descriptor of its buffers, waits until all
//! ranks posted the same operation, copies what its peers send it (real copies, receiver pulls),
//! optionally sleeps until the emulated link would have delivered the data, and waits until
//! every rank finished reading before completing (so a completed operation's send buffer may be
//! reused). A rank that never arrives makes the others fail with `errc::timeout` after the
//! world's timeout; a rank that aborts (or throws inside `run`) makes every pending and later
//! operation of the others fail with a `peer_error` (`errc::peer_failure`) naming that rank,
//! its error code and message; mismatched sizes between a sender and a receiver, or ranks
//! calling different collectives, fail with a message naming both. Any failure inside a
//! collective aborts the world, as an NCCL communicator error does.
//!
//! Ranks' operations match in the order they run, as in MPI and NCCL: an operation skipped
//! because its stream had failed moves nothing and matches nothing (it only keeps its place in
//! its communicator's enqueue order, which is checked).
#pragma once

#include "weave/comm/communicator.hpp"
#include "weave/comm/emulated_link.hpp"
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
};

namespace detail {

enum class local_op : int { none, all_to_all_v, send_recv, exchange_counts, all_reduce, barrier };

constexpr const char* to_string(local_op op) noexcept {
  switch (op) {
  case local_op::all_to_all_v:
    return "all_to_all_v";
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
      , timeout_(options.timeout)
      , links_(static_cast<std::size_t>(size) * static_cast<std::size_t>(size), options.link)
      , posts_(static_cast<std::size_t>(size))
      , finished_(static_cast<std::size_t>(size), 0)
      , taken_(static_cast<std::size_t>(size), 0) {
    for (int r = 0; r < size; ++r)
      links_[index(r, r)] = emulated_link{}; // a rank's copy to itself is local
  }

  int size() const noexcept { return size_; }
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
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
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
          if (late)
            missing += (missing.empty() ? "" : ", ") + std::to_string(peer);
        }
        const std::string message =
            detail::concat("local_world rank ", rank, ": ", to_string(post.op), " #", post.seq,
                           " timed out after ", timeout_.count(), " ms waiting for rank(s) ",
                           missing, arriving ? " to arrive at it" : " to complete it");
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
      check_layout(size_, post.send_counts, post.send_displs, post.unit, "send");
      check_layout(size_, post.recv_counts, post.recv_displs, post.unit, "receive");
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
      for (int peer = 0; peer < size_; ++peer) {
        const auto p = static_cast<std::size_t>(peer);
        const local_post& from = posts_[p];
        const std::int64_t sent = from.send_counts[r] * static_cast<std::int64_t>(from.unit);
        const std::int64_t expected = post.recv_counts[p] * static_cast<std::int64_t>(post.unit);
        WEAVE_EXPECT(sent == expected, errc::size_mismatch, "all_to_all_v #", post.seq, ": rank ",
                     peer, " sends ", sent, " bytes to rank ", rank, " but rank ", rank,
                     " expects ", expected, " bytes from it");
        if (sent > 0)
          std::memcpy(post.recv + post.recv_displs[p] * static_cast<std::int64_t>(post.unit),
                      from.send + from.send_displs[r] * static_cast<std::int64_t>(from.unit),
                      static_cast<std::size_t>(sent));
        arrive(peer, sent);
      }
      break;
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
  std::chrono::milliseconds timeout_;
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

//! One rank's handle to a `local_world`. Operations run on a `host_stream` the caller owns; a
//! handle's operations must be enqueued from one thread at a time (they take sequence numbers
//! in call order, and every rank must call the same operations in the same order).
class local_communicator {
 public:
  using stream_type = host_stream;

  local_communicator(const local_communicator&) = delete;
  local_communicator& operator=(const local_communicator&) = delete;

  //! This rank, in [0, size()).
  int rank() const noexcept { return rank_; }
  //! Number of ranks in the world.
  int size() const noexcept { return state_->size(); }

  //! Variable all-to-all in units of `unit` bytes (see `weave::all_to_all_v`); ranks whose
  //! `tag`s differ fail with `errc::call_mismatch` before anything is copied.
  void all_to_all_v(host_stream& s, const void* send, std::span<const std::int64_t> send_counts,
                    std::span<const std::int64_t> send_displs, void* recv,
                    std::span<const std::int64_t> recv_counts,
                    std::span<const std::int64_t> recv_displs, std::size_t unit = 1,
                    call_tag tag = {}) {
    detail::local_post p = make(detail::local_op::all_to_all_v);
    p.tag = tag;
    p.send = static_cast<const std::byte*>(send);
    p.recv = static_cast<std::byte*>(recv);
    p.send_counts = send_counts;
    p.send_displs = send_displs;
    p.recv_counts = recv_counts;
    p.recv_displs = recv_displs;
    p.unit = unit;
    enqueue(s, p);
  }

  //! Grouped point-to-point transfers. In a local_world every rank takes part in each group
  //! (with an empty list if it exchanges nothing).
  void send_recv(host_stream& s, std::span<const peer_transfer> transfers) {
    detail::local_post p = make(detail::local_op::send_recv);
    p.transfers = transfers;
    enqueue(s, p);
  }

  //! Sends the k counts `send[j * k, (j + 1) * k)` to rank j and receives rank j's k counts into
  //! `recv[j * k, (j + 1) * k)`, where k = send.size() / size(). Ranks disagreeing on k fail
  //! with `errc::size_mismatch`.
  void exchange_counts(host_stream& s, std::span<const std::int64_t> send,
                       std::span<std::int64_t> recv, call_tag tag = {}) {
    s.submit_always(deferred_exchange_counts(send, recv, tag));
  }

  //! `exchange_counts` taken now and run when the returned task is called on the stream thread
  //! (see `has_deferred_exchange_counts`).
  detail::local_task deferred_exchange_counts(std::span<const std::int64_t> send,
                                              std::span<std::int64_t> recv, call_tag tag = {}) {
    detail::local_post p = make(detail::local_op::exchange_counts);
    p.tag = tag;
    p.send_counts = send;
    p.recv_counts = recv;
    p.recv = reinterpret_cast<std::byte*>(recv.data());
    p.unit = send.size() / static_cast<std::size_t>(size());
    return {state_, rank_, p};
  }

  //! Element-wise reduction into `out` on every rank; `in` and `out` are the same array or do
  //! not overlap.
  template <reducible T>
  void all_reduce(host_stream& s, std::span<const T> in, std::span<T> out, reduce_op op) {
    WEAVE_EXPECT(in.size() == out.size(), errc::size_mismatch, "all_reduce: ", in.size(),
                 " inputs for ", out.size(), " outputs");
    detail::local_post p = make(detail::local_op::all_reduce);
    p.send = reinterpret_cast<const std::byte*>(in.data());
    p.recv = reinterpret_cast<std::byte*>(out.data());
    p.count = in.size();
    p.type = detail::reduce_type_id<T>();
    p.reduction = op;
    enqueue(s, p);
  }

  //! Completes once every rank reached its barrier.
  void barrier(host_stream& s) { enqueue(s, make(detail::local_op::barrier)); }

  //! Declares this rank failed: every pending and later operation of every rank fails with a
  //! `peer_error` naming this rank and `reason`.
  void abort(const std::string& reason) { state_->abort({rank_, errc::internal, false, reason}); }
  //! As above, with the failure's code and message (its `rank` is taken as is: a failure that
  //! started elsewhere keeps its origin).
  void abort(const failure_record& why) { state_->abort(why); }
  //! True once the world was aborted (by any rank, or a timeout): every operation now fails.
  bool aborted() const { return state_->failed_rank() >= 0; }

 private:
  friend class local_world;

  local_communicator(std::shared_ptr<detail::local_world_state> state, int rank)
      : state_(std::move(state))
      , rank_(rank) {}

  detail::local_post make(detail::local_op op) {
    detail::local_post p;
    p.order = next_order_.fetch_add(1, std::memory_order_relaxed) + 1;
    p.op = op;
    return p;
  }

  void enqueue(host_stream& s, const detail::local_post& p) {
    s.submit_always(detail::local_task{state_, rank_, p});
  }

  std::shared_ptr<detail::local_world_state> state_;
  int rank_;
  std::atomic<std::uint64_t> next_order_{0};
};

static_assert(has_tagged_collectives<local_communicator> && has_send_recv<local_communicator> &&
              has_exchange_counts<local_communicator> &&
              has_deferred_exchange_counts<local_communicator> && has_barrier<local_communicator> &&
              has_all_reduce<local_communicator, double>);

//! N in-process ranks. Owns the shared state and one `local_communicator` per rank; the state
//! outlives the world while operations referring to it are still queued.
class local_world {
 public:
  //! A world of `size` ranks.
  explicit local_world(int size, local_world_options options = {})
      : state_(make_state(size, options)) {
    comms_.reserve(static_cast<std::size_t>(size));
    for (int r = 0; r < size; ++r)
      comms_.emplace_back(new local_communicator(state_, r));
  }

  //! Number of ranks.
  int size() const noexcept { return state_->size(); }

  //! Rank `r`'s communicator.
  local_communicator& comm(int r) {
    WEAVE_EXPECT(r >= 0 && r < size(), errc::out_of_range, "local_world: rank ", r,
                 " outside a world of ", size());
    return *comms_[static_cast<std::size_t>(r)];
  }

  //! Replaces the link from `src` to `dst`. Only before any operation is enqueued.
  void set_link(int src, int dst, const emulated_link& link) {
    WEAVE_EXPECT(src >= 0 && src < size() && dst >= 0 && dst < size(), errc::out_of_range,
                 "local_world::set_link: ranks ", src, " -> ", dst, " outside a world of ", size());
    state_->link(src, dst) = link;
  }

  //! The rank whose failure aborted the world, or -1.
  int failed_rank() const { return state_->failed_rank(); }

  //! Runs `f(comm(r))` on one thread per rank and joins them. A rank whose `f` throws aborts
  //! the world (the others' operations fail with `errc::peer_failure`); returns each rank's
  //! exception (null where it returned normally).
  template <class F>
  std::vector<std::exception_ptr> run_collect(F&& f) {
    std::vector<std::exception_ptr> failures(static_cast<std::size_t>(size()));
    std::vector<std::thread> threads;
    threads.reserve(failures.size());
    for (int r = 0; r < size(); ++r)
      threads.emplace_back([&, r] {
        try {
          f(comm(r));
        } catch (...) {
          failures[static_cast<std::size_t>(r)] = std::current_exception();
          state_->abort(record_of(failures[static_cast<std::size_t>(r)], r));
        }
      });
    for (std::thread& t : threads)
      t.join();
    return failures;
  }

  //! As `run_collect`, then throws the root cause: the exception of the rank whose failure
  //! aborted the world (else the lowest failing rank's). When several ranks failed, a
  //! `weave::error` root cause is rethrown with every rank's error appended to its message.
  template <class F>
  void run(F&& f) {
    const std::vector<std::exception_ptr> failures = run_collect(std::forward<F>(f));
    std::size_t root = failures.size(), count = 0;
    for (std::size_t r = 0; r < failures.size(); ++r)
      if (failures[r]) {
        root = std::min(root, r);
        ++count;
      }
    const int first = failed_rank();
    if (first >= 0 && failures[static_cast<std::size_t>(first)])
      root = static_cast<std::size_t>(first);
    if (count == 0)
      return;
    if (count == 1)
      std::rethrow_exception(failures[root]);
    std::string all = detail::concat("; every rank's error: [rank ", root, "] first");
    for (std::size_t r = 0; r < failures.size(); ++r)
      if (failures[r] && r != root)
        all += detail::concat("; [rank ", r, "] ", what_of(failures[r]));
    try {
      std::rethrow_exception(failures[root]);
    } catch (const peer_error& e) {
      throw peer_error(e.origin(), detail::concat("local_world::run, rank ", root, all), e.where());
    } catch (const error& e) {
      throw error(e.code(), e.message() + all, e.where());
    }
  }

 private:
  static std::shared_ptr<detail::local_world_state> make_state(int size,
                                                               const local_world_options& o) {
    WEAVE_EXPECT(size > 0, errc::invalid_argument, "local_world: size must be positive, got ",
                 size);
    WEAVE_EXPECT(o.timeout.count() > 0, errc::invalid_argument,
                 "local_world: timeout must be positive, got ", o.timeout.count(), " ms");
    return std::make_shared<detail::local_world_state>(size, o);
  }

  std::shared_ptr<detail::local_world_state> state_;
  std::vector<std::unique_ptr<local_communicator>> comms_;
};

WEAVE_NAMESPACE_END
