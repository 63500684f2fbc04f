//! \file
//! Umbrella header: everything in weave that needs no backend SDK (CUDA, NCCL, MPI). Backend
//! headers are included on their own, from their components.
#pragma once

#include "weave/core.hpp"
#include "weave/exec.hpp"
#include "weave/placement.hpp"
