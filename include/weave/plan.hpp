//! \file
//! The Lancet-style overlap planner, namespace `weave::plan`: cost models (alpha-beta
//! all-to-all, per-row kernels, fitting), the operator graph, the partitioning dynamic program,
//! the dW scheduler, schedules, the two-stream timeline simulator, the executor that runs a
//! schedule on real streams, and Chrome-trace export of timelines.
#pragma once

#include "weave/plan/cost_model.hpp"
#include "weave/plan/dw_scheduler.hpp"
#include "weave/plan/executor.hpp"
#include "weave/plan/graph.hpp"
#include "weave/plan/partition_planner.hpp"
#include "weave/plan/schedule.hpp"
#include "weave/plan/timeline.hpp"
#include "weave/plan/timeline_trace.hpp"
