// The handle API's failure cases (handle_faults.hpp) under mpirun -np 2 and -np 4, for the MoE
// exchange in every execution space CI has (host_space, emulated_gpu_space), each over a fresh
// mpi_communicator with the default timeout (10 minutes): every rank ends with a typed error
// naming the cause within seconds, or computes the right result; MPI never aborts the job (a
// mismatched call is found in the header that precedes its data, so nothing is truncated).
#include <doctest/doctest.h>

#include "handle_faults.hpp"
#include "mpi_session.hpp"

#include <weave/comm/mpi_communicator.hpp>
#include <weave/exec/emulated_gpu_space.hpp>

#include <memory>
#include <string>
#include <vector>

namespace {

// After an abort MPI may still write into an abandoned collective's buffers until MPI_Finalize:
// what the cases keep (layers, workspaces, streams, communicators) lives here until then.
weave_test::kept_until_finalize graveyard;

const weave_test::mpi_session session;

using handle_faults::fault;

template <class Space>
void run_all() {
  int ranks = 0, rank = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  const int culprit = ranks - 1;
  for (const fault f : handle_faults::all_faults) {
    const std::string layer = handle_faults::space_name<Space>(), what = handle_faults::name(f);
    CAPTURE(layer);
    CAPTURE(what);
    auto comm = std::make_shared<weave::mpi_communicator>(MPI_COMM_WORLD);
    graveyard.keep(comm);
    const auto o = handle_faults::run_case<Space>(
        *comm, f, culprit, [](std::shared_ptr<void> p) { graveyard.keep(p); });
    MPI_Barrier(MPI_COMM_WORLD); // every rank finished the case
    const bool guilty = rank == culprit;
    CHECK(o.seconds < 5.0); // the communicator's timeout is 10 minutes
    switch (f) {
    case fault::swapped_equal_sizes:
    case fault::swapped_other_sizes:
      CHECK((o.code == weave::errc::call_mismatch ||
             (o.code == weave::errc::peer_failure && o.origin_code == weave::errc::call_mismatch)));
      break;
    case fault::destroyed_in_flight:
    case fault::destroyed_after_sync:
    case fault::destroyed_before_handle:
    case fault::combine_twice:
      if (guilty) {
        CHECK(o.code == (f == fault::combine_twice ? weave::errc::invalid_state : weave::errc{}));
      } else if (f == fault::combine_twice && o.code == weave::errc{}) {
        // The culprit had issued every collective of both calls (iterating past a handle's last
        // chunk issues its combine): a peer may finish both, right, before the abort.
        CHECK(o.outputs_right);
      } else {
        CHECK(o.code == weave::errc::peer_failure);
        CHECK(o.origin == culprit);
        CHECK(o.origin_code == weave::errc::invalid_state);
      }
      break;
    case fault::recovery:
      CHECK(o.code == (guilty ? weave::errc::out_of_range : weave::errc::peer_failure));
      if (!guilty)
        CHECK(o.origin_code == weave::errc::out_of_range);
      CHECK(o.handles_stale);
      CHECK(o.outputs_right);
      break;
    }
  }
}

} // namespace

TEST_CASE_TEMPLATE("handle faults: the MoE exchange over MPI", Space, weave::host_space,
                   weave::emulated_gpu_space) {
  run_all<Space>();
}
