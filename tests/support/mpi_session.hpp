// MPI for the whole test executable: define one `mpi_session` object at namespace scope (doctest's
// main runs inside its lifetime). MPI_THREAD_MULTIPLE, as weave's MPI tests need.
#pragma once

#include <mpi.h>

#include <memory>
#include <utility>
#include <vector>

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

inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
inline int world_size() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

// What MPI may still touch until MPI_Finalize: the buffers (and communicators) of a collective
// abandoned after an abort. Define one before the `mpi_session`, so it is destroyed after it.
struct kept_until_finalize {
  std::vector<std::shared_ptr<void>> things;
  template <class T>
  void keep(std::shared_ptr<T> thing) {
    things.push_back(std::move(thing));
  }
  // Last kept, first released: a layer goes before the communicator it was built on.
  ~kept_until_finalize() {
    while (!things.empty())
      things.pop_back();
  }
};

} // namespace weave_test
