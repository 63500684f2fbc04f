//! \file
//! The CUDA row kernels under `row_moves<cuda_space>` (`cuda_row_moves.cuh`), compiled by the
//! consumer's nvcc: the gather and merge kernels and their launches (device-resident row counts,
//! -1 rows left untouched), the warp-per-row dot product, and the element conversions and dtype
//! dispatch the quantisation kernels (`quantize.cuh`) share. Each step rounds as the host path
//! does (`__fmul_rn`, `__fadd_rn`, round-to-nearest conversions, fixed j order), so results match
//! the host kernels of `kernels_host.hpp` bitwise. Rows whose bytes, strides and bases are
//! multiples of 16 move with 128-bit loads and stores (same arithmetic per element). Indices come
//! from plans and are not range-checked on the device. Internal.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/cuda_dtype.hpp"
#include "weave/core/cuda_error.hpp"
#include "weave/core/tensor.hpp"
#include "weave/exec/cuda_stream.hpp"
#include "weave/routing/kernels_host.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

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

// Rows by block (grid-stride), columns by thread. Word is an unsigned type of the element size,
// or `uint4` (16 bytes) when rows, strides and bases are 16-byte aligned.
template <class Word>
__global__ void gather_copy_kernel(const std::byte* src, std::size_t src_stride, std::byte* dst,
                                   std::size_t dst_stride, const std::int64_t* index,
                                   std::int64_t rows, const std::int64_t* count, std::size_t cols) {
  const std::int64_t n = count != nullptr && *count < rows ? *count : rows;
  for (std::int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    if (index[i] < 0)
      continue; // padding: left untouched
    const Word* in =
        reinterpret_cast<const Word*>(src + static_cast<std::size_t>(index[i]) * src_stride);
    Word* out = reinterpret_cast<Word*>(dst + static_cast<std::size_t>(i) * dst_stride);
    for (std::size_t c = threadIdx.x; c < cols; c += blockDim.x)
      out[c] = in[c];
  }
}

// 16 bytes of T elements, moved with one 128-bit load or store.
template <class T>
struct cuda_vec {
  static constexpr int size = static_cast<int>(16 / sizeof(T));
  T v[size];
};

template <class T>
__device__ inline cuda_vec<T> cuda_load_vec(const std::byte* p) {
  const uint4 word = *reinterpret_cast<const uint4*>(p);
  cuda_vec<T> out;
  memcpy(&out, &word, sizeof(word));
  return out;
}

template <class T>
__device__ inline void cuda_store_vec(std::byte* p, const cuda_vec<T>& x) {
  uint4 word;
  memcpy(&word, &x, sizeof(word));
  *reinterpret_cast<uint4*>(p) = word;
}

// Element by element, or `Vec` = 16 bytes (cols then counts 16-byte groups) when aligned; the
// per-element arithmetic is the same either way.
template <class T, bool Vec>
__global__ void gather_scale_kernel(const std::byte* src, std::size_t src_stride, std::byte* dst,
                                    std::size_t dst_stride, const std::int64_t* index,
                                    const float* scale, std::int64_t rows,
                                    const std::int64_t* count, std::size_t cols) {
  const std::int64_t n = count != nullptr && *count < rows ? *count : rows;
  for (std::int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    if (index[i] < 0)
      continue;
    const std::byte* in = src + static_cast<std::size_t>(index[i]) * src_stride;
    std::byte* out = dst + static_cast<std::size_t>(i) * dst_stride;
    const float s = scale[i];
    for (std::size_t c = threadIdx.x; c < cols; c += blockDim.x) {
      if constexpr (Vec) {
        cuda_vec<T> x = cuda_load_vec<T>(in + c * 16);
        for (int e = 0; e < cuda_vec<T>::size; ++e)
          x.v[e] = cuda_store<T>(__fmul_rn(s, cuda_load(x.v[e])));
        cuda_store_vec<T>(out + c * 16, x);
      } else {
        reinterpret_cast<T*>(out)[c] =
            cuda_store<T>(__fmul_rn(s, cuda_load(reinterpret_cast<const T*>(in)[c])));
      }
    }
  }
}

template <class T, bool Vec>
__global__ void merge_kernel(const std::byte* src, std::size_t src_stride, std::byte* dst,
                             std::size_t dst_stride, const std::int64_t* index, const float* weight,
                             int k, std::int64_t rows, const std::int64_t* count, bool skip_empty,
                             std::size_t cols) {
  constexpr int V = Vec ? cuda_vec<T>::size : 1;
  constexpr std::size_t bytes = V * sizeof(T);
  const std::int64_t n = count != nullptr && *count < rows ? *count : rows;
  for (std::int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    std::byte* out = dst + static_cast<std::size_t>(i) * dst_stride;
    const std::int64_t* idx = index + i * k;
    if (skip_empty) {
      bool any = false;
      for (int j = 0; j < k; ++j)
        any = any || idx[j] >= 0;
      if (!any)
        continue; // padding: left untouched
    }
    for (std::size_t c = threadIdx.x; c < cols; c += blockDim.x) {
      float acc[V];
      for (int e = 0; e < V; ++e)
        acc[e] = 0.0f;
      for (int j = 0; j < k; ++j) {
        if (idx[j] < 0)
          continue;
        const std::byte* in = src + static_cast<std::size_t>(idx[j]) * src_stride + c * bytes;
        T x[V];
        if constexpr (Vec)
          memcpy(x, cuda_load_vec<T>(in).v, sizeof(x));
        else
          x[0] = *reinterpret_cast<const T*>(in);
        const float w = weight != nullptr ? weight[i * k + j] : 0.0f;
        for (int e = 0; e < V; ++e) {
          const float v = cuda_load(x[e]);
          acc[e] = weight != nullptr ? __fadd_rn(acc[e], __fmul_rn(w, v)) : __fadd_rn(acc[e], v);
        }
      }
      if constexpr (Vec) {
        cuda_vec<T> y;
        for (int e = 0; e < V; ++e)
          y.v[e] = cuda_store<T>(acc[e]);
        cuda_store_vec<T>(out + c * bytes, y);
      } else {
        *reinterpret_cast<T*>(out + c * bytes) = cuda_store<T>(acc[0]);
      }
    }
  }
}

