// The CUDA block quantisation kernels against the host path: random f32, bf16 and f16 rows,
// both FP8 formats and both scale roundings, codes and scales bitwise equal to quantize_rows,
// dequantised rows bitwise equal to dequantize_rows; quant_moves<cuda_space> (index, padding,
// device count, status word of non-finite rows) equal to quant_moves<host_space>. Skips without
// a GPU.
#include <doctest/doctest.h>

#include <weave/core/host_matrix.hpp>
#include <weave/routing/host_quant_moves.hpp>
#include <weave/routing/quantize.cuh>

#include "cuda_buffers.hpp"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

namespace {

using weave_test::dev;

template <class T>
std::vector<T> random_elements(std::mt19937& rng, std::size_t n, std::size_t block) {
  std::vector<T> out(n);
  std::normal_distribution<float> normal(0, 1);
  const int spread = std::is_same_v<T, weave::half> ? 8 : 30;
  float m = 1;
  for (std::size_t i = 0; i < n; ++i) {
    if (i % block == 0)
      m = std::ldexp(1.0f, static_cast<int>(rng() % (2 * spread + 1)) - spread);
    out[i] = T(normal(rng) * m * (rng() % 8 == 0 ? 1.0f / 512 : 1.0f));
  }
  return out;
}

template <class T>
weave::token_view device_rows(dev<T>& d, std::size_t cols) {
  return weave::token_view(reinterpret_cast<std::byte*>(d.ptr), d.size / cols, cols,
                           weave::dtype_of_v<T>, weave::memory_space::device, 0);
}

template <class T>
weave::token_view host_rows(std::vector<T>& h, std::size_t cols) {
  return weave::make_token_view(h, cols);
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

template <class Fp8, class T>
void compare(std::mt19937& rng, const weave::block_quantization& q) {
  weave_test::stream_holder stream;
  const std::size_t rows = 1 + rng() % 40, cols = q.block * (1 + rng() % 20);
  auto src = random_elements<T>(rng, rows * cols, q.block);
  std::vector<Fp8> codes(rows * cols);
  std::vector<float> scales(rows * cols / q.block);
  weave::quantize_rows(host_rows(src, cols), host_rows(codes, cols),
                       host_rows(scales, cols / q.block), q);
  dev<T> d_src(src);
  dev<Fp8> d_codes(codes.size());
  dev<float> d_scales(scales.size());
  weave::quantize_rows(stream.ref(), device_rows(d_src, cols), device_rows(d_codes, cols),
                       device_rows(d_scales, cols / q.block), q);
  WEAVE_CUDA_CHECK(cudaStreamSynchronize(stream.raw));
  CHECK(same_bits(weave_test::to_host(d_codes.cspan()), codes));
  CHECK(same_bits(weave_test::to_host(d_scales.cspan()), scales));

  std::vector<T> back(rows * cols);
  weave::dequantize_rows(host_rows(codes, cols), host_rows(scales, cols / q.block),
                         host_rows(back, cols), q);
  dev<T> d_back(back.size());
  weave::dequantize_rows(stream.ref(), device_rows(d_codes, cols),
                         device_rows(d_scales, cols / q.block), device_rows(d_back, cols), q);
  WEAVE_CUDA_CHECK(cudaStreamSynchronize(stream.raw));
  CHECK(same_bits(weave_test::to_host(d_back.cspan()), back));
}

} // namespace

TEST_CASE("CUDA quantize/dequantize equal the host path bitwise") {
  std::mt19937 rng(21);
  for (auto rounding : {weave::scale_rounding::exact, weave::scale_rounding::power_of_two})
    for (std::size_t block : {128u, 32u, 96u}) {
      weave::block_quantization q;
      q.block = block;
      q.rounding = rounding;
      compare<weave::fp8_e4m3, float>(rng, q);
      compare<weave::fp8_e4m3, weave::bfloat16>(rng, q);
      compare<weave::fp8_e4m3, weave::half>(rng, q);
      compare<weave::fp8_e5m2, weave::bfloat16>(rng, q);
    }
}

TEST_CASE("quant_moves<cuda_space> equals quant_moves<host_space>: index, padding, count, status") {
  std::mt19937 rng(4);
  const std::size_t rows = 12, cols = 384, out_rows = 10;
  auto src = random_elements<weave::bfloat16>(rng, rows * cols, 128);
  src[7 * cols + 200] = weave::bfloat16(NAN);
  src[3 * cols + 5] = weave::bfloat16(INFINITY);
  const std::vector<std::int64_t> index = {11, 7, -1, 3, 0, 7, 2, -1, 5, 9};
  const std::int64_t count = 8; // rows 8 and 9 stay untouched
  weave::block_quantization q;

  std::vector<weave::fp8_e4m3> codes(out_rows * cols, weave::fp8_e4m3::from_bits(0xff));
  std::vector<float> scales(out_rows * 3);
  std::memset(scales.data(), 0xff, scales.size() * sizeof(float));
  std::int64_t status = -1;
  {
    weave::host_stream hs;
    weave::quant_moves<weave::host_space>::quantize(hs, host_rows(src, cols),
                                                    host_rows(codes, cols), host_rows(scales, 3),
                                                    index.data(), &count, q, &status);
    hs.synchronize();
  }
  CHECK(status == 3);

  weave_test::stream_holder stream;
  dev<weave::bfloat16> d_src(src);
  dev<weave::fp8_e4m3> d_codes(codes.size()); // poisoned with 0xff, as the host buffers
  dev<float> d_scales(scales.size());
  dev<std::int64_t> d_index(index), d_count(std::vector<std::int64_t>{count}),
      d_status(std::vector<std::int64_t>{-1});
  weave::quant_moves<weave::cuda_space>::quantize(
      stream.ref(), device_rows(d_src, cols), device_rows(d_codes, cols), device_rows(d_scales, 3),
      d_index.ptr, d_count.ptr, q, d_status.ptr);
  WEAVE_CUDA_CHECK(cudaStreamSynchronize(stream.raw));
  CHECK(same_bits(weave_test::to_host(d_codes.cspan()), codes));
  CHECK(same_bits(weave_test::to_host(d_scales.cspan()), scales));
  CHECK(weave_test::to_host(d_status.cspan())[0] == 3);

  const std::vector<std::int64_t> order = {4, -1, 0, 6};
  std::vector<float> back(4 * cols, 7.0f);
  {
    weave::host_stream hs;
    weave::quant_moves<weave::host_space>::dequantize(hs, host_rows(codes, cols),
                                                      host_rows(scales, 3), host_rows(back, cols),
                                                      order.data(), nullptr, q);
    hs.synchronize();
  }
  dev<float> d_back(std::vector<float>(4 * cols, 7.0f));
  dev<std::int64_t> d_order(order);
  weave::quant_moves<weave::cuda_space>::dequantize(
      stream.ref(), device_rows(d_codes, cols), device_rows(d_scales, 3), device_rows(d_back, cols),
      d_order.ptr, nullptr, q);
  WEAVE_CUDA_CHECK(cudaStreamSynchronize(stream.raw));
  const auto got = weave_test::to_host(d_back.cspan());
  for (std::size_t i = 0; i < got.size(); ++i)
    CHECK((std::isnan(back[i]) ? std::isnan(got[i]) : got[i] == back[i]));
}
