//! \file
//! How an operation of `mpi_communicator` runs and fails, out of the class: its stream task
//! (`step`: a failed communicator fails at once, a failing operation aborts it and tells the
//! peers), the error every operation of a failed communicator raises, the peers' failure
//! notices, MPI's status checks, and `wait_all`, which progresses an operation's requests
//! with the notice channel's receive until they complete, a notice arrives or the timeout
//! expires. Included by `mpi_communicator.hpp`.
#pragma once

#include "weave/comm/mpi_communicator.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/failure.hpp"
#include "weave/core/mpi_error.hpp"

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <exception>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>

WEAVE_NAMESPACE_BEGIN

// The stream task of an operation (see `run`), given the stream's failure.
template <class F>
std::exception_ptr mpi_communicator::step(const char* what, std::exception_ptr failure, F&& body) {
  if (failed_flag_.load(std::memory_order_acquire)) {
    send_notices();
    if (failure)
      return failure;
    throw_failed(what);
  }
  if (failure)
    return failure;
  try { // a peer's notice is tested with the operation's own requests (`wait_all`)
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
[[noreturn]] inline void mpi_communicator::throw_failed(const char* what) {
  const failure_record why = failure();
  if (why.rank != rank_)
    throw peer_error(why, detail::concat("mpi_communicator rank ", rank_, ": ", what));
  WEAVE_THROW(why.weave_error ? why.code : errc::invalid_state, why.message,
              " (mpi_communicator rank ", rank_, " aborted for it; ", what,
              " cannot run: MPI cannot cancel collectives, so the communicator stays unusable)");
}

inline failure_record mpi_communicator::failure() {
  std::lock_guard lock(mutex_);
  return failed_.value_or(failure_record{});
}

// Sends the pending failure notice to every peer once (on the thread allowed to call MPI).
inline void mpi_communicator::send_notices() {
  notices_.send();
}

// A peer's failure notice, if one arrived: the communicator fails and the caller throws.
inline void mpi_communicator::check_notice(const char* what) {
  if (std::optional<failure_record> why = notices_.poll())
    fail_on_notice(*why, what);
}

[[noreturn]] inline void mpi_communicator::fail_on_notice(const failure_record& why,
                                                          const char* what) {
  {
    std::lock_guard lock(mutex_);
    if (!failed_)
      failed_ = why;
  }
  notices_.silence(); // the peers were told by the origin
  failed_flag_.store(true, std::memory_order_release);
  throw_failed(what);
}

// Unless `status` is success: aborts the communicator (a peer may wait for this rank in the
// failed operation) and throws `errc::mpi` naming the call, the operation and MPI's text.
inline void mpi_communicator::check(int status, const char* call, const char* what) {
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
// expires (which aborts the communicator). The notice channel's receive is tested with the
// requests, in one MPI_Testsome: each turn of MPI's progress engine serves both, and a notice
// that arrived by the turn that completes the operation fails it (a test of its own before
// each operation cost a turn more: 10-20% of a one-token decode layer). A wait with nothing
// to complete tests the notices alone. The statuses are left in `statuses_`.
inline void mpi_communicator::wait_all(std::span<MPI_Request> requests, const char* what) {
  const std::size_t n = requests.size();
  statuses_.resize(n);
  std::size_t left = 0;
  for (const MPI_Request r : requests)
    left += r != MPI_REQUEST_NULL;
  if (left == 0) {
    check_notice(what);
    return;
  }
  struct abandon_guard { // leaving without completing abandons the requests (see ~)
    std::atomic<bool>& abandoned;
    bool completed = false;
    ~abandon_guard() {
      if (!completed)
        abandoned.store(true, std::memory_order_release);
    }
  } guard{*abandoned_};
  polled_.assign(requests.begin(), requests.end());
  polled_.push_back(notices_.inbox()); // the notice channel's receive, last
  indices_.resize(n + 1);
  tested_.resize(n + 1);
  // Read the clock first at the first check: most small waits end before it.
  std::optional<std::chrono::steady_clock::time_point> deadline;
  for (unsigned spins = 0;; ++spins) {
    int count = 0;
    const int status = MPI_Testsome(static_cast<int>(n + 1), polled_.data(), &count,
                                    indices_.data(), tested_.data());
    notices_.inbox() = polled_.back(); // MPI_REQUEST_NULL once a notice arrived
    if (status != MPI_SUCCESS && status != MPI_ERR_IN_STATUS)
      check(status, "MPI_Testsome", what);
    const std::span<const int> done(indices_.data(), static_cast<std::size_t>(std::max(count, 0)));
    for (std::size_t i = 0; i < done.size(); ++i) {
      const auto at = static_cast<std::size_t>(done[i]);
      if (at < n) {
        requests[at] = polled_[at]; // MPI_REQUEST_NULL: completed
        statuses_[at] = tested_[i];
        --left;
      }
    }
    for (std::size_t i = 0; i < done.size(); ++i) {
      const auto at = static_cast<std::size_t>(done[i]);
      if (status == MPI_ERR_IN_STATUS && tested_[i].MPI_ERROR != MPI_SUCCESS)
        check(tested_[i].MPI_ERROR,
              at == n ? "the failure-notice receive" : "a request of MPI_Testsome", what);
      if (at == n) // a peer's failure wins over this operation's completion
        fail_on_notice(notices_.received(tested_[i]), what);
    }
    if (left == 0) {
      guard.completed = true;
      return;
    }
    if (spins > 64)
      std::this_thread::yield(); // let oversubscribed peers run
    // The clock, and an abort by another thread, every 8th round.
    if (spins % 8 != 7)
      continue;
    if (failed_flag_.load(std::memory_order_acquire)) { // aborted by another thread
      send_notices();
      throw_failed(what);
    }
    const auto now = std::chrono::steady_clock::now();
    if (!deadline)
      deadline = now + options_.timeout;
    else if (now > *deadline) {
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

WEAVE_NAMESPACE_END
