// The forward dispatch of moe_exchange in the layer's type (bf16) against the FP8 dispatch
// (`moe_options::fp8_dispatch`, e4m3 codes and one f32 scale per 128 elements), side by side in
// one run, on the emulated link of the exchange benchmarks (moe_bench_setup.hpp: 4 in-process
// ranks, 2048 tokens/rank, E = 32, k = 4, hidden 256, 0.05 GB/s per rank pair).
//
// Each iteration: every rank waits at a barrier, then rank 0 times `dispatch` until its rows
// reached its experts (both streams synchronised: quantisation, count exchange, the all-to-all,
// the scatter into the expert layout and, for `fp8_dequantized`, the dequantisation); the
// experts and combine run untimed. Counters: wire_bytes (rank 0's rows sent to other ranks
// times the bytes of one dispatch row), row_bytes (one dispatch row on the wire) and
// bytes_ratio (row_bytes over the bf16 row's).
#include <benchmark/benchmark.h>

#include "moe_bench_setup.hpp"

#include <weave/comm/local_world.hpp>
#include <weave/core/host_matrix.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/overlap/moe_exchange.hpp>

#include <chrono>
#include <cstddef>
#include <random>
#include <vector>

namespace {

using namespace moe_bench;
constexpr std::size_t tokens = 2048;
constexpr int iterations = 16;

enum class wire { bf16, fp8, fp8_dequantized };

void dispatch_on_link(benchmark::State& state, wire mode) {
  weave::moe_options o = options(tokens, 1); // one chunk: the dispatch is one all-to-all
  if (mode != wire::bf16)
    o.fp8_dispatch =
        weave::fp8_dispatch_options{weave::dtype::e4m3, {}, mode == wire::fp8_dequantized};
  std::mt19937 rng(7);
  std::vector<rank_data> data;
  for (int r = 0; r < ranks; ++r)
    data.push_back(make_rank_data(tokens, rng));
  std::vector<double> seconds;
  weave::moe_stats stats;
  weave::local_world world(ranks, {std::chrono::seconds(120), link()});
  world.run([&](weave::local_communicator& comm) {
    const int r = comm.rank();
    auto& d = data[static_cast<std::size_t>(r)];
    weave::moe_exchange<weave::local_communicator> ex(
        comm, weave::placement::contiguous(experts, ranks), o);
    weave::host_stream compute("compute"), stream("comm");
    for (int i = 0; i <= iterations; ++i) { // the first one warms up
      comm.barrier(stream);
      stream.synchronize();
      const auto begin = std::chrono::steady_clock::now();
      auto h = ex.dispatch(d.x.view(), d.ids, d.weights, compute, stream);
      compute.synchronize();
      stream.synchronize();
      const auto end = std::chrono::steady_clock::now();
      for (const auto chunk : ex.chunks(h))
        compute.submit([chunk] { (void)chunk.experts(); }); // outputs left as they are
      ex.combine(h, d.y.view(), compute, stream);
      compute.synchronize();
      stream.synchronize();
      if (r == 0 && i > 0)
        seconds.push_back(std::chrono::duration<double>(end - begin).count());
      if (r == 0 && i == 0)
        stats = ex.stats(h, compute);
    }
  });
  std::size_t i = 0;
  for (auto _ : state)
    state.SetIterationTime(seconds[i++ % seconds.size()]);
  state.counters["wire_bytes"] = static_cast<double>(stats.sent_rows - stats.local_rows) *
                                 static_cast<double>(stats.dispatch_row_bytes);
  state.counters["row_bytes"] = static_cast<double>(stats.dispatch_row_bytes);
  state.counters["bytes_ratio"] =
      static_cast<double>(stats.dispatch_row_bytes) / static_cast<double>(stats.row_bytes);
}

void BM_dispatch_bf16(benchmark::State& state) {
  dispatch_on_link(state, wire::bf16);
}
void BM_dispatch_fp8(benchmark::State& state) {
  dispatch_on_link(state, wire::fp8);
}
void BM_dispatch_fp8_dequantized(benchmark::State& state) {
  dispatch_on_link(state, wire::fp8_dequantized);
}

} // namespace

BENCHMARK(BM_dispatch_bf16)->UseManualTime()->Iterations(iterations)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_dispatch_fp8)->UseManualTime()->Iterations(iterations)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_dispatch_fp8_dequantized)
    ->UseManualTime()
    ->Iterations(iterations)
    ->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
