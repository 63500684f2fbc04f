//! \file
//! Umbrella header of the host routing layer: gating, capacity, device-limited routing, the
//! dispatch plans (`device_dispatch_plan<Space>`, `device_expert_plan<Space>`,
//! `device_capacity_filter<Space>`: one algorithm in every execution space, run on host streams
//! by `host_space`), the row primitives and layout moves (`gather_rows` / `merge_rows` on host
//! memory; in stream order `row_moves<Space>` and `layout_move`), and block-scaled FP8
//! quantisation. The CUDA pieces are in `weave/routing/plan.cuh`,
//! `weave/routing/cuda_row_moves.cuh` (`row_moves<cuda_space>`) and `weave/routing/quantize.cuh`
//! (nvcc).
#pragma once

#include "weave/routing/capacity.hpp"
#include "weave/routing/device_capacity.hpp"
#include "weave/routing/device_dispatch_plan.hpp"
#include "weave/routing/device_expert_plan.hpp"
#include "weave/routing/device_limit.hpp"
#include "weave/routing/device_maps.hpp"
#include "weave/routing/gate.hpp"
#include "weave/routing/host_quant_moves.hpp"
#include "weave/routing/host_row_moves.hpp"
#include "weave/routing/kernels_host.hpp"
#include "weave/routing/quantize.hpp"
#include "weave/routing/route_entry.hpp"
#include "weave/routing/row_moves.hpp"
