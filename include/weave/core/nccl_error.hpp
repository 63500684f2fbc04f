//! \file
//! NCCL error checking (component `weave::nccl`).
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"

#include <nccl.h>

WEAVE_NAMESPACE_BEGIN

//! Throws `errc::nccl` naming the failed call and NCCL's description unless `status` is success.
inline void nccl_check(ncclResult_t status, const char* call,
                       source_location where = source_location::current()) {
  if (WEAVE_LIKELY(status == ncclSuccess))
    return;
  detail::raise(errc::nccl,
                detail::concat(call, " failed: ", ncclGetErrorString(status), " (",
                               static_cast<int>(status), ")"),
                where);
}

WEAVE_NAMESPACE_END

//! Checks an NCCL call, naming it in the error.
#define WEAVE_NCCL_CHECK(call) ::weave::nccl_check((call), #call)
