// The fault matrix (fault_matrix.hpp) under mpirun -np 2 and -np 4: the MoE exchange in every
// execution space CI has (host_space, emulated_gpu_space), dynamic and static shapes, over a
// fresh mpi_communicator per case; the culprit is the last rank.
#include <doctest/doctest.h>

#include "fault_matrix.hpp"
#include "mpi_session.hpp"

#include <weave/comm/mpi_communicator.hpp>
#include <weave/exec/emulated_gpu_space.hpp>

#include <memory>
#include <vector>

namespace {

// After an abort, MPI may still write into the buffers of the abandoned collective until
// MPI_Finalize (see mpi_communicator): aborted layers and their communicators are kept here.
weave_test::kept_until_finalize graveyard;

const weave_test::mpi_session session;

template <class Space>
void run_matrix(bool fixed) {
  int ranks = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  for (const fault_matrix::fault f : fault_matrix::all_faults) {
    const std::string what = fault_matrix::name(f);
    CAPTURE(what);
    fault_matrix::watchdog dog(fault_matrix::layer_name<Space>(fixed) + ", " +
                               fault_matrix::name(f));
    weave::mpi_options options;
    options.timeout = fault_matrix::timeout;
    auto comm = std::make_shared<weave::mpi_communicator>(MPI_COMM_WORLD, options);
    fault_matrix::run_case<Space>(*comm, f, ranks - 1, fixed, [&](auto&& layer) {
      graveyard.keep(std::shared_ptr<void>(std::move(layer)));
      graveyard.keep(comm);
    });
    MPI_Barrier(MPI_COMM_WORLD); // every rank finished the case
  }
}

} // namespace

TEST_CASE_TEMPLATE("fault matrix: the MoE exchange over MPI", Space, weave::host_space,
                   weave::emulated_gpu_space) {
  SUBCASE("dynamic shapes") {
    run_matrix<Space>(false);
  }
  SUBCASE("static shapes") {
    run_matrix<Space>(true);
  }
}
