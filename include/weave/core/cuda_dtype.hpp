//! \file
//! `dtype_of` for CUDA's 16-bit and 8-bit float types (component `weave::cuda`), and the
//! guarantee that they share layout with weave's host storage types.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/dtype.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

WEAVE_NAMESPACE_BEGIN

template <>
struct dtype_of<__half> {
  static constexpr dtype value = dtype::f16;
};
template <>
struct dtype_of<__nv_bfloat16> {
  static constexpr dtype value = dtype::bf16;
};

template <>
struct dtype_of<__nv_fp8_e4m3> {
  static constexpr dtype value = dtype::e4m3;
};
template <>
struct dtype_of<__nv_fp8_e5m2> {
  static constexpr dtype value = dtype::e5m2;
};

static_assert(sizeof(__half) == sizeof(half) && sizeof(__nv_bfloat16) == sizeof(bfloat16));
static_assert(sizeof(__nv_fp8_e4m3) == sizeof(fp8_e4m3) &&
              sizeof(__nv_fp8_e5m2) == sizeof(fp8_e5m2));

WEAVE_NAMESPACE_END
