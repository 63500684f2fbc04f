// Decode-sized MoE layers: the low-latency decode_exchange (one record per (token, device), counts
// in the message headers, two all-to-alls per layer) against the dynamic moe_exchange (count
// exchange, then routes and rows, then the combine: four collectives per layer), at 1, 8, 64 and
// 256 tokens per rank, registered side by side so one run measures them all. A third mode is the
// device decode exchange (`basic_device_decode_exchange`, the algorithm of `cuda_decode_exchange`)
// run on host streams: the protocol in DeepEP's per-slot layout with every step written for a GPU
// (no host wait inside the layer; the host waits once, in `check_errors`). A fourth is decode_exchange with its dispatch in
// FP8 (e4m3, one scale per 128 elements, dequantised on arrival).
//
// 4 in-process ranks, E = 32, k = 4, hidden 256 bf16 (moe_bench_setup.hpp), on an emulated link of
// 20 us per message and 25 GB/s per rank pair. The experts copy their input (no compute): the layer
// time is the exchange's alone. Each decode exchange is sized for its batch
// (max_tokens_per_rank = tokens), as an engine capturing one graph per batch-size bucket would
// size one exchange per bucket. Each iteration is one layer on every rank (the slowest rank's
// time, manual time); counters per rank and layer: collectives, messages (collectives times
// the 3 peers) and bytes sent to peers.
#include <benchmark/benchmark.h>

#include "moe_bench_setup.hpp"

#include <weave/comm/local_world.hpp>
#include <weave/core/dtype.hpp>
#include <weave/core/host_matrix.hpp>
#include <weave/exec/host_space.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/overlap/decode_exchange.hpp>
#include <weave/overlap/device_decode_exchange.hpp>
#include <weave/overlap/moe_exchange.hpp>
#include <weave/routing/host_quant_moves.hpp>
#include <weave/routing/host_row_moves.hpp>

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

using namespace moe_bench; // 4 ranks, E = 32, k = 4, hidden 256 bf16, random top-k rows

weave::emulated_link decode_link() {
  return {std::chrono::microseconds(20), 25e9};
}

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

enum class mode { dynamic = 0, decode = 1, device_decode = 2, decode_fp8 = 3 };

// Persistent ranks, each with its exchange and streams; `step()` runs one layer on all.
class layer_ranks {
 public:
  layer_ranks(mode m, std::size_t tokens)
      : world_(ranks, {std::chrono::seconds(60), decode_link()})
      , start_(ranks + 1)
      , done_(ranks + 1) {
    std::mt19937 rng(7);
    for (int r = 0; r < ranks; ++r)
      data_.push_back(make_rank_data(tokens, rng));
    for (int r = 0; r < ranks; ++r)
      threads_.emplace_back([this, r, m, tokens] { serve(r, m, tokens); });
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
  void serve(int r, mode m, std::size_t tokens) {
    counting_comm comm(world_.comm(r));
    const auto where = weave::placement::contiguous(experts, ranks);
    auto& d = data_[static_cast<std::size_t>(r)];
    weave::host_stream compute("compute"), stream("comm");
    if (m == mode::device_decode) {
      weave::basic_device_decode_exchange<weave::host_space, counting_comm, row_t> ex(
          comm, where, {k, hidden, tokens});
      const std::size_t bytes = ex.workspace_size();
      std::unique_ptr<std::byte, void (*)(std::byte*)> ws(
          static_cast<std::byte*>(::operator new (bytes, std::align_val_t{256})),
          [](std::byte* p) { ::operator delete (p, std::align_val_t{256}); });
      ex.initialize(ws.get(), bytes, stream);
      loop(r, comm, [&] {
        auto h = ex.dispatch(d.x.elements(), d.ids, d.weights, stream);
        stream.submit([xs = h.experts()] { // the experts, queued: no host wait mid-layer
          const std::size_t row = xs.hidden * sizeof(row_t);
          for (int l = 0; l < xs.local_experts; ++l)
            std::memcpy(xs.output_of(l), xs.input_of(l),
                        static_cast<std::size_t>(xs.rows[l]) * row);
        });
        ex.combine(h, d.y.elements(), stream);
        ex.check_errors(stream); // the one wait
      });
    } else if (m == mode::decode || m == mode::decode_fp8) {
      weave::decode_options o{k, hidden, tokens};
      if (m == mode::decode_fp8) // e4m3, 128-element blocks, dequantised for the experts
        o.fp8_dispatch = weave::fp8_dispatch_options{weave::dtype::e4m3, {}, true};
      weave::decode_exchange<counting_comm, row_t> ex(comm, where, o);
      loop(r, comm, [&] {
        auto h = ex.dispatch(d.x.elements(), d.ids, d.weights, stream);
        stream.submit([xs = h.experts()] { // the experts, queued: no host wait mid-layer
          for (int l = 0; l < xs.local_experts(); ++l)
            std::memcpy(xs.output(l).data(), xs.input(l).data(), xs.input(l).size_bytes());
        });
        ex.combine(h, d.y.elements(), stream);
        stream.synchronize();
      });
    } else {
      weave::moe_exchange<counting_comm> ex(comm, where, options(tokens, 1));
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
  const auto m = static_cast<mode>(state.range(0));
  const auto tokens = static_cast<std::size_t>(state.range(1));
  layer_ranks layer(m, tokens);
  layer.step(); // warm-up (first-touch of buffers)
  for (auto _ : state)
    state.SetIterationTime(layer.step());
  state.counters["collectives_per_layer"] = layer.collectives_per_layer();
  state.counters["messages_per_layer"] = layer.collectives_per_layer() * (ranks - 1);
  state.counters["peer_bytes_per_layer"] = layer.bytes_per_layer();
  state.SetLabel(m == mode::decode          ? "decode"
                 : m == mode::device_decode ? "device decode (host streams)"
                 : m == mode::decode_fp8    ? "decode, FP8 dispatch"
                                            : "dynamic");
}

} // namespace

BENCHMARK(moe_decode_layer)
    ->ArgNames({"decode", "tokens"})
    ->Apply([](benchmark::internal::Benchmark* b) {
      for (int tokens : {1, 8, 64, 256}) // each size's modes next to each other
        for (int decode : {0, 1, 2, 3})
          b->Args({decode, tokens});
    })
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond)
    ->Iterations(200);

BENCHMARK_MAIN();
