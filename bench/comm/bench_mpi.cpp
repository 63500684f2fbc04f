// weave's MPI all-to-all (mpi_communicator: MPI_Ialltoallv progressed on a host_stream) against
// raw blocking MPI_Alltoallv, in the same run, under mpirun. Every rank runs the same fixed
// number of iterations; each iteration starts after a barrier and its time is the slowest
// rank's (MPI_Allreduce max), reported through manual timing. Only rank 0 reports.
// Arguments: bytes per rank, traffic (0 uniform, 1 skewed).
#include <benchmark/benchmark.h>

#include "traffic.hpp"

#include <weave/comm/mpi_communicator.hpp>

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace {

using comm_bench::traffic;

int rank_of() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int size_of() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

struct setup {
  int n = size_of(), r = rank_of();
  std::vector<std::vector<std::int64_t>> counts;
  comm_bench::layout L;
  std::vector<int> sc, sd, rc, rd;
  std::vector<std::byte> send, recv;

  explicit setup(const benchmark::State& state)
      : counts(comm_bench::pattern(n, state.range(0), static_cast<traffic>(state.range(1))))
      , L(comm_bench::layout_of(counts, r))
      , sc(L.send_counts.begin(), L.send_counts.end())
      , sd(L.send_displs.begin(), L.send_displs.end())
      , rc(L.recv_counts.begin(), L.recv_counts.end())
      , rd(L.recv_displs.begin(), L.recv_displs.end())
      , send(std::size_t(L.send_bytes), std::byte{1})
      , recv(std::size_t(L.recv_bytes), std::byte{0}) {}

  template <class F>
  void time(benchmark::State& state, F&& op) {
    for (auto _ : state) {
      MPI_Barrier(MPI_COMM_WORLD);
      const auto start = std::chrono::steady_clock::now();
      op();
      double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      MPI_Allreduce(MPI_IN_PLACE, &seconds, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      state.SetIterationTime(seconds);
    }
    const double bytes = static_cast<double>(comm_bench::volume(counts));
    state.counters["algbw_GBps"] =
        benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
    state.counters["busbw_GBps"] = benchmark::Counter(
        bytes * 1e-9 * (n - 1) / n, benchmark::Counter::kIsIterationInvariantRate);
    state.counters["bytes_per_rank"] = bytes;
    state.counters["ranks"] = n;
  }
};

void raw_mpi_alltoallv(benchmark::State& state) {
  setup S(state);
  S.time(state, [&] {
    MPI_Alltoallv(S.send.data(), S.sc.data(), S.sd.data(), MPI_BYTE, S.recv.data(), S.rc.data(),
                  S.rd.data(), MPI_BYTE, MPI_COMM_WORLD);
  });
}

void weave_mpi_all_to_all_v(benchmark::State& state) {
  setup S(state);
  weave::mpi_communicator comm(MPI_COMM_WORLD);
  weave::host_stream stream("comm");
  S.time(state, [&] {
    comm.all_to_all_v(stream, S.send.data(), S.L.send_counts, S.L.send_displs, S.recv.data(),
                      S.L.recv_counts, S.L.recv_displs);
    stream.synchronize();
  });
}

} // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  const bool root = rank_of() == 0;
  // Only rank 0 writes output files; the others drop --benchmark_out*.
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i)
    if (root || std::string(argv[i]).rfind("--benchmark_out", 0) != 0)
      args.push_back(argv[i]);
  int count = static_cast<int>(args.size());
  for (int t : {0, 1})
    for (int shift : {10, 14, 18, 20, 22, 24, 26, 28}) {
      const std::int64_t bytes = std::int64_t(1) << shift;
      // Fixed iterations: every rank must run the same number of collectives.
      const auto iterations = std::clamp<std::int64_t>((std::int64_t(1) << 27) / bytes, 3, 400);
      for (auto* b :
           {benchmark::RegisterBenchmark("raw_mpi_alltoallv", raw_mpi_alltoallv),
            benchmark::RegisterBenchmark("weave_mpi_all_to_all_v", weave_mpi_all_to_all_v)})
        b->Args({bytes, t})
            ->ArgNames({"bytes", "skewed"})
            ->Iterations(iterations)
            ->UseManualTime()
            ->Unit(benchmark::kMicrosecond);
    }
  benchmark::Initialize(&count, args.data());
  struct silent : benchmark::BenchmarkReporter {
    bool ReportContext(const Context&) override { return true; }
    void ReportRuns(const std::vector<Run>&) override {}
  } quiet;
  if (root)
    benchmark::RunSpecifiedBenchmarks();
  else
    benchmark::RunSpecifiedBenchmarks(&quiet);
  benchmark::Shutdown();
  MPI_Finalize();
  return 0;
}
