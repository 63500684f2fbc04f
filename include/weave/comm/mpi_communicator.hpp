//! \file
//! `mpi_communicator`: weave's communicator over MPI (component `weave::mpi`).
//!
//! Wraps a caller's `MPI_Comm` without owning it: the constructor duplicates it (collective) and
//! owns only the duplicates, on which it installs `MPI_ERRORS_RETURN` (so MPI failures become
//! `errc::mpi` errors naming the operation and MPI's error string instead of aborting the job;
//! the caller's communicator and its handler are left untouched, and weave's traffic cannot
//! match the caller's messages). Operations are non-blocking MPI calls (MPI_Isend/MPI_Irecv per
//! peer, MPI_Ialltoall, MPI_Iallreduce, MPI_Ibarrier) issued and progressed by a task on a
//! `host_stream`, so they compose with compute on other streams; a small one on an idle stream
//! runs on the calling thread instead, saving the hand-off (`mpi_options::inline_max_bytes`).
//!
//! Failures (fail-stop): `abort(why)` sends a failure notice to every peer over a second
//! duplicate (`mpi_failure_notices`), where each rank keeps a receive posted; an operation waiting
//! for a peer that aborted fails at once with a `peer_error` naming that rank, its code and its
//! message. A timeout aborts the same way. MPI cannot cancel a collective, so after an abort the
//! communicator is unusable (every later operation fails at once): the collective the
//! survivors were in stays incomplete, and MPI may still write into the receive buffers it
//! named until `MPI_Finalize`, so keep them alive until then (or end the job); for the same
//! reason the destructor leaves that duplicate to `MPI_Finalize`. `all_to_all_v` is point to
//! point, so its errors (a truncated block) come back on the duplicate; Open MPI 4.1 reports
//! errors found inside its non-blocking collectives (an untagged `exchange_counts` whose ranks
//! disagree) through `MPI_COMM_WORLD`'s handler (fatal by default): weave's layers rule them out
//! by agreeing on their configuration first; for direct use, set `MPI_ERRORS_RETURN` on
//! `MPI_COMM_WORLD` to have them reported as `errc::mpi`.
//!
//! 64-bit sizes: MPI 3.1 (Open MPI 4.1) counts are `int`. `all_to_all_v` sends each peer block
//! point to point from its own address (no `int` displacement), in pieces of at most
//! `max_chunk_units` units (at most INT_MAX / size); both sides know the block's count, so they
//! cut it alike. Results are identical to one MPI_Alltoallv in every case.
#pragma once

#include "weave/comm/communicator.hpp"
#include "weave/comm/mpi_call_header.hpp"
#include "weave/comm/mpi_failure_notices.hpp"
#include "weave/comm/mpi_options.hpp"
#include "weave/comm/shrink.hpp"
#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/failure.hpp"
#include "weave/core/mpi_error.hpp"
#include "weave/core/retain.hpp"
#include "weave/exec/host_stream.hpp"

#include <mpi.h>
#if defined(OPEN_MPI) && __has_include(<mpi-ext.h>)
#include <mpi-ext.h> // tells whether this Open MPI has the ULFM extension
#endif

#include <atomic>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

WEAVE_NAMESPACE_BEGIN

//! One rank of an MPI communicator. Not copyable or movable (queued tasks refer to it); its
//! operations must run one at a time (enqueue them on one stream, or order the streams), and it
//! must be destroyed before `MPI_Finalize` once its streams are drained. Needs MPI initialized
//! with at least `MPI_THREAD_SERIALIZED` (operations run on the stream's thread, or inline on
//! the caller's, one at a time); below
//! `MPI_THREAD_MULTIPLE` no other thread may call MPI while operations are queued.
class mpi_communicator {
 public:
  using stream_type = host_stream;

