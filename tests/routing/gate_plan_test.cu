// The CUDA gate and dispatch plan against the host path on fresh random inputs (outputs and
// workspaces poisoned with 0xFF bytes before every run): the gate against `top_k_gate`, the plan
// against the host reference plan (tests/support/host_plans.hpp) and the Tutel-style mask
// reference, the 16-byte gather/merge paths against the host kernels, and bad input.
#include <doctest/doctest.h>

#include <weave/core/host_matrix.hpp>
#include <weave/routing/cuda_row_moves.cuh>
#include <weave/routing/gate.cuh>
#include <weave/routing/gate.hpp>
#include <weave/routing/kernels_host.hpp>
#include <weave/routing/plan.cuh>

#include "cuda_buffers.hpp"
#include "host_plans.hpp"
#include "mask_routing.cuh"
#include "random_choices.hpp"
#include "routing_reference.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

using weave_test::dev;
using weave_test::random_choices;
using weave_test::random_keep;
using weave_test::stream_holder;
using weave_test::to_host;

namespace {

// Host selection keys of one token in double precision: the reference for near-tie checks.
std::vector<double> selection_keys(const float* logits, int E, bool sigmoid,
                                   const std::vector<float>& bias) {
  std::vector<double> s(static_cast<std::size_t>(E));
  double top = -std::numeric_limits<double>::infinity(), sum = 0;
  for (int e = 0; e < E; ++e)
    top = std::max(top, static_cast<double>(logits[e]));
  for (int e = 0; e < E; ++e) {
    s[e] = sigmoid ? 1.0 / (1.0 + std::exp(-static_cast<double>(logits[e])))
                   : std::exp(static_cast<double>(logits[e]) - top);
    sum += s[e];
  }
  for (int e = 0; e < E; ++e)
    s[e] = (sigmoid ? s[e] : s[e] / sum) + (bias.empty() ? 0.0 : bias[e]);
  return s;
}

template <class L>
void gate_trials(std::mt19937& rng, const stream_holder& stream) {
  const int experts[] = {1, 7, 32, 33, 64, 256, 1000};
  for (int trial = 0; trial < 24; ++trial) {
    const int E = experts[rng() % 7];
    const int k = 1 + static_cast<int>(rng() % std::min(E, 8));
    const std::size_t T = rng() % 3 == 0 ? rng() % 5 : 1 + rng() % 3000;
    const bool sigmoid = rng() % 2 == 0, quantized = rng() % 2 == 0;
    weave::gate_options options;
    options.k = k;
    options.scoring = sigmoid ? weave::gate_scoring::sigmoid : weave::gate_scoring::softmax;
    options.renormalize = rng() % 2 == 0;
    std::vector<float> bias;
    if (rng() % 2 == 0)
      for (int e = 0; e < E; ++e)
        bias.push_back(quantized ? 2.0f * static_cast<float>(rng() % 3) : 0.01f * (rng() % 7));
    // Quantized logits (halves in [-6, 6]; bias steps of 2 exceed any score gap) tie exactly
    // (equal inputs give equal scores on both sides) and are otherwise far apart, so ids must
    // match exactly; normal logits may near-tie.
    weave::host_matrix<L> logits(T, static_cast<std::size_t>(E));
    std::normal_distribution<float> normal(0, 2);
    for (auto& v : logits.elements())
      v = L(quantized ? std::clamp(std::round(normal(rng) * 2) / 2, -6.0f, 6.0f) : normal(rng));
    std::vector<std::int32_t> ids(T * k);
    std::vector<float> w(T * k), top(T);
    dev<float> d_bias(bias);
    options.bias = bias;
    weave::top_k_gate(logits.view(), options, ids, w, top);

    dev<L> d_logits(std::vector<L>(logits.elements().begin(), logits.elements().end()));
    dev<std::int32_t> d_ids(T * k);
    dev<float> d_w(T * k), d_top(T);
    dev<std::uint32_t> d_err(std::vector<std::uint32_t>{0});
    weave::gate_options dopt = options;
    dopt.bias = bias.empty() ? std::span<const float>{} : d_bias.cspan();
    const weave::const_token_view dview(reinterpret_cast<const std::byte*>(d_logits.ptr), T,
                                        static_cast<std::size_t>(E), weave::dtype_of_v<L>,
                                        weave::memory_space::device, 0);
    weave::top_k_gate(stream.ref(), dview, dopt, d_ids.span(), d_w.span(), d_err.ptr, d_top.span());
    stream.ref().synchronize();
    CHECK(to_host(d_err.cspan())[0] == 0u);
    const auto got_ids = to_host(d_ids.cspan());
    const auto got_w = to_host(d_w.cspan());
    const auto got_top = to_host(d_top.cspan());
    for (std::size_t t = 0; t < T; ++t)
      CHECK(std::abs(got_top[t] - top[t]) <= 1e-5f * std::max(1.0f, std::abs(top[t])));
    std::size_t near_ties = 0;
    std::vector<float> row(static_cast<std::size_t>(E));
    for (std::size_t t = 0; t < T; ++t) {
      for (int r = 0; r < k; ++r) {
        const std::size_t p = t * k + r;
        if (got_ids[p] != ids[p]) {
          REQUIRE_FALSE(quantized);
          REQUIRE(got_ids[p] >= 0);
          REQUIRE(got_ids[p] < E);
          for (int e = 0; e < E; ++e)
            row[e] = static_cast<float>(logits(t, static_cast<std::size_t>(e)));
          const auto key = selection_keys(row.data(), E, sigmoid, bias);
          CHECK(std::abs(key[ids[p]] - key[got_ids[p]]) <= 1e-5);
          ++near_ties;
          break; // later ranks shift after a near-tie swap
        }
        CHECK(std::abs(got_w[p] - w[p]) <= 1e-5f * std::max(1.0f, std::abs(w[p])));
      }
    }
    CHECK(near_ties <= T / 100 + 1);
  }
}

void expect_plan_equal(const oracle::dispatch_plan& host, const weave::cuda_dispatch_plan& gpu,
                       const stream_holder& stream) {
  stream.ref().synchronize();
  const std::int64_t rows = host.rows();
  REQUIRE(gpu.read_rows(stream.ref()) == rows);
  const auto k = static_cast<std::size_t>(host.k());
  CHECK(to_host(gpu.send_counts()) ==
        std::vector<std::int64_t>(host.send_counts().begin(), host.send_counts().end()));
  CHECK(to_host(gpu.send_offsets()) ==
        std::vector<std::int64_t>(host.send_offsets().begin(), host.send_offsets().end()));
  CHECK(to_host(gpu.row_token().first(static_cast<std::size_t>(rows))) ==
        std::vector<std::int64_t>(host.row_token().begin(), host.row_token().end()));
  CHECK(to_host(gpu.token_rows()) ==
        std::vector<std::int64_t>(host.token_rows().begin(), host.token_rows().end()));
  CHECK(to_host(gpu.row_routes().first(static_cast<std::size_t>(rows) * k)) ==
        std::vector<weave::route_entry>(host.row_routes().begin(), host.row_routes().end()));
  CHECK(to_host(gpu.kept_experts()) ==
        std::vector<std::int32_t>(host.kept_experts().begin(), host.kept_experts().end()));
  CHECK(to_host(gpu.slot_loads()) ==
        std::vector<std::int64_t>(host.slot_loads().begin(), host.slot_loads().end()));
  gpu.check_errors(stream.ref());
}

} // namespace

