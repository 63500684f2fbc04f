// The device decode exchange in host_space over real MPI processes (mpirun -np 2 / 4): the
// local_world cases, one process per rank.
#include "device_decode_cases.hpp"

#include <weave/comm/mpi_communicator.hpp>
#include <weave/core/dtype.hpp>

#include "mpi_session.hpp"

namespace {
const weave_test::mpi_session session; // MPI for the whole executable
} // namespace

TEST_CASE_TEMPLATE("device decode exchange over MPI equals the reference and the host exchange", T,
                   float, weave::bfloat16) {
  weave::mpi_communicator comm(MPI_COMM_WORLD);
  decode_test::check_device_against_host<T>(
      comm, weave::placement::contiguous(decode_test::experts, comm.size()));
}

TEST_CASE("device decode exchange over MPI with partial sums equals the host exchange") {
  weave::mpi_communicator comm(MPI_COMM_WORLD);
  decode_test::check_device_against_host<weave::bfloat16>(
      comm, weave::placement::contiguous(decode_test::experts, comm.size()), true);
}

TEST_CASE("device decode exchange over MPI: one rank's bad call fails every rank") {
  weave::mpi_communicator comm(MPI_COMM_WORLD);
  decode_test::check_device_every_fault(comm);
}

TEST_CASE("device decode exchange over MPI: calls queued back to back") {
  weave::mpi_communicator comm(MPI_COMM_WORLD);
  decode_test::check_device_queued_calls(comm);
}

TEST_CASE("FP8 decode over MPI: both exchanges equal the reference; a NaN token fails every rank") {
  weave::mpi_communicator comm(MPI_COMM_WORLD);
  decode_test::check_fp8_decode<weave::bfloat16>(comm, true);
  decode_test::check_fp8_decode<float>(comm, false);
  decode_test::check_fp8_nonfinite(comm);
}
