// cuda_decode_exchange on one GPU: several ranks through cuda_local_world against the naive
// reference and the same exchange in host_space over local_world on the same inputs (outputs
// bitwise, per-(slot, source) counts equal; f32 rows, either combine, gathered inputs, the
// workspace given or taken at the first call, and FP8 dispatched rows dequantised on arrival),
// the experts a kernel over the packed pool's arrays; a bad expert id on one rank failing every
// rank through synchronize with NaN outputs; and a decode layer over NCCL captured in a CUDA graph
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

// The linear experts y = W_e x on the pool's rows, one thread per (pool row, output), the sum in
// input order with one rounding per step: the host linear_experts exactly. The pool is packed:
// slot l's rows are [first[l], first[l] + rows[l]), first[L] rows in all (read here, on the
// device). A row's input is its pool row, the slot's one-row block (a peer's row where it
// arrived), or with gathered inputs its own pointer.
__global__ void linear_rows(const float* pool_in, const std::byte* const* blocks,
                            const std::byte* const* row_ptr, float* out, const std::int64_t* rows,
                            const std::int64_t* first, const std::int64_t* busy,
                            const std::int32_t* expert_of, const float* w, int L, int H,
                            std::int64_t max_rows) {
  const std::int64_t n = max_rows * H, placed = first[L];
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t row = i / H;
    if (row >= placed)
      continue;
    std::int64_t l = -1;
    for (std::int64_t b = 0; b < busy[L] && l < 0; ++b)
      if (row >= first[busy[b]] && row < first[busy[b]] + rows[busy[b]])
        l = busy[b];
    const int o = static_cast<int>(i % H);
    const float* in = row_ptr != nullptr     ? reinterpret_cast<const float*>(row_ptr[row])
                      : blocks[l] != nullptr ? reinterpret_cast<const float*>(blocks[l])
                                             : pool_in + row * H;
    const float* W = w + static_cast<std::size_t>(expert_of[l]) * H * H;
    float acc = 0.0f;
    for (int j = 0; j < H; ++j)
      acc = __fadd_rn(acc, __fmul_rn(W[o * H + j], in[j]));
    out[row * H + o] = acc;
  }
}

// The experts on the handle's view, enqueued on `s` (capturable: one kernel).
struct device_experts {
  dev<float> w;
  dev<std::int32_t> expert_of;
  std::int64_t max_rows;
  template <class View>
  device_experts(const moe_test::linear_experts& f, const View& xs, std::int64_t pool_rows)
      : w(f.w)
      , expert_of(experts_of(xs))
      , max_rows(pool_rows) {}
  template <class View>
  static std::vector<std::int32_t> experts_of(const View& xs) {
    std::vector<std::int32_t> e;
    for (int l = 0; l < xs.local_experts(); ++l)
      e.push_back(xs.expert(l));
    return e;
  }
  template <class View>
  void operator()(const View& xs, cudaStream_t s) const {
    linear_rows<<<128, 256, 0, s>>>(xs.input_pool(), xs.input_blocks(), xs.input_row_pointers(),
                                    xs.output_pool(), xs.slot_rows(), xs.slot_first(),
                                    xs.busy_slots(), expert_of.ptr, w.ptr, xs.local_experts(),
                                    static_cast<int>(xs.hidden()), max_rows);
    WEAVE_CUDA_CHECK(cudaGetLastError());
  }
};

// The most pool rows a layer of `o` on `ranks` ranks holds (its records' choices).
std::int64_t pool_rows(const weave::decode_options& o, int ranks) {
  const int local = experts / ranks;
  return static_cast<std::int64_t>(ranks) * static_cast<std::int64_t>(o.max_tokens_per_rank) *
         std::min(o.k, local);
}

struct rank_result {
  std::vector<float> y;
  std::vector<std::int64_t> rows;
};

// One rank's decode layer on its own stream, with device copies of its inputs; its workspace
// given by `initialize`, or taken at the first call.
template <class Comm>
struct rank_layer {
  stream_holder s;
  weave::cuda_decode_exchange<Comm, float> ex;
  std::optional<dev<std::byte>> ws;
  dev<float> x;
  dev<std::int32_t> ids;
  dev<float> weights, y;
  rank_layer(Comm& comm, const moe_test::rank_input<float>& in,
             const weave::decode_options& o = options(), bool given = true)
      : ex(comm, weave::placement::contiguous(experts, comm.size()), o)
      , x(std::vector<float>(in.x.elements().begin(), in.x.elements().end()))
      , ids(in.ids)
      , weights(in.weights)
      , y(in.x.elements().size()) {
    if (!given)
      return;
    ws.emplace(ex.workspace_size());
    ex.initialize(ws->ptr, ws->size, s.ref());
  }
  // One call: dispatch, the experts' kernel, combine (no host wait); returns the view.
  auto call(std::optional<device_experts>& run, const moe_test::linear_experts& f, int ranks) {
    auto h = ex.dispatch(x.cspan(), ids.cspan(), weights.cspan(), s.ref());
    const auto xs = h.experts();
    if (!run)
      run.emplace(f, xs, pool_rows(ex.options(), ranks));
    (*run)(xs, s.raw);
    ex.combine(h, y.span(), s.ref());
    return xs;
  }
};

