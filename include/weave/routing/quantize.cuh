//! \file
//! CUDA kernels of block-scaled FP8 quantisation (see `weave/routing/quantize.hpp` for the
//! definition), their stream forms `quantize_rows(stream, ...)` / `dequantize_rows(stream, ...)`,
//! and `quant_moves<cuda_space>` (compiled by the consumer's nvcc; component `weave::cuda`).
//! Views, indices, counts and the status word are device memory.
//!
//! One warp quantises one (row, block) pair: a max-reduction of the magnitudes' bits, the scale
//! from `detail::block_scale` (the host's code), then the codes. On sm_89 and newer the codes
//! come from the hardware conversion (`__nv_cvt_float_to_fp8`, satfinite, round to nearest
//! even), elsewhere from weave's `fp8_e4m3` / `fp8_e5m2`; both equal the host path bit for bit.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/cuda_dtype.hpp"
#include "weave/core/cuda_error.hpp"
#include "weave/core/fp8.hpp"
#include "weave/core/tensor.hpp"
#include "weave/exec/cuda_space.cuh"
#include "weave/exec/cuda_stream.hpp"
#include "weave/routing/detail/cuda_row_kernels.cuh"
#include "weave/routing/quantize.hpp"

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

WEAVE_NAMESPACE_BEGIN

namespace detail {

template <class Fp8>
__device__ inline std::uint8_t cuda_fp8_encode(float y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  constexpr __nv_fp8_interpretation_t kind = std::is_same_v<Fp8, fp8_e4m3> ? __NV_E4M3 : __NV_E5M2;
  return __nv_cvt_float_to_fp8(y, __NV_SATFINITE, kind);
#else
  return Fp8(y, fp8_overflow::saturate).bits;
#endif
}

// Grid-stride over (row, block) pairs, one warp each.
template <class Fp8, class T>
__global__ void quantize_kernel(const std::byte* src, std::size_t src_stride, std::byte* dst,
                                std::size_t dst_stride, std::byte* scales, std::size_t scale_stride,
                                const std::int64_t* index, std::int64_t rows,
                                const std::int64_t* count, std::int64_t blocks, int block,
                                float min_amax, scale_rounding rounding, std::int64_t* status) {
  const std::int64_t n = count != nullptr && *count < rows ? *count : rows;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x / 32);
  for (std::int64_t task = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
       task < n * blocks; task += warps) {
    const std::int64_t i = task / blocks, b = task % blocks;
    const std::int64_t from = index != nullptr ? index[i] : i;
    if (from < 0)
      continue; // padding: left untouched (uniform across the warp)
    const T* in =
        reinterpret_cast<const T*>(src + static_cast<std::size_t>(from) * src_stride) + b * block;
    Fp8* out = reinterpret_cast<Fp8*>(dst + static_cast<std::size_t>(i) * dst_stride) + b * block;
    std::uint32_t amax = 0;
    for (int j = lane; j < block; j += 32)
      amax = max(amax, magnitude_bits(cuda_load(in[j])));
    for (int offset = 16; offset > 0; offset /= 2)
      amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    float* scale =
        reinterpret_cast<float*>(scales + static_cast<std::size_t>(i) * scale_stride) + b;
    if (amax >= 0x7f800000u) { // NaN or inf: the block is NaN, the row reported
      for (int j = lane; j < block; j += 32)
        out[j] = Fp8::from_bits(0x7f);
      if (lane == 0) {
        *scale = __int_as_float(0x7fc00000);
        if (status != nullptr)
          atomicMin(reinterpret_cast<unsigned long long*>(status),
                    static_cast<unsigned long long>(from));
      }
      continue;
    }
    const fp8_block_scale s =
        block_scale(__uint_as_float(amax), min_amax, rounding, fp8_traits<Fp8>::max_finite,
                    fp8_traits<Fp8>::inverse_max);
    for (int j = lane; j < block; j += 32)
      out[j] = Fp8::from_bits(cuda_fp8_encode<Fp8>(__fmul_rn(cuda_load(in[j]), s.multiplier)));
    if (lane == 0)
      *scale = s.scale;
  }
}

// Grid-stride over the elements of the first n destination rows, one thread each.
template <class Fp8, class T>
__global__ void dequantize_kernel(const std::byte* src, std::size_t src_stride,
                                  const std::byte* scales, std::size_t scale_stride, std::byte* dst,
                                  std::size_t dst_stride, const std::int64_t* index,
                                  std::int64_t rows, const std::int64_t* count, std::int64_t cols,
                                  int block) {
  const std::int64_t n = count != nullptr && *count < rows ? *count : rows;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       e < n * cols; e += stride) {
    const std::int64_t i = e / cols, c = e % cols;
    const std::int64_t from = index != nullptr ? index[i] : i;
    if (from < 0)
      continue;
    const auto r = static_cast<std::size_t>(from);
    const Fp8 code = reinterpret_cast<const Fp8*>(src + r * src_stride)[c];
    const float scale = reinterpret_cast<const float*>(scales + r * scale_stride)[c / block];
    reinterpret_cast<T*>(dst + static_cast<std::size_t>(i) * dst_stride)[c] =
        cuda_store<T>(__fmul_rn(static_cast<float>(code), scale));
  }
}

