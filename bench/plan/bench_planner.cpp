// The overlap planner measured three ways, each beside its baseline in the same run:
//  1. planning time of weave's incremental DP vs the same DP evaluating every range from scratch,
//     on transformer-block graphs of 50..2000 ops;
//  2. exposed communication and makespan of no overlap, Tutel-style expert-only pipelining and
//     weave's whole-graph partitioning (simulated), plus dW scheduling in the backward pass;
//  3. predicted vs measured makespan of those schedules executed on host streams, compute ops as
//     calibrated sleeps and each a2a as an emulated transfer (peers rendezvous, then sleep
//     latency + bytes / bandwidth).
// Set WEAVE_TRACE_DIR to also write Chrome traces of the predicted and measured timelines.
#include <benchmark/benchmark.h>

#include <weave/comm/local_world.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/plan/dw_scheduler.hpp>
#include <weave/plan/executor.hpp>
#include <weave/plan/partition_planner.hpp>
#include <weave/plan/timeline.hpp>
#include <weave/plan/timeline_trace.hpp>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace weave::plan;

// ---------------------------------------------------------------------------------------------
// Transformer-block graphs. Relative costs of one MoE layer at full batch (microseconds, scaled
// by `scale`), shaped like a GPT-style MoE layer on a commodity cluster where the two a2as take
// about 35% of the serial step: attention dominates the dense part, experts the sparse one.
struct layer_ops {
  op_id dispatch, experts, combine;
};

struct moe_graph {
  graph g;
  std::vector<layer_ops> layers;
};

moe_graph transformer(std::size_t layers, double scale = 1.0,
                      std::optional<weave::plan::a2a_cost> a2a = std::nullopt) {
  const weave::plan::a2a_cost link =
      a2a.value_or(weave::plan::a2a_cost::from_bandwidth(30.0 * scale, 12.5));
  const double a2a_bytes = 11.0e6 * scale; // about 0.9 ms at 12.5 GB/s
  moe_graph m;
  graph& g = m.g;
  op_id prev = g.add_compute("embed", {10 * scale, 100 * scale});
  for (std::size_t l = 0; l < layers; ++l) {
    const op_id ln1 = g.add_compute("ln1", {5 * scale, 60 * scale}, {prev});
    const op_id attn = g.add_compute("attention", {20 * scale, 1200 * scale}, {ln1});
    const op_id proj = g.add_compute("attn_out", {10 * scale, 150 * scale}, {attn});
    const op_id gate = g.add_compute("gate", {15 * scale, 60 * scale}, {proj});
    const op_id disp = g.add_a2a("dispatch", a2a_bytes, link, {gate});
    const op_id ex = g.add_compute("experts", {30 * scale, 1500 * scale}, {disp});
    const op_id comb = g.add_a2a("combine", a2a_bytes, link, {ex});
    prev = g.add_compute("residual", {5 * scale, 80 * scale}, {comb, proj});
    m.layers.push_back({disp, ex, comb});
  }
  return m;
}

// Tutel: pipeline only dispatch -> experts -> combine, at the best overlap degree (Tutel's
// adaptive degree search, here by simulation).
partition_plan expert_only(const moe_graph& m, std::int64_t degree, double overhead) {
  const std::vector<op_id> order = m.g.topological_order();
  std::vector<std::size_t> pos(order.size());
  for (std::size_t i = 0; i < order.size(); ++i)
    pos[order[i]] = i;
  partition_plan p;
  p.order = order;
  p.chunk_overhead_us = overhead;
  std::size_t next = 0;
  for (const layer_ops& l : m.layers) {
    const std::size_t b = pos[l.dispatch], e = pos[l.combine] + 1;
    for (std::size_t i = next; i < b; ++i)
      p.ranges.push_back({i, i + 1, 1});
    p.ranges.push_back({b, e, degree});
    next = e;
  }
  for (std::size_t i = next; i < order.size(); ++i)
    p.ranges.push_back({i, i + 1, 1});
  return p;
}

