//! \file
//! `mpi_communicator`: weave's communicator over MPI (component `weave::mpi`).
//!
//! Wraps a caller's `MPI_Comm` without owning it: the constructor duplicates it (collective) and
//! owns only the duplicates, on which it installs `MPI_ERRORS_RETURN` (so MPI failures become
//! `errc::mpi` errors naming the operation and MPI's error string instead of aborting the job;
//! the caller's communicator and its handler are left untouched, and weave's traffic cannot
//! match the caller's messages). Operations are non-blocking MPI calls (MPI_Ialltoallv,
//! MPI_Ialltoall, MPI_Iallreduce, MPI_Ibarrier) issued and progressed by a task on a
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
//! reason the destructor leaves that duplicate to `MPI_Finalize`. Open MPI 4.1 reports errors
//! found inside its non-blocking collectives through `MPI_COMM_WORLD`'s handler (fatal by
//! default): weave's layers rule out the size disagreements that cause them by agreeing on
//! their configuration first; for direct use, set `MPI_ERRORS_RETURN` on `MPI_COMM_WORLD` to
//! have them reported as `errc::mpi`.
//!
//! 64-bit sizes: MPI 3.1 (Open MPI 4.1) counts are `int`. A peer block of more than
//! `max_chunk_units` units (at most INT_MAX / size) is sent point to point in pieces of at most
//! that many units, beside the MPI_Ialltoallv carrying the other blocks; sender and receiver
//! agree on which blocks go that way because both know the block's count. If a displacement of
//! the remaining blocks does not fit an `int`, that side packs (or receives) them through a
//! temporary buffer. Results are identical to one MPI_Alltoallv in every case.
#pragma once

