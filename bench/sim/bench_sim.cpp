// The cluster simulator measured two ways, each beside its baseline in the same run:
//  1. simulator cost vs ranks (8..4096 GPUs, 64 layers, E = max(64, ranks)), and one layer's
//     traffic: weave's linear-memory pass (flat and 2DH volumes) beside a brute-force pass that
//     fills the dense rank × rank byte matrix and folds it into the flat volumes (up to 1024
//     ranks: at 4096 the matrix would be 128 MiB);
//  2. predicted vs measured all-to-all time: the dispatch volumes the simulator predicts for a
//     small cluster (2 nodes × 2 GPUs) exchanged for real by local_world with emulated links
//     (intra-node fast, inter-node slow, tens of ms per exchange), against the simulator's
//     per_peer prediction.
#include <benchmark/benchmark.h>

#include <weave/comm/communicator.hpp>
#include <weave/comm/local_world.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/placement.hpp>
#include <weave/sim.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace {

using namespace weave::sim;

moe_model scale_model(int ranks) {
  moe_model m;
  m.layers = 64;
  m.hidden = 4096;
  m.ffn_hidden = 1536;
  m.experts = std::max(64, ranks);
  m.k = 8;
  m.tokens_per_gpu = 8192;
  return m;
}

cluster scale_cluster(int ranks) {
  cluster c = cluster::h100(std::max(1, ranks / 8));
  if (ranks < 8) {
    c.nodes = 1;
    c.gpus_per_node = ranks;
  }
  return c;
}

// One whole simulation: 64 layers, 4 distinct routing pools, 256 sampled tokens per rank.
void BM_simulate(benchmark::State& state) {
  const int ranks = static_cast<int>(state.range(0));
  const cluster c = scale_cluster(ranks);
  const moe_model m = scale_model(ranks);
  const weave::placement p = weave::placement::contiguous(m.experts, ranks);
  routing_source src;
  src.distinct_layers = 4;
  src.synthetic.zipf = 0.8;
  sim_options o;
  o.pipeline_degree = 2;
  o.traffic.sample_tokens = 256;
  double step = 0;
  for (auto _ : state) {
    const sim_result r = simulate_cluster(c, m, p, src, o);
    benchmark::DoNotOptimize(r.layers.data());
    step = r.step_us;
  }
  state.counters["ranks"] = ranks;
  state.counters["step_ms"] = step / 1e3;
  state.counters["rank_layers/s"] = benchmark::Counter(static_cast<double>(ranks) * m.layers *
                                                           static_cast<double>(state.iterations()),
                                                       benchmark::Counter::kIsRate);
}
BENCHMARK(BM_simulate)->RangeMultiplier(2)->Range(8, 4096)->Unit(benchmark::kMillisecond);

// The traffic of one layer, weave's pass.
void BM_traffic_weave(benchmark::State& state) {
  const int ranks = static_cast<int>(state.range(0));
  const cluster c = scale_cluster(ranks);
  const moe_model m = scale_model(ranks);
  const weave::placement p = weave::placement::contiguous(m.experts, ranks);
  const weave::routing_trace pool = routing_pool({}, m, ranks, 256, 0);
  traffic_options o;
  o.sample_tokens = 256;
  for (auto _ : state)
    benchmark::DoNotOptimize(layer_traffic_of(c, m, p, pool, o).device_rows.data());
  state.counters["ranks"] = ranks;
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(ranks) * 256 * static_cast<double>(state.iterations()),
                         benchmark::Counter::kIsRate);
}
BENCHMARK(BM_traffic_weave)->RangeMultiplier(2)->Range(8, 4096)->Unit(benchmark::kMillisecond);

// Dense rank × rank byte matrix for the same tokens, then per-rank folds (the baseline).
std::vector<double> dense_traffic(const cluster& c, const moe_model& m, const weave::placement& p,
                                  const weave::routing_trace& pool, std::int64_t T) {
  const auto D = static_cast<std::size_t>(c.num_ranks());
  std::vector<double> bytes(D * D, 0.0);
  std::vector<char> seen(D);
  const double row = m.row_bytes() * static_cast<double>(m.tokens_per_gpu) / static_cast<double>(T);
  for (std::size_t r = 0; r < D; ++r)
    for (std::int64_t i = 0; i < T; ++i) {
      const auto t =
          (r * static_cast<std::size_t>(T) + static_cast<std::size_t>(i)) % pool.num_tokens();
      std::fill(seen.begin(), seen.end(), 0);
      for (const std::int32_t e : pool.token(t)) {
        const auto d = static_cast<std::size_t>(
            p.device_of_slot(p.slot_for(e, static_cast<std::size_t>(i), static_cast<int>(r))));
        if (d != r && !seen[d]) {
          seen[d] = 1;
          bytes[r * D + d] += row;
        }
      }
    }
  return bytes;
}

