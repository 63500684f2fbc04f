// moe_exchange on an emulated link: pipelined (C chunks) against unpipelined (C = 1), in the
// same binary and run, at compute/communication ratios 0.25..4 (`moe_layer`); and a whole block
// (producer op, MoE layer, consumer op) unpartitioned, pipelined inside the layer only (Tutel),
// and with the producer and consumer partitioned into the layer's chunks (Lancet, chunk hooks)
// (`moe_block`).
//
// 4 in-process ranks, 2048 tokens/rank, E = 32, k = 4, hidden 256 (bf16). The link is
// 0.05 GB/s per rank pair (slow, so that the emulated costs dominate the CPU work of a 2-core
// machine); expert compute is emulated by sleeping a calibrated time per
// expert row, so `ratio` = (expert compute time) / (dispatch + combine link time). Each
// iteration is one forward on every rank; the reported time is rank 0's makespan (manual
// time), with counters: exposed_comm_ms (makespan - compute-stream busy time), compute_ms,
// comm_ms. Compare a ratio's C = 1 row with its C > 1 rows.
//
// `moe_call_overhead`: the same 4 ranks with no link and no expert time, 64 or 1024 tokens per
// rank, C = 1 or 4, one forward through the callback form (form 0) or two micro-batches through
// handles, both dispatched before either is computed (form 1): the time of a step is then the
// layer's own cost (planning, count exchanges, copies, stream hand-offs), which is where a change
// of the success path shows.
#include <benchmark/benchmark.h>

#include "moe_bench_setup.hpp"

#include <weave/comm/local_world.hpp>
#include <weave/core/host_matrix.hpp>
#include <weave/overlap/moe_exchange.hpp>
#include <weave/overlap/pipeline_timing.hpp>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

namespace {

using namespace moe_bench;
constexpr std::size_t tokens = 2048;

// What runs around the layer: nothing (the layer alone), a producer and a consumer outside the
// layer's pipeline, or the same two inside it as chunk hooks.
enum class around { nothing, whole, partitioned };

// Persistent ranks: each owns an exchange and streams; `step()` runs one forward on all.
class layer_ranks {
 public:
  layer_ranks(int chunks, double ratio, around mode = around::nothing)
      : world_(ranks, {std::chrono::seconds(60), link()})
      , start_(ranks + 1)
      , done_(ranks + 1) {
    std::mt19937 rng(7);
    for (int r = 0; r < ranks; ++r)
      data_.push_back(make_rank_data(tokens, rng));
    // Link time of one layer for rank 0: its largest per-peer volume, both ways.
    ns_per_row_ = 0; // calibrated after the first step from the plan's volumes
    ratio_ = ratio;
    mode_ = mode;
    for (int r = 0; r < ranks; ++r)
      threads_.emplace_back([this, r, chunks] { serve(r, chunks); });
  }

  ~layer_ranks() {
    stop_ = true;
    start_.arrive_and_wait();
    for (auto& t : threads_)
      t.join();
  }

  weave::pipeline_timing step() {
    start_.arrive_and_wait();
    done_.arrive_and_wait();
    return timing_;
  }