#include "weave/comm/communicator.hpp"
#include "weave/comm/mpi_failure_notices.hpp"
#include "weave/comm/mpi_large_blocks.hpp"
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
    const auto n = static_cast<std::size_t>(size_);
    ints_.resize(4 * n);
    options_.max_chunk_units =
        std::max<std::int64_t>(1, std::min<std::int64_t>(options.max_chunk_units, INT_MAX / size_));
    options_.max_displacement_units =
        std::max<std::int64_t>(0, std::min<std::int64_t>(options.max_displacement_units, INT_MAX));
  }

  mpi_communicator(const mpi_communicator&) = delete;
  mpi_communicator& operator=(const mpi_communicator&) = delete;

  //! Frees the duplicate communicators (and cached datatype); never throws. A duplicate on which
  //! a collective was abandoned (after an abort) is not freed: MPI may still progress that
  //! collective, which must find its communicator and the count arrays and headers it names
  //! (retained; MPI_Finalize releases the communicator).
  ~mpi_communicator() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized)
      return;
    if (abandoned_->load(std::memory_order_acquire)) {
      detail::retain_value_until_exit(std::move(ints_));
      detail::retain_value_until_exit(std::move(header_send_));
      detail::retain_value_until_exit(std::move(header_recv_));
      return; // the datatype too may still be in use
    }
    if (unit_type_ != MPI_DATATYPE_NULL)
      MPI_Type_free(&unit_type_);
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
  //! (`call_tag`) first exchanges a small header with every peer, its tag and the bytes it sends:
  //! ranks at different calls fail with `errc::call_mismatch`, a size that disagrees with this
  //! rank's receive with `errc::size_mismatch`, before any data moves (so MPI never truncates).
  void all_to_all_v(host_stream& s, const void* send, std::span<const std::int64_t> send_counts,
                    std::span<const std::int64_t> send_displs, void* recv,
                    std::span<const std::int64_t> recv_counts,
                    std::span<const std::int64_t> recv_displs, std::size_t unit = 1,
                    call_tag tag = {}) {
    run(
        s, "all_to_all_v",
        [=, this] { return inline_allowed(detail::moved_bytes(send_counts, recv_counts, unit)); },
        [=, this] {
          if (tag.tagged()) {
            detail::check_layout(size_, send_counts, send_displs, unit, "send");
            detail::check_layout(size_, recv_counts, recv_displs, unit, "receive");
            check_header(tag, header_all_to_all, send_counts, recv_counts, unit, "all_to_all_v");
          }
          run_all_to_all_v(static_cast<const std::byte*>(send), send_counts, send_displs,
                           static_cast<std::byte*>(recv), recv_counts, recv_displs, unit);
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
        if (tag.tagged())
          self->check_header(tag, header_counts, {}, {}, static_cast<std::size_t>(k),
                             "exchange_counts");
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
  static constexpr int piece_tag = 0x5EA7;
  // The header of a tagged collective, per peer: a marker, the tag, the kind, and the size the
  // sender sends (all_to_all_v: bytes to that peer; exchange_counts: counts per peer).
  static constexpr std::int64_t header_marker = 0x7765617665544147; // "weaveTAG"
  static constexpr std::int64_t header_all_to_all = 1, header_counts = 2;
  static constexpr std::size_t header_words = 4;

  // Exchanges the headers of a tagged collective (one small MPI_Ialltoall) and checks every
  // peer's against this rank's: the same marker, kind and tag, and for an all-to-all the bytes
  // this rank will receive from it (`recv_counts[j] * unit`; for a count exchange, `unit` is
  // the counts per peer). A mismatch aborts the communicator (the peers find theirs too) and
  // throws, so the collective's data is never posted.
  void check_header(call_tag tag, std::int64_t kind, std::span<const std::int64_t> send_counts,
                    std::span<const std::int64_t> recv_counts, std::size_t unit, const char* what) {
    const auto n = static_cast<std::size_t>(size_);
    header_send_.resize(n * header_words);
    header_recv_.resize(n * header_words);
    const auto u = static_cast<std::int64_t>(unit);
    for (std::size_t j = 0; j < n; ++j) {
      std::int64_t* h = header_send_.data() + j * header_words;
      h[0] = header_marker;
      h[1] = static_cast<std::int64_t>(tag.bits);
      h[2] = kind;
      h[3] = kind == header_counts ? u : send_counts[j] * u;
    }
    MPI_Request request = MPI_REQUEST_NULL;
    check(MPI_Ialltoall(header_send_.data(), static_cast<int>(header_words), MPI_INT64_T,
                        header_recv_.data(), static_cast<int>(header_words), MPI_INT64_T, comm_,
                        &request),
          "MPI_Ialltoall", what);
    wait_all(std::span<MPI_Request>(&request, 1), what);
    for (std::size_t j = 0; j < n; ++j) {
      const std::int64_t* h = header_recv_.data() + j * header_words;
      const int peer = static_cast<int>(j);
      try {
        WEAVE_EXPECT(h[0] == header_marker, errc::call_mismatch, "mpi_communicator rank ", rank_,
                     ": ", what, ": rank ", peer,
                     " is at a collective that carries no weave call header");
        const call_tag theirs{static_cast<std::uint64_t>(h[1])};
        if (theirs != tag || h[2] != kind)
          detail::throw_call_mismatch("mpi_communicator", rank_, tag, peer, theirs);
        const std::int64_t expected = kind == header_counts ? u : recv_counts[j] * u;
        WEAVE_EXPECT(h[3] == expected, errc::size_mismatch, "mpi_communicator rank ", rank_, ": ",
                     what, " of ", tag.describe(), ": rank ", peer, " sends ", h[3],
                     kind == header_counts ? " counts per peer" : " bytes",
                     " where this rank receives ", expected);
      } catch (...) {
        abort(record_of(std::current_exception(), rank_));
        send_notices();
        throw;
      }
    }
  }

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

  // The stream task of an operation (see `run`), given the stream's failure.
  template <class F>
  std::exception_ptr step(const char* what, std::exception_ptr failure, F&& body) {
    if (failed_flag_.load(std::memory_order_acquire)) {
      send_notices();
      if (failure)
        return failure;
      throw_failed(what);
    }
    if (failure)
      return failure;
    try {
      check_notice(what); // a peer already failed: do not start what it will never join
      body();
    } catch (...) { // the peers may wait for this rank in the operation: tell them
      abort(record_of(std::current_exception(), rank_));
      send_notices();
      throw;
    }
    return failure;
  }

  // Throws the error every operation of a failed communicator raises: a peer's failure, or
  // this rank's own (its code and message) when it aborted.
  [[noreturn]] void throw_failed(const char* what) {
    const failure_record why = failure();
    if (why.rank != rank_)
      throw peer_error(why, detail::concat("mpi_communicator rank ", rank_, ": ", what));
    WEAVE_THROW(why.weave_error ? why.code : errc::invalid_state, why.message,
                " (mpi_communicator rank ", rank_, " aborted for it; ", what,
                " cannot run: MPI cannot cancel collectives, so the communicator stays unusable)");
  }

  failure_record failure() {
    std::lock_guard lock(mutex_);
    return failed_.value_or(failure_record{});
  }

  // Sends the pending failure notice to every peer once (on the thread allowed to call MPI).
  void send_notices() {
    notices_.send();
  }

  // A peer's failure notice, if one arrived: the communicator fails and the caller throws.
  void check_notice(const char* what) {
    std::optional<failure_record> why = notices_.poll();
    if (!why)
      return;
    {
      std::lock_guard lock(mutex_);
      if (!failed_)
        failed_ = *why;
    }
    notices_.silence(); // the peers were told by the origin
    failed_flag_.store(true, std::memory_order_release);
    throw_failed(what);
  }

  // Unless `status` is success: aborts the communicator (a peer may wait for this rank in the
  // failed operation) and throws `errc::mpi` naming the call, the operation and MPI's text.
  void check(int status, const char* call, const char* what) {
    if (WEAVE_LIKELY(status == MPI_SUCCESS))
      return;
    const std::string message =
        detail::concat("mpi_communicator rank ", rank_, ": ", what, ": ", call, " failed (", status,
                       "): ", mpi_error_string(status));
    abort({rank_, errc::mpi, true, message});
    send_notices();
    WEAVE_THROW(errc::mpi, message);
  }

  // Progresses `requests` until all complete, a peer's failure notice arrives, or the timeout
  // expires (which aborts the communicator). Single requests use MPI_Test, whose return value
  // is the request's own error (MPI_Testall would report MPI_ERR_IN_STATUS).
  void wait_all(std::span<MPI_Request> requests, const char* what) {
    const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
    statuses_.resize(requests.size());
    struct abandon_guard { // leaving without completing abandons the requests (see ~)
      std::atomic<bool>& abandoned;
      bool completed = false;
      ~abandon_guard() {
        if (!completed)
          abandoned.store(true, std::memory_order_release);
      }
    } guard{*abandoned_};
    for (unsigned spins = 0;; ++spins) {
      int done = 0;
      if (requests.size() == 1) {
        check(MPI_Test(requests.data(), &done, MPI_STATUS_IGNORE), "MPI_Test", what);
      } else {
        const int status = MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done,
                                       statuses_.data());
        if (status == MPI_ERR_IN_STATUS)
          for (const MPI_Status& st : statuses_)
            if (st.MPI_ERROR != MPI_SUCCESS && st.MPI_ERROR != MPI_ERR_PENDING)
              check(st.MPI_ERROR, "a request of MPI_Testall", what);
        check(status, "MPI_Testall", what);
      }
      if (done) {
        guard.completed = true;
        return;
      }
      if (spins > 64)
        std::this_thread::yield(); // let oversubscribed peers run
      // The notices and the clock every 8th round: a notice is another MPI_Test (another round
      // of MPI's progress engine), which would double the cost of a small collective's wait.
      if (spins % 8 != 7)
        continue;
      check_notice(what);
      if (failed_flag_.load(std::memory_order_acquire)) { // aborted by another thread
        send_notices();
        throw_failed(what);
      }
      if (std::chrono::steady_clock::now() > deadline) {
        const std::string message =
            detail::concat("mpi_communicator rank ", rank_, ": ", what, " did not complete within ",
                           options_.timeout.count(),
                           " ms (a peer never arrived or died); the communicator was aborted");
        abort({rank_, errc::timeout, true, message});
        send_notices();
        WEAVE_THROW(errc::timeout, message);
      }
    }
  }

  MPI_Datatype unit_type(std::size_t unit) {
    if (unit == 1)
      return MPI_BYTE;
    if (unit != cached_unit_) {
      if (unit_type_ != MPI_DATATYPE_NULL)
        check(MPI_Type_free(&unit_type_), "MPI_Type_free", "all_to_all_v");
      check(MPI_Type_contiguous(checked_cast<int>(unit, "unit bytes"), MPI_BYTE, &unit_type_),
            "MPI_Type_contiguous", "all_to_all_v");
      check(MPI_Type_commit(&unit_type_), "MPI_Type_commit", "all_to_all_v");
      cached_unit_ = unit;
    }
    return unit_type_;
  }

  void run_all_to_all_v(const std::byte* send, std::span<const std::int64_t> send_counts,
                        std::span<const std::int64_t> send_displs, std::byte* recv,
                        std::span<const std::int64_t> recv_counts,
                        std::span<const std::int64_t> recv_displs, std::size_t unit) {
    detail::check_layout(size_, send_counts, send_displs, unit, "send");
    detail::check_layout(size_, recv_counts, recv_displs, unit, "receive");
    const MPI_Datatype type = unit_type(unit);
    const std::int64_t limit = options_.max_chunk_units;
    const auto n = static_cast<std::size_t>(size_);
    int* sc = ints_.data();
    int* sd = sc + n;
    int* rc = sd + n;
    int* rd = rc + n;
    const auto send_part = detail::mpi_collective_part(send_counts, send_displs, limit,
                                                       options_.max_displacement_units, sc, sd);
    const auto recv_part = detail::mpi_collective_part(recv_counts, recv_displs, limit,
                                                       options_.max_displacement_units, rc, rd);
    const bool large = send_part.large || recv_part.large;
    const bool send_fits = send_part.fits, recv_fits = recv_part.fits;
    // Staging for a side whose displacements overflow: its small blocks, packed in peer order,
    // span at most size * limit <= INT_MAX units.
    std::vector<std::byte> send_stage, recv_stage;
    struct retain_stages { // an abandoned collective may still use them (see abandoned())
      std::vector<std::byte>&send, &recv;
      const std::atomic<bool>& abandoned;
      ~retain_stages() {
        if (abandoned.load(std::memory_order_acquire) && (!send.empty() || !recv.empty())) {
          detail::retain_value_until_exit(std::move(send));
          detail::retain_value_until_exit(std::move(recv));
        }
      }
    } stages{send_stage, recv_stage, *abandoned_};
    const std::byte* send_base = send;
    std::byte* recv_base = recv;
    if (!send_fits) {
      send_stage.resize(static_cast<std::size_t>(detail::mpi_packed_offsets(n, sc, sd)) * unit);
      detail::mpi_each_block(n, unit, sc, send_displs, sd, [&](auto at, auto staged, auto bytes) {
        std::memcpy(send_stage.data() + staged, send + at, bytes);
      });
      send_base = send_stage.data();
    }
    if (!recv_fits) {
      recv_stage.resize(static_cast<std::size_t>(detail::mpi_packed_offsets(n, rc, rd)) * unit);
      recv_base = recv_stage.data();
    }
    if (!large) {
      MPI_Request request = MPI_REQUEST_NULL;
      check(MPI_Ialltoallv(send_base, sc, sd, type, recv_base, rc, rd, type, comm_, &request),
            "MPI_Ialltoallv", "all_to_all_v");
      wait_all(std::span<MPI_Request>(&request, 1), "all_to_all_v");
    } else {
      std::vector<MPI_Request> requests(1, MPI_REQUEST_NULL);
      check(MPI_Ialltoallv(send_base, sc, sd, type, recv_base, rc, rd, type, comm_, &requests[0]),
            "MPI_Ialltoallv", "all_to_all_v");
      // Pieces of one block share (source, tag, communicator), so MPI delivers them in order.
      auto pieces = [&](std::int64_t count, auto&& post) {
        for (std::int64_t done = 0; done < count; done += limit)
          post(done, static_cast<int>(std::min(limit, count - done)));
      };
      for (std::size_t j = 0; j < n; ++j) {
        const int peer = static_cast<int>(j);
        if (recv_counts[j] > limit)
          pieces(recv_counts[j], [&](std::int64_t at, int count) {
            requests.push_back(MPI_REQUEST_NULL);
            check(MPI_Irecv(recv + (recv_displs[j] + at) * std::int64_t(unit), count, type, peer,
                            piece_tag, comm_, &requests.back()),
                  "MPI_Irecv", "all_to_all_v");
          });
        if (send_counts[j] > limit)
          pieces(send_counts[j], [&](std::int64_t at, int count) {
            requests.push_back(MPI_REQUEST_NULL);
            check(MPI_Isend(send + (send_displs[j] + at) * std::int64_t(unit), count, type, peer,
                            piece_tag, comm_, &requests.back()),
                  "MPI_Isend", "all_to_all_v");
          });
      }
      wait_all(requests, "all_to_all_v");
    }
    if (!recv_fits)
      detail::mpi_each_block(n, unit, rc, recv_displs, rd, [&](auto at, auto staged, auto bytes) {
        std::memcpy(recv + at, recv_stage.data() + staged, bytes);
      });
  }

  mpi_options options_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 0;
  int threads_ = MPI_THREAD_SERIALIZED; // the thread level MPI provides
  mpi_failure_notices notices_;         // the failure-notice channel (its own duplicate)
  std::vector<MPI_Status> statuses_;
  std::mutex mutex_; // guards failed_ (abort may come from any thread)
  std::optional<failure_record> failed_;
  std::atomic<bool> failed_flag_{false};
  // A wait gave up on incomplete requests (shared with the layers built on this communicator).
  std::shared_ptr<std::atomic<bool>> abandoned_ = std::make_shared<std::atomic<bool>>(false);
  std::vector<int> ints_; // MPI's int counts and displacements, reused by every call
  std::vector<std::int64_t> header_send_, header_recv_; // tagged collectives' headers
  MPI_Datatype unit_type_ = MPI_DATATYPE_NULL;
  std::size_t cached_unit_ = 0;
};

static_assert(has_tagged_collectives<mpi_communicator> && has_shrink<mpi_communicator> &&
              has_deferred_exchange_counts<mpi_communicator> && has_barrier<mpi_communicator> &&
              has_all_reduce<mpi_communicator, double>);

WEAVE_NAMESPACE_END
