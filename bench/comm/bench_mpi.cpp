// weave's MPI all-to-all (mpi_communicator: MPI_Ialltoallv progressed on a host_stream) against
// raw blocking MPI_Alltoallv, in the same run, under mpirun. Every rank runs the same fixed
// number of iterations; each iteration starts after a barrier and its time is the slowest
// rank's (MPI_Allreduce max), reported through manual timing. Only rank 0 reports.
// Arguments: bytes per rank, traffic (0 uniform, 1 skewed).
//
// `overhead/...` measures the cost of weave's path fairly: every iteration times, interleaved in
// a rotating order, raw MPI_Alltoallv, weave's all_to_all_v (default options: small operations
// on an idle stream run on the calling thread), the same handed to the stream's worker
// (inline_max_bytes = 0), and parts of weave's path on their own (MPI_Ialltoallv polled with
// MPI_Testall on the calling thread; Irecv + Isend per peer, polled; an empty task's round trip
// through a host_stream). Each is reported as the median over the iterations, with the ratio
// weave / raw, and weave's all-to-all tagged as a layer's (a 32-byte header per peer, with the
// block inside up to `tagged_inline_bytes`, faults.md) beside the untagged one and beside tagged
// calls whose headers travel alone. Argument: bytes per peer (uniform traffic).
// `compute_beside/...`: see compute_beside below.
#include <benchmark/benchmark.h>

#include "mpi_bench.hpp"
#include "traffic.hpp"

#include <weave/comm/mpi_communicator.hpp>

#include <mpi.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

using comm_bench::traffic;

using mpi_bench::rank_of;
using mpi_bench::size_of;
using mpi_bench::slowest_rank_seconds;

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
    for (auto _ : state)
      state.SetIterationTime(slowest_rank_seconds(op));
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

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n == 0 ? 0.0 : n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

