// local_world all-to-all against memcpy bandwidth, in the same binary and the same threads:
// the baseline copies each rank's receive volume with one memcpy per rank on the same kind of
// host_stream, which is the most a shared-memory exchange can move. Arguments: ranks, bytes per
// rank, traffic (0 uniform, 1 skewed). Counters follow nccl-tests (algbw, busbw in GB/s).
// `count_exchange`: a plain count exchange beside the status-carrying one of weave's layers.
#include <benchmark/benchmark.h>

#include "traffic.hpp"

#include <weave/comm/local_world.hpp>
#include <weave/comm/status_exchange.hpp>

#include <chrono>
#include <cstring>
#include <memory>
#include <vector>

namespace {

using comm_bench::traffic;

struct setup {
  int n;
  std::vector<std::vector<std::int64_t>> counts;
  std::vector<comm_bench::layout> layouts;
  std::vector<std::vector<std::byte>> send, recv;
  std::vector<std::unique_ptr<weave::host_stream>> streams;

  explicit setup(const benchmark::State& state)
      : n(static_cast<int>(state.range(0)))
      , counts(comm_bench::pattern(n, state.range(1), static_cast<traffic>(state.range(2)))) {
    for (int r = 0; r < n; ++r) {
      layouts.push_back(comm_bench::layout_of(counts, r));
      send.emplace_back(std::size_t(layouts.back().send_bytes), std::byte{1});
      recv.emplace_back(std::size_t(layouts.back().recv_bytes), std::byte{0});
      streams.push_back(std::make_unique<weave::host_stream>("rank"));
    }
  }