partition_plan best_expert_only(const moe_graph& m, double overhead) {
  partition_plan best;
  double best_ms = std::numeric_limits<double>::infinity();
  for (std::int64_t d : {1, 2, 4, 8}) {
    partition_plan p = expert_only(m, d, overhead);
    const double ms = weave::plan::simulate(make_schedule(m.g, p)).makespan_us();
    if (ms < best_ms) {
      best_ms = ms;
      best = std::move(p);
    }
  }
  return best;
}

constexpr double chunk_overhead_us = 5.0;

// ---------------------------------------------------------------------------------------------
// 1. Planning time.

// Baseline: the same DP, but every t(j, i, n) evaluated from scratch instead of incrementally.
double naive_dp(const graph& g, std::int64_t max_parts, std::size_t max_len, double overhead) {
  const std::vector<op_id> ord = g.topological_order();
  const std::size_t n = ord.size();
  std::vector<std::size_t> pos(n);
  for (std::size_t i = 0; i < n; ++i)
    pos[ord[i]] = i;
  std::vector<double> best(n + 1, std::numeric_limits<double>::infinity());
  best[0] = 0;
  std::vector<double> end(max_len * static_cast<std::size_t>(max_parts));
  for (std::size_t i = 1; i <= n; ++i)
    for (std::size_t j = i > max_len ? i - max_len : 0; j < i; ++j)
      for (std::int64_t p = 1; p <= max_parts; ++p) {
        const auto pp = static_cast<std::size_t>(p);
        double free[2] = {0, 0};
        bool ok = true;
        for (std::size_t k = j; k < i && ok; ++k) {
          const op& o = g.ops()[ord[k]];
          if (p > 1 && !o.partitionable) {
            ok = false;
            break;
          }
          const double len = o.cost.at(1.0 / static_cast<double>(p)) + (p > 1 ? overhead : 0);
          double& f = free[static_cast<std::size_t>(stream_of(o.kind))];
          for (std::size_t c = 0; c < pp; ++c) {
            double ready = f;
            for (op_id d : o.deps)
              if (pos[d] >= j)
                ready = std::max(ready, end[(pos[d] - j) * pp + c]);
            f = ready + len;
            end[(k - j) * pp + c] = f;
          }
        }
        if (ok)
          best[i] = std::min(best[i], best[j] + std::max(free[0], free[1]));
      }
  return best[n];
}

void plan_weave(benchmark::State& state) {
  const std::size_t target = static_cast<std::size_t>(state.range(0));
  const moe_graph m = transformer(std::max<std::size_t>(1, (target - 1) / 8));
  double predicted = 0;
  for (auto _ : state) {
    const partition_plan p =
        plan_partitions(m.g, {.max_parts = 8, .chunk_overhead_us = chunk_overhead_us});
    predicted = p.predicted_us;
    benchmark::DoNotOptimize(p.ranges.data());
  }
  state.counters["ops"] = static_cast<double>(m.g.size());
  state.counters["ops_per_s"] =
      benchmark::Counter(static_cast<double>(m.g.size()) * static_cast<double>(state.iterations()),
                         benchmark::Counter::kIsRate);
  state.counters["predicted_ms"] = predicted / 1e3;
}

void plan_naive_dp_baseline(benchmark::State& state) {
  const std::size_t target = static_cast<std::size_t>(state.range(0));
  const moe_graph m = transformer(std::max<std::size_t>(1, (target - 1) / 8));
  const partition_plan reference =
      plan_partitions(m.g, {.max_parts = 8, .chunk_overhead_us = chunk_overhead_us});
  double predicted = 0;
  for (auto _ : state) {
    predicted = naive_dp(m.g, 8, 32, chunk_overhead_us);
    benchmark::DoNotOptimize(predicted);
  }
  state.counters["ops"] = static_cast<double>(m.g.size());
  state.counters["ops_per_s"] =
      benchmark::Counter(static_cast<double>(m.g.size()) * static_cast<double>(state.iterations()),
                         benchmark::Counter::kIsRate);
  state.counters["predicted_ms"] = predicted / 1e3;
  if (std::abs(predicted - reference.predicted_us) > 1e-6 * reference.predicted_us)
    state.SkipWithError("naive DP disagrees with plan_partitions");
}

