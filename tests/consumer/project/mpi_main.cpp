// The MPI component links MPI and weave's MPI error checking.
#include <weave/core/mpi_error.hpp>

int main(int argc, char** argv) {
  WEAVE_MPI_CHECK(MPI_Init(&argc, &argv));
  WEAVE_MPI_CHECK(MPI_Finalize());
  return 0;
}
