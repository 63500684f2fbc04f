// Decode-sized MoE layers: the low-latency decode_exchange (one record per (token, device), counts
// in the message headers, two all-to-alls per layer) against the dynamic moe_exchange (count
// exchange, then routes and rows, then the combine: four collectives per layer), registered side
// by side so one run measures them all. Modes: decode_exchange with DeepEP's per-pair combine
// (`partial_sums = false`: one combine row per (token, expert)); the same layer with cuda_space's
// control flow (`basic_decode_exchange<emulated_gpu_space, ...>`: the GPU's forms of the steps,
// host code at enqueue time, no host wait inside the layer, every message sent whole), per-pair
// too; decode_exchange with its dispatch in FP8 (e4m3, one scale per 128 elements, dequantised on
// arrival) and the default combine; then decode_exchange and its emulated CUDA path with the
// default combine (`partial_sums`: one row per (token, device), the dynamic exchange's sums);
// decode_exchange with the default combine and gathered inputs (the experts copy each row from
// where it arrived, no pool copy).
//
// 4 in-process ranks, k = 8, bf16 rows, uniform random top-k, on an emulated link of 5 or 20 us
// per message and 25 GB/s per rank pair; E = 32 and 256, hidden 256 and 2048, 1 to 512 tokens
// per rank. The experts copy their input (no compute): the layer time is the exchange's alone.
// Each decode exchange is sized for its batch (max_tokens_per_rank = tokens), as an engine
// capturing one graph per batch-size bucket would size one exchange per bucket. Each iteration
// is one layer on every rank (the slowest rank's time, manual time); counters per rank and
// layer: collectives, messages (collectives times the 3 peers) and bytes sent to peers.
#include <benchmark/benchmark.h>

#include "moe_bench_setup.hpp"

#include <weave/comm/local_world.hpp>
#include <weave/core/dtype.hpp>
#include <weave/core/host_matrix.hpp>
#include <weave/exec/emulated_gpu_space.hpp>
#include <weave/exec/host_space.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/overlap/decode_exchange.hpp>
#include <weave/overlap/moe_exchange.hpp>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstring>
#include <memory>
#include <new>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

namespace {

using moe_bench::rank_data;
using moe_bench::row_t;
constexpr int ranks = 4, k = 8;

// What one benchmark measures.
struct shape {
  int link_us = 20, experts = 32;
  std::size_t hidden = 256, tokens = 1;
};

// A local communicator that counts what this rank issues: collectives, and the bytes its
// all-to-alls send to other ranks (read on the stream, when the counts are final).
class counting_comm {
 public:
  using stream_type = weave::host_stream;
  explicit counting_comm(weave::local_communicator& c)
      : c_(&c) {}
  int rank() const { return c_->rank(); }
  int size() const { return c_->size(); }

  void all_to_all_v(weave::host_stream& s, const void* send, std::span<const std::int64_t> sc,
                    std::span<const std::int64_t> sd, void* recv, std::span<const std::int64_t> rc,
                    std::span<const std::int64_t> rd, std::size_t unit) {
    ++collectives;
    s.submit([this, sc, unit] {
      for (int p = 0; p < size(); ++p)
        if (p != rank())
          bytes += sc[static_cast<std::size_t>(p)] * static_cast<std::int64_t>(unit);
    });
    c_->all_to_all_v(s, send, sc, sd, recv, rc, rd, unit);
  }
  // The decode exchanges' dispatch: each message's occupied part (see decode.md, "Cost").
  void all_to_all_v_bounded(weave::host_stream& s, const void* send,
                            std::span<const std::int64_t> sc, std::span<const std::int64_t> sd,
                            void* recv, std::span<const std::int64_t> rc,
                            std::span<const std::int64_t> rd, std::span<std::int64_t> received,
                            std::size_t unit) {
    ++collectives;
    s.submit([this, sc, unit] {
      for (int p = 0; p < size(); ++p)
        if (p != rank())
          bytes += sc[static_cast<std::size_t>(p)] * static_cast<std::int64_t>(unit);
    });
    c_->all_to_all_v_bounded(s, send, sc, sd, recv, rc, rd, received, unit);
  }
  void exchange_counts(weave::host_stream& s, std::span<const std::int64_t> in,
                       std::span<std::int64_t> out) {
    ++collectives;
    bytes += static_cast<std::int64_t>(in.size() / static_cast<std::size_t>(size()) *
                                       static_cast<std::size_t>(size() - 1) * 8);
    c_->exchange_counts(s, in, out);
  }
  void abort(const std::string& reason) { c_->abort(reason); }

  std::atomic<std::int64_t> collectives{0}, bytes{0};

