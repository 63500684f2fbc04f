// decode_exchange over real MPI processes (mpirun -np 2 / 4): the same cases as the
// local_world test, one process per rank: bitwise equal to the naive reference for f32 and
// bf16 rows with zero-token and full ranks (the experts reading copies or, with gathered inputs,
// the rows where they arrived), and fail-stop for every bad input.
#include "decode_cases.hpp"

#include <weave/comm/mpi_communicator.hpp>
#include <weave/core/dtype.hpp>
#include <weave/exec/host_stream.hpp>

#include "mpi_session.hpp"

namespace {
const weave_test::mpi_session session; // MPI for the whole executable
} // namespace

TEST_CASE_TEMPLATE("decode_exchange over MPI equals the naive reference", T, float,
                   weave::bfloat16) {
  weave::mpi_communicator comm(MPI_COMM_WORLD);
  decode_test::check_against_reference<T>(
      comm, weave::placement::contiguous(decode_test::experts, comm.size()));
}

TEST_CASE("decode_exchange over MPI with partial sums equals its per-device reference") {
  weave::mpi_communicator comm(MPI_COMM_WORLD);
  decode_test::check_against_reference<weave::bfloat16>(
      comm, weave::placement::contiguous(decode_test::experts, comm.size()), true);
}

TEST_CASE("decode_exchange over MPI with gathered inputs equals the reference of either combine") {
  weave::mpi_communicator comm(MPI_COMM_WORLD);
  for (const bool partial_sums : {true, false})
    decode_test::check_against_reference<weave::bfloat16>(
        comm, weave::placement::contiguous(decode_test::experts, comm.size()), partial_sums, true);
}

TEST_CASE("decode_exchange over MPI: one rank's bad call fails every rank, none hangs") {
  weave::mpi_communicator comm(MPI_COMM_WORLD);
  decode_test::check_every_fault(comm);
}

TEST_CASE("decode_exchange over MPI: calls queued back to back without waiting") {
  weave::mpi_communicator comm(MPI_COMM_WORLD);
  decode_test::check_queued_calls(comm);
}

TEST_CASE("decode_exchange over MPI: destroyed with a call still queued, it waits for it") {
  weave::mpi_communicator comm(MPI_COMM_WORLD);
  decode_test::check_destroyed_while_queued(comm);
}

TEST_CASE("decode_exchange over MPI inside the caller's claim of its stream runs on the calling "
          "thread") {
  weave::mpi_communicator comm(MPI_COMM_WORLD);
  decode_test::check_inside_a_claim(comm);
}