// ---------------------------------------------------------------------------------------------
// 2. Exposed communication, simulated.

struct outcome {
  double makespan_us, exposed_us;
};

outcome simulated(const graph& g, const partition_plan& p, std::size_t ranks = 1) {
  const schedule s = make_schedule(g, p);
  const auto t = weave::plan::simulate(s, ranks);
  const auto st = weave::plan::analyze_worst(s, t);
  return {st.makespan_us, st.exposed_comm_us};
}

void exposed_comm_forward(benchmark::State& state) {
  const moe_graph m = transformer(static_cast<std::size_t>(state.range(0)));
  outcome none{}, tutel{}, ours{};
  double plan_us = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    const partition_plan p =
        plan_partitions(m.g, {.max_parts = 8, .chunk_overhead_us = chunk_overhead_us});
    plan_us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    none = simulated(m.g, partition_plan::unpartitioned(m.g.topological_order()));
    tutel = simulated(m.g, best_expert_only(m, chunk_overhead_us));
    ours = simulated(m.g, p);
  }
  state.counters["layers"] = static_cast<double>(state.range(0));
  state.counters["none_exposed_ms"] = none.exposed_us / 1e3;
  state.counters["tutel_exposed_ms"] = tutel.exposed_us / 1e3;
  state.counters["weave_exposed_ms"] = ours.exposed_us / 1e3;
  state.counters["tutel_less_exposed_pct"] = 100.0 * (1.0 - tutel.exposed_us / none.exposed_us);
  state.counters["weave_less_exposed_pct"] = 100.0 * (1.0 - ours.exposed_us / none.exposed_us);
  state.counters["none_makespan_ms"] = none.makespan_us / 1e3;
  state.counters["tutel_makespan_ms"] = tutel.makespan_us / 1e3;
  state.counters["weave_makespan_ms"] = ours.makespan_us / 1e3;
  state.counters["weave_speedup_vs_none"] = none.makespan_us / ours.makespan_us;
  state.counters["weave_speedup_vs_tutel"] = tutel.makespan_us / ours.makespan_us;
  state.counters["plan_us"] = plan_us;
}

// Backward pass of the same model, in the order autograd issues it: per layer (last first),
// combine_bwd a2a, then each linear's dX followed by its dW, then dispatch_bwd a2a, then the
// gate and attention the same way. Backward kernels cost about their forward op each for dX and
// dW. In this order the dW ops delay the dX that feeds the next a2a, and each a2a's consumer
// waits for it with nothing else to run.
graph backward(std::size_t layers) {
  const weave::plan::a2a_cost link = weave::plan::a2a_cost::from_bandwidth(30.0, 12.5);
  const double a2a_bytes = 11.0e6;
  graph g;
  op_id prev = g.add_compute("loss_grad", {10, 100});
  for (std::size_t l = 0; l < layers; ++l) {
    const op_id comb = g.add_a2a("combine_bwd", a2a_bytes, link, {prev});
    const op_id w2_dx = g.add_compute("experts_w2_dX", {15, 750}, {comb});
    g.add_weight_grad("experts_w2_dW", {15, 750}, {comb});
    const op_id w1_dx = g.add_compute("experts_w1_dX", {15, 750}, {w2_dx});
    g.add_weight_grad("experts_w1_dW", {15, 750}, {w2_dx});
    const op_id disp = g.add_a2a("dispatch_bwd", a2a_bytes, link, {w1_dx});
    const op_id gate_dx = g.add_compute("gate_dX", {15, 60}, {disp});
    g.add_weight_grad("gate_dW", {15, 60}, {disp});
    const op_id out_dx = g.add_compute("attn_out_dX", {10, 150}, {gate_dx});
    g.add_weight_grad("attn_out_dW", {10, 150}, {gate_dx});
    const op_id core_dx = g.add_compute("attention_core_dX", {20, 900}, {out_dx});
    const op_id qkv_dx = g.add_compute("qkv_dX", {10, 300}, {core_dx});
    g.add_weight_grad("qkv_dW", {10, 300}, {core_dx});
    prev = qkv_dx;
  }
  return g;
}