 private:
  weave::local_communicator* c_;
};

enum class mode {
  dynamic = 0,
  decode = 1,
  emulated_decode = 2,
  decode_fp8 = 3,
  decode_partial = 4,
  emulated_decode_partial = 5,
  decode_gathered = 6 // the default combine, the experts reading the rows where they arrived
};

// Persistent ranks, each with its exchange and streams; `step()` runs one layer on all.
class layer_ranks {
 public:
  layer_ranks(mode m, shape at)
      : world_(ranks, {std::chrono::seconds(60),
                       weave::emulated_link{std::chrono::microseconds(at.link_us), 25e9}})
      , start_(ranks + 1)
      , done_(ranks + 1) {
    std::mt19937 rng(7);
    for (int r = 0; r < ranks; ++r)
      data_.push_back(moe_bench::random_tokens(at.tokens, at.hidden, at.experts, k, rng));
    for (int r = 0; r < ranks; ++r)
      threads_.emplace_back([this, r, m, at] { serve(r, m, at); });
  }
  ~layer_ranks() {
    stop_ = true;
    start_.arrive_and_wait();
    for (auto& t : threads_)
      t.join();
  }

  // Seconds of the slowest rank's layer.
  double step() {
    seconds_ = 0;
    start_.arrive_and_wait();
    done_.arrive_and_wait();
    return seconds_.load();
  }
  double collectives_per_layer() const { return collectives_; }
  double bytes_per_layer() const { return bytes_; }

 private:
  void serve(int r, mode m, shape at) {
    counting_comm comm(world_.comm(r));
    const auto where = weave::placement::contiguous(at.experts, ranks);
    const std::size_t tokens = at.tokens, hidden = at.hidden;
    auto& d = data_[static_cast<std::size_t>(r)];
    weave::host_stream compute("compute"), stream("comm");
    if (m == mode::emulated_decode || m == mode::emulated_decode_partial) {
      weave::decode_options o{k, hidden, tokens};
      o.partial_sums = m == mode::emulated_decode_partial;
      weave::basic_decode_exchange<weave::emulated_gpu_space, counting_comm, row_t> ex(comm, where,
                                                                                       o);
      loop(r, comm, [&] {
        auto h = ex.dispatch(d.x.elements(), d.ids, d.weights, stream);
        stream.submit([xs = h.experts(), &o] { // the experts, queued: no host wait mid-layer
          moe_bench::copy_decode_experts(xs, false, o.hidden * sizeof(row_t));
        });
        ex.combine(h, d.y.elements(), stream);
        ex.synchronize(stream); // the one wait
      });
    } else if (m == mode::decode || m == mode::decode_fp8 || m == mode::decode_partial ||
               m == mode::decode_gathered) {
      weave::decode_options o{k, hidden, tokens};
      o.partial_sums = m != mode::decode;
      o.gathered_inputs = m == mode::decode_gathered;
      if (m == mode::decode_fp8) // e4m3, 128-element blocks, dequantised for the experts
        o.fp8_dispatch = weave::fp8_dispatch_options{weave::dtype::e4m3, {}, true};
      weave::decode_exchange<counting_comm, row_t> ex(comm, where, o);
      loop(r, comm, [&] {
        auto h = ex.dispatch(d.x.elements(), d.ids, d.weights, stream);
        stream.submit([xs = h.experts(), &o] { // the experts, queued: no host wait mid-layer
          moe_bench::copy_decode_experts(xs, o.gathered_inputs, o.hidden * sizeof(row_t));
        });
        ex.combine(h, d.y.elements(), stream);
        ex.synchronize(stream);
      });
    } else {
      weave::moe_options o;
      o.k = k;
      o.hidden = hidden;
      o.element = weave::dtype::bf16;
      o.max_tokens = tokens;
      weave::moe_exchange<counting_comm> ex(comm, where, o);
      loop(r, comm, [&] {
        ex.forward(d.x.view(), d.ids, d.weights, d.y.view(), moe_bench::copy_experts, compute,
                   stream);
        compute.synchronize();
        stream.synchronize();
      });
    }
  }

  template <class Layer>
  void loop(int r, counting_comm& comm, Layer layer) {
    for (int step = 0;; ++step) {
      start_.arrive_and_wait();
      if (stop_)
        return;
      const auto c0 = comm.collectives.load(), b0 = comm.bytes.load();
      const auto t0 = std::chrono::steady_clock::now();
      layer();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      double seen = seconds_.load(); // the slowest rank's time (reset by `step`)
      while (s > seen && !seconds_.compare_exchange_weak(seen, s)) {
      }
      if (r == 0 && step == 0) {
        collectives_ = static_cast<double>(comm.collectives.load() - c0);
        bytes_ = static_cast<double>(comm.bytes.load() - b0);
      }
      done_.arrive_and_wait();
    }
  }

