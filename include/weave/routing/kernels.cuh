//! \file
//! The CUDA row moves: `row_moves<cuda_space>` and `layout_move` (`cuda_row_moves.cuh`, which
//! this header includes), the one form of the row primitives on CUDA streams. The kernels under
//! them are in `detail/cuda_row_kernels.cuh`.
#pragma once

#include "weave/routing/cuda_row_moves.cuh"
