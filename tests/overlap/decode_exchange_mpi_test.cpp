// The decode exchange over real MPI processes (mpirun -np 2 / 4), every case run in host_space
// (`decode_exchange`) and in emulated_gpu_space (the control flow of `cuda_decode_exchange`), one
// process per rank: the local_world cases, bitwise equal to the naive reference for f32 and bf16
// rows with zero-token and full ranks (the experts reading copies or, with gathered inputs, the
// rows where they arrived), both spaces giving the same bits, an FP8 dispatch, and fail-stop for
// every bad input.
#include "decode_cases.hpp"

#include <weave/comm/mpi_communicator.hpp>
#include <weave/core/dtype.hpp>
#include <weave/exec/emulated_gpu_space.hpp>
#include <weave/exec/host_space.hpp>
#include <weave/exec/host_stream.hpp>

#include "mpi_session.hpp"

namespace {
const weave_test::mpi_session session; // MPI for the whole executable
} // namespace

TEST_CASE_TEMPLATE("decode_exchange over MPI equals the naive reference", Space, weave::host_space,
                   weave::emulated_gpu_space) {
  weave::mpi_communicator comm(MPI_COMM_WORLD);
  const auto where = weave::placement::contiguous(decode_test::experts, comm.size());
  decode_test::check_against_reference<Space, float>(comm, where);
  decode_test::check_against_reference<Space, weave::bfloat16>(comm, where, {false, false, true});
}

TEST_CASE_TEMPLATE("decode_exchange over MPI with partial sums equals its per-device reference",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  weave::mpi_communicator comm(MPI_COMM_WORLD);
  decode_test::check_against_reference<Space, weave::bfloat16>(
      comm, weave::placement::contiguous(decode_test::experts, comm.size()), {true});
}

TEST_CASE_TEMPLATE("decode_exchange over MPI with gathered inputs equals the reference of either "
                   "combine",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  weave::mpi_communicator comm(MPI_COMM_WORLD);
  for (const bool partial_sums : {true, false})
    decode_test::check_against_reference<Space, weave::bfloat16>(
        comm, weave::placement::contiguous(decode_test::experts, comm.size()),
        {partial_sums, true});
}

TEST_CASE("decode_exchange over MPI in host_space and in emulated_gpu_space gives the same bits") {
  weave::mpi_communicator comm(MPI_COMM_WORLD);
  const auto where = weave::placement::contiguous(decode_test::experts, comm.size());
  for (const bool partial_sums : {true, false})
    decode_test::check_spaces_agree<float>(comm, where, {partial_sums, !partial_sums});
}

TEST_CASE_TEMPLATE("decode_exchange over MPI: one rank's bad call fails every rank, none hangs",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  weave::mpi_communicator comm(MPI_COMM_WORLD);
  decode_test::check_every_fault<Space>(comm);
}

TEST_CASE_TEMPLATE("decode_exchange over MPI: calls queued back to back without waiting", Space,
                   weave::host_space, weave::emulated_gpu_space) {
  weave::mpi_communicator comm(MPI_COMM_WORLD);
  decode_test::check_queued_calls<Space>(comm);
}

TEST_CASE_TEMPLATE("decode_exchange over MPI: destroyed with a call still queued, it waits for it",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  weave::mpi_communicator comm(MPI_COMM_WORLD);
  decode_test::check_destroyed_while_queued<Space>(comm);
}

TEST_CASE_TEMPLATE("decode_exchange over MPI inside the caller's claim of its stream runs on the "
                   "calling thread",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  weave::mpi_communicator comm(MPI_COMM_WORLD);
  decode_test::check_inside_a_claim<Space>(comm);
}

TEST_CASE_TEMPLATE("FP8 decode over MPI equals the reference; a NaN token fails every rank", Space,
                   weave::host_space, weave::emulated_gpu_space) {
  weave::mpi_communicator comm(MPI_COMM_WORLD);
  decode_test::check_fp8_decode<Space, weave::bfloat16>(comm, true);
  decode_test::check_fp8_decode<Space, float>(comm, false);
  decode_test::check_fp8_nonfinite<Space>(comm);
}
