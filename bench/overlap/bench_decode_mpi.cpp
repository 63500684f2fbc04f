// Decode-sized MoE layers over MPI, under mpirun (one process per rank), in one run: per layer,
// the decode exchange (default and per-pair combines, gathered inputs, steps handed off), the
// dynamic moe_exchange, and two raw-MPI baselines without weave: the bytes floor (two blocking
// all-to-alls of the decode's bytes: no packing, no experts, no sums) and the raw-MPI decode
// reference (the same layer written by hand with plain MPI and loops: the same bytes, experts
// and sums; raw_mpi_decode.hpp). The experts copy their input.
// Every iteration is one layer on every rank after a barrier, timed as the slowest rank's
// (MPI_Allreduce max). Only rank 0 reports. Arguments: tokens per rank, hidden (bf16), experts
// (k = 8), mode (0 decode per-pair, 1 its steps handed off, 2 dynamic, 3 bytes floor of the
// per-pair decode: one MPI_Alltoallv of its dispatch messages, one of its combine's rows, each
// rank's own message a header as in weave; 4 decode with the default combine (`partial_sums`),
// 5 its bytes floor, 6 the default combine with gathered inputs: the experts copy each row from
// where it arrived, `decode_experts::input_rows`; 7 the raw-MPI decode reference, its output
// checked once to equal the default decode layer's bitwise, as is its form with one block of
// inputs per expert). `decode_side_by_side_mpi` runs the dynamic exchange, the decode layer
// (default and gathered inputs) and the reference (both forms) in turn within each iteration
// and reports the ratios measured side by side.
#include <benchmark/benchmark.h>

#include "../comm/mpi_bench.hpp"
#include "moe_bench_setup.hpp"
#include "raw_mpi_decode.hpp"

#include <weave/comm/mpi_communicator.hpp>
#include <weave/core/dtype.hpp>
#include <weave/core/host_matrix.hpp>
#include <weave/overlap/decode_exchange.hpp>
#include <weave/overlap/moe_exchange.hpp>

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

using row_t = weave::bfloat16;
constexpr int k = 8;

using mpi_bench::rank_of;
using mpi_bench::size_of;
using mpi_bench::slowest_rank_seconds;

// This rank's tokens: rows, k distinct uniform expert ids per token, equal weights.
moe_bench::rank_data tokens_of_rank(std::size_t tokens, std::size_t hidden, int experts) {
  std::mt19937 rng(static_cast<unsigned>(rank_of()) * 7919u + 1u);
  return moe_bench::random_tokens(tokens, hidden, experts, k, rng);
}

// The dynamic exchange the decode layers are compared with: bf16 rows, one chunk.
weave::moe_options dynamic_options(std::size_t tokens, std::size_t hidden) {
  weave::moe_options o;
  o.k = k;
  o.hidden = hidden;
  o.element = weave::dtype::bf16;
  o.max_tokens = tokens;
  o.chunks = 1;
  return o;
}

