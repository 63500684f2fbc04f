//! \file
//! `mpi_options`, the settings of an `mpi_communicator` (component `weave::mpi`), and the
//! MPI datatypes of the element types weave reduces and of the rows it moves.
#pragma once

#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"

#include <mpi.h>

#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <type_traits>

WEAVE_NAMESPACE_BEGIN

//! Settings of an `mpi_communicator`.
struct mpi_options {
  //! How long an operation may take once its stream reaches it before it fails with
  //! `errc::timeout`. The timeout aborts the communicator (its peers learn it at once); MPI
  //! cannot cancel a collective, so the communicator is unusable afterwards.
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
  //! Peer blocks of more units than this go point to point, in pieces of at most this many
  //! units (clamped to INT_MAX / size). Lower it only to test the large-message path.
  std::int64_t max_chunk_units = INT_MAX;
  //! Ignored: `all_to_all_v` sends every block from its own address, so no displacement is
  //! passed to MPI (kept so that code setting it still compiles).
  std::int64_t max_displacement_units = INT_MAX;
  //! An operation moving at most this many bytes on this rank (sent plus received) runs on the
  //! calling thread when its stream is idle (`host_stream::run_inline_or_submit`): it skips the
  //! hand-off to the stream's worker (5-40 us; docs/perf.md, "MPI overhead"), and the call
  //! returns once it completed. Operations then start in the order the calling threads issue
  //! them, so a rank that issues operations of several communicators must issue them in the
  //! same order as its peers do, as MPI's blocking calls require. 0: every operation runs on the
  //! stream's worker, and calls never wait.
  std::size_t inline_max_bytes = std::size_t{1} << 22;
  //! A tagged collective (every one a weave layer issues) sends a peer block of at most this
  //! many bytes inside the message of its call header, so the receiver checks the call and takes
  //! the block in one round trip; a larger block goes alone, its receive posted beside the
  //! header's. Costs a staging copy of such blocks on each side (which is why larger blocks go
  //! alone: at 16 and 64 KiB the copies cost more than the round trip saved; docs/perf.md) and up
  //! to (size - 1) x (32 + this) bytes of staging per side, capped at 4 MiB (the limit shrinks
  //! beyond 1024 ranks). Set it alike on every rank: a block above the receiver's limit fails the
  //! call with `errc::mpi` (MPI's truncation). 0: headers travel alone.
  std::size_t tagged_inline_bytes = 4096;
};

namespace detail {

template <class T>
MPI_Datatype mpi_type() {
  if constexpr (std::is_same_v<T, float>)
    return MPI_FLOAT;
  else if constexpr (std::is_same_v<T, double>)
    return MPI_DOUBLE;
  else if constexpr (std::is_same_v<T, std::int32_t>)
    return MPI_INT32_T;
  else
    return MPI_INT64_T;
}

//! The contiguous datatype of `unit` bytes an all-to-all moves its rows as, built once per unit
//! (a caller moves rows of one size call after call).
class mpi_unit_type {
 public:
  //! Sets `type` to the datatype of `unit` bytes (MPI_BYTE for 1); returns MPI's status.
  int get(std::size_t unit, MPI_Datatype& type) {
    if (unit == 1) {
      type = MPI_BYTE;
      return MPI_SUCCESS;
    }
    if (unit != unit_) {
      free();
      if (const int status =
              MPI_Type_contiguous(checked_cast<int>(unit, "unit bytes"), MPI_BYTE, &type_);
          status != MPI_SUCCESS)
        return status;
      if (const int status = MPI_Type_commit(&type_); status != MPI_SUCCESS)
        return status;
      unit_ = unit;
    }
    type = type_;
    return MPI_SUCCESS;
  }

  //! Frees the cached datatype (never throws).
  void free() noexcept {
    if (type_ != MPI_DATATYPE_NULL)
      MPI_Type_free(&type_);
    unit_ = 0;
  }

 private:
  MPI_Datatype type_ = MPI_DATATYPE_NULL;
  std::size_t unit_ = 0;
};

} // namespace detail

WEAVE_NAMESPACE_END
