//! \file
//! How `mpi_communicator::all_to_all_v` fits 64-bit layouts into MPI 3.1's `int` counts and
//! displacements: which blocks go through `MPI_Ialltoallv` (the others, above the piece limit,
//! go point to point in pieces), and the staging of a side whose displacements overflow.
#pragma once

#include "weave/core/config.hpp"

#include <cstddef>
#include <cstdint>
#include <span>

WEAVE_NAMESPACE_BEGIN
namespace detail {

//! One side of an all-to-all as `MPI_Ialltoallv` takes it.
struct mpi_side_part {
  bool fits = true;   //!< every collective block's displacement fits: no staging
  bool large = false; //!< some block is above the limit (it goes in pieces)
};

//! Writes the `int` counts `c` and displacements `d` of the blocks that go through the
//! collective: a block of more than `limit` units leaves it (count 0) on both sides, since both
//! know its count; a displacement past `max_displacement` makes the side staged (`fits` false).
inline mpi_side_part mpi_collective_part(std::span<const std::int64_t> counts,
                                         std::span<const std::int64_t> displs, std::int64_t limit,
                                         std::int64_t max_displacement, int* c, int* d) {
  mpi_side_part part;
  for (std::size_t j = 0; j < counts.size(); ++j) {
    const bool big = counts[j] > limit;
    part.large = part.large || big;
    c[j] = big ? 0 : static_cast<int>(counts[j]);
    d[j] = 0;
    if (!big && counts[j] > 0) {
      if (displs[j] > max_displacement)
        part.fits = false;
      else
        d[j] = static_cast<int>(displs[j]);
    }
  }
  return part;
}

//! Displacements `d` of the collective blocks packed in peer order; returns the units they span
//! (at most size * limit <= INT_MAX).
inline std::int64_t mpi_packed_offsets(std::size_t n, const int* c, int* d) {
  std::int64_t offset = 0;
  for (std::size_t j = 0; j < n; ++j) {
    d[j] = static_cast<int>(offset);
    offset += c[j];
  }
  return offset;
}

//! Calls `copy(placed, staged, bytes)` for each collective block: its byte offset at its
//! displacement in the caller's buffer, at `d` in the packed stage, and its size.
template <class Copy>
void mpi_each_block(std::size_t n, std::size_t unit, const int* c,
                    std::span<const std::int64_t> displs, const int* d, Copy&& copy) {
  for (std::size_t j = 0; j < n; ++j)
    if (c[j] > 0)
      copy(static_cast<std::size_t>(displs[j]) * unit, static_cast<std::size_t>(d[j]) * unit,
           static_cast<std::size_t>(c[j]) * unit);
}

} // namespace detail
WEAVE_NAMESPACE_END