 private:
  // The producer and consumer stand-ins each sleep half the experts' time per token, so the
  // operators around the layer cost as much as its experts.
  void serve(int r, int chunks) {
    auto& comm = world_.comm(r);
    const weave::moe_options o = options(tokens, chunks);
    weave::moe_exchange<weave::local_communicator> ex(
        comm, weave::placement::contiguous(experts, ranks), o);
    weave::host_stream compute("compute"), stream("comm");
    auto& d = data_[static_cast<std::size_t>(r)];
    bool calibrated = false;
    for (;;) {
      start_.arrive_and_wait();
      if (stop_)
        return;
      const double ns = calibrated ? ns_per_row_.load() : 0.0;
      // Expert rows per token (k over the devices' copies) sets the around-ops' cost per token.
      const double around_ns =
          calibrated ? 0.5 * ns * static_cast<double>(expert_rows_) / static_cast<double>(tokens)
                     : 0.0;
      const weave::moe_chunk_hooks hooks{[&d, around_ns](std::size_t first, std::size_t count) {
                                           around_op(d.x, first, count, around_ns);
                                         },
                                         [&d, around_ns](std::size_t first, std::size_t count) {
                                           around_op(d.y, first, count, around_ns);
                                         }};
      const weave::host_event begin = compute.record();
      weave::host_event produced, consumed;
      if (mode_ == around::whole) {
        compute.submit([&] { around_op(d.x, 0, tokens, around_ns); });
        compute.record(produced);
      }
      ex.forward(
          d.x.view(), d.ids, d.weights, d.y.view(),
          [ns](const weave::expert_batch& b) {
            emulated_experts(b.input, b.output, b.expert_offsets, ns);
          },
          compute, stream, mode_ == around::partitioned ? &hooks : nullptr);
      const weave::host_event forwarded = compute.record();
      if (mode_ == around::whole) {
        compute.submit([&] { around_op(d.y, 0, tokens, around_ns); });
        compute.record(consumed);
      }
      const weave::host_event end = compute.record();
      compute.synchronize();
      stream.synchronize();
      if (!calibrated && r == 0) {
        // Dispatch + combine link time: the busiest peer's rows, each way, over the link.
        const weave::moe_stats st = ex.stats(compute);
        const double remote = static_cast<double>(st.sent_rows - st.local_rows) / (ranks - 1);
        const double link_s =
            2.0 * remote * static_cast<double>(st.row_bytes) / link_bytes_per_second;
        ns_per_row_ = ratio_ * link_s * 1e9 / static_cast<double>(st.expert_rows);
        expert_rows_ = static_cast<std::size_t>(st.expert_rows);
      }
      calibrated = true;
      if (r == 0) {
        // The block: from before the producer to after the consumer; compute busy includes
        // the around-ops wherever they ran.
        timing_ = weave::measure(ex.pipeline());
        using ms = std::chrono::duration<double, std::milli>;
        if (mode_ != around::nothing)
          timing_.makespan_ms = ms(end.completed_at() - begin.completed_at()).count();
        if (mode_ == around::whole)
          timing_.compute_busy_ms += ms(produced.completed_at() - begin.completed_at()).count() +
                                     ms(consumed.completed_at() - forwarded.completed_at()).count();
      }
      done_.arrive_and_wait();
    }
  }

  weave::local_world world_;
  std::vector<rank_data> data_;
  std::barrier<> start_, done_;
  std::vector<std::thread> threads_;
  std::atomic<double> ns_per_row_{0};
  double ratio_ = 1;
  around mode_ = around::nothing;
  std::size_t expert_rows_ = 0; // rank 0's expert rows per layer (calibration)
  std::atomic<bool> stop_{false};
  weave::pipeline_timing timing_;
};

void run_steps(benchmark::State& state, layer_ranks& layer, int chunks, double ratio);

// The layer's own cost per step, with no link and no expert time (the experts copy their rows).
// Persistent ranks as in `layer_ranks`; each step is one forward on every rank (form 0) or two
// micro-batches' forwards through handles (form 1), timed on rank 0 from its start to both of
// its streams drained.
class overhead_ranks {
 public:
  overhead_ranks(int chunks, std::size_t tokens_per_rank, int form)
      : world_(ranks)
      , start_(ranks + 1)
      , done_(ranks + 1) {
    for (int r = 0; r < ranks; ++r)
      threads_.emplace_back(
          [this, r, chunks, tokens_per_rank, form] { serve(r, chunks, tokens_per_rank, form); });
  }
  ~overhead_ranks() {
    stop_ = true;
    start_.arrive_and_wait();
    for (auto& t : threads_)
      t.join();
  }
  double step_seconds() {
    start_.arrive_and_wait();
    done_.arrive_and_wait();
    return seconds_;
  }

 private:
  void serve(int r, int chunks, std::size_t n, int form) {
    weave::moe_options o = options(n, chunks);
    o.max_in_flight = 2;
    using exchange = weave::moe_exchange<weave::local_communicator>;
    exchange ex(world_.comm(r), weave::placement::contiguous(experts, ranks), o);
    weave::host_stream compute("compute"), stream("comm");
    std::mt19937 rng(11 + static_cast<unsigned>(r));
    rank_data a = make_rank_data(n, rng), b = make_rank_data(n, rng);
    const auto copy = [](const weave::expert_batch& e) {
      emulated_experts(e.input, e.output, e.expert_offsets, 0.0);
    };
    for (;;) {
      start_.arrive_and_wait();
      if (stop_)
        return;
      const auto begin = std::chrono::steady_clock::now();
      if (form == 0) {
        ex.forward(a.x.view(), a.ids, a.weights, a.y.view(), copy, compute, stream);
      } else { // b's dispatch runs under a's experts (DualPipe's order)
        exchange::handle ha = ex.dispatch(a.x.view(), a.ids, a.weights, compute, stream);
        exchange::handle hb = ex.dispatch(b.x.view(), b.ids, b.weights, compute, stream);
        for (exchange::handle* h : {&ha, &hb}) {
          for (const exchange::chunk c : ex.chunks(*h))
            compute.submit([c, copy] { copy(c.experts()); });
          ex.combine(*h, (h == &ha ? a : b).y.view(), compute, stream);
        }
      }
      compute.synchronize();
      stream.synchronize();
      if (r == 0)
        seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
      done_.arrive_and_wait();
    }
  }

