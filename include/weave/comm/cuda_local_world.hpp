//! \file
//! `cuda_local_world`: N ranks of one process on CUDA streams, one host thread each, exchanging
//! device buffers with stream-ordered `cudaMemcpyAsync` (component `weave::cuda`; host compiler
//! and the CUDA runtime). It lets the CUDA exchanges run several ranks on one GPU (NCCL admits
//! one rank per GPU per communicator) or on the GPUs of one node, and is how the CUDA tests
//! check multi-rank exchanges on a single GPU.
//!
//! A collective is a rendezvous at enqueue time: each rank posts its buffers, counts and an
//! event marking where its stream is; once every rank has posted, each enqueues on its own
//! stream a wait for every peer's event and the copies of what the peers send it (the receiver
//! pulls), records a second event, and after a second rendezvous every stream waits for every
//! peer's copies, so buffers may be reused by later work. Nothing waits for the GPU. Counts and
//! displacements are host arrays read at the call; buffers are device (or managed) memory.
//! Ranks must enqueue the same collectives in the same order; a mismatch fails with
//! `errc::size_mismatch` / `errc::invalid_state`, a rank that throws fails its peers with
//! `errc::peer_failure`, a rank that never arrives fails them with `errc::timeout`.
#pragma once

#include "weave/comm/call_tag.hpp"
#include "weave/comm/communicator.hpp"
#include "weave/comm/cuda_all_gather.hpp"
#include "weave/core/config.hpp"
#include "weave/core/cuda_error.hpp"
#include "weave/core/error.hpp"
#include "weave/exec/cuda_stream.hpp"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

WEAVE_NAMESPACE_BEGIN

class cuda_local_world;

//! One rank's handle to a `cuda_local_world`. Not copyable; owned by the world.
class cuda_local_communicator {
 public:
  using stream_type = cuda_stream_ref;

  int rank() const noexcept { return rank_; }
  int size() const noexcept;

  //! `send_counts[j]` units from unit `send_displs[j]` of `send` go to rank j; `recv_counts[j]`
  //! units from rank j land at unit `recv_displs[j]` of `recv`. Enqueued on `s`.
  //! Ranks whose `tag`s differ fail with `errc::call_mismatch` before anything is enqueued.
  void all_to_all_v(cuda_stream_ref s, const void* send, std::span<const std::int64_t> send_counts,
                    std::span<const std::int64_t> send_displs, void* recv,
                    std::span<const std::int64_t> recv_counts,
                    std::span<const std::int64_t> recv_displs, std::size_t unit = 1,
                    call_tag tag = {});

  //! Sends `send[j * k, (j + 1) * k)` to rank j and receives rank j's k counts into
  //! `recv[j * k, (j + 1) * k)` (device memory, k = send.size() / size()).
  void exchange_counts(cuda_stream_ref s, std::span<const std::int64_t> send,
                       std::span<std::int64_t> recv, call_tag tag = {});

  //! Fails every pending and later collective of the world with `errc::peer_failure`.
  void abort(const std::string& reason);

  //! True once the world failed (a rank aborted or threw, or a collective failed).
  bool aborted() const;

  //! A blocking all-gather of a few 64-bit words per rank, for setup-time agreement (not for the
  //! hot path): through a temporary device buffer and stream.
  std::vector<std::int64_t> all_gather_now(std::span<const std::int64_t> mine);

 private:
  friend class cuda_local_world;
  cuda_local_communicator(cuda_local_world& world, int rank)
      : world_(&world)
      , rank_(rank)
      , ready_(cudaEventDisableTiming)
      , done_(cudaEventDisableTiming) {}

  cuda_local_world* world_;
  int rank_;
  cuda_event ready_, done_;
  std::vector<std::int64_t> counts_, displs_; // exchange_counts' layout
};

//! Ranks of one process on CUDA streams (see the file comment).
class cuda_local_world {
 public:
  //! `size` ranks on the device current on the calling thread (every rank thread uses it).
  explicit cuda_local_world(int size, std::chrono::milliseconds timeout = std::chrono::seconds(60))
      : timeout_(timeout)
      , posts_(static_cast<std::size_t>(size)) {
    WEAVE_EXPECT(size >= 1, errc::invalid_argument, "cuda_local_world of ", size, " ranks");
    WEAVE_CUDA_CHECK(cudaGetDevice(&device_));
    for (int r = 0; r < size; ++r)
      comms_.emplace_back(new cuda_local_communicator(*this, r));
  }