// True when both views allow 16-byte loads and stores of whole rows.
inline bool cuda_vectorizable(const const_token_view& src, const token_view& dst) {
  const std::size_t row_bytes = dst.cols() * size_of(dst.element_type());
  const auto aligned = [](std::uintptr_t x) { return x % 16 == 0; };
  return row_bytes % 16 == 0 && aligned(reinterpret_cast<std::uintptr_t>(src.data())) &&
         aligned(reinterpret_cast<std::uintptr_t>(dst.data())) && aligned(src.row_stride()) &&
         aligned(dst.row_stride());
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

namespace detail {

// Launches a gather of up to `rows` rows (min(*count, rows) when `count` is set).
inline void launch_gather(cuda_stream_ref stream, const const_token_view& src,
                          const token_view& dst, const std::int64_t* index, const float* scale,
                          std::int64_t rows, const std::int64_t* count) {
  if (rows == 0 || src.cols() == 0)
    return;
  constexpr unsigned threads = 256;
  const bool vec = cuda_vectorizable(src, dst);
  const std::size_t row_bytes = src.cols() * size_of(src.element_type());
  if (scale == nullptr && vec) {
    gather_copy_kernel<uint4><<<cuda_grid(rows), threads, 0, stream.get()>>>(
        src.data(), src.row_stride(), dst.data(), dst.row_stride(), index, rows, count,
        row_bytes / 16);
  } else if (scale == nullptr) {
    auto launch = [&]<class Word>(Word*) {
      gather_copy_kernel<Word><<<cuda_grid(rows), threads, 0, stream.get()>>>(
          src.data(), src.row_stride(), dst.data(), dst.row_stride(), index, rows, count,
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
    visit_cuda_float(src.element_type(), "gate-scaled gather_rows", [&]<class T>(T*) {
      if (vec)
        gather_scale_kernel<T, true><<<cuda_grid(rows), threads, 0, stream.get()>>>(
            src.data(), src.row_stride(), dst.data(), dst.row_stride(), index, scale, rows, count,
            row_bytes / 16);
      else
        gather_scale_kernel<T, false><<<cuda_grid(rows), threads, 0, stream.get()>>>(
            src.data(), src.row_stride(), dst.data(), dst.row_stride(), index, scale, rows, count,
            src.cols());
    });
  }
  WEAVE_CUDA_CHECK(cudaGetLastError());
}

// Launches a merge into up to `rows` rows (min(*count, rows) when `count` is set).
inline void launch_merge(cuda_stream_ref stream, const const_token_view& src, const token_view& dst,
                         const std::int64_t* index, int k, const float* weight, std::int64_t rows,
                         const std::int64_t* count, bool skip_empty) {
  if (rows == 0 || dst.cols() == 0)
    return;
  const bool vec = cuda_vectorizable(src, dst);
  visit_cuda_float(src.element_type(), "merge_rows", [&]<class T>(T*) {
    if (vec)
      merge_kernel<T, true><<<cuda_grid(rows), 256, 0, stream.get()>>>(
          src.data(), src.row_stride(), dst.data(), dst.row_stride(), index, weight, k, rows, count,
          skip_empty, dst.cols() * sizeof(T) / 16);
    else
      merge_kernel<T, false><<<cuda_grid(rows), 256, 0, stream.get()>>>(
          src.data(), src.row_stride(), dst.data(), dst.row_stride(), index, weight, k, rows, count,
          skip_empty, dst.cols());
  });
  WEAVE_CUDA_CHECK(cudaGetLastError());
}

// One warp per row: out[i] = sum over h of a[i][h] * b[i][h] in fp32; lanes take every 32nd
// element, then a fixed butterfly order, so the result is deterministic.
template <class T>
__global__ void dot_kernel(const std::byte* a, std::size_t a_stride, const std::byte* b,
                           std::size_t b_stride, float* out, std::int64_t rows,
                           const std::int64_t* count, std::size_t cols) {
  const std::int64_t n = count != nullptr && *count < rows ? *count : rows;
  const unsigned lane = threadIdx.x % 32;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x / 32);
  for (std::int64_t i =
           static_cast<std::int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
       i < n; i += warps) {
    const T* x = reinterpret_cast<const T*>(a + static_cast<std::size_t>(i) * a_stride);
    const T* y = reinterpret_cast<const T*>(b + static_cast<std::size_t>(i) * b_stride);
    float acc = 0.0f;
    for (std::size_t c = lane; c < cols; c += 32)
      acc = __fadd_rn(acc, __fmul_rn(cuda_load(x[c]), cuda_load(y[c])));
    for (int offset = 16; offset > 0; offset /= 2)
      acc = __fadd_rn(acc, __shfl_down_sync(0xffffffffu, acc, offset));
    if (lane == 0)
      out[i] = acc;
  }
}

} // namespace detail

WEAVE_NAMESPACE_END
