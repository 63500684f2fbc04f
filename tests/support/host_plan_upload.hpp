// The maps of the host reference plans (host_plans.hpp) copied into device memory, for
// comparing the CUDA layout moves over them with the host moves: `upload` carves the device
// maps out of one caller-allocated device workspace, sized by `upload_workspace_size` with the
// same carving code, and copies them on the caller's stream. The library's plans build their
// maps where they run (`device_dispatch_plan<cuda_space>::maps`, `device_expert_plan::maps`).
#pragma once

#include "host_plans.hpp"

#include <weave/core/cuda_error.hpp>
#include <weave/core/error.hpp>
#include <weave/core/workspace.hpp>
#include <weave/exec/cuda_stream.hpp>
#include <weave/routing/device_maps.hpp>

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <span>

namespace oracle {

namespace upload_detail {

template <class T>
std::span<const T> upload_span(weave::workspace_carver& carver, std::span<const T> host,
                               weave::cuda_stream_ref stream) {
  const std::span<T> out = carver.take<T>(host.size());
  if (!carver.measuring() && !host.empty())
    WEAVE_CUDA_CHECK(cudaMemcpyAsync(out.data(), host.data(), host.size_bytes(),
                                     cudaMemcpyHostToDevice, stream.get()));
  return out;
}

inline weave::device_dispatch_maps carve(const dispatch_plan& plan, weave::workspace_carver& carver,
                                         weave::cuda_stream_ref stream) {
  weave::device_dispatch_maps maps;
  maps.row_token = upload_span(carver, plan.row_token(), stream);
  maps.token_rows = upload_span(carver, plan.token_rows(), stream);
  maps.k = plan.k();
  return maps;
}

inline weave::device_expert_maps carve(const expert_plan& plan, weave::workspace_carver& carver,
                                       weave::cuda_stream_ref stream) {
  weave::device_expert_maps maps;
  maps.epd_row_source = upload_span(carver, plan.epd_row_source(), stream);
  maps.epd_weight = upload_span(carver, plan.epd_weight(), stream);
  maps.row_epd = upload_span(carver, plan.row_epd(), stream);
  maps.row_weight = upload_span(carver, plan.row_weight(), stream);
  maps.k = plan.k();
  return maps;
}

} // namespace upload_detail

// Device bytes `upload(plan, ...)` needs.
template <class Plan>
std::size_t upload_workspace_size(const Plan& plan) {
  weave::workspace_carver measure;
  (void)upload_detail::carve(plan, measure, weave::cuda_stream_ref(nullptr));
  return measure.used();
}

// Copies the maps of `plan` (a `dispatch_plan` or `expert_plan`) into `workspace` (device
// memory of `bytes` bytes, 256-byte aligned) on `stream`. The plan must stay unchanged until
// the copies have run. Throws `errc::size_mismatch` for a workspace that is too small.
template <class Plan>
auto upload(const Plan& plan, void* workspace, std::size_t bytes, weave::cuda_stream_ref stream) {
  WEAVE_EXPECT(workspace != nullptr || upload_workspace_size(plan) == 0,
               weave::errc::invalid_argument, "null device workspace");
  weave::workspace_carver carver(workspace, bytes); // a null base only measures: nothing to copy
  return upload_detail::carve(plan, carver, stream);
}

} // namespace oracle