  explicit mpi_communicator(MPI_Comm comm, mpi_options options = {})
      : options_(options) {
    int initialized = 0;
    WEAVE_MPI_CHECK(MPI_Initialized(&initialized));
    WEAVE_EXPECT(initialized, errc::invalid_state, "mpi_communicator: MPI is not initialized");
    int provided = MPI_THREAD_SINGLE;
    WEAVE_MPI_CHECK(MPI_Query_thread(&provided));
    WEAVE_EXPECT(provided >= MPI_THREAD_SERIALIZED, errc::not_supported,
                 "mpi_communicator needs MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE (got level ",
                 provided, "): initialize MPI with MPI_Init_thread");
    WEAVE_EXPECT(options.timeout.count() > 0, errc::invalid_argument,
                 "mpi_communicator: timeout must be positive");
    threads_ = provided;
    WEAVE_MPI_CHECK(MPI_Comm_dup(comm, &comm_));
    WEAVE_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    WEAVE_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    WEAVE_MPI_CHECK(MPI_Comm_size(comm_, &size_));
    notices_.open(comm);
    options_.max_chunk_units =
        std::max<std::int64_t>(1, std::min<std::int64_t>(options.max_chunk_units, INT_MAX / size_));
    const std::size_t staging_cap = (std::size_t{4} << 20) / static_cast<std::size_t>(size_);
    messages_ = detail::mpi_call_messages(std::min(options.tagged_inline_bytes, staging_cap));
  }

  mpi_communicator(const mpi_communicator&) = delete;
  mpi_communicator& operator=(const mpi_communicator&) = delete;

