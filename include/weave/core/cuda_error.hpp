//! \file
//! CUDA runtime error checking (component `weave::cuda`). Host-compiler compatible.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"

#include <cuda_runtime_api.h>

WEAVE_NAMESPACE_BEGIN

//! Throws `errc::cuda` naming the failed call and CUDA's description unless `status` is success.
inline void cuda_check(cudaError_t status, const char* call,
                       source_location where = source_location::current()) {
  if (WEAVE_LIKELY(status == cudaSuccess))
    return;
  detail::raise(errc::cuda,
                detail::concat(call, " failed: ", cudaGetErrorName(status), " (",
                               static_cast<int>(status), "): ", cudaGetErrorString(status)),
                where);
}

//! Number of usable CUDA devices; 0 when there is no device or no driver (never throws).
inline int cuda_device_count() noexcept {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError(); // clear the sticky "no device" status
    return 0;
  }
  return count;
}

WEAVE_NAMESPACE_END

//! Checks a CUDA runtime call, naming it in the error.
#define WEAVE_CUDA_CHECK(call) ::weave::cuda_check((call), #call)
