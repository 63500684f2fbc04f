// FP8 conversions on the GPU: weave's fp8_e4m3 / fp8_e5m2 run in device code, and CUDA's device
// conversions (__nv_cvt_float_to_fp8: the hardware instruction on sm_89+ with saturation), over
// every bf16 value and a strided sweep of f32 bit patterns, both formats and overflow modes;
// each must equal weave's host conversion bit for bit (NaN inputs: a NaN code). The bit
// classification of weave/core/float_bits.hpp in device code equals CUDA's isnan / isinf on
// every 16-bit pattern (as bf16 and as half) and on the same f32 sweep. Skips without a GPU.
#include <doctest/doctest.h>

#include <weave/core/cuda_dtype.hpp>
#include <weave/core/dtype.hpp>
#include <weave/core/float_bits.hpp>
#include <weave/core/fp8.hpp>

#include "cuda_buffers.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// out[4 * i + k]: k = 0/1 weave e4m3/e5m2 on the device, 2/3 CUDA's e4m3/e5m2.
__global__ void convert_kernel(const float* in, std::uint8_t* out, std::size_t n, bool saturate) {
  const auto mode = saturate ? weave::fp8_overflow::saturate : weave::fp8_overflow::non_saturating;
  const auto cuda_mode = saturate ? __NV_SATFINITE : __NV_NOSAT;
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x) {
    out[4 * i + 0] = weave::fp8_e4m3(in[i], mode).bits;
    out[4 * i + 1] = weave::fp8_e5m2(in[i], mode).bits;
    out[4 * i + 2] = __nv_cvt_float_to_fp8(in[i], cuda_mode, __NV_E4M3);
    out[4 * i + 3] = __nv_cvt_float_to_fp8(in[i], cuda_mode, __NV_E5M2);
  }
}

__global__ void decode_kernel(float* out) {
  const int i = static_cast<int>(threadIdx.x);
  out[2 * i] = static_cast<float>(weave::fp8_e4m3::from_bits(std::uint8_t(i)));
  out[2 * i + 1] = static_cast<float>(weave::fp8_e5m2::from_bits(std::uint8_t(i)));
}

// out[i]: bit 0..2 weave's is_nan / is_inf / is_finite of in[i] as f32, bits 3..5 CUDA's isnan /
// isinf / isfinite; bits 8..13 the same of pattern i & 0xffff as bf16, bits 16..21 as half.
__global__ void classify_kernel(const float* in, std::uint32_t* out, std::size_t n) {
  using weave::detail::is_finite, weave::detail::is_inf, weave::detail::is_nan;
  const auto flags = [](auto x, float wide) {
    return (is_nan(x) ? 1u : 0u) | (is_inf(x) ? 2u : 0u) | (is_finite(x) ? 4u : 0u) |
           (isnan(wide) ? 8u : 0u) | (isinf(wide) ? 16u : 0u) | (isfinite(wide) ? 32u : 0u);
  };
  for (std::size_t i = blockIdx.x * std::size_t(blockDim.x) + threadIdx.x; i < n;
       i += std::size_t(gridDim.x) * blockDim.x) {
    const auto b = static_cast<std::uint16_t>(i & 0xffffu);
    const weave::bfloat16 x = weave::bfloat16::from_bits(b);
    const weave::half h = weave::half::from_bits(b);
    out[i] = flags(in[i], in[i]) | flags(x, __bfloat162float(__ushort_as_bfloat16(b))) << 8 |
             flags(h, __half2float(__ushort_as_half(b))) << 16;
  }
}

bool same_code(std::uint8_t got, std::uint8_t want, bool e4m3) {
  const auto is_nan = [&](std::uint8_t c) { return e4m3 ? (c & 0x7f) == 0x7f : (c & 0x7f) > 0x7c; };
  return is_nan(want) ? is_nan(got) : got == want;
}

} // namespace