  //! Frees the duplicate communicators (and cached datatype); never throws. A duplicate that
  //! aborted, or on which an operation was abandoned, is not freed: MPI may still progress that
  //! operation, which must find its communicator and the headers it names, and peers may still
  //! send to it (retained; MPI_Finalize releases the communicator).
  ~mpi_communicator() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized)
      return;
    // After an abort, peers may still send to this rank on the duplicate (their part of the
    // operation it left): freeing it would let a later duplicate meet those messages.
    if (abandoned_->load(std::memory_order_acquire) ||
        failed_flag_.load(std::memory_order_acquire)) {
      messages_.retain_until_exit();
      return; // the datatype too may still be in use
    }
    unit_types_.free();
    MPI_Comm_free(&comm_);
  }

  //! True once a collective was abandoned (after an abort or a timeout): MPI cannot cancel it and
  //! may write into the buffers it names until `MPI_Finalize`. weave's layers then retain their
  //! own buffers; buffers of the caller's (outputs, workspaces) must outlive `MPI_Finalize` too.
  bool abandoned() const noexcept { return abandoned_->load(std::memory_order_acquire); }
  //! The flag behind `abandoned()`, shared: it outlives the communicator, so a layer destroyed
  //! after it still knows whether to keep its buffers.
  std::shared_ptr<const std::atomic<bool>> abandoned_flag() const noexcept { return abandoned_; }

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  //! The duplicate communicator weave uses.
  MPI_Comm get() const noexcept { return comm_; }

  //! Declares this communicator failed because of `why` and tells every peer: their waiting
  //! and later operations fail at once with a `peer_error` naming `why` (a failure that started
  //! on another rank keeps its origin). Later operations here fail too. With
  //! `MPI_THREAD_MULTIPLE` the notices leave now; below it they leave from the thread that runs
  //! this communicator's next operation (its stream's, even when that operation is skipped), so
  //! that no two threads call MPI at once. Idempotent: the first failure wins.
  void abort(const failure_record& why) {
    {
      std::lock_guard lock(mutex_);
      if (failed_)
        return;
      failed_ = why;
      notices_.prepare(why);
    }
    failed_flag_.store(true, std::memory_order_release);
    if (threads_ == MPI_THREAD_MULTIPLE)
      send_notices();
  }
  //! As above, for a failure described by text only.
  void abort(const std::string& reason) { abort({rank_, errc::internal, false, reason}); }

  //! True once this communicator failed: aborted here, told by a peer, or timed out.
  bool aborted() const noexcept { return failed_flag_.load(std::memory_order_acquire); }

  //! Refuses with `errc::not_supported` (see `shrink.hpp`): Open MPI without the ULFM extension
  //! (`MPIX_Comm_shrink`, which weave does not use yet) ends the whole job when a process dies;
  //! restart on the surviving hosts from a checkpoint, or use NCCL or an in-process world.
  shrunk_communicator<mpi_communicator> shrink(std::span<const int> excluded = {}) {
    (void)detail::excluded_ranks(excluded, size_, "mpi_communicator::shrink");
#if defined(OMPI_HAVE_MPI_EXT_FTMPI) && OMPI_HAVE_MPI_EXT_FTMPI
    constexpr const char* mpi_here =
        "this MPI has the ULFM extension, which weave does not use yet";
#else
    constexpr const char* mpi_here = "this MPI has no ULFM extension (MPIX_Comm_shrink) and ends "
                                     "the whole job when a process dies";
#endif
    WEAVE_THROW(errc::not_supported, "mpi_communicator rank ", rank_, ": cannot shrink: ", mpi_here,
                "; restart the job on the surviving hosts from a checkpoint, or use NCCL or "
                "local_world, whose communicators shrink");
  }

  //! Variable all-to-all in units of `unit` bytes (see `weave::all_to_all_v`). A tagged one
  //! (`call_tag`) sends every peer a small header with its data, its tag and the bytes it sends,
  //! and takes a peer's data only after every header checked: ranks at different calls fail
  //! with `errc::call_mismatch`, a size that disagrees with this rank's receive with
  //! `errc::size_mismatch` (a failed call's `recv` holds unspecified bytes: a block above
  //! `mpi_options::tagged_inline_bytes` is received beside the headers).
  void all_to_all_v(host_stream& s, const void* send, std::span<const std::int64_t> send_counts,
                    std::span<const std::int64_t> send_displs, void* recv,
                    std::span<const std::int64_t> recv_counts,
                    std::span<const std::int64_t> recv_displs, std::size_t unit = 1,
                    call_tag tag = {}) {
    run(
        s, "all_to_all_v",
        [=, this] { return inline_allowed(detail::moved_bytes(send_counts, recv_counts, unit)); },
        [=, this] {
          run_all_to_all_v(static_cast<const std::byte*>(send), send_counts, send_displs,
                           static_cast<std::byte*>(recv), recv_counts, recv_displs, unit, tag);
        });
  }

  //! `all_to_all_v` whose receive counts are room, not sizes: rank j's block to this rank may be
  //! shorter than `recv_counts[j]`, and its length (units) is written to `received[j]` when the
  //! operation has run. Each block is one message of at most INT_MAX units (`max_chunk_units`
  //! does not cut it); a block longer than its room fails the receiver with `errc::mpi` (MPI's
  //! truncation), its own with `errc::size_mismatch`. Untagged: a layer that uses it carries its
  //! own headers (see `has_bounded_all_to_all`).
  void all_to_all_v_bounded(host_stream& s, const void* send,
                            std::span<const std::int64_t> send_counts,
                            std::span<const std::int64_t> send_displs, void* recv,
                            std::span<const std::int64_t> recv_counts,
                            std::span<const std::int64_t> recv_displs,
                            std::span<std::int64_t> received, std::size_t unit = 1) {
    run(
        s, "all_to_all_v_bounded",
        [=, this] { return inline_allowed(detail::moved_bytes(send_counts, recv_counts, unit)); },
        [=, this] {
          run_bounded_all_to_all_v(static_cast<const std::byte*>(send), send_counts, send_displs,
                                   static_cast<std::byte*>(recv), recv_counts, recv_displs,
                                   received, unit);
        });
  }

  //! Sends the j-th group of k counts of `send` to rank j and receives rank j's k counts into
  //! the j-th group of `recv`; a tagged exchange checks the peers' tags first, as `all_to_all_v`.
  void exchange_counts(host_stream& s, std::span<const std::int64_t> send,
                       std::span<std::int64_t> recv, call_tag tag = {}) {
    const std::size_t bytes = 2 * send.size() * sizeof(std::int64_t);
    issue(s, deferred_exchange_counts(send, recv, tag),
          [this, bytes] { return inline_allowed(bytes); });
  }

  //! The task of a deferred `exchange_counts` (see `has_deferred_exchange_counts`).
  struct counts_task {
    mpi_communicator* self;
    std::span<const std::int64_t> send;
    std::span<std::int64_t> recv;
    int k;
    call_tag tag;
    std::exception_ptr operator()(std::exception_ptr failure) const {
      return self->step("exchange_counts", std::move(failure), [this] {
        if (tag.tagged()) { // the counts go as a tagged all-to-all of k counts per peer
          const auto n = static_cast<std::size_t>(self->size_);
          std::vector<std::int64_t>& layout = self->counts_layout_;
          layout.assign(2 * n, k);
          for (std::size_t j = 0; j < n; ++j)
            layout[n + j] = static_cast<std::int64_t>(j) * k;
          const std::span<const std::int64_t> counts(layout.data(), n),
              displs(layout.data() + n, n);
          self->run_all_to_all_v(reinterpret_cast<const std::byte*>(send.data()), counts, displs,
                                 reinterpret_cast<std::byte*>(recv.data()), counts, displs,
                                 sizeof(std::int64_t), tag, header::counts, "exchange_counts");
          return;
        }
        MPI_Request request = MPI_REQUEST_NULL;
        self->check(MPI_Ialltoall(send.data(), k, MPI_INT64_T, recv.data(), k, MPI_INT64_T,
                                  self->comm_, &request),
                    "MPI_Ialltoall", "exchange_counts");
        self->wait_all(std::span<MPI_Request>(&request, 1), "exchange_counts");
      });
    }
  };

  //! `exchange_counts` run when the returned task is called on the stream thread (see
  //! `has_deferred_exchange_counts`).
  counts_task deferred_exchange_counts(std::span<const std::int64_t> send,
                                       std::span<std::int64_t> recv, call_tag tag = {}) {
    const auto n = static_cast<std::size_t>(size_);
    WEAVE_EXPECT(!send.empty() && send.size() % n == 0 && recv.size() == send.size(),
                 errc::size_mismatch, "exchange_counts: ", send.size(), " send and ", recv.size(),
                 " receive counts for ", size_,
                 " ranks (need the same non-zero multiple of the group size)");
    return {this, send, recv, checked_cast<int>(send.size() / n, "counts per peer"), tag};
  }

  //! Element-wise reduction into `out` on every rank (`in` may equal `out`).
  template <reducible T>
  void all_reduce(host_stream& s, std::span<const T> in, std::span<T> out, reduce_op op) {
    WEAVE_EXPECT(in.size() == out.size(), errc::size_mismatch, "all_reduce: ", in.size(),
                 " inputs for ", out.size(), " outputs");
    const int count = checked_cast<int>(in.size(), "all_reduce element count");
    const bool small = inline_allowed(2 * in.size() * sizeof(T));
    run(
        s, "all_reduce", [small] { return small; },
        [=, this] {
          const void* source = in.data() == out.data() ? MPI_IN_PLACE : in.data();
          MPI_Request request = MPI_REQUEST_NULL;
          check(MPI_Iallreduce(source, out.data(), count, detail::mpi_type<T>(),
                               op == reduce_op::sum ? MPI_SUM : MPI_MAX, comm_, &request),
                "MPI_Iallreduce", "all_reduce");
          wait_all(std::span<MPI_Request>(&request, 1), "all_reduce");
        });
  }

  //! Completes once every rank reached its barrier.
  void barrier(host_stream& s) {
    run(
        s, "barrier", [this] { return inline_allowed(0); },
        [this] {
          MPI_Request request = MPI_REQUEST_NULL;
          check(MPI_Ibarrier(comm_, &request), "MPI_Ibarrier", "barrier");
          wait_all(std::span<MPI_Request>(&request, 1), "barrier");
        });
  }

 private:
  static constexpr int block_tag = 0x5EA7;  // the all-to-all's messages
  static constexpr int header_tag = 0x5EA8; // a tagged all-to-all's headers
  using header = detail::mpi_call_header;

  // Runs an operation's task on `s`. On a failed stream it moves nothing but still sends the
  // notices of an abort that waited for this thread. A failed communicator fails at once.
  // On the calling thread when the stream is idle and `small()` (asked then: see
  // `inline_max_bytes`), else on the stream's worker.
  template <class Small, class F>
  void run(host_stream& s, const char* what, Small small, F body) {
    issue(
        s,
        [this, what, body = std::move(body)](std::exception_ptr failure) mutable {
          return step(what, std::move(failure), body);
        },
        std::move(small));
  }

  // The one place that chooses between the calling thread and the stream's worker.
  template <class Task, class Small>
  void issue(host_stream& s, Task task, Small small) {
    if (options_.inline_max_bytes == 0)
      s.submit_always(std::move(task));
    else
      s.run_inline_or_submit_always(std::move(task), std::move(small));
  }

  bool inline_allowed(std::size_t bytes) const noexcept {
    return options_.inline_max_bytes > 0 && bytes <= options_.inline_max_bytes;
  }

  // How an operation runs and fails, out of the class (detail/mpi_communicator_waits.hpp): its
  // stream task, the error of a failed communicator, the peers' failure notices, MPI's status
  // checks, and the wait that progresses its requests.
  template <class F>
  std::exception_ptr step(const char* what, std::exception_ptr failure, F&& body);
  [[noreturn]] void throw_failed(const char* what);
  failure_record failure();
  void send_notices();
  void check_notice(const char* what);
  [[noreturn]] void fail_on_notice(const failure_record& why, const char* what);
  void check(int status, const char* call, const char* what);
  void wait_all(std::span<MPI_Request> requests, const char* what);

  MPI_Datatype unit_type(std::size_t unit) {
    MPI_Datatype type = MPI_BYTE;
    check(unit_types_.get(unit, type), "MPI_Type_contiguous or MPI_Type_commit", "all_to_all_v");
    return type;
  }

  // The all-to-all's messages, out of the class (mpi_all_to_all.hpp): the tagged calls'
  // headers, posted, sent and checked, and the point-to-point all-to-all itself.
  void receive_headers(const char* what);
  void send_headers(call_tag tag, std::int64_t kind, const std::byte* send,
                    std::span<const std::int64_t> send_counts,
                    std::span<const std::int64_t> send_displs, std::size_t unit, const char* what);
  template <class Receive>
  void check_headers(call_tag tag, std::int64_t kind, std::byte* recv,
                     std::span<const std::int64_t> recv_counts,
                     std::span<const std::int64_t> recv_displs, std::size_t unit, const char* what,
                     Receive&& receive_from);
  void run_all_to_all_v(const std::byte* send, std::span<const std::int64_t> send_counts,
                        std::span<const std::int64_t> send_displs, std::byte* recv,
                        std::span<const std::int64_t> recv_counts,
                        std::span<const std::int64_t> recv_displs, std::size_t unit,
                        call_tag tag = {}, std::int64_t kind = header::all_to_all,
                        const char* what = "all_to_all_v");
  void run_bounded_all_to_all_v(const std::byte* send, std::span<const std::int64_t> send_counts,
                                std::span<const std::int64_t> send_displs, std::byte* recv,
                                std::span<const std::int64_t> recv_counts,
                                std::span<const std::int64_t> recv_displs,
                                std::span<std::int64_t> received, std::size_t unit);

  mpi_options options_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 0;
  int threads_ = MPI_THREAD_SERIALIZED; // the thread level MPI provides
  mpi_failure_notices notices_;         // the failure-notice channel (its own duplicate)
  std::vector<MPI_Status> statuses_;
  std::vector<MPI_Request> polled_; // a wait's requests and the notice channel's receive
  std::vector<int> indices_;        // what one MPI_Testsome completed
  std::vector<MPI_Status> tested_;  // and their statuses
  std::mutex mutex_;                // guards failed_ (abort may come from any thread)
  std::optional<failure_record> failed_;
  std::atomic<bool> failed_flag_{false};
  // A wait gave up on incomplete requests (shared with the layers built on this communicator).
  std::shared_ptr<std::atomic<bool>> abandoned_ = std::make_shared<std::atomic<bool>>(false);
  std::vector<MPI_Request> requests_;  // an all-to-all's receives and sends, reused by every call
  detail::mpi_call_messages messages_; // tagged collectives' headers, with small blocks inside
  std::vector<std::int64_t> counts_layout_; // a tagged count exchange's counts and displacements
  detail::mpi_unit_type unit_types_;        // the all-to-all's rows as one MPI element
};

static_assert(has_tagged_collectives<mpi_communicator> && has_shrink<mpi_communicator> &&
              has_deferred_exchange_counts<mpi_communicator> && has_barrier<mpi_communicator> &&
              has_all_reduce<mpi_communicator, double>);

WEAVE_NAMESPACE_END

#include "weave/comm/detail/mpi_communicator_waits.hpp" // operations and failures, out of the class
#include "weave/comm/mpi_all_to_all.hpp" // the all-to-all's messages, out of the class
