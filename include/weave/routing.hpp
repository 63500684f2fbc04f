//! \file
//! Umbrella header of the host routing layer: gating, capacity, device-limited routing,
//! dispatch plans (sender and receiver halves), host kernels, block-scaled FP8 quantisation and
//! statistics. The CUDA kernels are in `weave/routing/kernels.cuh` and
//! `weave/routing/quantize.cuh` (nvcc) and the plan upload in `plan_cuda.hpp`.
#pragma once

#include "weave/routing/capacity.hpp"
#include "weave/routing/device_capacity.hpp"
#include "weave/routing/device_dispatch_plan.hpp"
#include "weave/routing/device_expert_plan.hpp"
#include "weave/routing/device_limit.hpp"
#include "weave/routing/device_maps.hpp"
#include "weave/routing/dispatch_plan.hpp"
#include "weave/routing/expert_plan.hpp"
#include "weave/routing/gate.hpp"
#include "weave/routing/host_quant_moves.hpp"
#include "weave/routing/host_row_moves.hpp"
#include "weave/routing/kernels_async.hpp"
#include "weave/routing/kernels_host.hpp"
#include "weave/routing/quantize.hpp"
#include "weave/routing/row_moves.hpp"
#include "weave/routing/statistics.hpp"
