// MPI for the whole life of an MPI test executable (doctest's main runs inside it), with
// MPI_THREAD_MULTIPLE: the communicator's operations run on host stream threads.
#pragma once

#include <mpi.h>

namespace weave_test {

struct mpi_session {
  mpi_session() {
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
  }
  ~mpi_session() { MPI_Finalize(); }
  mpi_session(const mpi_session&) = delete;
  mpi_session& operator=(const mpi_session&) = delete;
};

} // namespace weave_test
