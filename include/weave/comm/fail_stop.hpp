//! \file
//! Fail-stop helpers shared by weave's collective layers: telling the peers about a failure they
//! cannot learn from the next count exchange (`abort_peers`), waiting for a stream through its
//! communicator so a dead peer ends in the communicator's timeout and abort rather than a hang
//! (`wait_watched`), and the one wait of a layer that reports the root cause
//! (`synchronize_streams`).
#pragma once

#include "weave/comm/communicator.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/failure.hpp"

#include <atomic>
#include <exception>
#include <memory>
#include <string>
#include <utility>

WEAVE_NAMESPACE_BEGIN

//! A communicator that can tell its peers about a failure out of band (`local_communicator`,
//! `mpi_communicator`, `cuda_local_communicator`).
template <class C>
concept has_abort = communicator<C> && requires(C& c, const std::string& reason) {
  c.abort(reason);
};

//! True once `comm` was aborted (by any rank, or a timeout), for communicators that know.
template <communicator C>
bool communicator_aborted(const C& comm) {
  if constexpr (requires { comm.aborted(); })
    return comm.aborted();
  else
    return false;
}

//! A flag that turns true once `comm` gives up on a collective it could not complete (after an
//! abort or a timeout; `mpi_communicator::abandoned_flag`), shared so that it outlives `comm`;
//! null for communicators that never leave work behind. MPI may still write into the buffers an
//! abandoned collective names until `MPI_Finalize`, so a layer that sees the flag set when it is
//! destroyed keeps its own buffers (`detail::retain_until_exit`) rather than freeing them.
template <communicator C>
std::shared_ptr<const std::atomic<bool>> abandoned_flag_of(const C& comm) {
  if constexpr (requires { comm.abandoned_flag(); })
    return comm.abandoned_flag();
  else
    return nullptr;
}

//! True when `flag` (from `abandoned_flag_of`) is set.
inline bool abandoned(const std::shared_ptr<const std::atomic<bool>>& flag) noexcept {
  return flag != nullptr && flag->load(std::memory_order_acquire);
}

//! Aborts `comm` because of `failure` (raised on this rank), if it can be aborted: every peer's
//! pending and later operations then fail with a `peer_error` naming it. A no-op otherwise.
template <communicator C>
void abort_peers(C& comm, const std::exception_ptr& failure) {
  if constexpr (requires { comm.abort(failure_record{}); })
    comm.abort(record_of(failure, comm.rank()));
  else if constexpr (has_abort<C>)
    comm.abort(what_of(failure));
}

//! True for a weave error of code `code` that this rank raised itself (not a peer's failure
//! that names one).
inline bool is_own_error(const std::exception_ptr& failure, errc code) {
  if (!failure)
    return false;
  try {
    std::rethrow_exception(failure);
  } catch (const peer_error&) {
    return false;
  } catch (const error& e) {
    return e.code() == code;
  } catch (...) {
    return false;
  }
}

//! True for a failure this rank found in bytes a peer sent that no weave rank writes
//! (`errc::protocol`; not a peer's failure that names one).
inline bool is_protocol_error(const std::exception_ptr& failure) {
  return is_own_error(failure, errc::protocol);
}

//! True for this rank's finding that a peer was at another call (`errc::call_mismatch`).
inline bool is_call_mismatch(const std::exception_ptr& failure) {
  return is_own_error(failure, errc::call_mismatch);
}

//! For a failure this rank found in what one peer sent (`is_protocol_error`), which the other
//! ranks may not have received: aborts `comm` (see `abort_peers`), so that none of them waits for
//! this rank in a later collective. Returns `failure`; other failures pass unchanged.
template <communicator C>
std::exception_ptr abort_peers_on_protocol_error(C& comm, std::exception_ptr failure) {
  if (is_protocol_error(failure))
    abort_peers(comm, failure);
  return failure;
}

//! Runs `f`; if it throws, aborts `comm` (see `abort_peers`) and rethrows. For steps after
//! which the peers wait for this rank in a collective that carries no status.
template <communicator C, class F>
void abort_peers_on_failure(C& comm, F&& f) {
  try {
    std::forward<F>(f)();
  } catch (...) {
    abort_peers(comm, std::current_exception());
    throw;
  }
}

//! Waits for `s` through `comm` when the communicator watches its own waits (NCCL: polls for
//! asynchronous errors, and aborts the communicator on its timeout), else `s.synchronize()`.
template <communicator C, class Stream>
void wait_watched(C& comm, Stream& s) {
  if constexpr (requires { comm.synchronize(s); })
    comm.synchronize(s);
  else
    s.synchronize();
}

//! `Space::on_host(s, f)` (runs `f` on the host once `s` got there), with the wait of spaces that
//! block the host (CUDA) going through `comm` (see `wait_watched`).
template <class Space, communicator C, class F>
void on_host_watched(C& comm, typename Space::stream_arg s, F&& f) {
  if constexpr (Space::runs_later) {
    Space::on_host(s, std::forward<F>(f));
  } else {
    wait_watched(comm, s);
    std::forward<F>(f)();
  }
}

//! The one wait of a layer: waits for both of its streams (through `comm`, see
//! `wait_watched`), observing both streams' failures, and rethrows the root cause (see
//! `root_cause`: this rank's own error, else a peer's failure naming its origin).
template <communicator C, class Stream>
void synchronize_streams(C& comm, Stream& compute, Stream& comm_stream) {
  std::exception_ptr failures[2];
  Stream* streams[2] = {&compute, &comm_stream};
  for (int i = 0; i < 2; ++i) {
    try {
      wait_watched(comm, *streams[i]);
    } catch (...) {
      failures[i] = std::current_exception();
    }
  }
  if (std::exception_ptr root = root_cause({failures[0], failures[1]}))
    std::rethrow_exception(root);
}

WEAVE_NAMESPACE_END