void overhead(benchmark::State& state) {
  const int n = size_of();
  const std::int64_t per_peer = state.range(0);
  const auto peers = static_cast<std::size_t>(n);
  std::vector<std::int64_t> counts(peers, per_peer), displs(peers);
  for (int j = 0; j < n; ++j)
    displs[std::size_t(j)] = per_peer * j;
  const std::vector<int> ic(peers, static_cast<int>(per_peer));
  std::vector<int> id(peers);
  for (int j = 0; j < n; ++j)
    id[std::size_t(j)] = static_cast<int>(displs[std::size_t(j)]);
  std::vector<std::byte> send(static_cast<std::size_t>(per_peer) * peers, std::byte{1}),
      recv(static_cast<std::size_t>(per_peer) * peers, std::byte{0});
  weave::mpi_communicator comm(MPI_COMM_WORLD);
  weave::host_stream stream("comm");
  weave::mpi_options handed_off;
  handed_off.inline_max_bytes = 0; // every operation through the stream's worker
  weave::mpi_communicator comm_handed_off(MPI_COMM_WORLD, handed_off);
  weave::mpi_options headers_alone;
  headers_alone.tagged_inline_bytes = 0; // no block inside a header's message
  weave::mpi_communicator comm_headers_alone(MPI_COMM_WORLD, headers_alone);
  MPI_Comm raw_comm = MPI_COMM_NULL; // a duplicate, as weave uses one
  MPI_Comm_dup(MPI_COMM_WORLD, &raw_comm);
  std::uint64_t call = 0;
  const auto ops = std::array<std::function<void()>, 8>{
      [&] { // raw blocking collective
        MPI_Alltoallv(send.data(), ic.data(), id.data(), MPI_BYTE, recv.data(), ic.data(),
                      id.data(), MPI_BYTE, raw_comm);
      },
      [&] { // weave
        comm.all_to_all_v(stream, send.data(), counts, displs, recv.data(), counts, displs);
        stream.synchronize();
      },
      [&] { // weave's MPI calls alone: non-blocking collective, polled here
        MPI_Request request = MPI_REQUEST_NULL;
        MPI_Ialltoallv(send.data(), ic.data(), id.data(), MPI_BYTE, recv.data(), ic.data(),
                       id.data(), MPI_BYTE, raw_comm, &request);
        for (int done = 0; !done;)
          MPI_Testall(1, &request, &done, MPI_STATUSES_IGNORE);
      },
      [&] { // weave's hand-off alone: an empty task through the stream
        stream.submit([] {});
        stream.synchronize();
      },
      [&] { // weave, tagged as a layer's collectives: a header with (small) blocks inside
        const auto tag = weave::call_tag::of(1, ++call, weave::call_stage::dispatch, 0);
        comm.all_to_all_v(stream, send.data(), counts, displs, recv.data(), counts, displs, 1, tag);
        stream.synchronize();
      },
      [&] { // point to point: Irecv + Isend per peer, polled here
        std::vector<MPI_Request> requests(2 * peers, MPI_REQUEST_NULL);
        for (int j = 0; j < n; ++j)
          MPI_Irecv(recv.data() + displs[std::size_t(j)], ic[std::size_t(j)], MPI_BYTE, j, 7,
                    raw_comm, &requests[std::size_t(j)]);
        for (int j = 0; j < n; ++j)
          MPI_Isend(send.data() + displs[std::size_t(j)], ic[std::size_t(j)], MPI_BYTE, j, 7,
                    raw_comm, &requests[peers + std::size_t(j)]);
        for (int done = 0; !done;)
          MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done,
                      MPI_STATUSES_IGNORE);
      },
      [&] { // weave with every operation handed to the stream's worker (inline_max_bytes = 0)
        comm_handed_off.all_to_all_v(stream, send.data(), counts, displs, recv.data(), counts,
                                     displs);
        stream.synchronize();
      },
      [&] { // weave tagged, every header alone (tagged_inline_bytes = 0)
        const auto tag = weave::call_tag::of(2, ++call, weave::call_stage::dispatch, 0);
        comm_headers_alone.all_to_all_v(stream, send.data(), counts, displs, recv.data(), counts,
                                        displs, 1, tag);
        stream.synchronize();
      }};
  for (const auto& op : ops) // warm-up: connections, registration, first-touch pages
    slowest_rank_seconds(op);
  std::array<std::vector<double>, 8> times;
  std::size_t iteration = 0;
  for (auto _ : state) {
    for (std::size_t k = 0; k < ops.size(); ++k) { // rotate the order: no op always goes first
      const std::size_t which = (iteration + k) % ops.size();
      times[which].push_back(slowest_rank_seconds(ops[which]));
    }
    state.SetIterationTime(times[1].back());
    ++iteration;
  }
  MPI_Comm_free(&raw_comm);
  const double bytes = static_cast<double>(per_peer) * n; // per rank, as nccl-tests
  const double raw = median(times[0]), weave_time = median(times[1]);
  state.counters["raw_us"] = raw * 1e6;
  state.counters["weave_us"] = weave_time * 1e6;
  state.counters["ratio"] = weave_time / raw;
  state.counters["raw_algbw_GBps"] = bytes / raw * 1e-9;
  state.counters["raw_busbw_GBps"] = bytes / raw * 1e-9 * (n - 1) / n;
  state.counters["weave_algbw_GBps"] = bytes / weave_time * 1e-9;
  state.counters["weave_busbw_GBps"] = bytes / weave_time * 1e-9 * (n - 1) / n;
  state.counters["ialltoallv_poll_us"] = median(times[2]) * 1e6;
  state.counters["handoff_us"] = median(times[3]) * 1e6;
  state.counters["tagged_us"] = median(times[4]) * 1e6; // with the call tag's header
  state.counters["tagged_ratio"] = median(times[4]) / weave_time;
  state.counters["tagged_raw_ratio"] = median(times[4]) / raw;
  state.counters["headers_alone_us"] = median(times[7]) * 1e6;
  state.counters["headers_alone_raw_ratio"] = median(times[7]) / raw;
  state.counters["p2p_poll_us"] = median(times[5]) * 1e6;
  state.counters["handed_off_us"] = median(times[6]) * 1e6;
  state.counters["handed_off_ratio"] = median(times[6]) / raw;
  state.counters["bytes_per_peer"] = static_cast<double>(per_peer);
  state.counters["ranks"] = n;
}

// One unit of the compute that runs beside the collectives: a dependent chain of float
// multiply-adds (about a microsecond), so the count of units measures the core time it got.
float compute_unit(float x) {
  for (int i = 0; i < 1000; ++i)
    x = x * 0.999f + 0.5f;
  return x;
}