void BM_traffic_dense(benchmark::State& state) {
  const int ranks = static_cast<int>(state.range(0));
  const cluster c = scale_cluster(ranks);
  const moe_model m = scale_model(ranks);
  const weave::placement p = weave::placement::contiguous(m.experts, ranks);
  const weave::routing_trace pool = routing_pool({}, m, ranks, 256, 0);
  const auto D = static_cast<std::size_t>(ranks);
  for (auto _ : state) {
    const auto b = dense_traffic(c, m, p, pool, 256);
    // Fold into the same flat per-rank volumes weave's pass produces (2DH left out).
    std::vector<rank_volume> flat(D);
    for (std::size_t s = 0; s < D; ++s)
      for (std::size_t d = 0; d < D; ++d)
        if (b[s * D + d] > 0) {
          const bool same = c.node_of(static_cast<int>(s)) == c.node_of(static_cast<int>(d));
          flat[s].sent.add(same, b[s * D + d]);
          flat[d].received.add(same, b[s * D + d]);
        }
    benchmark::DoNotOptimize(flat.data());
  }
  state.counters["ranks"] = ranks;
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(ranks) * 256 * static_cast<double>(state.iterations()),
                         benchmark::Counter::kIsRate);
}
BENCHMARK(BM_traffic_dense)->RangeMultiplier(2)->Range(8, 1024)->Unit(benchmark::kMillisecond);

// Predicted vs measured dispatch all-to-all on local_world with emulated links.
void BM_local_world_vs_sim(benchmark::State& state) {
  cluster c;
  c.nodes = 2;
  c.gpus_per_node = 2;
  c.intra = {0.004, 1000.0}; // 4 MB/s, 1 ms
  c.inter = {0.001, 2000.0}; // 1 MB/s, 2 ms
  moe_model m;
  m.experts = 8;
  m.k = static_cast<int>(state.range(0));
  m.hidden = 512;
  m.tokens_per_gpu = 64;
  weave::trace_options to;
  to.num_experts = 8;
  to.k = m.k;
  to.tokens = 256;
  to.clusters = 2;
  const weave::routing_trace pool = weave::generate_trace(to);
  const weave::placement p = weave::placement::contiguous(8, 4);
  const auto bytes = dense_traffic(c, m, p, pool, m.tokens_per_gpu);
  sim_options so;
  so.links = link_model::per_peer;
  routing_source src;
  src.trace = pool;
  moe_model one = m;
  one.layers = 1;
  const double predicted_us = simulate_cluster(c, one, p, src, so).layers[0].dispatch_us;

  weave::local_world world(4);
  for (int s = 0; s < 4; ++s)
    for (int d = 0; d < 4; ++d)
      if (s != d) {
        const link_spec& l = c.link(s, d);
        world.set_link(s, d,
                       weave::emulated_link::gbps(
                           l.gbytes_per_s, std::chrono::nanoseconds(
                                               static_cast<std::int64_t>(l.latency_us * 1e3))));
      }
  std::vector<double> elapsed(4);
  double measured_sum = 0;
  for (auto _ : state) {
    world.run([&](weave::local_communicator& comm) {
      const int r = comm.rank();
      std::vector<std::int64_t> sc(4), sd(4), rc(4), rd(4);
      std::int64_t so_ = 0, ro = 0;
      for (int q = 0; q < 4; ++q) {
        sc[q] = static_cast<std::int64_t>(bytes[static_cast<std::size_t>(r * 4 + q)]);
        rc[q] = static_cast<std::int64_t>(bytes[static_cast<std::size_t>(q * 4 + r)]);
        sd[q] = so_;
        rd[q] = ro;
        so_ += sc[q];
        ro += rc[q];
      }
      std::vector<std::byte> send(static_cast<std::size_t>(so_)),
          recv(static_cast<std::size_t>(ro));
      weave::host_stream s;
      comm.barrier(s); // start together: thread start-up skew is not part of the exchange
      s.synchronize();
      const auto t0 = std::chrono::steady_clock::now();
      weave::all_to_all_v(comm, s, send.data(), sc, sd, recv.data(), rc, rd, 1);
      s.synchronize();
      elapsed[static_cast<std::size_t>(r)] =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    });
    const double measured = *std::max_element(elapsed.begin(), elapsed.end());
    measured_sum += measured;
    state.SetIterationTime(measured * 1e-6);
  }
  const double measured_mean = measured_sum / static_cast<double>(state.iterations());
  state.counters["predicted_ms"] = predicted_us / 1e3;
  state.counters["measured_ms"] = measured_mean / 1e3;
  state.counters["measured/predicted"] = measured_mean / predicted_us;
}
BENCHMARK(BM_local_world_vs_sim)
    ->Arg(1)
    ->Arg(2)
    ->Arg(4)
    ->UseManualTime()
    ->Iterations(5)
    ->Unit(benchmark::kMillisecond);

} // namespace

BENCHMARK_MAIN();