template <class Comm>
rank_result run_rank(Comm& comm, const moe_test::rank_input<float>& in,
                     const moe_test::linear_experts& f, int calls,
                     const weave::decode_options& o = options(), bool given = true) {
  rank_layer<Comm> layer(comm, in, o, given);
  std::optional<device_experts> run;
  rank_result out;
  for (int call = 0; call < calls; ++call) {
    const auto xs = layer.call(run, f, comm.size());
    layer.ex.synchronize(layer.s.ref());
    out.y = to_host(layer.y.cspan());
    out.rows = to_host(std::span<const std::int64_t>(
        xs.source_rows(), static_cast<std::size_t>(xs.local_experts() * comm.size())));
  }
  return out;
}

// The CUDA exchange over cuda_local_world and the same exchange in host_space over local_world
// on the same inputs (zero tokens, full slots and sizes between): outputs bitwise equal to each
// other and, without an FP8 dispatch, to the naive reference (with one, the host-stream tests
// check host_space against it on brute-force dequantised rows); counts equal.
void check_against_host(const weave::decode_options& o, bool given = true) {
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
    const auto where = weave::placement::contiguous(experts, ranks);
    host_world.run([&](weave::local_communicator& c) {
      const auto r = static_cast<std::size_t>(c.rank());
      weave::decode_exchange<weave::local_communicator, float> ex(c, where, o);
      weave::host_stream s("decode");
      want[r].y = decode_test::decode_call(ex, in[r], f, s, &want[r].rows);
      if (!o.fp8_dispatch)
        CHECK(decode_test::bitwise_equal(want[r].y,
                                         decode_test::expected(in[r], o, f, where, c.rank())));
    });
    weave::cuda_local_world world(ranks);
    world.run([&](weave::cuda_local_communicator& c) {
      const auto r = static_cast<std::size_t>(c.rank());
      got[r] = run_rank(c, in[r], f, 2, o, given);
    });
    for (std::size_t r = 0; r < got.size(); ++r) {
      CAPTURE(r);
      CHECK(decode_test::bitwise_equal(got[r].y, want[r].y));
      CHECK(got[r].rows == want[r].rows);
    }
  }
}

} // namespace

TEST_CASE("cuda_decode_exchange over cuda_local_world equals the reference and host_space") {
  check_against_host(options());
  check_against_host(options(), false);       // the workspace taken at the first call
  weave::decode_options per_pair = options(); // DeepEP's combine: one row per (token, expert)
  per_pair.partial_sums = false;
  check_against_host(per_pair);
}

TEST_CASE("cuda_decode_exchange with gathered inputs equals the reference and host_space") {
  for (const bool partial_sums : {true, false}) {
    CAPTURE(partial_sums);
    weave::decode_options o = options();
    o.partial_sums = partial_sums;
    o.gathered_inputs = true; // the kernel reads each row where it arrived
    check_against_host(o);
  }
}

TEST_CASE("cuda_decode_exchange's FP8 dispatch equals host_space's") {
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
  std::vector<char> nan(2, false); // not vector<bool>: written per rank thread
  world.run([&](weave::cuda_local_communicator& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    std::mt19937 rng(4 + static_cast<unsigned>(r));
    auto in = moe_test::random_input<float>(6, hidden, experts, k, rng);
    if (r == 0)
      in.ids[3] = experts + 1;
    rank_layer<weave::cuda_local_communicator> layer(c, in);
    std::optional<device_experts> run;
    layer.call(run, f, 2);
    try {
      layer.ex.synchronize(layer.s.ref());
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
        run.emplace(f, h.experts(), pool_rows(options(), comm.size()));
      (*run)(h.experts(), stream.raw); // reads the pool's arrays on the device
      layer.combine(h, y.span(), stream.ref());
    };
    step(); // one eager call first: it loads the kernels (not allowed inside a capture)
    layer.synchronize(stream.ref());
    cudaGraph_t graph = nullptr;
    WEAVE_CUDA_CHECK(cudaStreamBeginCapture(stream.raw, cudaStreamCaptureModeThreadLocal));
    step();
    WEAVE_CUDA_CHECK(cudaStreamEndCapture(stream.raw, &graph));
    cudaGraphExec_t exec = nullptr;
    WEAVE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    WEAVE_CUDA_CHECK(cudaGraphLaunch(exec, stream.raw)); // the whole decode layer
    layer.synchronize(stream.ref()); // waits; throws for flagged ids or weights, peers' failures
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