TEST_CASE("device FP8 conversions (weave's and CUDA's) equal weave's host conversion") {
  std::vector<float> inputs;
  for (std::uint32_t b = 0; b <= 0xffff; ++b)
    inputs.push_back(std::bit_cast<float>(b << 16));
  for (std::uint64_t bits = 0; bits <= 0xffffffffu; bits += 1021)
    inputs.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(bits)));
  weave_test::dev<float> d_in(inputs);
  weave_test::dev<std::uint8_t> d_out(4 * inputs.size());
  for (bool saturate : {true, false}) {
    convert_kernel<<<1024, 256>>>(d_in.ptr, d_out.ptr, inputs.size(), saturate);
    WEAVE_CUDA_CHECK(cudaDeviceSynchronize());
    const auto out = weave_test::to_host(d_out.cspan());
    const auto mode =
        saturate ? weave::fp8_overflow::saturate : weave::fp8_overflow::non_saturating;
    std::size_t mismatches = 0;
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      const std::uint8_t e4 = weave::fp8_e4m3(inputs[i], mode).bits;
      const std::uint8_t e5 = weave::fp8_e5m2(inputs[i], mode).bits;
      const bool ok = out[4 * i] == e4 && out[4 * i + 1] == e5 &&
                      same_code(out[4 * i + 2], e4, true) && same_code(out[4 * i + 3], e5, false);
      if (!ok && mismatches++ < 5)
        FAIL_CHECK("input 0x", std::hex, std::bit_cast<std::uint32_t>(inputs[i]), " saturate ",
                   saturate, ": device weave ", +out[4 * i], "/", +out[4 * i + 1], ", CUDA ",
                   +out[4 * i + 2], "/", +out[4 * i + 3], ", host ", +e4, "/", +e5);
    }
    CHECK(mismatches == 0);
  }
}

TEST_CASE("device FP8 decoding equals the host's") {
  weave_test::dev<float> d_out(512);
  decode_kernel<<<1, 256>>>(d_out.ptr);
  WEAVE_CUDA_CHECK(cudaDeviceSynchronize());
  const auto out = weave_test::to_host(d_out.cspan());
  for (int i = 0; i < 256; ++i) {
    const float e4 = static_cast<float>(weave::fp8_e4m3::from_bits(std::uint8_t(i)));
    const float e5 = static_cast<float>(weave::fp8_e5m2::from_bits(std::uint8_t(i)));
    CHECK((std::isnan(e4) ? std::isnan(out[2 * std::size_t(i)]) : out[2 * std::size_t(i)] == e4));
    CHECK((std::isnan(e5) ? std::isnan(out[2 * std::size_t(i) + 1])
                          : out[2 * std::size_t(i) + 1] == e5));
  }
}

TEST_CASE("device bit classification equals CUDA's for f32, bf16 and half") {
  std::vector<float> inputs;
  for (std::uint64_t bits = 0; bits <= 0xffffffffu; bits += 1021)
    inputs.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(bits)));
  weave_test::dev<float> d_in(inputs);
  weave_test::dev<std::uint32_t> d_out(inputs.size());
  classify_kernel<<<1024, 256>>>(d_in.ptr, d_out.ptr, inputs.size());
  WEAVE_CUDA_CHECK(cudaDeviceSynchronize());
  const auto out = weave_test::to_host(d_out.cspan());
  std::size_t mismatches = 0;
  for (std::size_t i = 0; i < out.size(); ++i)
    for (const unsigned shift : {0u, 8u, 16u}) {
      const std::uint32_t f = out[i] >> shift;
      if ((f & 7u) != ((f >> 3) & 7u) && mismatches++ < 5)
        FAIL_CHECK("input ", i, " shift ", shift, ": flags 0x", std::hex, f & 63u);
    }
  CHECK(mismatches == 0);
  CHECK(out.size() > 0xffffu); // every 16-bit pattern was classified
}