  weave::local_world world_;
  std::barrier<> start_, done_;
  std::vector<std::thread> threads_;
  std::atomic<bool> stop_{false};
  double seconds_ = 0;
};

void moe_call_overhead(benchmark::State& state) {
  overhead_ranks layer(static_cast<int>(state.range(0)), static_cast<std::size_t>(state.range(1)),
                       static_cast<int>(state.range(2)));
  for (int warm = 0; warm < 3; ++warm)
    layer.step_seconds();
  for (auto _ : state)
    state.SetIterationTime(layer.step_seconds());
  state.counters["chunks"] = static_cast<double>(state.range(0));
  state.counters["tokens"] = static_cast<double>(state.range(1));
  state.counters["form"] = static_cast<double>(state.range(2));
}

void moe_layer(benchmark::State& state) {
  const int chunks = static_cast<int>(state.range(0));
  const double ratio = static_cast<double>(state.range(1)) / 100.0;
  layer_ranks layer(chunks, ratio);
  run_steps(state, layer, chunks, ratio);
}

// A block at experts/comm ratio `ratio_pct`, the producer and consumer together costing as much
// as the experts. mode 0: unpartitioned (around-ops on the whole batch, the layer with C
// chunks; C = 1 is the baseline), mode 1: the around-ops as chunk hooks (Lancet).
void moe_block(benchmark::State& state) {
  const int chunks = static_cast<int>(state.range(0));
  const double ratio = static_cast<double>(state.range(1)) / 100.0;
  const auto mode = state.range(2) == 0 ? around::whole : around::partitioned;
  layer_ranks layer(chunks, ratio, mode);
  run_steps(state, layer, chunks, ratio);
  state.counters["partitioned"] = state.range(2) == 0 ? 0 : 1;
}

void run_steps(benchmark::State& state, layer_ranks& layer, int chunks, double ratio) {
  layer.step(); // calibrate the emulated compute
  layer.step(); // warm up at the calibrated cost
  double exposed = 0, compute = 0, comm = 0;
  for (auto _ : state) {
    const auto t = layer.step();
    state.SetIterationTime(t.makespan_ms / 1e3);
    exposed += t.exposed_comm_ms();
    compute += t.compute_busy_ms;
    comm += t.comm_busy_ms;
  }
  const auto n = static_cast<double>(state.iterations());
  state.counters["exposed_comm_ms"] = exposed / n;
  state.counters["compute_ms"] = compute / n;
  state.counters["comm_ms"] = comm / n;
  state.counters["chunks"] = chunks;
  state.counters["ratio"] = ratio;
}

} // namespace

BENCHMARK(moe_layer)
    ->ArgNames({"chunks", "ratio_pct"})
    ->ArgsProduct({{1, 2, 4, 8}, {25, 50, 100, 200, 400}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(5);

BENCHMARK(moe_block)
    ->ArgNames({"chunks", "ratio_pct", "partitioned"})
    ->Args({1, 100, 0})
    ->Args({4, 100, 0})
    ->Args({8, 100, 0})
    ->Args({4, 100, 1})
    ->Args({8, 100, 1})
    ->Args({1, 50, 0})
    ->Args({8, 50, 0})
    ->Args({8, 50, 1})
    ->Args({1, 200, 0})
    ->Args({8, 200, 0})
    ->Args({8, 200, 1})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(5);

BENCHMARK(moe_call_overhead)
    ->ArgNames({"chunks", "tokens", "form"})
    ->ArgsProduct({{1, 4}, {64, 1024}, {0, 1}})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->MinTime(1.0);

BENCHMARK_MAIN();