TEST_CASE("CUDA top_k_gate matches the host gate (f32, bf16, f16, f64 logits)") {
  stream_holder stream;
  std::mt19937 rng(21);
  gate_trials<float>(rng, stream);
  gate_trials<weave::bfloat16>(rng, stream);
  gate_trials<weave::half>(rng, stream);
  gate_trials<double>(rng, stream);
}

TEST_CASE("CUDA top_k_gate flags bad logits and bias, rejects bad arguments") {
  stream_holder stream;
  const int E = 16, k = 2;
  const std::size_t T = 40;
  std::vector<float> logits(T * E, 0.5f);
  dev<std::int32_t> ids(T * k);
  dev<float> w(T * k);
  dev<std::uint32_t> err(1);
  weave::gate_options options;
  options.k = k;
  const auto run = [&](const std::vector<float>& host, const std::vector<float>& bias) {
    dev<float> d(host), b(bias);
    weave::gate_options o = options;
    if (!bias.empty())
      o.bias = b.cspan();
    WEAVE_CUDA_CHECK(cudaMemsetAsync(err.ptr, 0, 4, stream.raw));
    weave::top_k_gate(stream.ref(),
                      weave::const_token_view(reinterpret_cast<const std::byte*>(d.ptr), T, E,
                                              weave::dtype::f32, weave::memory_space::device, 0),
                      o, ids.span(), w.span(), err.ptr);
    stream.ref().synchronize();
    return to_host(err.cspan())[0];
  };
  CHECK(run(logits, {}) == 0u);
  auto bad = logits;
  bad[7 * E + 3] = std::numeric_limits<float>::quiet_NaN();
  CHECK(run(bad, {}) == weave::cuda_gate_bad_logit);
  bad = logits;
  bad[5 * E + 1] = std::numeric_limits<float>::infinity();
  CHECK(run(bad, {}) == weave::cuda_gate_bad_logit);
  bad = logits;
  for (int e = 0; e < E; ++e)
    bad[11 * E + e] = -std::numeric_limits<float>::infinity();
  CHECK(run(bad, {}) == weave::cuda_gate_empty_row);
  std::vector<float> bias(E, 0.0f);
  bias[9] = std::numeric_limits<float>::infinity();
  CHECK(run(logits, bias) == weave::cuda_gate_bad_bias);

  dev<float> d(logits);
  const weave::const_token_view view(reinterpret_cast<const std::byte*>(d.ptr), T, E,
                                     weave::dtype::f32, weave::memory_space::device, 0);
  weave::gate_options o = options;
  o.k = E + 1;
  CHECK_THROWS_WITH_AS(weave::top_k_gate(stream.ref(), view, o, ids.span(), w.span()),
                       doctest::Contains("k = 17"), weave::error);
  o.k = k;
  CHECK_THROWS_AS(weave::top_k_gate(stream.ref(), view, o, ids.span().first(3), w.span()),
                  weave::error);
  const weave::device_limit limit{};
  o.limit = &limit;
  try {
    weave::top_k_gate(stream.ref(), view, o, ids.span(), w.span());
    FAIL("a device limit was accepted");
  } catch (const weave::error& e) {
    CHECK(e.code() == weave::errc::not_supported);
  }
  o.limit = nullptr;
  // A bias left in host memory (a host gate_options reused as it is) is refused before launch.
  const std::vector<float> host_bias(E, 0.0f);
  o.bias = host_bias;
  CHECK_THROWS_WITH_AS(weave::top_k_gate(stream.ref(), view, o, ids.span(), w.span()),
                       doctest::Contains("bias in host memory"), weave::error);
  o.bias = {};
  const weave::const_token_view host_view(reinterpret_cast<const std::byte*>(logits.data()), T, E,
                                          weave::dtype::f32);
  CHECK_THROWS_AS(weave::top_k_gate(stream.ref(), host_view, o, ids.span(), w.span()),
                  weave::error);
}

