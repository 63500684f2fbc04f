// The CUDA row moves (`row_moves<cuda_space>`, `layout_move<cuda_space>`) against the host path
// on random inputs: gather/merge for f32, bf16 and f16 rows, then a whole plan (the host
// reference plans of tests/support, their maps uploaded) through the four layout moves; bitwise
// equal.
#include <doctest/doctest.h>

#include "host_plan_upload.hpp"
#include "host_plans.hpp"

#include <weave/core/host_matrix.hpp>
#include <weave/routing/cuda_row_moves.cuh>
#include <weave/routing/gate.hpp>
#include <weave/routing/kernels_host.hpp>

#include <cuda_runtime.h>

#include <random>
#include <vector>

namespace {

// A device copy of a host buffer, freed at scope exit.
template <class T>
struct device_buffer {
  T* ptr = nullptr;
  std::size_t size = 0;
  explicit device_buffer(std::size_t n)
      : size(n) {
    WEAVE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&ptr), n * sizeof(T) + 256));
  }
  explicit device_buffer(const std::vector<T>& host)
      : device_buffer(host.size()) {
    if (!host.empty())
      WEAVE_CUDA_CHECK(
          cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    WEAVE_CUDA_CHECK(cudaDeviceSynchronize()); // the test streams are non-blocking
  }
  ~device_buffer() { (void)cudaFree(ptr); }
  device_buffer(const device_buffer&) = delete;
  std::vector<T> to_host() const {
    std::vector<T> out(size);
    WEAVE_CUDA_CHECK(cudaDeviceSynchronize());
    if (size)
      WEAVE_CUDA_CHECK(cudaMemcpy(out.data(), ptr, size * sizeof(T), cudaMemcpyDeviceToHost));
    return out;
  }
  std::span<const T> span() const { return {ptr, size}; }
};

template <class T>
weave::token_view device_view(device_buffer<T>& b, std::size_t cols) {
  return weave::token_view(reinterpret_cast<std::byte*>(b.ptr), b.size / cols, cols,
                           weave::dtype_of_v<T>, weave::memory_space::device, 0);
}

template <class T>
void compare_raw(std::mt19937& rng, cudaStream_t raw) {
  const weave::cuda_stream_ref stream(raw);
  for (int trial = 0; trial < 10; ++trial) {
    const std::size_t n_src = 1 + rng() % 300, n_dst = rng() % 400, cols = 1 + rng() % 1100;
    const int k = 1 + static_cast<int>(rng() % 8);
    weave::host_matrix<T> src(n_src, cols);
    std::normal_distribution<float> normal(0, 1);
    for (auto& v : src.elements())
      v = T(normal(rng));
    std::vector<std::int64_t> index(n_dst), pairs(n_dst * static_cast<std::size_t>(k));
    std::vector<float> scale(n_dst), weight(pairs.size());
    for (auto& i : index)
      i = static_cast<std::int64_t>(rng() % n_src);
    for (auto& i : pairs)
      i = rng() % 3 == 0 ? -1 : static_cast<std::int64_t>(rng() % n_src);
    for (auto& s : scale)
      s = normal(rng);
    for (auto& w : weight)
      w = normal(rng);
    device_buffer<T> d_src(src.elements().size()
                               ? std::vector<T>(src.elements().begin(), src.elements().end())
                               : std::vector<T>{});
    device_buffer<std::int64_t> d_index(index), d_pairs(pairs);
    device_buffer<float> d_scale(scale), d_weight(weight);
    for (int mode = 0; mode < 4; ++mode) {
      weave::host_matrix<T> expect(n_dst, cols);
      device_buffer<T> d_out(n_dst * cols);
      const auto out_view = device_view(d_out, cols);
      const weave::const_token_view in_view = device_view(d_src, cols);
      using moves = weave::row_moves<weave::cuda_space>;
      if (mode == 0) {
        weave::gather_rows(src.view(), expect.view(), index);
        moves::gather(stream, in_view, out_view, d_index.ptr, nullptr, nullptr);
      } else if (mode == 1) {
        weave::gather_rows(src.view(), expect.view(), index, scale);
        moves::gather(stream, in_view, out_view, d_index.ptr, d_scale.ptr, nullptr);
      } else if (mode == 2) {
        weave::merge_rows(src.view(), expect.view(), pairs, k, weight);
        moves::merge(stream, in_view, out_view, d_pairs.ptr, k, d_weight.ptr, nullptr, false);
      } else {
        weave::merge_rows(src.view(), expect.view(), pairs, k);
        moves::merge(stream, in_view, out_view, d_pairs.ptr, k, nullptr, nullptr, false);
      }
      stream.synchronize();
      const auto got = d_out.to_host();
      REQUIRE(std::vector<T>(expect.elements().begin(), expect.elements().end()) == got);
    }
  }
}

} // namespace

