//! \file
//! Communication layer, host-only parts: the communicator concept, the in-process world with its
//! emulated links, and the hierarchical (2DH) all-to-all. The MPI and NCCL communicators are in
//! `weave/comm/mpi_communicator.hpp` and `weave/comm/nccl_communicator.hpp` (components
//! `weave::mpi` and `weave::nccl`).
#pragma once

#include "weave/comm/communicator.hpp"
#include "weave/comm/emulated_link.hpp"
#include "weave/comm/hierarchical.hpp"
#include "weave/comm/local_world.hpp"
