//! \file
//! `dtype_of` for CUDA's 16-bit float types (component `weave::cuda`), and the guarantee that
//! they share layout with weave's host storage types.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/dtype.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

WEAVE_NAMESPACE_BEGIN

template <>
struct dtype_of<__half> {
  static constexpr dtype value = dtype::f16;
};
template <>
struct dtype_of<__nv_bfloat16> {
  static constexpr dtype value = dtype::bf16;
};

static_assert(sizeof(__half) == sizeof(half) && sizeof(__nv_bfloat16) == sizeof(bfloat16));

WEAVE_NAMESPACE_END
