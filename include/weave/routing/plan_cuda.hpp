//! \file
//! Copies of a plan's maps in device memory, for the CUDA kernels (component `weave::cuda`;
//! host compiler + CUDA runtime). Plans are built on the host; `upload` carves the device maps
//! out of one caller-allocated device workspace, sized by `upload_workspace_size` with the same
//! carving code, and copies them on the caller's stream.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/cuda_error.hpp"
#include "weave/core/workspace.hpp"
#include "weave/exec/cuda_stream.hpp"
#include "weave/routing/device_maps.hpp"
#include "weave/routing/dispatch_plan.hpp"
#include "weave/routing/expert_plan.hpp"

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <span>

WEAVE_NAMESPACE_BEGIN

namespace detail {

template <class T>
std::span<const T> upload_span(workspace_carver& carver, std::span<const T> host,
                               cuda_stream_ref stream) {
  const std::span<T> out = carver.take<T>(host.size());
  if (!carver.measuring() && !host.empty())
    WEAVE_CUDA_CHECK(cudaMemcpyAsync(out.data(), host.data(), host.size_bytes(),
                                     cudaMemcpyHostToDevice, stream.get()));
  return out;
}

inline device_dispatch_maps carve(const dispatch_plan& plan, workspace_carver& carver,
                                  cuda_stream_ref stream) {
  device_dispatch_maps maps;
  maps.row_token = upload_span(carver, plan.row_token(), stream);
  maps.token_rows = upload_span(carver, plan.token_rows(), stream);
  maps.k = plan.k();
  return maps;
}

inline device_expert_maps carve(const expert_plan& plan, workspace_carver& carver,
                                cuda_stream_ref stream) {
  device_expert_maps maps;
  maps.epd_row_source = upload_span(carver, plan.epd_row_source(), stream);
  maps.epd_weight = upload_span(carver, plan.epd_weight(), stream);
  maps.row_epd = upload_span(carver, plan.row_epd(), stream);
  maps.row_weight = upload_span(carver, plan.row_weight(), stream);
  maps.k = plan.k();
  return maps;
}

} // namespace detail

//! Device bytes `upload(plan, ...)` needs.
template <class Plan>
std::size_t upload_workspace_size(const Plan& plan) {
  workspace_carver measure;
  (void)detail::carve(plan, measure, cuda_stream_ref(nullptr));
  return measure.used();
}

//! Copies the maps of `plan` (a `dispatch_plan` or `expert_plan`) into `workspace` (device
//! memory of `bytes` bytes, 256-byte aligned) on `stream`. The plan must stay unchanged until
//! the copies have run. Throws `errc::size_mismatch` for a workspace that is too small.
template <class Plan>
auto upload(const Plan& plan, void* workspace, std::size_t bytes, cuda_stream_ref stream) {
  WEAVE_EXPECT(workspace != nullptr || upload_workspace_size(plan) == 0, errc::invalid_argument,
               "null device workspace");
  workspace_carver carver(workspace, bytes); // a null base only measures: nothing to copy
  return detail::carve(plan, carver, stream);
}

WEAVE_NAMESPACE_END
