//! \file
//! Umbrella header: everything in weave that needs no backend SDK (CUDA, NCCL, MPI). Backend
//! headers (`*cuda*`, `*nccl*`, `*mpi*`, `.cuh`) are included on their own, from their
//! components.
#pragma once

#include "weave/comm.hpp"
#include "weave/core.hpp"
#include "weave/exec.hpp"
#include "weave/overlap.hpp"
#include "weave/placement.hpp"
#include "weave/plan.hpp"
#include "weave/routing.hpp"
#include "weave/sim.hpp"