TEST_CASE("CUDA row_moves gather and merge equal the host path bitwise") {
  cudaStream_t raw = nullptr;
  WEAVE_CUDA_CHECK(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking));
  std::mt19937 rng(3);
  compare_raw<float>(rng, raw);
  compare_raw<weave::bfloat16>(rng, raw);
  compare_raw<weave::half>(rng, raw);
  WEAVE_CUDA_CHECK(cudaStreamDestroy(raw));
}

TEST_CASE("CUDA layout moves over uploaded reference plans equal the host layout moves") {
  cudaStream_t raw = nullptr;
  WEAVE_CUDA_CHECK(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking));
  const weave::cuda_stream_ref stream(raw);
  std::mt19937 rng(9);
  const int E = 16, D = 4, k = 4;
  const std::size_t T = 500, hidden = 256;
  const auto p = weave::placement::contiguous(E, D);
  weave::host_matrix<float> logits(T, E);
  weave::host_matrix<weave::bfloat16> x(T, hidden);
  std::normal_distribution<float> normal(0, 1);
  for (auto& v : logits.elements())
    v = normal(rng);
  for (auto& v : x.elements())
    v = weave::bfloat16(normal(rng));
  std::vector<std::int32_t> ids(T * k);
  std::vector<float> w(T * k);
  weave::gate_options options;
  options.k = k;
  weave::top_k_gate(logits.view(), options, ids, w);
  oracle::dispatch_plan plan(p, k, 1);
  plan.build(ids, w);
  // Treat every SFD row as received by one device holding all local slots of its destination:
  // the receiver plan over the whole SFD buffer with L = slots per device.
  oracle::expert_plan eplan(p.slots_per_device(), k);
  eplan.build(plan.row_routes(), plan.send_counts());

  weave::host_matrix<weave::bfloat16> sfd(static_cast<std::size_t>(plan.rows()), hidden),
      epd(static_cast<std::size_t>(eplan.epd_rows()), hidden), back(sfd.rows(), hidden),
      out(T, hidden);
  oracle::dispatch_gather(plan, x.view(), sfd.view());
  oracle::expert_scatter(eplan, sfd.view(), epd.view());
  oracle::expert_merge(eplan, epd.view(), back.view());
  oracle::combine_merge(plan, back.view(), out.view());

  device_buffer<std::byte> ws_plan(oracle::upload_workspace_size(plan)),
      ws_eplan(oracle::upload_workspace_size(eplan));
  const auto dmaps = oracle::upload(plan, ws_plan.ptr, ws_plan.size + 256, stream);
  const auto emaps = oracle::upload(eplan, ws_eplan.ptr, ws_eplan.size + 256, stream);
  device_buffer<weave::bfloat16> d_x(
      std::vector<weave::bfloat16>(x.elements().begin(), x.elements().end())),
      d_sfd(sfd.elements().size()), d_epd(epd.elements().size()), d_back(back.elements().size()),
      d_out(out.elements().size());
  // The four moves over the maps, as the exchanges run them: ORI -> SFD and SFD -> EPD as layout
  // moves (a GPU gathers), EPD -> SFD gate-weighted and SFD -> ORI as merges.
  using space = weave::cuda_space;
  weave::layout_move<space>(stream, device_view(d_x, hidden), device_view(d_sfd, hidden),
                            dmaps.row_token.data(), nullptr, nullptr, dmaps.token_rows.data(),
                            dmaps.k, nullptr, nullptr);
  weave::layout_move<space>(stream, device_view(d_sfd, hidden), device_view(d_epd, hidden),
                            emaps.epd_row_source.data(), nullptr, nullptr, emaps.row_epd.data(),
                            emaps.k, nullptr, nullptr);
  weave::row_moves<space>::merge(stream, device_view(d_epd, hidden), device_view(d_back, hidden),
                                 emaps.row_epd.data(), emaps.k, emaps.row_weight.data(), nullptr,
                                 false);
  weave::row_moves<space>::merge(stream, device_view(d_back, hidden), device_view(d_out, hidden),
                                 dmaps.token_rows.data(), dmaps.k, nullptr, nullptr, false);
  stream.synchronize();
  CHECK(d_sfd.to_host() ==
        std::vector<weave::bfloat16>(sfd.elements().begin(), sfd.elements().end()));
  CHECK(d_epd.to_host() ==
        std::vector<weave::bfloat16>(epd.elements().begin(), epd.elements().end()));
  CHECK(d_back.to_host() ==
        std::vector<weave::bfloat16>(back.elements().begin(), back.elements().end()));
  CHECK(d_out.to_host() ==
        std::vector<weave::bfloat16>(out.elements().begin(), out.elements().end()));
  WEAVE_CUDA_CHECK(cudaStreamDestroy(raw));
}
