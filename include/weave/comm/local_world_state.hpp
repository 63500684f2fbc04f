//! \file
//! The engine behind `local_world`: its options, and the rendezvous every operation of its ranks
//! meets at (`detail::local_world_state`: posts, matching, copies, the emulated link's delays,
//! timeouts and aborts). See `local_world.hpp` for the behaviour it gives.
//!
//! What a rank posts is `detail::local_post` (`detail/local_world_posts.hpp`); how the ranks'
//! posts are checked and their data moved once all arrived is in
//! `detail/local_world_transfer.hpp` (included at the end of this header).
#pragma once

#include "weave/comm/communicator.hpp"
#include "weave/comm/detail/local_world_posts.hpp"
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

  // What the ranks moved, out of the class (detail/local_world_transfer.hpp): the checks of
  // a rank's own post, the copies between the posts (with the emulated link's delays), and
  // the reductions.
  void check_own(const local_post& post) const;
  static const peer_transfer* find(std::span<const peer_transfer> group, int peer);
  void transfer(int rank, const local_post& post);
  template <class T>
  void reduce_slice(int rank, const local_post& post);

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

#include "weave/comm/detail/local_world_transfer.hpp" // the data moves, out of the class