  weave::local_world world_;
  std::vector<rank_data> data_;
  std::barrier<> start_, done_;
  std::vector<std::thread> threads_;
  std::atomic<double> seconds_{0};
  double collectives_ = 0, bytes_ = 0;
  std::atomic<bool> stop_{false};
};

void moe_decode_layer(benchmark::State& state) {
  const auto m = static_cast<mode>(state.range(4));
  const shape at{static_cast<int>(state.range(0)), static_cast<int>(state.range(1)),
                 static_cast<std::size_t>(state.range(2)),
                 static_cast<std::size_t>(state.range(3))};
  layer_ranks layer(m, at);
  layer.step(); // warm-up (first-touch of buffers)
  for (auto _ : state)
    state.SetIterationTime(layer.step());
  state.counters["collectives_per_layer"] = layer.collectives_per_layer();
  state.counters["messages_per_layer"] = layer.collectives_per_layer() * (ranks - 1);
  state.counters["peer_bytes_per_layer"] = layer.bytes_per_layer();
  state.SetLabel(m == mode::decode                    ? "decode, per-pair combine"
                 : m == mode::emulated_decode         ? "decode, CUDA's control flow, per-pair"
                 : m == mode::decode_fp8              ? "decode, FP8 dispatch"
                 : m == mode::decode_partial          ? "decode (default combine)"
                 : m == mode::emulated_decode_partial ? "decode, CUDA's control flow"
                 : m == mode::decode_gathered         ? "decode, gathered inputs"
                                                      : "dynamic");
}

} // namespace

// Bytes one layer sends to other ranks per rank (rank 0), counted, at more ranks than the timed
// runs: the decode layer's dispatch (its messages' occupied part, `all_to_all_v_bounded`) beside
// what its fixed messages would move whole, and both layers' totals. One layer: the counts are
// exact, the time is not the point.
void decode_bytes_by_ranks(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0)), experts = static_cast<int>(state.range(1));
  const auto tokens = static_cast<std::size_t>(state.range(2));
  const std::size_t hidden = 256;
  const auto where = weave::placement::contiguous(experts, n);
  std::vector<rank_data> data;
  std::mt19937 rng(7);
  for (int r = 0; r < n; ++r)
    data.push_back(moe_bench::random_tokens(tokens, hidden, experts, k, rng));
  std::int64_t dispatch = 0, decode = 0, dynamic = 0, whole = 0;
  for (auto _ : state) {
    weave::local_world world(n);
    world.run([&](weave::local_communicator& c) {
      counting_comm comm(c);
      auto& d = data[static_cast<std::size_t>(c.rank())];
      weave::host_stream compute("compute"), stream("comm");
      weave::decode_exchange<counting_comm, row_t> ex(comm, where, {k, hidden, tokens});
      const auto b0 = comm.bytes.load();
      auto h = ex.dispatch(d.x.elements(), d.ids, d.weights, stream);
      stream.synchronize();
      const auto b1 = comm.bytes.load();
      moe_bench::copy_decode_experts(h.experts(), false, hidden * sizeof(row_t));
      ex.combine(h, d.y.elements(), stream);
      stream.synchronize();
      const auto b2 = comm.bytes.load();
      weave::moe_options o;
      o.k = k;
      o.hidden = hidden;
      o.element = weave::dtype::bf16;
      o.max_tokens = tokens;
      weave::moe_exchange<counting_comm> dyn(comm, where, o);
      const auto b3 = comm.bytes.load();
      dyn.forward(d.x.view(), d.ids, d.weights, d.y.view(), moe_bench::copy_experts, compute,
                  stream);
      compute.synchronize();
      stream.synchronize();
      if (c.rank() == 0) {
        dispatch = b1 - b0;
        decode = b2 - b0;
        dynamic = comm.bytes.load() - b3;
        whole = static_cast<std::int64_t>(ex.dispatch_bytes_per_peer()) * (n - 1);
      }
    });
  }
  state.counters["dispatch_bytes"] = static_cast<double>(dispatch);
  state.counters["dispatch_bytes_whole"] = static_cast<double>(whole);
  state.counters["decode_bytes_per_layer"] = static_cast<double>(decode);
  state.counters["dynamic_bytes_per_layer"] = static_cast<double>(dynamic);
}

int main(int argc, char** argv) {
  for (const int n : {2, 4, 8, 16, 32})
    for (const int experts : {32, 256})
      benchmark::RegisterBenchmark("decode_bytes_by_ranks", decode_bytes_by_ranks)
          ->Args({n, experts, 64})
          ->ArgNames({"ranks", "experts", "tokens"})
          ->Iterations(1)
          ->Unit(benchmark::kMillisecond);
  for (const int link_us : {5, 20})
    for (const int experts : {32, 256})
      for (const int hidden : {256, 2048})
        for (const int tokens : {1, 8, 64, 256, 512})
          for (const int m : {0, 1, 2, 3, 4, 5, 6}) // each shape's modes next to each other
            benchmark::RegisterBenchmark("moe_decode_layer", moe_decode_layer)
                ->Args({link_us, experts, hidden, tokens, m})
                ->ArgNames({"link_us", "experts", "hidden", "tokens", "mode"})
                ->UseManualTime()
                ->Unit(benchmark::kMicrosecond)
                ->Iterations(tokens * hidden >= 64 * 2048 ? 30 : 200);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv))
    return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
