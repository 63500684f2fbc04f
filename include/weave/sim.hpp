//! \file
//! Simulation: cost models (alpha-beta all-to-all, per-row kernels, fitting) and the two-stream
//! timeline simulator.
#pragma once

#include "weave/sim/cost_model.hpp"
#include "weave/sim/timeline.hpp"