inline void check_device_memory(const const_token_view& a, const const_token_view& b,
                                const const_token_view& c, const char* what) {
  WEAVE_EXPECT(device_accessible(a.space()) && device_accessible(b.space()) &&
                   device_accessible(c.space()),
               errc::invalid_argument, what, " on a GPU with ", a.space(), ", ", b.space(), " and ",
               c.space(), " memory");
}

inline unsigned quantize_grid(std::int64_t threads_needed, unsigned threads) {
  const std::int64_t blocks = (threads_needed + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 1 ? 1 : blocks < 65535 ? blocks : 65535);
}

inline void launch_quantize(cuda_stream_ref s, const const_token_view& src, const token_view& dst,
                            const token_view& scales, const std::int64_t* index,
                            const std::int64_t* count, const block_quantization& q,
                            std::int64_t* status) {
  check_quantized(src, dst, scales, q, "quantize_rows");
  check_device_memory(src, dst, scales, "quantize_rows");
  const auto rows = static_cast<std::int64_t>(dst.rows());
  const auto blocks = static_cast<std::int64_t>(src.cols() / q.block);
  if (rows == 0 || blocks == 0)
    return;
  WEAVE_EXPECT(q.block <= 1u << 30, errc::invalid_argument, "quantize_rows: block of ", q.block,
               " elements");
  constexpr unsigned threads = 256;
  visit_fp8(dst.element_type(), "quantize_rows", [&]<class Fp8>(Fp8*) {
    visit_cuda_float(src.element_type(), "quantize_rows", [&]<class T>(T*) {
      quantize_kernel<Fp8, T><<<quantize_grid(rows * blocks * 32, threads), threads, 0, s.get()>>>(
          src.data(), src.row_stride(), dst.data(), dst.row_stride(), scales.data(),
          scales.row_stride(), index, rows, count, blocks, static_cast<int>(q.block), q.min_amax,
          q.rounding, status);
    });
  });
  WEAVE_CUDA_CHECK(cudaGetLastError());
}

inline void launch_dequantize(cuda_stream_ref s, const const_token_view& src,
                              const const_token_view& scales, const token_view& dst,
                              const std::int64_t* index, const std::int64_t* count,
                              const block_quantization& q) {
  check_quantized(dst, src, scales, q, "dequantize_rows");
  check_device_memory(src, scales, dst, "dequantize_rows");
  const auto rows = static_cast<std::int64_t>(dst.rows());
  const auto cols = static_cast<std::int64_t>(dst.cols());
  if (rows == 0 || cols == 0)
    return;
  constexpr unsigned threads = 256;
  visit_fp8(src.element_type(), "dequantize_rows", [&]<class Fp8>(Fp8*) {
    visit_cuda_float(dst.element_type(), "dequantize_rows", [&]<class T>(T*) {
      dequantize_kernel<Fp8, T><<<quantize_grid(rows * cols, threads), threads, 0, s.get()>>>(
          src.data(), src.row_stride(), scales.data(), scales.row_stride(), dst.data(),
          dst.row_stride(), index, rows, count, cols, static_cast<int>(q.block));
    });
  });
  WEAVE_CUDA_CHECK(cudaGetLastError());
}

} // namespace detail

//! `quantize_rows` on `s`: every row of `src` into `dst` and `scales` (device memory), equal to
//! the host's bit for bit. Shape errors throw at once (as on the host); a non-finite block is
//! NaN and lowers `*status` (device memory, initialised to -1 by the caller) to its row.
inline void quantize_rows(cuda_stream_ref s, const_token_view src, token_view dst,
                          token_view scales, const block_quantization& q = {},
                          std::int64_t* status = nullptr) {
  WEAVE_EXPECT(src.rows() == dst.rows(), errc::size_mismatch, "quantize_rows: ", src.rows(),
               " source rows for ", dst.rows(), " destination rows");
  detail::launch_quantize(s, src, dst, scales, nullptr, nullptr, q, status);
}

//! `dequantize_rows` on `s` (device memory), equal to the host's bit for bit.
inline void dequantize_rows(cuda_stream_ref s, const_token_view src, const_token_view scales,
                            token_view dst, const block_quantization& q = {}) {
  WEAVE_EXPECT(src.rows() == dst.rows(), errc::size_mismatch, "dequantize_rows: ", src.rows(),
               " source rows for ", dst.rows(), " destination rows");
  detail::launch_dequantize(s, src, scales, dst, nullptr, nullptr, q);
}

template <>
struct quant_moves<cuda_space> {
  static void quantize(cuda_stream_ref s, const_token_view src, token_view dst, token_view scales,
                       const std::int64_t* index, const std::int64_t* count,
                       const block_quantization& q, std::int64_t* status) {
    WEAVE_EXPECT(index != nullptr || src.rows() >= dst.rows(), errc::size_mismatch,
                 "quant_moves::quantize: ", src.rows(), " source rows for ", dst.rows(),
                 " destination rows without an index");
    detail::launch_quantize(s, src, dst, scales, index, count, q, status);
  }

  static void dequantize(cuda_stream_ref s, const_token_view src, const_token_view scales,
                         token_view dst, const std::int64_t* index, const std::int64_t* count,
                         const block_quantization& q) {
    WEAVE_EXPECT(index != nullptr || src.rows() >= dst.rows(), errc::size_mismatch,
                 "quant_moves::dequantize: ", src.rows(), " source rows for ", dst.rows(),
                 " destination rows without an index");
    detail::launch_dequantize(s, src, scales, dst, index, count, q);
  }
};

WEAVE_NAMESPACE_END
