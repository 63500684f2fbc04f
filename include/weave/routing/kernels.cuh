//! \file
//! CUDA row-movement kernels between ORI, SFD and EPD (compiled by the consumer's nvcc). Same
//! arguments and results as the host kernels in `kernels_host.hpp`, with a `cuda_stream_ref`
//! first; views and index spans refer to device memory. Each step rounds as the host path
//! does (`__fmul_rn`, `__fadd_rn`, round-to-nearest conversions, fixed j order), so results
//! match the host path bitwise. Indices come from plans and are not range-checked on the device.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/cuda_dtype.hpp"
#include "weave/core/cuda_error.hpp"
#include "weave/core/tensor.hpp"
#include "weave/exec/cuda_stream.hpp"
#include "weave/routing/kernels_host.hpp"
#include "weave/routing/plan_cuda.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <span>

WEAVE_NAMESPACE_BEGIN

namespace detail {

__device__ inline float cuda_load(float x) {
  return x;
}
__device__ inline float cuda_load(__half x) {
  return __half2float(x);
}
__device__ inline float cuda_load(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <class T>
__device__ T cuda_store(float x);
template <>
__device__ inline float cuda_store<float>(float x) {
  return x;
}
template <>
__device__ inline __half cuda_store<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ inline __nv_bfloat16 cuda_store<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Rows by block (grid-stride), columns by thread. Word is an unsigned type of the element size.
template <class Word>
__global__ void gather_copy_kernel(const std::byte* src, std::size_t src_stride, std::byte* dst,
                                   std::size_t dst_stride, const std::int64_t* index,
                                   std::int64_t rows, std::size_t cols) {
  for (std::int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const Word* in =
        reinterpret_cast<const Word*>(src + static_cast<std::size_t>(index[i]) * src_stride);
    Word* out = reinterpret_cast<Word*>(dst + static_cast<std::size_t>(i) * dst_stride);
    for (std::size_t c = threadIdx.x; c < cols; c += blockDim.x)
      out[c] = in[c];
  }
}

template <class T>
__global__ void gather_scale_kernel(const std::byte* src, std::size_t src_stride, std::byte* dst,
                                    std::size_t dst_stride, const std::int64_t* index,
                                    const float* scale, std::int64_t rows, std::size_t cols) {
  for (std::int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const T* in = reinterpret_cast<const T*>(src + static_cast<std::size_t>(index[i]) * src_stride);
    T* out = reinterpret_cast<T*>(dst + static_cast<std::size_t>(i) * dst_stride);
    const float s = scale[i];
    for (std::size_t c = threadIdx.x; c < cols; c += blockDim.x)
      out[c] = cuda_store<T>(__fmul_rn(s, cuda_load(in[c])));
  }
}

template <class T>
__global__ void merge_kernel(const std::byte* src, std::size_t src_stride, std::byte* dst,
                             std::size_t dst_stride, const std::int64_t* index, const float* weight,
                             int k, std::int64_t rows, std::size_t cols) {
  for (std::int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    T* out = reinterpret_cast<T*>(dst + static_cast<std::size_t>(i) * dst_stride);
    const std::int64_t* idx = index + i * k;
    for (std::size_t c = threadIdx.x; c < cols; c += blockDim.x) {
      float acc = 0.0f;
      for (int j = 0; j < k; ++j) {
        if (idx[j] < 0)
          continue;
        const T* in =
            reinterpret_cast<const T*>(src + static_cast<std::size_t>(idx[j]) * src_stride);
        const float x = cuda_load(in[c]);
        acc =
            weight != nullptr ? __fadd_rn(acc, __fmul_rn(weight[i * k + j], x)) : __fadd_rn(acc, x);
      }
      out[c] = cuda_store<T>(acc);
    }
  }
}

inline unsigned cuda_grid(std::int64_t rows) {
  return static_cast<unsigned>(rows < 65535 ? rows : 65535);
}

inline void check_device(const const_token_view& src, const token_view& dst, const char* what) {
  WEAVE_EXPECT(device_accessible(src.space()) && device_accessible(dst.space()),
               errc::invalid_argument, what, " on a GPU with ", src.space(), " -> ", dst.space(),
               " memory");
}

template <class F>
void visit_cuda_float(dtype t, const char* what, F&& f) {
  switch (t) {
  case dtype::f32:
    return f(static_cast<float*>(nullptr));
  case dtype::f16:
    return f(static_cast<__half*>(nullptr));
  case dtype::bf16:
    return f(static_cast<__nv_bfloat16*>(nullptr));
  default:
    WEAVE_THROW(errc::not_supported, what, " of ", t, " rows (f32, f16 and bf16 are supported)");
  }
}

} // namespace detail

//! CUDA `gather_rows`: dst[i] = src[index[i]] (times scale[i] if given), on `stream`.
inline void gather_rows(cuda_stream_ref stream, const_token_view src, token_view dst,
                        std::span<const std::int64_t> index, std::span<const float> scale = {}) {
  detail::check_rows(src, dst, "gather_rows");
  detail::check_device(src, dst, "gather_rows");
  WEAVE_EXPECT(dst.rows() == index.size(), errc::size_mismatch, "gather_rows: ", index.size(),
               " indices for ", dst.rows(), " destination rows");
  WEAVE_EXPECT(scale.empty() || scale.size() == index.size(), errc::size_mismatch,
               "gather_rows: ", scale.size(), " scales for ", index.size(), " rows");
  const auto rows = static_cast<std::int64_t>(index.size());
  if (rows == 0 || src.cols() == 0)
    return;
  constexpr unsigned threads = 256;
  if (scale.empty()) {
    auto launch = [&]<class Word>(Word*) {
      detail::gather_copy_kernel<Word><<<detail::cuda_grid(rows), threads, 0, stream.get()>>>(
          src.data(), src.row_stride(), dst.data(), dst.row_stride(), index.data(), rows,
          src.cols());
    };
    switch (size_of(src.element_type())) {
    case 1:
      launch(static_cast<std::uint8_t*>(nullptr));
      break;
    case 2:
      launch(static_cast<std::uint16_t*>(nullptr));
      break;
    case 4:
      launch(static_cast<std::uint32_t*>(nullptr));
      break;
    default:
      launch(static_cast<std::uint64_t*>(nullptr));
      break;
    }
  } else {
    detail::visit_cuda_float(src.element_type(), "gate-scaled gather_rows", [&]<class T>(T*) {
      detail::gather_scale_kernel<T><<<detail::cuda_grid(rows), threads, 0, stream.get()>>>(
          src.data(), src.row_stride(), dst.data(), dst.row_stride(), index.data(), scale.data(),
          rows, src.cols());
    });
  }
  WEAVE_CUDA_CHECK(cudaGetLastError());
}

//! CUDA `merge_rows`: dst[i] = sum over j of weight[i*k+j] * src[index[i*k+j]], on `stream`.
inline void merge_rows(cuda_stream_ref stream, const_token_view src, token_view dst,
                       std::span<const std::int64_t> index, int k,
                       std::span<const float> weight = {}) {
  detail::check_rows(src, dst, "merge_rows");
  detail::check_device(src, dst, "merge_rows");
  WEAVE_EXPECT(k >= 1 && index.size() == dst.rows() * static_cast<std::size_t>(k),
               errc::size_mismatch, "merge_rows: ", index.size(), " indices for ", dst.rows(),
               " rows with k = ", k);
  WEAVE_EXPECT(weight.empty() || weight.size() == index.size(), errc::size_mismatch,
               "merge_rows: ", weight.size(), " weights for ", index.size(), " indices");
  const auto rows = static_cast<std::int64_t>(dst.rows());
  if (rows == 0 || dst.cols() == 0)
    return;
  detail::visit_cuda_float(src.element_type(), "merge_rows", [&]<class T>(T*) {
    detail::merge_kernel<T><<<detail::cuda_grid(rows), 256, 0, stream.get()>>>(
        src.data(), src.row_stride(), dst.data(), dst.row_stride(), index.data(),
        weight.empty() ? nullptr : weight.data(), k, rows, dst.cols());
  });
  WEAVE_CUDA_CHECK(cudaGetLastError());
}

//! CUDA ORI -> SFD gather over uploaded `dispatch_plan` maps.
inline void dispatch_gather(cuda_stream_ref stream, const device_dispatch_maps& plan,
                            const_token_view ori, token_view sfd) {
  gather_rows(stream, ori, sfd, plan.row_token);
}

//! CUDA SFD -> EPD scatter over uploaded `expert_plan` maps (optionally gate-scaled).
inline void expert_scatter(cuda_stream_ref stream, const device_expert_maps& plan,
                           const_token_view received, token_view epd, bool gate_scaled = false) {
  gather_rows(stream, received, epd, plan.epd_row_source,
              gate_scaled ? plan.epd_weight : std::span<const float>{});
}

//! CUDA EPD -> SFD weighted local merge over uploaded `expert_plan` maps.
inline void expert_merge(cuda_stream_ref stream, const device_expert_maps& plan,
                         const_token_view expert_out, token_view back, bool weighted = true) {
  merge_rows(stream, expert_out, back, plan.row_epd, plan.k,
             weighted ? plan.row_weight : std::span<const float>{});
}

//! CUDA SFD -> ORI final merge over uploaded `dispatch_plan` maps.
inline void combine_merge(cuda_stream_ref stream, const device_dispatch_maps& plan,
                          const_token_view returned, token_view ori) {
  merge_rows(stream, returned, ori, plan.token_rows, plan.k);
}

WEAVE_NAMESPACE_END