void decode_layer_mpi(benchmark::State& state) {
  const auto tokens = static_cast<std::size_t>(state.range(0));
  const auto hidden = static_cast<std::size_t>(state.range(1));
  const auto experts = static_cast<int>(state.range(2));
  const auto mode = state.range(3);
  const int n = size_of();
  const auto where = weave::placement::contiguous(experts, n);
  auto d = tokens_of_rank(tokens, hidden, experts);
  weave::host_stream stream("comm"), compute("compute");
  weave::mpi_options options;
  if (mode == 1)
    options.inline_max_bytes = 0;
  weave::mpi_communicator comm(MPI_COMM_WORLD, options);
  const bool partial = mode >= 4;
  weave::decode_options o{k, hidden, tokens};
  o.partial_sums = partial;
  o.gathered_inputs = mode == 6;
  const std::size_t row = hidden * sizeof(row_t);
  // The decode's bytes: a fixed dispatch message per peer, and a combine of one row per
  // (token, expert) pair the peer's experts took, or per token routed there with partial sums
  // (counted here for the floor); a rank's messages to itself are a header.
  const std::size_t dispatch_per_peer =
      weave::decode_exchange<weave::mpi_communicator, row_t>(comm, where, o)
          .dispatch_bytes_per_peer();
  std::vector<int> combine_send(std::size_t(n), int(sizeof(weave::decode_header))),
      combine_recv(combine_send.size());
  std::vector<std::size_t> last_token(combine_recv.size(), ~std::size_t{0});
  for (std::size_t p = 0; p < d.ids.size(); ++p) {
    const int slot = where.slot_for(d.ids[p], p / k, rank_of());
    const auto dev = static_cast<std::size_t>(slot / where.slots_per_device());
    if (static_cast<int>(dev) == rank_of() || (partial && last_token[dev] == p / k))
      continue; // the token's row to this device is counted
    last_token[dev] = p / k;
    combine_recv[dev] += static_cast<int>(row);
  }
  MPI_Alltoall(combine_recv.data(), 1, MPI_INT, combine_send.data(), 1, MPI_INT, MPI_COMM_WORLD);
  std::size_t combine_bytes = 0;
  for (const int b : combine_send)
    combine_bytes += static_cast<std::size_t>(b);
  std::vector<double> times;
  auto run = [&](auto&& layer) {
    for (int warm = 0; warm < 3; ++warm)
      slowest_rank_seconds(layer);
    for (auto _ : state) {
      times.push_back(slowest_rank_seconds(layer));
      state.SetIterationTime(times.back());
    }
  };
  if (mode == 0 || mode == 1 || mode == 4 || mode == 6) {
    weave::decode_exchange<weave::mpi_communicator, row_t> ex(comm, where, o);
    run([&] {
      auto h = ex.dispatch(d.x.elements(), d.ids, d.weights, stream);
      weave::run_inline_or_submit(stream, [xs = h.experts(), &o, row] { // the experts
        moe_bench::copy_decode_experts(xs, o.gathered_inputs, row);
      });
      ex.combine(h, d.y.elements(), stream);
      stream.synchronize();
    });
  } else if (mode == 2) {
    weave::moe_exchange<weave::mpi_communicator> ex(comm, where, dynamic_options(tokens, hidden));
    run([&] {
      ex.forward(d.x.view(), d.ids, d.weights, d.y.view(), moe_bench::copy_experts, compute,
                 stream);
      compute.synchronize();
      stream.synchronize();
    });
  } else if (mode == 7) {
    raw_mpi_decode::layer ref(MPI_COMM_WORLD, tokens, hidden, experts, k);
    const auto bits = [](std::span<row_t> v) {
      return std::span<std::uint16_t>(reinterpret_cast<std::uint16_t*>(v.data()), v.size());
    };
    const auto x = bits(d.x.elements()), y = bits(d.y.elements());
    { // the reference computes weave's layer bitwise (the same f32 sums in the same order)
      weave::host_matrix<row_t> expected(tokens, hidden);
      weave::decode_exchange<weave::mpi_communicator, row_t> ex(comm, where, o);
      auto h = ex.dispatch(d.x.elements(), d.ids, d.weights, stream);
      weave::run_inline_or_submit(
          stream, [xs = h.experts(), row] { moe_bench::copy_decode_experts(xs, false, row); });
      ex.combine(h, expected.elements(), stream);
      stream.synchronize();
      raw_mpi_decode::layer blocks(MPI_COMM_WORLD, tokens, hidden, experts, k, true);
      int equal = 1;
      for (auto* r : {&blocks, &ref}) { // `ref`'s output stays in y
        r->run(x, d.ids, d.weights, y);
        equal &= std::memcmp(expected.data(), d.y.data(), y.size() * sizeof(row_t)) == 0;
      }
      MPI_Allreduce(MPI_IN_PLACE, &equal, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD); // all, or none
      if (!equal) {
        state.SkipWithError("the raw-MPI reference's output differs from weave's decode layer");
        return;
      }
    }
    run([&] { ref.run(x, d.ids, d.weights, y); });
  } else { // the floor: the decode's bytes in two blocking all-to-alls, no packing
    std::vector<int> dispatch_counts(static_cast<std::size_t>(n),
                                     static_cast<int>(dispatch_per_peer));
    dispatch_counts[static_cast<std::size_t>(rank_of())] = sizeof(weave::decode_header);
    std::vector<int> dispatch_displs(dispatch_counts.size());
    std::vector<int> send_displs(static_cast<std::size_t>(n)), recv_displs(send_displs);
    for (std::size_t j = 1; j < std::size_t(n); ++j) {
      dispatch_displs[j] = dispatch_displs[j - 1] + dispatch_counts[j - 1];
      send_displs[j] = send_displs[j - 1] + combine_send[j - 1];
      recv_displs[j] = recv_displs[j - 1] + combine_recv[j - 1];
    }
    const std::size_t received = static_cast<std::size_t>(recv_displs.back() + combine_recv.back());
    const std::size_t bytes =
        std::max({dispatch_per_peer * std::size_t(n), combine_bytes, received});
    std::vector<std::byte> send(bytes, std::byte{1}), recv(bytes);
    MPI_Comm raw = MPI_COMM_NULL;
    MPI_Comm_dup(MPI_COMM_WORLD, &raw);
    run([&] {
      MPI_Alltoallv(send.data(), dispatch_counts.data(), dispatch_displs.data(), MPI_BYTE,
                    recv.data(), dispatch_counts.data(), dispatch_displs.data(), MPI_BYTE, raw);
      MPI_Alltoallv(recv.data(), combine_send.data(), send_displs.data(), MPI_BYTE, send.data(),
                    combine_recv.data(), recv_displs.data(), MPI_BYTE, raw);
    });
    MPI_Comm_free(&raw);
  }
  std::sort(times.begin(), times.end());
  state.counters["layer_us"] = times.empty() ? 0 : times[times.size() / 2] * 1e6; // median
  state.counters["decode_dispatch_bytes_per_peer"] = static_cast<double>(dispatch_per_peer);
  state.counters["decode_combine_bytes"] = static_cast<double>(combine_bytes); // sent, all peers
  state.counters["ranks"] = n;
  static const char* const labels[] = {
      "decode, per-pair combine", "decode per-pair, handed off", "dynamic",
      "raw MPI floor, per-pair",  "decode (default combine)",    "raw MPI floor, default combine",
      "decode, gathered inputs",  "raw-MPI decode reference"};
  state.SetLabel(labels[mode]);
}

