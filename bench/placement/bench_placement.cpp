// Timing of the placement policies beside the contiguous baseline, at OLMoE-like (E=64, D=8)
// and 256-expert (E=256, D=32) shapes, plus migration planning and CT evaluation; and the
// replicated placement of a whole model at DeepSeek-V3's shape (58 MoE layers of 256 experts on
// 8 nodes x 8 GPUs, 320 slots) with the incremental packing beside the from-scratch packing
// it replaced (identical placements; the tests check that).
//
//   bench_placement --benchmark_format=json

#include <benchmark/benchmark.h>

#include "replication_reference.hpp"

#include <weave/placement.hpp>

#include <algorithm>
#include <cmath>
#include <random>
#include <utility>
#include <vector>

namespace {

const weave::expert_statistics& stats_for(int E, int k) {
  static std::vector<std::pair<int, weave::expert_statistics>> cache;
  for (const auto& [key, s] : cache)
    if (key == E * 1000 + k)
      return s;
  weave::trace_options o;
  o.num_experts = E;
  o.k = k;
  o.tokens = 20000;
  o.clusters = E / 8;
  o.affinity = 0.8;
  o.zipf = 0.6;
  const auto t = weave::generate_trace(o);
  weave::expert_statistics s(E);
  s.accumulate(t.ids, k);
  cache.emplace_back(E * 1000 + k, std::move(s));
  return cache.back().second;
}

void set_rate(benchmark::State& state, int E) {
  state.counters["experts/s"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * E, benchmark::Counter::kIsRate);
}

weave::topology topo_for(int D) {
  return D <= 8 ? weave::topology::flat(D) : weave::topology::grid(D / 8, 8);
}

void BM_contiguous(benchmark::State& state) {
  const int E = static_cast<int>(state.range(0)), D = static_cast<int>(state.range(1));
  for (auto _ : state)
    benchmark::DoNotOptimize(weave::place_contiguous(E, topo_for(D)));
  set_rate(state, E);
}

void BM_load_balanced(benchmark::State& state) {
  const int E = static_cast<int>(state.range(0)), D = static_cast<int>(state.range(1));
  const auto& s = stats_for(E, 8);
  for (auto _ : state)
    benchmark::DoNotOptimize(weave::place_load_balanced(s, topo_for(D)));
  set_rate(state, E);
}

void BM_collaborative(benchmark::State& state) {
  const int E = static_cast<int>(state.range(0)), D = static_cast<int>(state.range(1));
  const auto& s = stats_for(E, 8);
  for (auto _ : state)
    benchmark::DoNotOptimize(weave::place_collaborative(s, topo_for(D)));
  set_rate(state, E);
}

void BM_replicated(benchmark::State& state) {
  const int E = static_cast<int>(state.range(0)), D = static_cast<int>(state.range(1));
  const auto& s = stats_for(E, 8);
  weave::replication_options o;
  o.redundant_slots = D;
  for (auto _ : state)
    benchmark::DoNotOptimize(weave::place_replicated(s, topo_for(D), o));
  set_rate(state, E);
}

// The same number of spare slots as BM_replicated, as a per-device list: two on every even
// device, none on odd ones (unequal capacities, empty slots padding the smaller devices).
void BM_replicated_spare_list(benchmark::State& state) {
  const int E = static_cast<int>(state.range(0)), D = static_cast<int>(state.range(1));
  const auto& s = stats_for(E, 8);
  weave::replication_options o;
  for (int d = 0; d < D; ++d)
    o.spare_slots_per_device.push_back(d % 2 == 0 ? 2 : 0);
  for (auto _ : state)
    benchmark::DoNotOptimize(weave::place_replicated(s, topo_for(D), o));
  set_rate(state, E);
}

void BM_migration(benchmark::State& state) {
  const int E = static_cast<int>(state.range(0)), D = static_cast<int>(state.range(1));
  const auto topo = topo_for(D);
  const auto cur = weave::place_contiguous(E, topo);
  const auto next = weave::place_collaborative(stats_for(E, 8), topo);
  for (auto _ : state)
    benchmark::DoNotOptimize(weave::plan_migration(cur, next, topo));
  set_rate(state, E);
}

void BM_evaluate(benchmark::State& state) {
  const int E = static_cast<int>(state.range(0)), D = static_cast<int>(state.range(1));
  weave::trace_options o;
  o.num_experts = E;
  o.k = 8;
  o.tokens = 10000;
  const auto t = weave::generate_trace(o);
  const auto topo = topo_for(D);
  const auto p = weave::place_contiguous(E, topo);
  for (auto _ : state)
    benchmark::DoNotOptimize(weave::evaluate_placement(p, topo, t.ids, 8));
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * static_cast<double>(o.tokens),
                         benchmark::Counter::kIsRate);
}

// 58 layers of 256 expert loads, Zipf 1.0 and lognormal(0, 1) in turn, shuffled.
const std::vector<double>& model_loads() {
  static const std::vector<double> loads = [] {
    std::mt19937 rng(58);
    std::vector<double> all;
    for (int l = 0; l < 58; ++l) {
      std::vector<double> layer(256);
      std::lognormal_distribution<double> lognormal(0.0, 1.0);
      for (int e = 0; e < 256; ++e)
        layer[static_cast<std::size_t>(e)] = l % 2 ? 1000.0 / (e + 1.0) : lognormal(rng);
      std::shuffle(layer.begin(), layer.end(), rng);
      all.insert(all.end(), layer.begin(), layer.end());
    }
    return all;
  }();
  return loads;
}

// Arg: 0 = from-scratch packing (the reference), 1 = incremental, layer by layer.
void BM_model_replicated(benchmark::State& state) {
  const auto& loads = model_loads();
  const auto topo = weave::topology::grid(8, 8);
  weave::replication_options o;
  o.redundant_slots = 64;
  for (auto _ : state)
    for (std::size_t l = 0; l < 58; ++l) {
      const std::span<const double> layer(loads.data() + l * 256, 256);
      if (state.range(0) == 0)
        benchmark::DoNotOptimize(replication_reference::place_replicated(layer, {}, topo, o));
      else
        benchmark::DoNotOptimize(weave::place_replicated(layer, topo, o));
    }
  state.counters["layers/s"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * 58, benchmark::Counter::kIsRate);
}

// All 58 layers in one `place_replicated_layers` call on Arg threads.
void BM_model_replicated_layers(benchmark::State& state) {
  const auto topo = weave::topology::grid(8, 8);
  weave::layer_replication_options o;
  o.layer.redundant_slots = 64;
  o.threads = static_cast<int>(state.range(0));
  for (auto _ : state)
    benchmark::DoNotOptimize(weave::place_replicated_layers(model_loads(), 256, topo, o));
  state.counters["layers/s"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * 58, benchmark::Counter::kIsRate);
}

} // namespace

BENCHMARK(BM_contiguous)->Args({64, 8})->Args({256, 32});
BENCHMARK(BM_load_balanced)->Args({64, 8})->Args({256, 32})->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_collaborative)->Args({64, 8})->Args({256, 32})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_replicated)->Args({64, 8})->Args({256, 32})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_replicated_spare_list)->Args({64, 8})->Args({256, 32})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_migration)->Args({64, 8})->Args({256, 32})->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_evaluate)->Args({64, 8})->Args({256, 32})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_model_replicated)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_model_replicated_layers)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();

BENCHMARK_MAIN();
