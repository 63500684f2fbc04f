//! \file
//! Simulation: cost models (alpha-beta all-to-all, per-row kernels, fitting), the two-stream
//! timeline simulator, and the cluster-scale MoE simulator (cluster presets and file format,
//! per-layer traffic, step time, JSON and Chrome-trace reports).
#pragma once

#include "weave/sim/cluster.hpp"
#include "weave/sim/cluster_sim.hpp"
#include "weave/sim/cost_model.hpp"
#include "weave/sim/moe_model.hpp"
#include "weave/sim/report.hpp"
#include "weave/sim/timeline.hpp"
