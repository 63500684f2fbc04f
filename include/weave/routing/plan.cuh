//! \file
//! `cuda_dispatch_plan` (compiled by the consumer's nvcc): `device_dispatch_plan` (see
//! `device_dispatch_plan.hpp`) in `cuda_space`, replicas included. The counting sort is one
//! thread per token, a `cub::DeviceScan` of the per-device counts and a stable
//! `cub::DeviceRadixSort`; the same steps run on host streams in `host_space` and
//! `emulated_gpu_space`, where CI checks them against a sequential host reference.
#pragma once

#include "weave/core/config.hpp"
#include "weave/exec/cuda_space.cuh"
#include "weave/routing/device_dispatch_plan.hpp"

WEAVE_NAMESPACE_BEGIN

//! Device-built dispatch plan on CUDA streams. Construct (needs a current CUDA device: it sizes
//! CUB's scratch), allocate `workspace_size()` bytes of device memory, `initialize` once, then
//! `build` on a stream as often as needed (no allocation).
using cuda_dispatch_plan = device_dispatch_plan<cuda_space>;

WEAVE_NAMESPACE_END
