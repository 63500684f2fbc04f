//! \file
//! `nccl_communicator`: weave's communicator over NCCL (component `weave::nccl`).
//!
//! Wraps a caller's `ncclComm_t` without owning it. Operations are enqueued on a borrowed CUDA
//! stream (`cuda_stream_ref`) and return at once; all_to_all_v and send_recv are one NCCL group
//! of ncclSend/ncclRecv. Unlike the host backends, NCCL needs the sizes on the host when the
//! operation is enqueued: all_to_all_v reads its count and displacement arrays (host memory)
//! during the call, while exchange_counts and all_reduce work on device memory. The
//! counts-then-all_to_all_v pattern therefore copies the exchanged counts to the host and waits
//! for them (`synchronize`) before enqueuing the all-to-all, as every NCCL MoE layer does.
//!
//! Failures: `synchronize(s)` waits for the stream while polling `ncclCommGetAsyncError`; an
//! asynchronous NCCL error or the timeout aborts the communicator (`ncclCommAbort`, which also
//! frees it: its owner must then not call `ncclCommDestroy`) and throws `errc::nccl` or
//! `errc::timeout`. `abort(why)` does the same on request (weave's layers call it when a step
//! fails after a dispatch). NCCL has no channel to tell the peers: they learn a failure from the
//! status weave's layers send with their count exchanges, or else from their own timeout (and,
//! over a network transport, from NCCL's remote error once the aborted rank's connections
//! close). Set `nccl_options.timeout` to what a step may take at most.
//!
//! Elastic use (`shrink.hpp`): with `nccl_options::on_failure = nccl_failure_action::revoke`, a
//! failure revokes the communicator (`ncclCommRevoke`, NCCL 2.28) instead of aborting it, so it
//! stays valid: `shrink(excluded)` then builds the survivors' communicator (`ncclCommShrink`) and
//! checks on it that every survivor excluded the same ranks. The owner of a revoked communicator
//! ends it with `ncclCommAbort` (NCCL forbids `ncclCommFinalize` after a revoke).
#pragma once

#include "weave/comm/communicator.hpp"
#include "weave/comm/cuda_all_gather.hpp"
#include "weave/comm/shrink.hpp"
#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/core/cuda_error.hpp"
#include "weave/core/error.hpp"
#include "weave/core/failure.hpp"
#include "weave/core/nccl_error.hpp"
#include "weave/exec/cuda_stream.hpp"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <thread>
#include <vector>

WEAVE_NAMESPACE_BEGIN

//! What an `nccl_communicator` does to its `ncclComm_t` when it gives up (an asynchronous
//! error, a timeout, `abort`).
enum class nccl_failure_action : int {
  abort = 0,  //!< `ncclCommAbort`, which frees it (its owner must not destroy it)
  revoke = 1, //!< `ncclCommRevoke`: it stays valid for `shrink` (its owner ends it with abort)
};

//! Settings of an `nccl_communicator`.
struct nccl_options {
  //! How long `synchronize` waits for the stream before giving up on the communicator.
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
  //! What giving up does: abort (the default) or revoke, to let the survivors `shrink`.
  nccl_failure_action on_failure = nccl_failure_action::abort;
};

namespace detail {

template <class T>
ncclDataType_t nccl_type() {
  if constexpr (std::is_same_v<T, float>)
    return ncclFloat32;
  else if constexpr (std::is_same_v<T, double>)
    return ncclFloat64;
  else if constexpr (std::is_same_v<T, std::int32_t>)
    return ncclInt32;
  else
    return ncclInt64;
}

} // namespace detail

//! One rank of an NCCL communicator, on the device current when it was constructed.
//! Not copyable; owns only a 4-byte device scratch word used by `barrier`.
class nccl_communicator {
 public:
  using stream_type = cuda_stream_ref;

