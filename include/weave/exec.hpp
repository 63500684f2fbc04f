//! \file
//! Execution vocabulary: the stream/event concepts and the host stream. The CUDA wrappers are in
//! `weave/exec/cuda_stream.hpp` (component `weave::cuda`).
#pragma once

#include "weave/exec/emulated_gpu_space.hpp"
#include "weave/exec/host_mirror.hpp"
#include "weave/exec/host_space.hpp"
#include "weave/exec/host_stream.hpp"
#include "weave/exec/space.hpp"
#include "weave/exec/stream.hpp"
#include "weave/exec/stream_allocator.hpp"
#include "weave/exec/unique_task.hpp"
