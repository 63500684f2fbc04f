//! \file
//! `cuda_moe_exchange<Comm>`: the MoE exchange on CUDA streams (compiled by the consumer's
//! nvcc; components `weave::cuda`, and `weave::nccl` for `nccl_communicator`). It is
//! `basic_moe_exchange` (see `moe_exchange.hpp`) in `cuda_space`: plans are built on the
//! GPU by kernels, CUB sorts and scans; rows move with the CUDA row kernels; the all-to-alls are
//! the communicator's (NCCL grouped send/recv, or `cuda_local_world` for ranks of one process).
//! With `moe_options::static_shape` a call enqueues kernels and collectives only, never waits
//! for the GPU, and can be captured in a CUDA graph.
#pragma once

#include "weave/core/config.hpp"
#include "weave/exec/cuda_space.cuh"
#include "weave/overlap/moe_exchange.hpp"
#include "weave/routing/cuda_row_moves.cuh"
#include "weave/routing/quantize.cuh"

WEAVE_NAMESPACE_BEGIN

//! The MoE exchange on CUDA streams over `Comm` (whose stream type is `cuda_stream_ref`).
template <class Comm>
using cuda_moe_exchange = basic_moe_exchange<cuda_space, Comm>;

//! The expert callback batches and chunk hooks of `cuda_moe_exchange` (device offsets, views
//! of the chunk's capacity, and the stream to enqueue on).
using cuda_expert_batch = basic_expert_batch<cuda_space>;
using cuda_expert_grad_batch = basic_expert_grad_batch<cuda_space>;
using cuda_chunk_hooks = basic_chunk_hooks<cuda_space>;

WEAVE_NAMESPACE_END
