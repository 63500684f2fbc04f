//! \file
//! Overlap layer: the MoE exchange and its chunked pipeline, and the Lancet-style planner
//! (graph model, partition planner, dW scheduler, schedules and their executor, Chrome traces).
#pragma once

#include "weave/overlap/device_exchange.hpp"
#include "weave/overlap/device_exchange_steps.hpp"
#include "weave/overlap/dw_scheduler.hpp"
#include "weave/overlap/executor.hpp"
#include "weave/overlap/graph.hpp"
#include "weave/overlap/moe_exchange.hpp"
#include "weave/overlap/moe_options.hpp"
#include "weave/overlap/partition_planner.hpp"
#include "weave/overlap/pipeline.hpp"
#include "weave/overlap/pipeline_timing.hpp"
#include "weave/overlap/row_buffer.hpp"
#include "weave/overlap/schedule.hpp"
#include "weave/overlap/timeline_trace.hpp"
#include "weave/overlap/trace.hpp"