// `compute_beside/...`: what a rank's own compute loses while the rank issues small
// all-to-alls, on the calling thread (weave's default below inline_max_bytes) or handed to the
// stream's worker. A compute task runs on a host_stream, counting units, while the main thread
// issues 2000 all-to-alls, each followed by synchronize(); the same span with the main thread
// asleep gives the compute's rate alone. Arguments: bytes per peer, mode (0 inline, 1 hand-off).
void compute_beside(benchmark::State& state) {
  const int n = size_of();
  const std::int64_t per_peer = state.range(0);
  const bool hand_off = state.range(1) != 0;
  const auto peers = static_cast<std::size_t>(n);
  std::vector<std::int64_t> counts(peers, per_peer), displs(peers);
  for (int j = 0; j < n; ++j)
    displs[std::size_t(j)] = per_peer * j;
  std::vector<std::byte> send(static_cast<std::size_t>(per_peer) * peers, std::byte{1}),
      recv(static_cast<std::size_t>(per_peer) * peers, std::byte{0});
  weave::mpi_options options;
  if (hand_off)
    options.inline_max_bytes = 0;
  weave::mpi_communicator comm(MPI_COMM_WORLD, options);
  weave::host_stream stream("comm"), compute("compute");
  std::atomic<std::uint64_t> units{0};
  std::atomic<bool> stop{false};
  volatile float sink = 0;
  const auto rate = [&](const std::function<void()>& during) { // units per second
    stop = false;
    compute.submit([&] {
      float x = 1;
      while (!stop.load(std::memory_order_relaxed)) {
        x = compute_unit(x);
        units.fetch_add(1, std::memory_order_relaxed);
      }
      sink = x;
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(1)); // the compute is running
    MPI_Barrier(MPI_COMM_WORLD);
    const std::uint64_t before = units.load();
    const auto start = std::chrono::steady_clock::now();
    during();
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const std::uint64_t done = units.load() - before;
    stop = true;
    compute.synchronize();
    return std::pair{static_cast<double>(done) / seconds, seconds};
  };
  constexpr int calls = 2000;
  std::vector<double> alone, beside, latency;
  for (auto _ : state) {
    const auto [with_rate, span] = rate([&] {
      for (int c = 0; c < calls; ++c) {
        comm.all_to_all_v(stream, send.data(), counts, displs, recv.data(), counts, displs);
        stream.synchronize();
      }
    });
    const auto [alone_rate, _span] = rate(
        [&, span = span] { std::this_thread::sleep_for(std::chrono::duration<double>(span)); });
    beside.push_back(with_rate);
    alone.push_back(alone_rate);
    latency.push_back(span / calls);
    state.SetIterationTime(span);
  }
  state.counters["call_us"] = median(latency) * 1e6;
  state.counters["compute_kept"] = median(beside) / median(alone); // 1: no compute lost
  state.counters["bytes_per_peer"] = static_cast<double>(per_peer);
  state.counters["hand_off"] = hand_off ? 1 : 0;
  state.counters["ranks"] = n;
}

} // namespace

int main(int argc, char** argv) {
  return mpi_bench::main(argc, argv, [] {
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
    for (int shift = 12; shift <= 26; shift += 2) {
      const std::int64_t per_peer = std::int64_t(1) << shift;
      // Fixed iterations (every rank runs the same collectives); at least 9 for the medians.
      const auto iterations =
          std::clamp<std::int64_t>((std::int64_t(1) << 27) / (per_peer * size_of()), 9, 400);
      benchmark::RegisterBenchmark("overhead", overhead)
          ->Arg(per_peer)
          ->ArgName("bytes_per_peer")
          ->Iterations(iterations)
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
    }
    for (const std::int64_t per_peer : {std::int64_t{4} << 10, std::int64_t{64} << 10})
      for (const int hand_off : {0, 1})
        benchmark::RegisterBenchmark("compute_beside", compute_beside)
            ->Args({per_peer, hand_off})
            ->ArgNames({"bytes_per_peer", "hand_off"})
            ->Iterations(3)
            ->UseManualTime()
            ->Unit(benchmark::kMicrosecond);
  });
}
