// cuda_decode_exchange on one GPU: several ranks through cuda_local_world against the host
// decode_exchange on the same inputs (outputs bitwise, per-(slot, source) counts equal; f32 rows,
// and FP8 dispatched rows dequantised on arrival), a bad expert id on one rank failing every rank
// through check_errors with NaN outputs, and a decode layer over NCCL captured in a CUDA graph
// and replayed. Reports skipped without a GPU.
#include <doctest/doctest.h>

#include "cuda_buffers.hpp"
#include "decode_test_support.hpp"

#include <weave/comm/cuda_local_world.hpp>
#include <weave/comm/local_world.hpp>
#include <weave/comm/nccl_communicator.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/overlap/cuda_decode_exchange.cuh>
#include <weave/overlap/decode_exchange.hpp>

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <random>
#include <vector>

using weave_test::dev;
using weave_test::stream_holder;
using weave_test::to_host;

namespace {

constexpr int experts = 8, k = 3;
constexpr std::size_t hidden = 32, max_tokens = 16;

weave::decode_options options() {
  return {k, hidden, max_tokens};
}

// The linear experts y = W_e x on the valid rows of every local slot, one thread per (row,
// output), the sum in input order with one rounding per step: the host linear_experts exactly.
__global__ void linear_rows(const float* in, float* out, const std::int64_t* rows,
                            const std::int32_t* expert_of, const float* w, int L, int H,
                            std::int64_t per) {
  const std::int64_t n = static_cast<std::int64_t>(L) * per * H;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t row = i / H, l = row / per;
    const int o = static_cast<int>(i % H);
    if (row % per >= rows[l])
      continue;
    const float* W = w + static_cast<std::size_t>(expert_of[l]) * H * H;
    float acc = 0.0f;
    for (int j = 0; j < H; ++j)
      acc = __fadd_rn(acc, __fmul_rn(W[o * H + j], in[row * H + j]));
    out[row * H + o] = acc;
  }
}

// The experts on the handle's view, enqueued on `s` (capturable: one kernel).
struct device_experts {
  dev<float> w;
  dev<std::int32_t> expert_of;
  device_experts(const moe_test::linear_experts& f, std::span<const std::int32_t> local)
      : w(f.w)
      , expert_of(std::vector<std::int32_t>(local.begin(), local.end())) {}
  void operator()(const weave::device_decode_experts<float>& xs, cudaStream_t s) const {
    linear_rows<<<128, 256, 0, s>>>(xs.input, xs.output, xs.rows, expert_of.ptr, w.ptr,
                                    xs.local_experts, static_cast<int>(xs.hidden),
                                    static_cast<std::int64_t>(xs.rows_per_expert));
    WEAVE_CUDA_CHECK(cudaGetLastError());
  }
};

struct rank_result {
  std::vector<float> y;
  std::vector<std::int64_t> rows;
};

// One rank's decode layer on its own stream, with device copies of its inputs.
template <class Comm>
struct rank_layer {
  stream_holder s;
  weave::cuda_decode_exchange<Comm, float> ex;
  dev<std::byte> ws;
  dev<float> x;
  dev<std::int32_t> ids;
  dev<float> weights, y;
  rank_layer(Comm& comm, const moe_test::rank_input<float>& in,
             const weave::decode_options& o = options())
      : ex(comm, weave::placement::contiguous(experts, comm.size()), o)
      , ws(ex.workspace_size())
      , x(std::vector<float>(in.x.elements().begin(), in.x.elements().end()))
      , ids(in.ids)
      , weights(in.weights)
      , y(in.x.elements().size()) {
    ex.initialize(ws.ptr, ws.size, s.ref());
  }
  // One call: dispatch, the experts' kernel, combine (no host wait); returns the view.
  weave::device_decode_experts<float> call(std::optional<device_experts>& run,
                                           const moe_test::linear_experts& f) {
    auto h = ex.dispatch(x.cspan(), ids.cspan(), weights.cspan(), s.ref());
    const auto xs = h.experts();
    if (!run)
      run.emplace(f, xs.experts);
    (*run)(xs, s.raw);
    ex.combine(h, y.span(), s.ref());
    return xs;
  }
};

