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
//!
//! After a failure the ranks still alive may `shrink` the world and go on without the lost ones
//! (see `shrink.hpp`): a rank that threw inside `run`, whose handle was destroyed, that a
//! timeout found missing, or that does not reach the shrink within the world's timeout is left
//! out.
#pragma once

#include "weave/comm/communicator.hpp"
#include "weave/comm/local_world_state.hpp"
#include "weave/comm/shrink.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/failure.hpp"
#include "weave/exec/host_stream.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

WEAVE_NAMESPACE_BEGIN

//! One rank's handle to a `local_world`. Operations run on a `host_stream` the caller owns; a
//! handle's operations must be enqueued from one thread at a time (they take sequence numbers
//! in call order, and every rank must call the same operations in the same order).
class local_communicator {
 public:
  using stream_type = host_stream;

  local_communicator(const local_communicator&) = delete;
  local_communicator& operator=(const local_communicator&) = delete;
  //! A destroyed handle's rank takes no part in a later shrink of its world.
  ~local_communicator() { state_->shrink_round().depart(rank_); }

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
    detail::local_post p = all_to_all_post(detail::local_op::all_to_all_v, send, send_counts,
                                           send_displs, recv, recv_counts, recv_displs, unit);
    p.tag = tag;
    enqueue(s, p, [=] { return detail::moved_bytes(send_counts, recv_counts, unit); });
  }

  //! `all_to_all_v` whose receive counts are room, not sizes: rank j's block to this rank may be
  //! shorter than `recv_counts[j]`, and its length (units) is written to `received[j]` when the
  //! operation has run. A block longer than its room fails with `errc::size_mismatch`. Untagged:
  //! a layer that uses it carries its own headers (see `has_bounded_all_to_all`).
  void all_to_all_v_bounded(host_stream& s, const void* send,
                            std::span<const std::int64_t> send_counts,
                            std::span<const std::int64_t> send_displs, void* recv,
                            std::span<const std::int64_t> recv_counts,
                            std::span<const std::int64_t> recv_displs,
                            std::span<std::int64_t> received, std::size_t unit = 1) {
    detail::local_post p =
        all_to_all_post(detail::local_op::all_to_all_v_bounded, send, send_counts, send_displs,
                        recv, recv_counts, recv_displs, unit);
    p.received = received;
    enqueue(s, p, [=] { return detail::moved_bytes(send_counts, recv_counts, unit); });
  }

  //! Grouped point-to-point transfers. In a local_world every rank takes part in each group
  //! (with an empty list if it exchanges nothing).
  void send_recv(host_stream& s, std::span<const peer_transfer> transfers) {
    detail::local_post p = make(detail::local_op::send_recv);
    p.transfers = transfers;
    enqueue(s, p, [transfers] {
      std::size_t bytes = 0;
      for (const peer_transfer& t : transfers)
        bytes += static_cast<std::size_t>(std::max<std::int64_t>(t.send_bytes, 0)) +
                 static_cast<std::size_t>(std::max<std::int64_t>(t.recv_bytes, 0));
      return bytes;
    });
  }

  //! Sends the k counts `send[j * k, (j + 1) * k)` to rank j and receives rank j's k counts into
  //! `recv[j * k, (j + 1) * k)`, where k = send.size() / size(). Ranks disagreeing on k fail
  //! with `errc::size_mismatch`.
  void exchange_counts(host_stream& s, std::span<const std::int64_t> send,
                       std::span<std::int64_t> recv, call_tag tag = {}) {
    const std::size_t bytes = 2 * send.size() * sizeof(std::int64_t);
    run(s, deferred_exchange_counts(send, recv, tag), [bytes] { return bytes; });
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
    const std::size_t bytes = 2 * in.size() * sizeof(T);
    enqueue(s, p, [bytes] { return bytes; });
  }

  //! Completes once every rank reached its barrier.
  void barrier(host_stream& s) {
    enqueue(s, make(detail::local_op::barrier), [] { return std::size_t{0}; });
  }

  //! Declares this rank failed: every pending and later operation of every rank fails with a
  //! `peer_error` naming this rank and `reason`.
  void abort(const std::string& reason) { state_->abort({rank_, errc::internal, false, reason}); }
  //! As above, with the failure's code and message (its `rank` is taken as is: a failure that
  //! started elsewhere keeps its origin).
  void abort(const failure_record& why) { state_->abort(why); }
  //! True once the world was aborted (by any rank, or a timeout): every operation now fails.
  bool aborted() const { return state_->failed_rank() >= 0; }

  //! Revokes this world (every operation of every rank fails from now on, as after an abort)
  //! and joins its survivors' agreement (see `shrink.hpp`): returns this rank's handle to a new
  //! world of the ranks that reached the shrink, less `excluded`, with the same options and
  //! links. A rank whose thread ended, whose handle was destroyed or that a timeout of this
  //! world found missing is not waited for; any other rank that does not arrive is left out
  //! after the world's timeout. Throws `errc::config_mismatch` on every rank when the ranks'
  //! `excluded` differ, `errc::invalid_state` for a rank excluded or arriving after the group
  //! closed, `errc::out_of_range` for an excluded rank outside the world. Once per world:
  //! shrink the new handle after a later failure.
  shrunk_communicator<local_communicator> shrink(std::span<const int> excluded = {}) {
    std::vector<int> ex = detail::excluded_ranks(excluded, size(), "local_communicator::shrink");
    state_->abort({rank_, errc::invalid_state, true,
                   detail::concat("rank ", rank_, " revoked the world to shrink it")});
    const auto old = state_;
    auto out = state_->shrink_round().join(
        rank_, std::move(ex), state_->timeout(), [old](const std::vector<int>& survivors) {
          local_world_options o = old->options();
          auto next =
              std::make_shared<detail::local_world_state>(static_cast<int>(survivors.size()), o);
          for (std::size_t i = 0; i < survivors.size(); ++i)
            for (std::size_t j = 0; j < survivors.size(); ++j)
              if (i != j)
                next->link(static_cast<int>(i), static_cast<int>(j)) =
                    old->link(survivors[i], survivors[j]);
          return next;
        });
    const auto at = std::find(out.survivors.begin(), out.survivors.end(), rank_);
    const int new_rank = static_cast<int>(at - out.survivors.begin());
    shrunk_communicator<local_communicator> result;
    result.comm.reset(new local_communicator(std::move(out.next), new_rank));
    result.lost = detail::lost_ranks(out.survivors, size());
    result.survivors = std::move(out.survivors);
    return result;
  }

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

  // The post of an all-to-all (exact or bounded): what both send and receive.
  detail::local_post all_to_all_post(detail::local_op op, const void* send,
                                     std::span<const std::int64_t> send_counts,
                                     std::span<const std::int64_t> send_displs, void* recv,
                                     std::span<const std::int64_t> recv_counts,
                                     std::span<const std::int64_t> recv_displs, std::size_t unit) {
    detail::local_post p = make(op);
    p.send = static_cast<const std::byte*>(send);
    p.recv = static_cast<std::byte*>(recv);
    p.send_counts = send_counts;
    p.send_displs = send_displs;
    p.recv_counts = recv_counts;
    p.recv_displs = recv_displs;
    p.unit = unit;
    return p;
  }

  template <class Bytes>
  void enqueue(host_stream& s, const detail::local_post& p, Bytes bytes) {
    run(s, detail::local_task{state_, rank_, p}, std::move(bytes));
  }

  // On the calling thread when the stream is idle and the operation small (see
  // `local_world_options::inline_max_bytes`); `bytes()` is asked only then, once the work
  // before it (which may fill its counts) has run.
  template <class Bytes>
  void run(host_stream& s, detail::local_task task, Bytes bytes) {
    if (!state_->inline_enabled())
      s.submit_always(std::move(task));
    else
      s.run_inline_or_submit_always(std::move(task),
                                    [this, &bytes] { return state_->runs_inline(bytes()); });
  }

  std::shared_ptr<detail::local_world_state> state_;
  int rank_;
  std::atomic<std::uint64_t> next_order_{0};
};

static_assert(has_tagged_collectives<local_communicator> && has_send_recv<local_communicator> &&
              has_shrink<local_communicator> && has_exchange_counts<local_communicator> &&
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
        state_->shrink_round().depart(r); // this rank takes no part in a later shrink
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
