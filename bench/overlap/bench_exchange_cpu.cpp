// The MoE exchange's CPU cost on host streams at a training layer's shape: `moe_exchange` over
// an in-process world with no link and no expert time (the experts copy their rows), so a
// call's time is the layer's own work: planning, count exchanges, row moves, stream hand-offs.
// Hidden 1024 bf16, E = 64, k = 8; 2 or 4 ranks; 1024 or 4096 tokens per rank; 1 or 4 chunks.
// Each step is one forward on every rank (the callback form), timed on rank 0 from its start
// to both of its streams drained; outputs are checked against the tokens (each token's weights
// sum to 1, its experts copy, so y = x up to rounding: bf16 of a sum of k equal rows).
//
// It uses only the exchange's calls every version has had (construction, `forward`, the
// batch's rows and offsets), so the same file builds against an older weave's headers: two
// builds run alternately give the side-by-side table of docs/perf.md.
#include <benchmark/benchmark.h>

#include <weave/comm/local_world.hpp>
#include <weave/core/host_matrix.hpp>
#include <weave/overlap/moe_exchange.hpp>
#include <weave/placement/placement.hpp>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstring>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

namespace {

constexpr int experts = 64, k = 8;
constexpr std::size_t hidden = 1024;
using row_t = weave::bfloat16;

struct rank_data {
  weave::host_matrix<row_t> x, y;
  std::vector<std::int32_t> ids;
  std::vector<float> weights;
};

rank_data make_data(std::size_t tokens, std::mt19937& rng) {
  rank_data d{
      weave::host_matrix<row_t>(tokens, hidden), weave::host_matrix<row_t>(tokens, hidden), {}, {}};
  for (row_t& v : d.x.elements()) // powers of two: a sum of k equal rows times 1/k is exact
    v = row_t(static_cast<float>(1 << (rng() % 8)));
  std::vector<int> all(experts);
  for (int e = 0; e < experts; ++e)
    all[static_cast<std::size_t>(e)] = e;
  for (std::size_t t = 0; t < tokens; ++t) {
    std::shuffle(all.begin(), all.end(), rng);
    for (int j = 0; j < k; ++j) {
      d.ids.push_back(all[static_cast<std::size_t>(j)]);
      d.weights.push_back(1.0f / k);
    }
  }
  return d;
}

// Persistent ranks, each with its exchange and streams; `step()` runs one forward on all.
class ranks_running {
 public:
  ranks_running(int ranks, std::size_t tokens, int chunks)
      : world_(ranks)
      , start_(ranks + 1)
      , done_(ranks + 1) {
    for (int r = 0; r < ranks; ++r)
      threads_.emplace_back([this, r, ranks, tokens, chunks] { serve(r, ranks, tokens, chunks); });
  }
  ~ranks_running() {
    stop_ = true;
    start_.arrive_and_wait();
    for (auto& t : threads_)
      t.join();
  }
  double step_seconds() {
    start_.arrive_and_wait();
    done_.arrive_and_wait();
    if (!ok_)
      throw std::runtime_error("an output differs from its token");
    return seconds_;
  }

 private:
  void serve(int r, int ranks, std::size_t tokens, int chunks) {
    weave::moe_options o;
    o.k = k;
    o.hidden = hidden;
    o.element = weave::dtype::bf16;
    o.max_tokens = tokens;
    o.chunks = chunks;
    weave::moe_exchange<weave::local_communicator> ex(
        world_.comm(r), weave::placement::contiguous(experts, ranks), o);
    weave::host_stream compute("compute"), stream("comm");
    std::mt19937 rng(5 + static_cast<unsigned>(r));
    rank_data d = make_data(tokens, rng);
    const auto copy = [](const auto& b) {
      const auto rows = static_cast<std::size_t>(b.expert_offsets.back());
      std::memcpy(b.output.data(), b.input.data(), rows * b.input.row_bytes());
    };
    for (;;) {
      start_.arrive_and_wait();
      if (stop_)
        return;
      const auto begin = std::chrono::steady_clock::now();
      ex.forward(d.x.view(), d.ids, d.weights, d.y.view(), copy, compute, stream);
      compute.synchronize();
      stream.synchronize();
      if (r == 0)
        seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
      if (std::memcmp(d.x.data(), d.y.data(), tokens * hidden * sizeof(row_t)) != 0)
        ok_ = false;
      done_.arrive_and_wait();
    }
  }

  weave::local_world world_;
  std::barrier<> start_, done_;
  std::vector<std::thread> threads_;
  std::atomic<bool> stop_{false}, ok_{true};
  double seconds_ = 0;
};

void moe_exchange_cpu(benchmark::State& state) {
  ranks_running layer(static_cast<int>(state.range(0)), static_cast<std::size_t>(state.range(1)),
                      static_cast<int>(state.range(2)));
  for (int warm = 0; warm < 2; ++warm)
    layer.step_seconds();
  for (auto _ : state)
    state.SetIterationTime(layer.step_seconds());
  state.counters["ranks"] = static_cast<double>(state.range(0));
  state.counters["tokens"] = static_cast<double>(state.range(1));
  state.counters["chunks"] = static_cast<double>(state.range(2));
}

} // namespace

BENCHMARK(moe_exchange_cpu)
    ->ArgNames({"ranks", "tokens", "chunks"})
    ->ArgsProduct({{2, 4}, {1024, 4096}, {1, 4}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->MinTime(2.0);

BENCHMARK_MAIN();
