//! \file
//! Communication layer, host-only parts: the communicator concept, the in-process world with its
//! emulated links, the hierarchical (2DH) all-to-all, and the fail-stop pieces (configuration
//! agreement, the status-carrying count exchange, aborts and the one wait). The MPI and NCCL
//! communicators are in `weave/comm/mpi_communicator.hpp` and `weave/comm/nccl_communicator.hpp`
//! (components `weave::mpi` and `weave::nccl`).
#pragma once

#include "weave/comm/agreement.hpp"
#include "weave/comm/communicator.hpp"
#include "weave/comm/emulated_link.hpp"
#include "weave/comm/fail_stop.hpp"
#include "weave/comm/hierarchical.hpp"
#include "weave/comm/local_world.hpp"
#include "weave/comm/shrink.hpp"
#include "weave/comm/status_exchange.hpp"
