// What the benchmarks run under mpirun share: the rank and size of MPI_COMM_WORLD, the slowest
// rank's time of an operation, and a main that runs the registered benchmarks on every rank
// with rank 0 reporting.
#pragma once

#include <benchmark/benchmark.h>

#include <mpi.h>

#include <chrono>
#include <string>
#include <vector>

namespace mpi_bench {

inline int rank_of() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

inline int size_of() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

// Runs `op` on every rank after a barrier; returns the slowest rank's seconds.
template <class F>
double slowest_rank_seconds(F&& op) {
  MPI_Barrier(MPI_COMM_WORLD);
  const auto start = std::chrono::steady_clock::now();
  op();
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  MPI_Allreduce(MPI_IN_PLACE, &seconds, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return seconds;
}

// Initializes MPI (MPI_THREAD_MULTIPLE), calls `register_all()` (after MPI_Init, so it may ask
// the world's size), runs the benchmarks on every rank (each must run the same collectives, so
// iteration counts are fixed) with only rank 0 reporting and writing --benchmark_out, then
// finalizes. Every rank has the same arguments, so a bad one stops all of them.
template <class Register>
int main(int argc, char** argv, Register&& register_all) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  const bool root = rank_of() == 0;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i)
    if (root || std::string(argv[i]).rfind("--benchmark_out", 0) != 0)
      args.push_back(argv[i]);
  int count = static_cast<int>(args.size());
  register_all();
  benchmark::Initialize(&count, args.data());
  if (count > 1) {
    if (root)
      benchmark::ReportUnrecognizedArguments(count, args.data());
    MPI_Finalize();
    return 1;
  }
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

} // namespace mpi_bench