template <class Comm>
rank_result run_rank(Comm& comm, const moe_test::rank_input<float>& in,
                     const moe_test::linear_experts& f, int calls,
                     const weave::decode_options& o = options()) {
  rank_layer<Comm> layer(comm, in, o);
  std::optional<device_experts> run;
  rank_result out;
  for (int call = 0; call < calls; ++call) {
    const auto xs = layer.call(run, f);
    layer.ex.check_errors(layer.s.ref());
    out.y = to_host(layer.y.cspan());
    out.rows = to_host(std::span<const std::int64_t>(
        xs.source_rows, static_cast<std::size_t>(xs.local_experts * xs.sources)));
  }
  return out;
}

} // namespace

namespace {

// Both exchanges on the same inputs (zero tokens, full slots and sizes between): the CUDA one
// over cuda_local_world, the host one over local_world; outputs bitwise, counts equal.
void check_against_host(const weave::decode_options& o) {
  const moe_test::linear_experts f(experts, o.hidden, 5);
  for (const int ranks : {1, 2, 4}) {
    CAPTURE(ranks);
    std::vector<moe_test::rank_input<float>> in;
    std::mt19937 rng(31);
    for (int r = 0; r < ranks; ++r)
      in.push_back(moe_test::random_input<float>(
          std::vector<std::size_t>{0, max_tokens, 5, 1}[static_cast<std::size_t>(r)], o.hidden,
          experts, k, rng));
    std::vector<rank_result> want(static_cast<std::size_t>(ranks)), got(want.size());
    weave::local_world host_world(ranks);
    host_world.run([&](weave::local_communicator& c) {
      const auto r = static_cast<std::size_t>(c.rank());
      weave::decode_exchange<weave::local_communicator, float> ex(
          c, weave::placement::contiguous(experts, ranks), o);
      weave::host_stream s("decode");
      want[r].y = decode_test::decode_call(ex, in[r], f, s, &want[r].rows);
    });
    weave::cuda_local_world world(ranks);
    world.run([&](weave::cuda_local_communicator& c) {
      const auto r = static_cast<std::size_t>(c.rank());
      got[r] = run_rank(c, in[r], f, 2, o);
    });
    for (std::size_t r = 0; r < got.size(); ++r) {
      CAPTURE(r);
      CHECK(decode_test::bitwise_equal(got[r].y, want[r].y));
      CHECK(got[r].rows == want[r].rows);
    }
  }
}

} // namespace

TEST_CASE("cuda_decode_exchange over cuda_local_world equals the host decode_exchange") {
  check_against_host(options());
  weave::decode_options per_pair = options(); // DeepEP's combine: one row per (token, expert)
  per_pair.partial_sums = false;
  check_against_host(per_pair);
}

TEST_CASE("cuda_decode_exchange's FP8 dispatch equals the host decode_exchange's") {
  weave::decode_options o = options();
  o.hidden = 256;
  o.fp8_dispatch = weave::fp8_dispatch_options{weave::dtype::e4m3, {}, true};
  check_against_host(o);
}