TEST_CASE("CUDA dispatch plan equals the host reference plan (dropless and with a keep mask)") {
  stream_holder stream;
  std::mt19937 rng(33);
  const int devices[] = {1, 2, 3, 8, 64};
  for (int trial = 0; trial < 40; ++trial) {
    const int D = devices[rng() % 5];
    const int spd = 1 + static_cast<int>(rng() % 4);
    const int E = D * spd;
    const int k = 1 + static_cast<int>(rng() % std::min(E, 8));
    const std::size_t T = rng() % 4 == 0 ? rng() % 4 : 1 + rng() % 5000;
    const auto p = ref::random_placement(E, D, static_cast<int>(rng() % 3), rng); // replicas too
    const std::size_t offset = rng() % 1000; // a chunk's first token: replicas depend on it
    const int source = static_cast<int>(rng() % static_cast<unsigned>(D));
    std::vector<std::int32_t> ids;
    std::vector<float> w;
    random_choices(rng, T, E, k, ids, w);
    const std::vector<std::uint8_t> keep = random_keep(rng, ids.size());
    oracle::dispatch_plan host(p, k, source);
    host.build(ids, w, keep, offset);

    const std::size_t max_tokens = T + rng() % 100;
    weave::cuda_dispatch_plan gpu(p, k, source, max_tokens);
    dev<std::byte> ws(gpu.workspace_size()); // poisoned
    gpu.initialize(ws.ptr, ws.size, stream.ref());
    dev<std::int32_t> d_ids(ids);
    dev<float> d_w(w);
    dev<std::uint8_t> d_keep(keep);
    gpu.build(stream.ref(), d_ids.cspan(), d_w.cspan(),
              keep.empty() ? std::span<const std::uint8_t>{} : d_keep.cspan(), offset);
    expect_plan_equal(host, gpu, stream);
    // A rebuild over poisoned outputs with other choices gives the new host plan.
    random_choices(rng, T, E, k, ids, w);
    host.build(ids, w);
    WEAVE_CUDA_CHECK(cudaMemcpy(d_ids.ptr, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
    WEAVE_CUDA_CHECK(cudaMemcpy(d_w.ptr, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
    WEAVE_CUDA_CHECK(cudaMemset(ws.ptr, 0xFF, ws.size));
    WEAVE_CUDA_CHECK(cudaDeviceSynchronize()); // pageable copies are not ordered with the stream
    gpu.initialize(ws.ptr, ws.size, stream.ref());
    gpu.build(stream.ref(), d_ids.cspan(), d_w.cspan());
    expect_plan_equal(host, gpu, stream);
  }
}

TEST_CASE("CUDA gate + plan + layout moves equal the host pipeline; plan rows equal the mask "
          "reference") {
  stream_holder stream;
  std::mt19937 rng(45);
  for (const int E : {64, 256}) {
    const int k = 8;
    const std::size_t T = 4096, hidden = 256;
    weave::host_matrix<float> logits(T, static_cast<std::size_t>(E));
    std::normal_distribution<float> normal(0, 1);
    for (auto& v : logits.elements())
      v = normal(rng);
    dev<float> d_logits(std::vector<float>(logits.elements().begin(), logits.elements().end()));
    dev<std::int32_t> d_ids(T * k);
    dev<float> d_w(T * k);
    //! [gate_plan]
    weave::gate_options options;
    options.k = k;
    options.renormalize = true;
    weave::top_k_gate(stream.ref(),
                      weave::const_token_view(reinterpret_cast<const std::byte*>(d_logits.ptr), T,
                                              static_cast<std::size_t>(E), weave::dtype::f32,
                                              weave::memory_space::device, 0),
                      options, d_ids.span(), d_w.span());
    // One expert per device: mask positions are SFD rows.
    const auto p = weave::placement::contiguous(E, E);
    weave::cuda_dispatch_plan gpu(p, k, 0, T);
    dev<std::byte> ws(gpu.workspace_size());
    gpu.initialize(ws.ptr, ws.size, stream.ref());
    gpu.build(stream.ref(), d_ids.cspan(), d_w.cspan());
    //! [gate_plan]
    const weave_test::mask_routing mask(static_cast<std::int64_t>(T), E, k);
    dev<std::byte> mws(mask.bytes());
    dev<std::int64_t> mask_rows(T * k);
    mask.run(d_ids.ptr, mask_rows.ptr, mws.ptr, stream.raw);
    stream.ref().synchronize();
    // The host plan from the device gate's own choices is the bitwise expectation.
    const auto ids = to_host(d_ids.cspan());
    const auto w = to_host(d_w.cspan());
    oracle::dispatch_plan host(p, k, 0);
    host.build(ids, w);
    expect_plan_equal(host, gpu, stream);
    auto by_mask = to_host(mask_rows.cspan());
    for (std::size_t t = 0; t < T; ++t) // token_rows are ascending, mask rows in rank order
      std::sort(by_mask.begin() + static_cast<std::ptrdiff_t>(t * k),
                by_mask.begin() + static_cast<std::ptrdiff_t>((t + 1) * k));
    CHECK(by_mask == to_host(gpu.token_rows()));

    // ORI -> SFD -> ORI over the device maps equals the host moves.
    weave::host_matrix<weave::bfloat16> x(T, hidden),
        sfd(static_cast<std::size_t>(host.rows()), hidden), out(T, hidden);
    for (auto& v : x.elements())
      v = weave::bfloat16(normal(rng));
    oracle::dispatch_gather(host, x.view(), sfd.view());
    oracle::combine_merge(host, sfd.view(), out.view());
    dev<weave::bfloat16> d_x(
        std::vector<weave::bfloat16>(x.elements().begin(), x.elements().end()));
    dev<weave::bfloat16> d_sfd(sfd.elements().size()), d_out(out.elements().size());
    const auto view = [hidden](dev<weave::bfloat16>& b) {
      return weave::token_view(reinterpret_cast<std::byte*>(b.ptr), b.size / hidden, hidden,
                               weave::dtype::bf16, weave::memory_space::device, 0);
    };
    //! [moves]
    const auto maps = gpu.maps(host.rows()); // the row count: gpu.read_rows(stream), or known
    weave::layout_move<weave::cuda_space>(stream.ref(), view(d_x), view(d_sfd),
                                          maps.row_token.data(), nullptr, nullptr,
                                          maps.token_rows.data(), maps.k, nullptr, nullptr);
    weave::row_moves<weave::cuda_space>::merge(stream.ref(), view(d_sfd), view(d_out),
                                               maps.token_rows.data(), maps.k, nullptr, nullptr,
                                               false);
    //! [moves]
    stream.ref().synchronize();
    CHECK(to_host(d_sfd.cspan()) ==
          std::vector<weave::bfloat16>(sfd.elements().begin(), sfd.elements().end()));
    CHECK(to_host(d_out.cspan()) ==
          std::vector<weave::bfloat16>(out.elements().begin(), out.elements().end()));
  }
}

TEST_CASE("CUDA dispatch plan flags bad choices and rejects bad arguments") {
  stream_holder stream;
  const int E = 8, D = 4, k = 2;
  const auto p = weave::placement::contiguous(E, D);
  weave::cuda_dispatch_plan gpu(p, k, 0, 16);
  dev<std::byte> ws(gpu.workspace_size());
  gpu.initialize(ws.ptr, ws.size, stream.ref());
  const auto code_of = [&](std::vector<std::int32_t> ids, std::vector<float> w) {
    dev<std::int32_t> d_ids(ids);
    dev<float> d_w(w);
    gpu.build(stream.ref(), d_ids.cspan(), d_w.cspan());
    try {
      gpu.check_errors(stream.ref());
    } catch (const weave::error& e) {
      return e.code();
    }
    return weave::errc{};
  };
  CHECK(code_of({0, 1, 2, -1}, {0.5f, 0.5f, 1.0f, 0.0f}) == weave::errc{});
  CHECK(code_of({0, 8, 2, 3}, {0.5f, 0.5f, 1.0f, 0.0f}) == weave::errc::out_of_range);
  CHECK(code_of({0, -2, 2, 3}, {0.5f, 0.5f, 1.0f, 0.0f}) == weave::errc::out_of_range);
  CHECK(code_of({0, 1, 3, 3}, {0.5f, 0.5f, 1.0f, 0.0f}) == weave::errc::invalid_argument);
  CHECK(code_of({0, 1, 2, 3}, {0.5f, std::numeric_limits<float>::quiet_NaN(), 1.0f, 0.0f}) ==
        weave::errc::invalid_argument);

  dev<std::int32_t> many(17 * k);
  dev<float> many_w(17 * k);
  CHECK_THROWS_AS(gpu.build(stream.ref(), many.cspan(), many_w.cspan()), weave::error);
  CHECK_THROWS_AS(gpu.build(stream.ref(), many.cspan().first(3), many_w.cspan().first(3)),
                  weave::error);
  CHECK_THROWS_AS(gpu.build(stream.ref(), many.cspan().first(4), many_w.cspan().first(6)),
                  weave::error);
  // Replicated placements are plannable (a replica table is uploaded at initialize); their
  // plans are checked against the host reference in the equality test above.
  const weave::placement replicated(4, 2, {0, 1, 2, 3, 0, 1, 2, 3});
  CHECK_NOTHROW(weave::cuda_dispatch_plan(replicated, 2, 0, 8));
  CHECK_THROWS_AS(weave::cuda_dispatch_plan(p, 0, 0, 8), weave::error);
  CHECK_THROWS_AS(weave::cuda_dispatch_plan(p, 2, 4, 8), weave::error);
  weave::cuda_dispatch_plan uninit(p, k, 0, 8);
  CHECK_THROWS_AS(uninit.build(stream.ref(), many.cspan().first(4), many_w.cspan().first(4)),
                  weave::error);
}

TEST_CASE("CUDA 16-byte and scalar gather/merge paths equal the host kernels bitwise") {
  stream_holder stream;
  std::mt19937 rng(57);
  std::normal_distribution<float> normal(0, 1);
  // hidden 4096 bf16 and an aligned f32 width take the vector path; 9 columns and a base
  // offset by one element take the scalar path.
  for (const std::size_t cols : {std::size_t{4096}, std::size_t{24}, std::size_t{9}}) {
    for (const std::size_t shift : {std::size_t{0}, std::size_t{1}}) {
      const std::size_t n_src = 300, n_dst = 500;
      const int k = 4;
      weave::host_matrix<weave::bfloat16> src(n_src, cols);
      for (auto& v : src.elements())
        v = weave::bfloat16(normal(rng));
      std::vector<std::int64_t> index(n_dst), pairs(n_dst * k);
      std::vector<float> scale(n_dst), weight(pairs.size());
      for (auto& i : index)
        i = static_cast<std::int64_t>(rng() % n_src);
      for (auto& i : pairs)
        i = rng() % 4 == 0 ? -1 : static_cast<std::int64_t>(rng() % n_src);
      for (auto& s : scale)
        s = normal(rng);
      for (auto& x : weight)
        x = normal(rng);
      std::vector<weave::bfloat16> padded(shift);
      padded.insert(padded.end(), src.elements().begin(), src.elements().end());
      dev<weave::bfloat16> d_src(padded), d_out(n_dst * cols + shift);
      dev<std::int64_t> d_index(index), d_pairs(pairs);
      dev<float> d_scale(scale), d_weight(weight);
      const weave::const_token_view in(reinterpret_cast<const std::byte*>(d_src.ptr + shift), n_src,
                                       cols, weave::dtype::bf16, weave::memory_space::device, 0);
      const weave::token_view out(reinterpret_cast<std::byte*>(d_out.ptr + shift), n_dst, cols,
                                  weave::dtype::bf16, weave::memory_space::device, 0);
      for (int mode = 0; mode < 4; ++mode) {
        weave::host_matrix<weave::bfloat16> expect(n_dst, cols);
        d_out.poison();
        using moves = weave::row_moves<weave::cuda_space>;
        if (mode == 0) {
          weave::gather_rows(src.view(), expect.view(), index);
          moves::gather(stream.ref(), in, out, d_index.ptr, nullptr, nullptr);
        } else if (mode == 1) {
          weave::gather_rows(src.view(), expect.view(), index, scale);
          moves::gather(stream.ref(), in, out, d_index.ptr, d_scale.ptr, nullptr);
        } else if (mode == 2) {
          weave::merge_rows(src.view(), expect.view(), pairs, k, weight);
          moves::merge(stream.ref(), in, out, d_pairs.ptr, k, d_weight.ptr, nullptr, false);
        } else {
          weave::merge_rows(src.view(), expect.view(), pairs, k);
          moves::merge(stream.ref(), in, out, d_pairs.ptr, k, nullptr, nullptr, false);
        }
        stream.ref().synchronize();
        const auto got = to_host(std::span<const weave::bfloat16>(d_out.ptr + shift, n_dst * cols));
        CHECK(std::memcmp(got.data(), expect.elements().data(), got.size() * 2) == 0);
      }
    }
  }
}
