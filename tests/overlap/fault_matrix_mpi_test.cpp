// The fault matrix (fault_matrix.hpp) under mpirun -np 2 and -np 4: moe_exchange and the device
// exchange on host streams, dynamic and static shapes, over a fresh mpi_communicator per case;
// the culprit is the last rank.
#include <doctest/doctest.h>

#include "fault_matrix.hpp"
#include "mpi_session.hpp"

#include <weave/comm/mpi_communicator.hpp>

#include <memory>
#include <vector>

namespace {

// After an abort, MPI may still write into the buffers of the abandoned collective until
// MPI_Finalize (see mpi_communicator): aborted layers and their communicators are kept here.
weave_test::kept_until_finalize graveyard;

const weave_test::mpi_session session;

template <template <class> class Layer>
void run_matrix() {
  int ranks = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  for (const fault_matrix::fault f : fault_matrix::all_faults) {
    CAPTURE(fault_matrix::name(f));
    fault_matrix::watchdog dog(std::string(Layer<weave::mpi_communicator>::name) + ", " +
                               fault_matrix::name(f));
    weave::mpi_options options;
    options.timeout = fault_matrix::timeout;
    auto comm = std::make_shared<weave::mpi_communicator>(MPI_COMM_WORLD, options);
    fault_matrix::run_case<Layer>(*comm, f, ranks - 1, [&](auto&& layer) {
      graveyard.keep(std::shared_ptr<void>(std::move(layer)));
      graveyard.keep(comm);
    });
    MPI_Barrier(MPI_COMM_WORLD); // every rank finished the case
  }
}

} // namespace

TEST_CASE("fault matrix: moe_exchange over MPI") {
  run_matrix<fault_matrix::host_layer>();
}

TEST_CASE("fault matrix: device exchange (host streams, dynamic shapes) over MPI") {
  run_matrix<fault_matrix::device_dynamic>();
}

TEST_CASE("fault matrix: device exchange (host streams, static shapes) over MPI") {
  run_matrix<fault_matrix::device_static>();
}
