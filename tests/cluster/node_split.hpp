// The nodes as MPI sees them (ranks sharing memory), for the programs and tests run under
// weave-cluster: this rank's node communicator and the communicator of the ranks with its local
// rank on every node (2DH's two levels).
#pragma once

#include <mpi.h>

namespace cluster_test {

struct node_split {
  MPI_Comm intra = MPI_COMM_NULL, inter = MPI_COMM_NULL;
  int rank = 0, ranks = 0;       // in MPI_COMM_WORLD
  int local = 0, local_rank = 0; // in this node
  int nodes = 0, node = 0;       // across the nodes

  node_split() {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &ranks);
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &intra);
    MPI_Comm_size(intra, &local);
    MPI_Comm_rank(intra, &local_rank);
    MPI_Comm_split(MPI_COMM_WORLD, local_rank, rank, &inter);
    MPI_Comm_size(inter, &nodes);
    MPI_Comm_rank(inter, &node);
  }
  ~node_split() {
    MPI_Comm_free(&intra);
    MPI_Comm_free(&inter);
  }
  node_split(const node_split&) = delete;
  node_split& operator=(const node_split&) = delete;
};

} // namespace cluster_test