void exposed_comm_backward_dw(benchmark::State& state) {
  const graph g = backward(static_cast<std::size_t>(state.range(0)));
  outcome base{}, ours{};
  std::size_t moved = 0;
  for (auto _ : state) {
    const dw_result r = schedule_weight_grads(g);
    base = simulated(g, partition_plan::unpartitioned(g.topological_order()));
    ours = simulated(g, r.plan);
    moved = r.moved;
  }
  state.counters["layers"] = static_cast<double>(state.range(0));
  state.counters["default_exposed_ms"] = base.exposed_us / 1e3;
  state.counters["dw_exposed_ms"] = ours.exposed_us / 1e3;
  state.counters["dw_less_exposed_pct"] = 100.0 * (1.0 - ours.exposed_us / base.exposed_us);
  state.counters["default_makespan_ms"] = base.makespan_us / 1e3;
  state.counters["dw_makespan_ms"] = ours.makespan_us / 1e3;
  state.counters["dw_speedup"] = base.makespan_us / ours.makespan_us;
  state.counters["moved"] = static_cast<double>(moved);
}

// ---------------------------------------------------------------------------------------------
// 3. Predicted vs measured, on host streams.

// Sleeps overshoot by a roughly constant scheduler latency; measure it once and sleep that much
// less, against an absolute deadline so errors do not accumulate within a task.
double sleep_overshoot_us() {
  static const double value = [] {
    std::vector<double> v;
    for (int i = 0; i < 40; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      std::this_thread::sleep_for(std::chrono::microseconds(300));
      v.push_back(
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() -
          300.0);
    }
    std::sort(v.begin(), v.end());
    return std::max(0.0, v[v.size() / 2]);
  }();
  return value;
}

void calibrated_sleep(double us) {
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double, std::micro>(us));
  const double lead = sleep_overshoot_us();
  std::this_thread::sleep_until(deadline - std::chrono::duration_cast<std::chrono::nanoseconds>(
                                               std::chrono::duration<double, std::micro>(lead)));
}

// Emulated a2a link: every rank arrives (the collective's synchronisation), then the transfer
// takes latency + bytes / bandwidth of this chunk.
struct emulated_link {
  weave::plan::a2a_cost model;
  std::barrier<> peers;
  emulated_link(weave::plan::a2a_cost m, std::ptrdiff_t ranks)
      : model(m)
      , peers(ranks) {}
  void transfer(const op& o, const task& t, double extra_us) {
    peers.arrive_and_wait();
    calibrated_sleep(model.at(o.bytes * t.fraction) + extra_us);
  }
};

void write_traces(const graph& g, const schedule& s, const weave::plan::timeline& predicted,
                  const weave::plan::timeline& measured, const std::string& name) {
  const char* dir = std::getenv("WEAVE_TRACE_DIR");
  if (!dir)
    return;
  weave::trace_writer w;
  append_timeline(w, g, s, predicted, "predicted", 0);
  append_timeline(w, g, s, measured, "measured", 100);
  w.write_file(std::string(dir) + "/" + name + ".json");
}

// The three schedules compared: 0 no overlap, 1 Tutel-style expert-only pipelining, 2 weave.
partition_plan strategy_plan(const moe_graph& m, int strategy) {
  if (strategy == 0)
    return partition_plan::unpartitioned(m.g.topological_order());
  if (strategy == 1)
    return best_expert_only(m, chunk_overhead_us);
  return plan_partitions(m.g, {.max_parts = 4, .chunk_overhead_us = chunk_overhead_us});
}

const char* strategy_label(int strategy) {
  return strategy == 0 ? "no overlap" : strategy == 1 ? "expert-only (Tutel)" : "weave";
}

