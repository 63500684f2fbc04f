//! \file
//! The host kernels of `kernels_host.hpp` enqueued on a `host_stream`, so row movement can
//! overlap other host work (a pipelined exchange runs chunk i's merge while chunk i+1 moves).
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/tensor.hpp"
#include "weave/exec/host_stream.hpp"
#include "weave/routing/kernels_host.hpp"

#include <cstdint>
#include <span>

WEAVE_NAMESPACE_BEGIN

//! `gather_rows` enqueued on `stream`; the views and spans must stay valid until it runs.
inline void gather_rows(host_stream& stream, const_token_view src, token_view dst,
                        std::span<const std::int64_t> index, std::span<const float> scale = {}) {
  stream.submit([=] { gather_rows(src, dst, index, scale); });
}

//! `merge_rows` enqueued on `stream`; the views and spans must stay valid until it runs.
inline void merge_rows(host_stream& stream, const_token_view src, token_view dst,
                       std::span<const std::int64_t> index, int k,
                       std::span<const float> weight = {}) {
  stream.submit([=] { merge_rows(src, dst, index, k, weight); });
}

WEAVE_NAMESPACE_END