// The same layers side by side: each iteration runs the dynamic exchange, the default decode
// layer, the decode layer with gathered inputs and the raw-MPI reference in its two forms (the
// experts reading rows where they arrived, as the gathered layer's; and reading one block each,
// as the default layer's) once each, in an order that rotates with the iteration (each after a
// barrier, the slowest rank's time), so that a change of the host's speed within the run hits
// all five alike. Counters: each one's median and the medians of the per-iteration ratios. The
// iteration time is the gathered layer's.
void decode_side_by_side_mpi(benchmark::State& state) {
  const auto tokens = static_cast<std::size_t>(state.range(0));
  const auto hidden = static_cast<std::size_t>(state.range(1));
  const auto experts = static_cast<int>(state.range(2));
  const auto where = weave::placement::contiguous(experts, size_of());
  auto d = tokens_of_rank(tokens, hidden, experts);
  weave::host_stream stream("comm"), compute("compute");
  weave::mpi_communicator comm(MPI_COMM_WORLD);
  const std::size_t row = hidden * sizeof(row_t);
  weave::decode_options o{k, hidden, tokens};
  o.partial_sums = true;
  weave::decode_options og = o;
  og.gathered_inputs = true;
  weave::decode_exchange<weave::mpi_communicator, row_t> plain(comm, where, o),
      gathered(comm, where, og);
  weave::moe_exchange<weave::mpi_communicator> dynamic(comm, where,
                                                       dynamic_options(tokens, hidden));
  raw_mpi_decode::layer ref(MPI_COMM_WORLD, tokens, hidden, experts, k),
      ref_blocks(MPI_COMM_WORLD, tokens, hidden, experts, k, true);
  const auto x = std::span<const std::uint16_t>(reinterpret_cast<const std::uint16_t*>(d.x.data()),
                                                tokens * hidden);
  const auto y =
      std::span<std::uint16_t>(reinterpret_cast<std::uint16_t*>(d.y.data()), tokens * hidden);
  const auto decode = [&](auto& ex, bool rows_in_place) {
    auto h = ex.dispatch(d.x.elements(), d.ids, d.weights, stream);
    weave::run_inline_or_submit(stream, [xs = h.experts(), rows_in_place, row] {
      moe_bench::copy_decode_experts(xs, rows_in_place, row);
    });
    ex.combine(h, d.y.elements(), stream);
    stream.synchronize();
  };
  const auto layer = [&](int which) {
    switch (which) {
    case 0:
      dynamic.forward(d.x.view(), d.ids, d.weights, d.y.view(), moe_bench::copy_experts, compute,
                      stream);
      compute.synchronize();
      stream.synchronize();
      break;
    case 1:
      decode(plain, false);
      break;
    case 2:
      decode(gathered, true);
      break;
    case 3:
      ref.run(x, d.ids, d.weights, y);
      break;
    default:
      ref_blocks.run(x, d.ids, d.weights, y);
    }
  };
  constexpr int layers = 5;
  std::vector<double> times[layers];
  for (int warm = 0; warm < 3; ++warm)
    for (int which = 0; which < layers; ++which)
      slowest_rank_seconds([&] { layer(which); });
  int iteration = 0;
  for (auto _ : state) {
    for (int i = 0; i < layers; ++i) {
      const int which = (i + iteration) % layers;
      times[which].push_back(slowest_rank_seconds([&] { layer(which); }));
    }
    state.SetIterationTime(times[2].back());
    ++iteration;
  }
  const auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
  };
  const auto ratio = [&](int a, int b) { // median of the per-iteration ratios a / b
    std::vector<double> r;
    for (std::size_t i = 0; i < times[a].size(); ++i)
      r.push_back(times[a][i] / times[b][i]);
    return median(std::move(r));
  };
  state.counters["dynamic_us"] = median(times[0]) * 1e6;
  state.counters["decode_us"] = median(times[1]) * 1e6;
  state.counters["gathered_us"] = median(times[2]) * 1e6;
  state.counters["reference_us"] = median(times[3]) * 1e6;
  state.counters["dynamic_over_gathered"] = ratio(0, 2); // the speed-up over dynamic
  state.counters["dynamic_over_decode"] = ratio(0, 1);
  state.counters["gathered_over_reference"] = ratio(2, 3);
  state.counters["decode_over_reference"] = ratio(1, 3);
  state.counters["blocks_reference_us"] = median(times[4]) * 1e6;
  state.counters["decode_over_blocks_reference"] = ratio(1, 4);    // the same contract
  state.counters["blocks_reference_over_reference"] = ratio(4, 3); // what the blocks cost
}

} // namespace