  explicit nccl_communicator(ncclComm_t comm, nccl_options options = {})
      : comm_(comm)
      , options_(options) {
    WEAVE_EXPECT(comm != nullptr, errc::invalid_argument, "nccl_communicator: null ncclComm_t");
    WEAVE_NCCL_CHECK(ncclCommUserRank(comm_, &rank_));
    WEAVE_NCCL_CHECK(ncclCommCount(comm_, &size_));
    WEAVE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&scratch_), sizeof(int)));
    WEAVE_CUDA_CHECK(cudaMemset(scratch_, 0, sizeof(int)));
  }
  nccl_communicator(const nccl_communicator&) = delete;
  nccl_communicator& operator=(const nccl_communicator&) = delete;
  ~nccl_communicator() {
    if (scratch_)
      (void)cudaFree(scratch_);
    if (owned_ && comm_ != nullptr) // a communicator `shrink` made
      (void)(revoked_ ? ncclCommAbort(comm_) : ncclCommDestroy(comm_));
  }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  //! The wrapped communicator (null after an abort; still valid after a revoke).
  ncclComm_t get() const noexcept { return comm_; }

  //! True once the communicator was given up (aborted or revoked, after an error, a timeout or
  //! `abort`): every later operation fails.
  bool aborted() const noexcept { return comm_ == nullptr || revoked_; }
  //! True once it was revoked rather than aborted (`nccl_failure_action::revoke`).
  bool revoked() const noexcept { return revoked_; }

  //! The survivors' communicator (see `shrink.hpp`): revokes this one if that was not done yet,
  //! waits until it is quiescent, and calls `ncclCommShrink` without `excluded`; the result owns
  //! the new `ncclComm_t`. Collective over the survivors, who must all exclude the same ranks:
  //! that is checked on the new communicator (`errc::config_mismatch`), though ranks whose
  //! lists differ in length may not get that far (NCCL may fail or time out in the shrink).
  //! Throws `errc::invalid_state` after an abort (`ncclCommAbort` freed the communicator: set
  //! `on_failure = revoke`), `errc::invalid_argument` when this rank excludes itself,
  //! `errc::not_supported` before NCCL 2.28.
  shrunk_communicator<nccl_communicator> shrink(std::span<const int> excluded = {}) {
    const std::vector<int> ex =
        detail::excluded_ranks(excluded, size_, "nccl_communicator::shrink");
    WEAVE_EXPECT(comm_ != nullptr, errc::invalid_state, "nccl_communicator rank ", rank_,
                 ": cannot shrink a communicator that was aborted (ncclCommAbort frees it); set "
                 "nccl_options::on_failure = nccl_failure_action::revoke");
    WEAVE_EXPECT(!std::binary_search(ex.begin(), ex.end(), rank_), errc::invalid_argument,
                 "nccl_communicator rank ", rank_, ": shrink excludes this rank itself");
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
    WEAVE_NCCL_CHECK(revoke());
    const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
    for (ncclResult_t state = ncclInProgress; state == ncclInProgress;) {
      WEAVE_NCCL_CHECK(ncclCommGetAsyncError(comm_, &state));
      WEAVE_EXPECT(std::chrono::steady_clock::now() < deadline, errc::timeout,
                   "nccl_communicator rank ", rank_, ": still not quiescent ",
                   options_.timeout.count(), " ms after its revoke");
      if (state == ncclInProgress)
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    ncclComm_t next = nullptr;
    std::vector<int> list = ex; // NCCL takes a non-const list
    WEAVE_NCCL_CHECK(ncclCommShrink(comm_, list.empty() ? nullptr : list.data(),
                                    static_cast<int>(list.size()), &next, nullptr,
                                    NCCL_SHRINK_DEFAULT));
    shrunk_communicator<nccl_communicator> out;
    out.comm.reset(new nccl_communicator(next, options_));
    out.comm->owned_ = true;
    for (int r = 0; r < size_; ++r)
      (std::binary_search(ex.begin(), ex.end(), r) ? out.lost : out.survivors).push_back(r);
    // The agreement: every survivor excluded the same ranks.
    std::int64_t digest = static_cast<std::int64_t>(ex.size());
    for (const int r : ex)
      digest = digest * 1000003 + r + 1;
    const std::int64_t mine[2] = {static_cast<std::int64_t>(ex.size()), digest};
    const std::vector<std::int64_t> all = out.comm->all_gather_now(mine);
    for (std::size_t i = 0; i < out.survivors.size(); ++i)
      WEAVE_EXPECT(all[2 * i] == mine[0] && all[2 * i + 1] == mine[1], errc::config_mismatch,
                   "nccl_communicator rank ", rank_,
                   ": the survivors disagree about who is left: ", "this rank excludes ",
                   detail::rank_list(ex), ", old rank ", out.survivors[i], " excludes ", all[2 * i],
                   " other rank(s)");
    return out;
#else
    WEAVE_THROW(errc::not_supported,
                "nccl_communicator::shrink needs NCCL 2.28 or later "
                "(ncclCommRevoke, ncclCommShrink); this is NCCL ",
                NCCL_MAJOR, ".", NCCL_MINOR);
#endif
  }

  //! Aborts the communicator (`ncclCommAbort`; its owner must then not destroy it) because of
  //! `why`; later operations fail with `errc::invalid_state` naming it. Idempotent.
  void abort(const failure_record& why) {
    if (aborted())
      return;
    why_ = why.describe();
    abort();
  }
  //! As above, for a failure described by text only.
  void abort(const std::string& reason) {
    abort(failure_record{rank_, errc::internal, false, reason});
  }

  //! A blocking all-gather of a few 64-bit words per rank, for setup-time agreement (not for the
  //! hot path): through a temporary device buffer and stream, waited for by `synchronize`.
  std::vector<std::int64_t> all_gather_now(std::span<const std::int64_t> mine) {
    usable();
    return detail::all_gather_through_device(
        size_, mine,
        [this](cuda_stream_ref s, std::span<const std::int64_t> send,
               std::span<std::int64_t> recv) { exchange_counts(s, send, recv); },
        [this](cuda_stream_ref s) { synchronize(s); });
  }

  //! One NCCL group of ncclSend/ncclRecv; the transfer list is read during the call.
  void send_recv(cuda_stream_ref s, std::span<const peer_transfer> transfers) {
    usable();
    WEAVE_NCCL_CHECK(ncclGroupStart());
    ncclResult_t status = ncclSuccess;
    for (const peer_transfer& t : transfers) {
      if (status == ncclSuccess && t.send_bytes > 0)
        status = ncclSend(t.send, static_cast<std::size_t>(t.send_bytes), ncclUint8, t.peer, comm_,
                          s.get());
      if (status == ncclSuccess && t.recv_bytes > 0)
        status = ncclRecv(t.recv, static_cast<std::size_t>(t.recv_bytes), ncclUint8, t.peer, comm_,
                          s.get());
    }
    const ncclResult_t end = ncclGroupEnd(); // always close the group
    WEAVE_NCCL_CHECK(status);
    WEAVE_NCCL_CHECK(end);
  }

  //! Variable all-to-all of device buffers; counts and displacements (host memory, in units of
  //! `unit` bytes) are read during the call.
  void all_to_all_v(cuda_stream_ref s, const void* send, std::span<const std::int64_t> send_counts,
                    std::span<const std::int64_t> send_displs, void* recv,
                    std::span<const std::int64_t> recv_counts,
                    std::span<const std::int64_t> recv_displs, std::size_t unit = 1) {
    detail::check_layout(size_, send_counts, send_displs, unit, "send");
    detail::check_layout(size_, recv_counts, recv_displs, unit, "receive");
    usable();
    const auto u = static_cast<std::int64_t>(unit);
    WEAVE_NCCL_CHECK(ncclGroupStart());
    ncclResult_t status = ncclSuccess;
    for (int peer = 0; peer < size_ && status == ncclSuccess; ++peer) {
      const auto p = static_cast<std::size_t>(peer);
      if (send_counts[p] > 0)
        status =
            ncclSend(static_cast<const std::byte*>(send) + send_displs[p] * u,
                     static_cast<std::size_t>(send_counts[p] * u), ncclUint8, peer, comm_, s.get());
      if (status == ncclSuccess && recv_counts[p] > 0)
        status =
            ncclRecv(static_cast<std::byte*>(recv) + recv_displs[p] * u,
                     static_cast<std::size_t>(recv_counts[p] * u), ncclUint8, peer, comm_, s.get());
    }
    const ncclResult_t end = ncclGroupEnd();
    WEAVE_NCCL_CHECK(status);
    WEAVE_NCCL_CHECK(end);
  }

  //! Sends device counts `send[j*k .. j*k+k)` to rank j, receives rank j's at `recv[j*k ..)`.
  void exchange_counts(cuda_stream_ref s, std::span<const std::int64_t> send,
                       std::span<std::int64_t> recv) {
    const auto n = static_cast<std::size_t>(size_);
    WEAVE_EXPECT(!send.empty() && send.size() % n == 0 && recv.size() == send.size(),
                 errc::size_mismatch, "exchange_counts: ", send.size(), " send and ", recv.size(),
                 " receive counts for ", size_, " ranks");
    usable();
    const std::size_t k = send.size() / n;
    WEAVE_NCCL_CHECK(ncclGroupStart());
    ncclResult_t status = ncclSuccess;
    for (int peer = 0; peer < size_ && status == ncclSuccess; ++peer) {
      const std::size_t at = static_cast<std::size_t>(peer) * k;
      status = ncclSend(send.data() + at, k, ncclInt64, peer, comm_, s.get());
      if (status == ncclSuccess)
        status = ncclRecv(recv.data() + at, k, ncclInt64, peer, comm_, s.get());
    }
    const ncclResult_t end = ncclGroupEnd();
    WEAVE_NCCL_CHECK(status);
    WEAVE_NCCL_CHECK(end);
  }

  //! Element-wise reduction of device arrays (`in` may equal `out`).
  template <reducible T>
  void all_reduce(cuda_stream_ref s, std::span<const T> in, std::span<T> out, reduce_op op) {
    WEAVE_EXPECT(in.size() == out.size(), errc::size_mismatch, "all_reduce: ", in.size(),
                 " inputs for ", out.size(), " outputs");
    usable();
    WEAVE_NCCL_CHECK(ncclAllReduce(in.data(), out.data(), in.size(), detail::nccl_type<T>(),
                                   op == reduce_op::sum ? ncclSum : ncclMax, comm_, s.get()));
  }

  //! A stream-ordered barrier (an all-reduce of one device word).
  void barrier(cuda_stream_ref s) {
    usable();
    WEAVE_NCCL_CHECK(ncclAllReduce(scratch_, scratch_, 1, ncclInt32, ncclSum, comm_, s.get()));
  }

  //! Waits for `s` (a stream, or an event: anything with `query()`) while watching the
  //! communicator: an asynchronous NCCL error or the timeout aborts it and throws (`errc::nccl` /
  //! `errc::timeout`).
  template <class Waitable>
  requires requires(const Waitable& w) {
    { w.query() } -> std::convertible_to<bool>;
  }
  void synchronize(const Waitable& s) {
    usable();
    const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
    for (;;) {
      ncclResult_t async = ncclSuccess;
      WEAVE_NCCL_CHECK(ncclCommGetAsyncError(comm_, &async));
      if (async != ncclSuccess && async != ncclInProgress) {
        abort();
        WEAVE_THROW(errc::nccl, "nccl_communicator rank ", rank_, ": asynchronous NCCL error ",
                    ncclGetErrorString(async), " (", static_cast<int>(async),
                    "); the communicator was aborted");
      }
      if (s.query())
        return;
      if (std::chrono::steady_clock::now() > deadline) {
        abort();
        WEAVE_THROW(errc::timeout, "nccl_communicator rank ", rank_, ": work not done after ",
                    options_.timeout.count(),
                    " ms (a peer never arrived or died); the communicator was aborted");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

 private:
  void usable() const {
    WEAVE_EXPECT(comm_ != nullptr && !revoked_, errc::invalid_state, "nccl_communicator rank ",
                 rank_, ": used after it was aborted", why_.empty() ? "" : " (", why_,
                 why_.empty() ? "" : ")");
  }
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
  // Revokes the communicator once (`ncclCommRevoke`); later calls do nothing.
  ncclResult_t revoke() noexcept {
    if (revoked_)
      return ncclSuccess;
    revoked_ = true;
    return ncclCommRevoke(comm_, NCCL_REVOKE_DEFAULT);
  }
#endif
  // Gives up on the communicator: aborts it (freed) or revokes it (kept for `shrink`).
  void abort() noexcept {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
    if (options_.on_failure == nccl_failure_action::revoke) {
      (void)revoke();
      return;
    }
#endif
    (void)ncclCommAbort(comm_);
    comm_ = nullptr;
  }

  ncclComm_t comm_;
  nccl_options options_;
  std::string why_; // what `abort(why)` was given
  int rank_ = 0;
  int size_ = 0;
  int* scratch_ = nullptr;
  bool revoked_ = false; // ncclCommRevoke was called: only shrink and abort remain
  bool owned_ = false;   // made by `shrink`: this object ends it
};

static_assert(has_all_to_all_v<nccl_communicator> && has_send_recv<nccl_communicator> &&
              has_shrink<nccl_communicator> && has_exchange_counts<nccl_communicator> &&
              has_barrier<nccl_communicator> && has_all_reduce<nccl_communicator, float>);

WEAVE_NAMESPACE_END
