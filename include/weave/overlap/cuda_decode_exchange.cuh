//! \file
//! `cuda_decode_exchange<Comm, T>`: the low-latency decode exchange on CUDA streams (compiled by
//! the consumer's nvcc; components `weave::cuda`, and `weave::nccl` for `nccl_communicator`).
//! It is `basic_decode_exchange` (see `decode_exchange.hpp`) in `cuda_space`: routes, records,
//! headers and the expert pool are kernels, rows move with the CUDA row kernels, and the two
//! all-to-alls are the communicator's, with whole messages. A call enqueues kernels and
//! collectives only, never waits for the GPU, and can be captured in a CUDA graph.
#pragma once

#include "weave/core/config.hpp"
#include "weave/exec/cuda_space.cuh"
#include "weave/overlap/decode_exchange.hpp"
#include "weave/routing/cuda_row_moves.cuh"
#include "weave/routing/quantize.cuh"

WEAVE_NAMESPACE_BEGIN

//! The decode exchange on CUDA streams over `Comm` (whose stream type is `cuda_stream_ref`).
template <class Comm, class T>
using cuda_decode_exchange = basic_decode_exchange<cuda_space, Comm, T>;

WEAVE_NAMESPACE_END