  int size() const noexcept { return static_cast<int>(comms_.size()); }
  int device() const noexcept { return device_; }
  cuda_local_communicator& comm(int r) { return *comms_.at(static_cast<std::size_t>(r)); }

  //! Runs `f(comm(r))` on one thread per rank (each with the world's device current) and
  //! rethrows the first failure after all threads ended.
  template <class F>
  void run(F&& f) {
    std::vector<std::exception_ptr> failures(comms_.size());
    std::vector<std::thread> threads;
    for (std::size_t r = 0; r < comms_.size(); ++r)
      threads.emplace_back([&, r] {
        try {
          WEAVE_CUDA_CHECK(cudaSetDevice(device_));
          f(*comms_[r]);
        } catch (const std::exception& e) {
          failures[r] = std::current_exception();
          fail("rank " + std::to_string(r) + " failed: " + e.what());
        } catch (...) {
          failures[r] = std::current_exception();
          fail("rank " + std::to_string(r) + " failed");
        }
      });
    for (std::thread& t : threads)
      t.join();
    for (const auto& failure : failures)
      if (failure)
        std::rethrow_exception(failure);
  }

 private:
  friend class cuda_local_communicator;

  struct post {
    std::uint64_t sequence = 0;
    const std::byte* send = nullptr;
    std::vector<std::int64_t> send_counts, send_displs;
    std::size_t unit = 0;
    const cuda_event* ready = nullptr;
    const cuda_event* done = nullptr;
    call_tag tag{};
  };

  void fail(const std::string& reason) {
    {
      std::lock_guard lock(mutex_);
      if (failure_.empty())
        failure_ = reason;
    }
    changed_.notify_all();
  }

  // Waits until every rank reached `phase` of collective `sequence`.
  void rendezvous(std::unique_lock<std::mutex>& lock, std::uint64_t target) {
    arrived_ += 1;
    changed_.notify_all();
    const bool ok = changed_.wait_for(
        lock, timeout_, [&] { return !failure_.empty() || arrived_ >= target * comms_.size(); });
    WEAVE_EXPECT(failure_.empty(), errc::peer_failure, "cuda_local_world: ", failure_);
    WEAVE_EXPECT(ok, errc::timeout, "cuda_local_world: a rank did not reach the collective within ",
                 timeout_.count(), " ms");
  }

  // One rank's part of an all-to-all (see the file comment).
  void exchange(cuda_local_communicator& me, cuda_stream_ref s, const void* send,
                std::span<const std::int64_t> send_counts,
                std::span<const std::int64_t> send_displs, void* recv,
                std::span<const std::int64_t> recv_counts,
                std::span<const std::int64_t> recv_displs, std::size_t unit, call_tag tag) {
    const auto n = comms_.size();
    WEAVE_EXPECT(send_counts.size() == n && send_displs.size() == n && recv_counts.size() == n &&
                     recv_displs.size() == n,
                 errc::size_mismatch, "cuda_local_world all_to_all_v: count arrays of ",
                 send_counts.size(), "/", send_displs.size(), "/", recv_counts.size(), "/",
                 recv_displs.size(), " entries for ", n, " ranks");
    for (std::size_t j = 0; j < n; ++j)
      WEAVE_EXPECT(send_counts[j] >= 0 && send_displs[j] >= 0 && recv_counts[j] >= 0 &&
                       recv_displs[j] >= 0,
                   errc::invalid_argument,
                   "cuda_local_world all_to_all_v: negative count or "
                   "displacement for rank ",
                   j);
    s.record(me.ready_);
    std::unique_lock lock(mutex_);
    const auto r = static_cast<std::size_t>(me.rank_);
    const std::uint64_t sequence = ++sequence_of_[r];
    post& mine = posts_[r];
    mine.sequence = sequence;
    mine.send = static_cast<const std::byte*>(send);
    mine.send_counts.assign(send_counts.begin(), send_counts.end());
    mine.send_displs.assign(send_displs.begin(), send_displs.end());
    mine.unit = unit;
    mine.ready = &me.ready_;
    mine.done = &me.done_;
    mine.tag = tag;
    rendezvous(lock, 2 * sequence - 1);
    for (std::size_t j = 0; j < n; ++j) {
      const post& peer = posts_[j];
      if (peer.sequence == sequence && peer.tag != tag) { // another call: fail every rank
        try {
          detail::throw_call_mismatch("cuda_local_world", static_cast<int>(r), tag,
                                      static_cast<int>(j), peer.tag);
        } catch (const error& e) {
          lock.unlock();
          fail(e.message());
          throw;
        }
      }
      WEAVE_EXPECT(peer.sequence == sequence && peer.unit == unit, errc::invalid_state,
                   "cuda_local_world: rank ", j, " is in another collective than rank ", r);
      WEAVE_EXPECT(peer.send_counts[r] == recv_counts[j], errc::size_mismatch, "rank ", j,
                   " sends ", peer.send_counts[r], " units to rank ", r, " but rank ", r,
                   " expects ", recv_counts[j]);
    }
    for (std::size_t j = 0; j < n; ++j) {
      const post& peer = posts_[j];
      s.wait(*peer.ready);
      const auto bytes = static_cast<std::size_t>(recv_counts[j]) * unit;
      if (bytes != 0)
        WEAVE_CUDA_CHECK(cudaMemcpyAsync(
            static_cast<std::byte*>(recv) + static_cast<std::size_t>(recv_displs[j]) * unit,
            peer.send + static_cast<std::size_t>(peer.send_displs[r]) * unit, bytes,
            cudaMemcpyDefault, s.get()));
    }
    s.record(me.done_);
    rendezvous(lock, 2 * sequence);
    for (std::size_t j = 0; j < n; ++j)
      s.wait(*posts_[j].done);
  }

