//! \file
//! Cluster-scale simulation: cluster presets and file format, per-layer MoE traffic, step time
//! over the planner's schedules (`weave/plan.hpp`), JSON and Chrome-trace reports.
#pragma once

#include "weave/sim/cluster.hpp"
#include "weave/sim/cluster_sim.hpp"
#include "weave/sim/moe_model.hpp"
#include "weave/sim/report.hpp"
