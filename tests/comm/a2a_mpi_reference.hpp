// MPI_Alltoallv itself on one rank's part of an all-to-all case (a2a_cases.hpp): the reference
// the MPI tests compare weave with, bitwise.
#pragma once

#include "a2a_cases.hpp"

#include <mpi.h>

#include <cstddef>
#include <vector>

namespace comm_test {

// This rank's (its rank in `comm`) received bytes of `c` after MPI_Alltoallv on `comm`.
inline std::vector<std::byte> mpi_alltoallv_reference(const a2a_case& c, MPI_Comm comm) {
  int rank = 0;
  MPI_Comm_rank(comm, &rank);
  const auto& L = c.ranks[std::size_t(rank)];
  std::vector<std::byte> out(L.recv_bytes, sentinel);
  MPI_Datatype type;
  MPI_Type_contiguous(static_cast<int>(c.unit), MPI_BYTE, &type);
  MPI_Type_commit(&type);
  const auto ints = [](const std::vector<std::int64_t>& v) {
    return std::vector<int>(v.begin(), v.end());
  };
  const auto sc = ints(L.send_counts), sd = ints(L.send_displs), rc = ints(L.recv_counts),
             rd = ints(L.recv_displs);
  MPI_Alltoallv(L.send.data(), sc.data(), sd.data(), type, out.data(), rc.data(), rd.data(), type,
                comm);
  MPI_Type_free(&type);
  return out;
}

} // namespace comm_test