  void report(benchmark::State& state) const {
    const double bytes = static_cast<double>(comm_bench::volume(counts));
    state.counters["algbw_GBps"] =
        benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
    state.counters["busbw_GBps"] = benchmark::Counter(
        bytes * 1e-9 * (n - 1) / n, benchmark::Counter::kIsIterationInvariantRate);
    state.counters["bytes_per_rank"] = bytes;
    state.counters["bytes_per_peer"] = bytes / n;
  }
};

void local_world_all_to_all_v(benchmark::State& state) {
  setup S(state);
  weave::local_world world(S.n);
  for (auto _ : state) {
    for (int r = 0; r < S.n; ++r) {
      const auto& L = S.layouts[std::size_t(r)];
      world.comm(r).all_to_all_v(*S.streams[std::size_t(r)], S.send[std::size_t(r)].data(),
                                 L.send_counts, L.send_displs, S.recv[std::size_t(r)].data(),
                                 L.recv_counts, L.recv_displs);
    }
    for (auto& s : S.streams)
      s->synchronize();
  }
  S.report(state);
}

// Baseline: every rank copies its whole receive volume in one memcpy, on its own stream.
void memcpy_baseline(benchmark::State& state) {
  setup S(state);
  std::vector<std::vector<std::byte>> source(S.recv.size());
  for (std::size_t r = 0; r < S.recv.size(); ++r)
    source[r].assign(S.recv[r].size(), std::byte{2});
  for (auto _ : state) {
    for (std::size_t r = 0; r < S.recv.size(); ++r)
      S.streams[r]->submit([&, r] {
        std::memcpy(S.recv[r].data(), source[r].data(), S.recv[r].size());
        benchmark::ClobberMemory();
      });
    for (auto& s : S.streams)
      s->synchronize();
  }
  S.report(state);
}

// Overlap on an emulated link (0.1 GB/s, 50 us per message; 1 MiB per rank): mode 0 runs only
// the exchange on a comm stream per rank, mode 1 only a compute loop on a compute stream per
// rank, mode 2 both at once. Exposed communication = time(2) - time(1); hidden = 1 - exposed /
// time(0). The link sleeps, but the copies and wake-ups still need a core.
void local_world_overlap(benchmark::State& state) {
  const int n = 2;
  const std::int64_t per_rank = std::int64_t(1) << 20;
  const auto mode = state.range(0);
  weave::local_world_options options;
  options.link = weave::emulated_link::gbps(0.1, std::chrono::microseconds(50));
  weave::local_world world(n, options);
  const auto counts = comm_bench::pattern(n, per_rank, traffic::uniform);
  std::vector<comm_bench::layout> layouts;
  std::vector<std::vector<std::byte>> send, recv;
  std::vector<std::unique_ptr<weave::host_stream>> comm, compute;
  std::vector<double> sink(n);
  for (int r = 0; r < n; ++r) {
    layouts.push_back(comm_bench::layout_of(counts, r));
    send.emplace_back(std::size_t(layouts.back().send_bytes), std::byte{1});
    recv.emplace_back(std::size_t(layouts.back().recv_bytes), std::byte{0});
    comm.push_back(std::make_unique<weave::host_stream>("comm"));
    compute.push_back(std::make_unique<weave::host_stream>("compute"));
  }
  for (auto _ : state) {
    for (int r = 0; r < n; ++r) {
      const auto& L = layouts[std::size_t(r)];
      if (mode != 1)
        world.comm(r).all_to_all_v(*comm[std::size_t(r)], send[std::size_t(r)].data(),
                                   L.send_counts, L.send_displs, recv[std::size_t(r)].data(),
                                   L.recv_counts, L.recv_displs);
      if (mode != 0)
        compute[std::size_t(r)]->submit([&sink, r] {
          double x = 1.0;
          for (int i = 0; i < 1500000; ++i)
            x = x * 1.0000001 + 1e-9;
          sink[std::size_t(r)] += x;
        });
    }
    for (int r = 0; r < n; ++r) {
      comm[std::size_t(r)]->synchronize();
      compute[std::size_t(r)]->synchronize();
    }
  }
  benchmark::DoNotOptimize(sink);
  state.counters["modeled_comm_us"] =
      double(options.link.transfer_time(per_rank / n).count()) * 1e-3;
}

// A chunk's count exchange (one count per peer) as the exchanges ran it before they carried a
// status (`plain`, the baseline) and with every rank's status beside the counts
// (`with_status`): what the fail-stop status costs each chunk on the success path.
void count_exchange(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0));
  const bool with_status = state.range(1) != 0;
  weave::local_world world(n);
  std::vector<std::unique_ptr<weave::host_stream>> streams;
  std::vector<weave::counts_with_status<weave::local_communicator>> status;
  std::vector<weave::status_block> blocks;
  std::vector<std::vector<std::int64_t>> send, recv;
  for (int r = 0; r < n; ++r) {
    streams.push_back(std::make_unique<weave::host_stream>("rank"));
    status.emplace_back(n, r, 1, "bench");
    blocks.push_back(status.back().make_block());
    send.emplace_back(std::size_t(n), r + 1);
    recv.emplace_back(std::size_t(n), 0);
  }
  for (auto _ : state) {
    for (int r = 0; r < n; ++r) {
      const auto i = std::size_t(r);
      if (with_status)
        status[i].exchange(world.comm(r), *streams[i], blocks[i], send[i], recv[i]);
      else
        world.comm(r).exchange_counts(*streams[i], send[i], recv[i]);
    }
    for (auto& s : streams)
      s->synchronize();
  }
}

} // namespace

// Each (ranks, bytes, traffic) point runs the baseline and weave back to back, so that the ratio
// is measured under the same machine load.
int main(int argc, char** argv) {
  for (int n : {2, 4})
    for (int t : {0, 1})
      for (int shift : {10, 14, 18, 20, 22, 24, 26, 28})
        for (auto* b :
             {benchmark::RegisterBenchmark("memcpy_baseline", memcpy_baseline),
              benchmark::RegisterBenchmark("local_world_all_to_all_v", local_world_all_to_all_v)})
          b->Args({n, std::int64_t(1) << shift, t})
              ->ArgNames({"ranks", "bytes", "skewed"})
              ->UseRealTime()
              ->Unit(benchmark::kMicrosecond);
  for (int n : {2, 4})
    for (int with_status : {0, 1})
      benchmark::RegisterBenchmark("count_exchange", count_exchange)
          ->Args({n, with_status})
          ->ArgNames({"ranks", "with_status"})
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
  for (int mode : {0, 1, 2})
    benchmark::RegisterBenchmark("local_world_overlap", local_world_overlap)
        ->Arg(mode)
        ->ArgName("mode")
        ->UseRealTime()
        ->Unit(benchmark::kMicrosecond);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv))
    return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