int main(int argc, char** argv) {
  return mpi_bench::main(argc, argv, [] {
    for (const int experts : {32, 256})
      for (const int hidden : {256, 2048})
        for (const int tokens : {1, 8, 64, 256, 512})
          for (const int mode : {0, 1, 2, 3, 4, 5, 6, 7}) // each shape's modes side by side
            benchmark::RegisterBenchmark("decode_layer_mpi", decode_layer_mpi)
                ->Args({tokens, hidden, experts, mode})
                ->ArgNames({"tokens", "hidden", "experts", "mode"})
                ->Iterations(tokens * hidden >= 256 * 2048 ? 20 : 100) // the same on every rank
                ->UseManualTime()
                ->Unit(benchmark::kMicrosecond);
    for (const int experts : {32, 256})
      for (const int hidden : {256, 2048})
        for (const int tokens : {1, 8, 64, 256, 512})
          benchmark::RegisterBenchmark("decode_side_by_side_mpi", decode_side_by_side_mpi)
              ->Args({tokens, hidden, experts})
              ->ArgNames({"tokens", "hidden", "experts"})
              ->Iterations(tokens * hidden >= 256 * 2048 ? 20
                           : tokens >= 64                ? 100
                                                         : 1000)
              ->UseManualTime()
              ->Unit(benchmark::kMicrosecond);
  });
}
