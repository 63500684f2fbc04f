//! \file
//! `mpi_failure_notices`: the out-of-band channel on which an `mpi_communicator` tells its peers
//! that it failed (component `weave::mpi`).
//!
//! A duplicate of the caller's communicator carries nothing but failure notices (a
//! `failure_record`'s wire form), so they can never match weave's traffic or the caller's. Every
//! rank keeps a receive from any peer posted; a wait tests it with the operation's own requests
//! (`inbox`, one `MPI_Testsome`), so the channel costs nothing while nothing fails. A failing
//! rank sends its notice to every peer once.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/failure.hpp"
#include "weave/core/mpi_error.hpp"

#include <mpi.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <thread>
#include <vector>

WEAVE_NAMESPACE_BEGIN

//! One rank's end of the failure-notice channel of a group. Not copyable or movable (MPI holds
//! its buffers); `open` it once MPI is known to be initialized.
class mpi_failure_notices {
 public:
  mpi_failure_notices() = default;
  mpi_failure_notices(const mpi_failure_notices&) = delete;
  mpi_failure_notices& operator=(const mpi_failure_notices&) = delete;

  //! Cancels the receive and frees the duplicate (notices still in flight complete on their
  //! own); never throws. Nothing to do after `MPI_Finalize`.
  ~mpi_failure_notices() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized || comm_ == MPI_COMM_NULL)
      return;
    if (inbox_request_ != MPI_REQUEST_NULL) {
      MPI_Cancel(&inbox_request_);
      MPI_Wait(&inbox_request_, MPI_STATUS_IGNORE);
    }
    for (MPI_Request& r : outbox_requests_)
      if (r != MPI_REQUEST_NULL)
        MPI_Request_free(&r);
    MPI_Comm_free(&comm_);
  }

  //! Duplicates `group` (collective over it) and posts the receive.
  void open(MPI_Comm group) {
    WEAVE_MPI_CHECK(MPI_Comm_dup(group, &comm_));
    WEAVE_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    WEAVE_MPI_CHECK(MPI_Comm_rank(comm_, &rank_));
    WEAVE_MPI_CHECK(MPI_Comm_size(comm_, &size_));
    WEAVE_MPI_CHECK(MPI_Irecv(inbox_.data(), static_cast<int>(inbox_.size()), MPI_INT64_T,
                              MPI_ANY_SOURCE, tag, comm_, &inbox_request_));
  }

  //! Sets the notice `send` will carry; the first one set wins. Calls must not overlap (the
  //! owner serializes them); `send` may run on another thread.
  void prepare(const failure_record& why) {
    if (prepared_.load(std::memory_order_relaxed))
      return;
    const failure_record sendable = detail::sendable(why, rank_);
    encode_failure(&sendable, outbox_);
    prepared_.store(true, std::memory_order_release);
  }

  //! Sends the prepared notice to every peer, once (on a thread allowed to call MPI); waits up to
  //! a second for the small messages to leave. A no-op before `prepare`, and after `silence`.
  void send() {
    if (!prepared_.load(std::memory_order_acquire) || sent_.exchange(true))
      return;
    outbox_requests_.assign(static_cast<std::size_t>(size_), MPI_REQUEST_NULL);
    for (int peer = 0; peer < size_; ++peer)
      if (peer != rank_)
        MPI_Isend(outbox_.data(), static_cast<int>(outbox_.size()), MPI_INT64_T, peer, tag, comm_,
                  &outbox_requests_[static_cast<std::size_t>(peer)]);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    int done = 0;
    while (!done && std::chrono::steady_clock::now() < deadline &&
           MPI_Testall(size_, outbox_requests_.data(), &done, MPI_STATUSES_IGNORE) == MPI_SUCCESS)
      std::this_thread::yield();
  }

  //! Sends nothing from now on (the peers already know: the failure started elsewhere).
  void silence() { sent_ = true; }

  //! A peer's notice, if one arrived (then the channel stops listening). A notice no weave rank
  //! writes is still a failure of its sender, with code `errc::protocol`.
  std::optional<failure_record> poll() {
    int arrived = 0;
    MPI_Status status{};
    if (inbox_request_ == MPI_REQUEST_NULL ||
        MPI_Test(&inbox_request_, &arrived, &status) != MPI_SUCCESS || !arrived)
      return std::nullopt;
    return received(status);
  }

  //! The posted receive, for a test of it together with other requests (`MPI_Testsome`: one
  //! turn of MPI's progress engine serves all). The caller stores back what the test left
  //! (`MPI_REQUEST_NULL` once a notice arrived: the channel stops listening) and reads that
  //! notice with `received`.
  MPI_Request& inbox() noexcept { return inbox_request_; }

  //! The notice of a completed receive whose status is `status` (see `poll`).
  failure_record received(const MPI_Status& status) const {
    const int sender = status.MPI_SOURCE;
    try {
      if (std::optional<failure_record> why = decode_failure(inbox_, sender, size_))
        return *why;
      return failure_record{sender, errc::protocol, true, "a failure notice that names no failure"};
    } catch (const error& e) {
      return failure_record{sender, errc::protocol, true, e.message()};
    }
  }

 private:
  static constexpr int tag = 0xFA11;

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 0;
  std::array<std::int64_t, failure_words> inbox_{}, outbox_{};
  MPI_Request inbox_request_ = MPI_REQUEST_NULL; // posted until a notice arrives
  std::vector<MPI_Request> outbox_requests_;
  std::atomic<bool> prepared_{false}, sent_{false};
};

WEAVE_NAMESPACE_END