TEST_CASE("cuda_decode_exchange: a bad expert id on one rank fails every rank, outputs NaN") {
  const moe_test::linear_experts f(experts, hidden, 2);
  weave::cuda_local_world world(2);
  std::vector<weave::errc> codes(2, weave::errc::internal);
  std::vector<int> origins(2, -1);
  std::vector<bool> nan(2, false);
  world.run([&](weave::cuda_local_communicator& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    std::mt19937 rng(4 + static_cast<unsigned>(r));
    auto in = moe_test::random_input<float>(6, hidden, experts, k, rng);
    if (r == 0)
      in.ids[3] = experts + 1;
    rank_layer<weave::cuda_local_communicator> layer(c, in);
    std::optional<device_experts> run;
    layer.call(run, f);
    try {
      layer.ex.check_errors(layer.s.ref());
    } catch (const weave::peer_error& e) {
      codes[r] = e.code();
      origins[r] = e.origin().rank;
    } catch (const weave::error& e) {
      codes[r] = e.code();
    }
    const auto out = to_host(layer.y.cspan());
    nan[r] = std::all_of(out.begin(), out.end(), [](float v) { return std::isnan(v); });
  });
  CHECK(codes[0] == weave::errc::out_of_range);
  CHECK(codes[1] == weave::errc::peer_failure);
  CHECK(origins[1] == 0);
  CHECK(nan[0]);
  CHECK(nan[1]);
}

TEST_CASE("a cuda_decode_exchange layer over NCCL runs inside a CUDA graph") {
  ncclComm_t raw = nullptr;
  int device = 0;
  WEAVE_CUDA_CHECK(cudaGetDevice(&device));
  WEAVE_NCCL_CHECK(ncclCommInitAll(&raw, 1, &device));
  {
    weave::nccl_communicator comm(raw);
    const moe_test::linear_experts f(experts, hidden, 8);
    std::mt19937 rng(8);
    const auto in = moe_test::random_input<float>(max_tokens, hidden, experts, k, rng);
    stream_holder stream;
    dev<float> x(std::vector<float>(in.x.elements().begin(), in.x.elements().end()));
    dev<std::int32_t> ids(in.ids);
    dev<float> weights(in.weights);
    dev<float> y(in.x.rows() * hidden);
    //! [graph]
    weave::cuda_decode_exchange<weave::nccl_communicator, float> layer(
        comm, weave::placement::contiguous(experts, comm.size()), options());
    dev<std::byte> ws(layer.workspace_size()); // device memory, allocated once
    layer.initialize(ws.ptr, ws.size, stream.ref());
    std::optional<device_experts> run; // the experts' weights: alive as long as the graph
    const auto step = [&] { // dispatch, the experts' kernel on the view, combine: no host wait
      auto h = layer.dispatch(x.cspan(), ids.cspan(), weights.cspan(), stream.ref());
      if (!run)
        run.emplace(f, h.experts().experts);
      (*run)(h.experts(), stream.raw); // reads the rows and their counts on the device
      layer.combine(h, y.span(), stream.ref());
    };
    step(); // one eager call first: it loads the kernels (not allowed inside a capture)
    layer.check_errors(stream.ref());
    cudaGraph_t graph = nullptr;
    WEAVE_CUDA_CHECK(cudaStreamBeginCapture(stream.raw, cudaStreamCaptureModeThreadLocal));
    step();
    WEAVE_CUDA_CHECK(cudaStreamEndCapture(stream.raw, &graph));
    cudaGraphExec_t exec = nullptr;
    WEAVE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    WEAVE_CUDA_CHECK(cudaGraphLaunch(exec, stream.raw)); // the whole decode layer
    layer.check_errors(stream.ref()); // waits; throws for flagged ids or weights, peers' failures
    //! [graph]
    const auto eager = to_host(y.cspan());
    for (int replay = 0; replay < 2; ++replay) {
      y.poison();
      WEAVE_CUDA_CHECK(cudaGraphLaunch(exec, stream.raw));
      stream.ref().synchronize();
      CHECK(to_host(y.cspan()) == eager);
    }
    CHECK(decode_test::bitwise_equal(
        eager,
        decode_test::expected(in, options(), f, weave::placement::contiguous(experts, comm.size()),
                              comm.rank())));
    WEAVE_CUDA_CHECK(cudaGraphExecDestroy(exec));
    WEAVE_CUDA_CHECK(cudaGraphDestroy(graph));
  }
  WEAVE_NCCL_CHECK(ncclCommDestroy(raw));
}
