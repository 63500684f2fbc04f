//! \file
//! Overlap layer: the MoE exchange (one class template over every execution space) with its
//! handles (dispatch, combine and their backward, several calls in flight), its chunked pipeline
//! and stage timings; the low-latency decode exchanges (host and device).
//! The Lancet-style planner (graph model, partition planner, dW scheduler, schedules, their
//! simulator and executor) lives in `weave/plan.hpp`, namespace `weave::plan`.
#pragma once

#include "weave/overlap/decode_exchange.hpp"
#include "weave/overlap/decode_handle.hpp"
#include "weave/overlap/decode_options.hpp"
#include "weave/overlap/expert_state_moves.hpp"
#include "weave/overlap/moe_exchange.hpp"
#include "weave/overlap/moe_handle.hpp"
#include "weave/overlap/moe_options.hpp"
#include "weave/overlap/pipeline.hpp"
#include "weave/overlap/pipeline_timing.hpp"
