// Timing of the placement policies beside the contiguous baseline, at OLMoE-like (E=64, D=8)
// and 256-expert (E=256, D=32) shapes, plus migration planning and CT evaluation.
//
//   bench_placement --benchmark_format=json

#include <benchmark/benchmark.h>

#include <weave/placement.hpp>

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

} // namespace

BENCHMARK(BM_contiguous)->Args({64, 8})->Args({256, 32});
BENCHMARK(BM_load_balanced)->Args({64, 8})->Args({256, 32})->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_collaborative)->Args({64, 8})->Args({256, 32})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_replicated)->Args({64, 8})->Args({256, 32})->Unit(benchmark::kMillisecond);
BENCHMARK(BM_migration)->Args({64, 8})->Args({256, 32})->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_evaluate)->Args({64, 8})->Args({256, 32})->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