  int device_ = 0;
  std::chrono::milliseconds timeout_;
  std::vector<std::unique_ptr<cuda_local_communicator>> comms_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<post> posts_;
  std::vector<std::uint64_t> sequence_of_ = std::vector<std::uint64_t>(posts_.size(), 0);
  std::uint64_t arrived_ = 0;
  std::string failure_;
};

inline int cuda_local_communicator::size() const noexcept {
  return world_->size();
}

inline void cuda_local_communicator::all_to_all_v(cuda_stream_ref s, const void* send,
                                                  std::span<const std::int64_t> send_counts,
                                                  std::span<const std::int64_t> send_displs,
                                                  void* recv,
                                                  std::span<const std::int64_t> recv_counts,
                                                  std::span<const std::int64_t> recv_displs,
                                                  std::size_t unit, call_tag tag) {
  world_->exchange(*this, s, send, send_counts, send_displs, recv, recv_counts, recv_displs, unit,
                   tag);
}

inline void cuda_local_communicator::exchange_counts(cuda_stream_ref s,
                                                     std::span<const std::int64_t> send,
                                                     std::span<std::int64_t> recv, call_tag tag) {
  const auto n = static_cast<std::size_t>(size());
  WEAVE_EXPECT(send.size() % n == 0 && recv.size() == send.size(), errc::size_mismatch,
               "exchange_counts: ", send.size(), " counts to send and ", recv.size(),
               " to receive for ", n, " ranks");
  const auto k = static_cast<std::int64_t>(send.size() / n);
  counts_.assign(n, k); // reuses its capacity: no allocation after the first call
  displs_.resize(n);
  for (std::size_t j = 0; j < n; ++j)
    displs_[j] = static_cast<std::int64_t>(j) * k;
  all_to_all_v(s, send.data(), counts_, displs_, recv.data(), counts_, displs_,
               sizeof(std::int64_t), tag);
}

inline void cuda_local_communicator::abort(const std::string& reason) {
  world_->fail("rank " + std::to_string(rank_) + " aborted: " + reason);
}

inline bool cuda_local_communicator::aborted() const {
  std::lock_guard lock(world_->mutex_);
  return !world_->failure_.empty();
}

inline std::vector<std::int64_t>
cuda_local_communicator::all_gather_now(std::span<const std::int64_t> mine) {
  return detail::all_gather_through_device(
      size(), mine,
      [this](cuda_stream_ref s, std::span<const std::int64_t> send, std::span<std::int64_t> recv) {
        exchange_counts(s, send, recv);
      },
      [](cuda_stream_ref s) { WEAVE_CUDA_CHECK(cudaStreamSynchronize(s.get())); });
}

static_assert(has_tagged_collectives<cuda_local_communicator>);

WEAVE_NAMESPACE_END