// A compute and a comm host stream per rank, owned here and lent to the executor.
struct rank_stream_set {
  std::vector<std::unique_ptr<weave::host_stream>> owned;
  std::vector<rank_streams<weave::host_stream>> streams;
  explicit rank_stream_set(std::size_t ranks) {
    for (std::size_t r = 0; r < ranks; ++r) {
      owned.push_back(std::make_unique<weave::host_stream>("compute"));
      owned.push_back(std::make_unique<weave::host_stream>("comm"));
      streams.push_back({owned[2 * r].get(), owned[2 * r + 1].get()});
    }
  }
};

void predicted_vs_measured(benchmark::State& state) {
  constexpr std::size_t ranks = 2;
  const int strategy = static_cast<int>(state.range(0)); // 0 none, 1 expert-only, 2 weave
  // ~15 ms per layer. Longer sleeps lose to other processes on a loaded machine (a woken sleeper
  // waits a whole time slice), shorter ones let each cross-stream hand-off's wake-up latency
  // (~0.1 ms there) weigh more; the median over runs discards the stalls.
  const double scale = 3.0;
  const moe_graph m = transformer(3, scale);
  const schedule s = make_schedule(m.g, strategy_plan(m, strategy));
  const auto predicted_t = weave::plan::simulate(s, ranks);
  const auto predicted = weave::plan::analyze_worst(s, predicted_t);

  rank_stream_set streams(ranks);
  schedule_executor<weave::host_stream> ex(m.g, s, streams.streams);
  emulated_link link(weave::plan::a2a_cost::from_bandwidth(30.0 * scale, 12.5), ranks);
  // Compute sleeps the op's cost at this fraction; the a2a's time comes from the link alone.
  auto compute = [](std::size_t, const op& o, const task& t) {
    calibrated_sleep(o.cost.at(t.fraction) + (t.chunks > 1 ? chunk_overhead_us : 0.0));
  };
  auto comm = [&](std::size_t, const op& o, const task& t) {
    link.transfer(o, t, t.chunks > 1 ? chunk_overhead_us : 0.0);
  };
  (void)sleep_overshoot_us();
  std::vector<double> makespans, exposed;
  for (auto _ : state) {
    const auto& t = ex.run(compute, comm);
    const auto st = weave::plan::analyze_worst(s, t);
    state.SetIterationTime(st.makespan_us / 1e6);
    makespans.push_back(st.makespan_us);
    exposed.push_back(st.exposed_comm_us);
    write_traces(m.g, s, predicted_t, t, "overlap_strategy" + std::to_string(strategy));
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double measured = median(makespans);
  state.counters["tasks"] = static_cast<double>(s.size());
  state.counters["predicted_ms"] = predicted.makespan_us / 1e3;
  state.counters["measured_median_ms"] = measured / 1e3;
  state.counters["error_pct"] = 100.0 * (measured / predicted.makespan_us - 1.0);
  state.counters["best_run_error_pct"] =
      100.0 * (*std::min_element(makespans.begin(), makespans.end()) / predicted.makespan_us - 1.0);
  state.counters["predicted_exposed_ms"] = predicted.exposed_comm_us / 1e3;
  state.counters["measured_exposed_median_ms"] = median(exposed) / 1e3;
  state.SetLabel(strategy_label(strategy));
}

// Cost-model fitting from measurements: time the emulated link at a sweep of sizes, as a2a
// microbenchmarks do, fit alpha-beta, and compare with the link's configured parameters.
void fit_emulated_link(benchmark::State& state) {
  const weave::plan::a2a_cost truth = weave::plan::a2a_cost::from_bandwidth(200.0, 5.0);
  emulated_link link(truth, 1);
  graph g;
  g.add_a2a("probe", 1.0, truth);
  const op& probe = g.at(0);
  std::vector<double> bytes, time;
  (void)sleep_overshoot_us();
  for (auto _ : state) {
    bytes.clear();
    time.clear();
    for (double b = 64e3; b <= 8e6; b *= 2)
      for (int rep = 0; rep < 3; ++rep) {
        task t;
        t.fraction = b; // probe.bytes is 1: the fraction carries the size
        const auto t0 = std::chrono::steady_clock::now();
        link.transfer(probe, t, 0.0);
        bytes.push_back(b);
        time.push_back(
            std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
                .count());
      }
  }
  const auto fit = weave::plan::fit_line(bytes, time);
  state.counters["alpha_us_true"] = truth.alpha_us;
  state.counters["alpha_us_fit"] = fit.intercept;
  state.counters["gbps_true"] = 1e-3 / truth.us_per_byte;
  state.counters["gbps_fit"] = 1e-3 / fit.slope;
  state.counters["rms_residual_us"] = fit.rms_residual;
}

// The a2a runs for real through weave's local_world: each rank sends an equal share of the op's
// bytes to every rank and waits for the exchange. The link is emulated (latency + bandwidth per
// rank pair, completion delayed by sleeping); payloads are scaled down `shrink` times over a
// link `shrink` times slower, so transfer times follow the cost model while the 2-core machine
// copies little.
struct world_link {
  static constexpr double shrink = 1000.0;
  std::size_t ranks;
  weave::local_world world;
  std::vector<std::unique_ptr<weave::host_stream>> streams;
  std::vector<std::vector<std::byte>> send, recv;

  world_link(weave::plan::a2a_cost model, std::size_t n, double max_bytes)
      : ranks(n)
      , world(static_cast<int>(n), link_options(model, n)) {
    const auto bytes = static_cast<std::size_t>(max_bytes / shrink) + n;
    for (std::size_t r = 0; r < n; ++r) {
      streams.push_back(std::make_unique<weave::host_stream>("a2a"));
      send.emplace_back(bytes);
      recv.emplace_back(bytes);
    }
  }

  static weave::local_world_options link_options(weave::plan::a2a_cost model, std::size_t n) {
    weave::local_world_options o;
    o.link.latency = std::chrono::nanoseconds(static_cast<std::int64_t>(model.alpha_us * 1e3));
    // Model: alpha + bytes * us_per_byte. A rank sends bytes / (n * shrink) to each peer in
    // parallel, so each pair runs at 1 / (us_per_byte * n * shrink) bytes per microsecond.
    o.link.bytes_per_second = 1e6 / (model.us_per_byte * static_cast<double>(n) * shrink);
    return o;
  }

  // Runs on rank r's comm stream thread (one thread per rank, so its operations stay ordered).
  void transfer(std::size_t r, const op& o, const task& t, double extra_us) {
    const auto per_peer =
        static_cast<std::int64_t>(o.bytes * t.fraction / static_cast<double>(ranks) / shrink);
    std::vector<std::int64_t> counts(ranks, per_peer), displs(ranks);
    for (std::size_t p = 0; p < ranks; ++p)
      displs[p] = static_cast<std::int64_t>(p) * per_peer;
    weave::host_stream& s = *streams[r];
    world.comm(static_cast<int>(r))
        .all_to_all_v(s, send[r].data(), counts, displs, recv[r].data(), counts, displs);
    s.synchronize();
    if (extra_us > 0)
      calibrated_sleep(extra_us);
  }
};

// Times local_world all-to-alls of `sizes` bytes over `link` (2 ranks, one thread each) and fits
// alpha-beta: the cost model as weave's own microbenchmark measures it, overheads included.
weave::plan::line_fit fit_world_link(world_link& link, const std::vector<double>& sizes) {
  graph g;
  g.add_a2a("probe", 1.0, weave::plan::a2a_cost{});
  const op& probe = g.at(0);
  std::vector<double> bytes, time;
  std::barrier<> start(2);
  for (double b : sizes) {
    std::vector<double> reps;
    for (int rep = 0; rep < 7; ++rep) {
      task t;
      t.fraction = b; // probe.bytes is 1: the fraction carries the size
      std::thread peer([&] {
        start.arrive_and_wait();
        link.transfer(1, probe, t, 0.0);
      });
      start.arrive_and_wait();
      const auto t0 = std::chrono::steady_clock::now();
      link.transfer(0, probe, t, 0.0);
      reps.push_back(
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
      peer.join();
    }
    std::sort(reps.begin(), reps.end()); // the median resists the stalls of a busy machine
    bytes.push_back(b);
    time.push_back(reps[reps.size() / 2]);
  }
  return weave::plan::fit_line(bytes, time);
}

// The whole loop on weave's own communicator: fit the a2a cost of local_world over an emulated
// link from microbenchmarks, plan with the fitted model, execute the schedule with real
// local_world all-to-alls, and compare the measured makespan with the prediction.
void predicted_vs_measured_local_world(benchmark::State& state) {
  constexpr std::size_t ranks = 2;
  const int strategy = static_cast<int>(state.range(0)); // 0 none, 1 expert-only, 2 weave
  const double scale = 3.0;
  const weave::plan::a2a_cost configured =
      weave::plan::a2a_cost::from_bandwidth(30.0 * scale, 12.5);
  const double full_bytes = 11.0e6 * scale;
  world_link link(configured, ranks, full_bytes);
  const auto fit =
      fit_world_link(link, {full_bytes / 8, full_bytes / 4, full_bytes / 2, full_bytes});
  // A machine busy enough to swamp the sweep can fit a negative term; costs cannot be negative.
  const weave::plan::a2a_cost fitted{std::max(0.0, fit.intercept), std::max(0.0, fit.slope)};
  const moe_graph m = transformer(3, scale, fitted);
  const schedule s = make_schedule(m.g, strategy_plan(m, strategy));
  const auto predicted = weave::plan::analyze_worst(s, weave::plan::simulate(s, ranks));
  rank_stream_set streams(ranks);
  schedule_executor<weave::host_stream> ex(m.g, s, streams.streams);
  auto compute = [](std::size_t, const op& o, const task& t) {
    calibrated_sleep(o.cost.at(t.fraction) + (t.chunks > 1 ? chunk_overhead_us : 0.0));
  };
  auto comm = [&](std::size_t r, const op& o, const task& t) {
    link.transfer(r, o, t, t.chunks > 1 ? chunk_overhead_us : 0.0);
  };
  std::vector<double> makespans;
  for (auto _ : state) {
    const auto st = weave::plan::analyze_worst(s, ex.run(compute, comm));
    state.SetIterationTime(st.makespan_us / 1e6);
    makespans.push_back(st.makespan_us);
  }
  std::sort(makespans.begin(), makespans.end());
  const double measured = makespans[makespans.size() / 2];
  state.counters["alpha_us_fit"] = fitted.alpha_us;
  state.counters["gbps_fit"] = 1e-3 / fitted.us_per_byte;
  state.counters["predicted_ms"] = predicted.makespan_us / 1e3;
  state.counters["measured_median_ms"] = measured / 1e3;
  state.counters["error_pct"] = 100.0 * (measured / predicted.makespan_us - 1.0);
  state.SetLabel(strategy_label(strategy));
}

} // namespace

BENCHMARK(predicted_vs_measured_local_world)
    ->DenseRange(0, 2)
    ->Iterations(9)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK(fit_emulated_link)->Iterations(1)->Unit(benchmark::kMillisecond);
BENCHMARK(plan_weave)
    ->Arg(50)
    ->Arg(100)
    ->Arg(200)
    ->Arg(500)
    ->Arg(1000)
    ->Arg(2000)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(plan_naive_dp_baseline)
    ->Arg(50)
    ->Arg(100)
    ->Arg(200)
    ->Arg(500)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(exposed_comm_forward)->Arg(1)->Arg(4)->Arg(12)->Arg(24)->Iterations(1);
BENCHMARK(exposed_comm_backward_dw)->Arg(1)->Arg(4)->Arg(12)->Arg(24)->Iterations(1);
BENCHMARK(predicted_vs_measured)
    ->Arg(0)
    ->Arg(1)
    ->Arg(2)
    ->Iterations(9)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
