// weave's main demo: a transformer block's MoE part on 4 in-process ranks joined by an emulated
// network link. The block is attention + gate (the producer of the layer's input and routing),
// the MoE layer (dispatch -> experts -> combine), and the residual add (the consumer). It runs
// three ways side by side: unpipelined; with the layer pipelined over token chunks (Tutel); and
// with the attention, gate and residual partitioned into the same chunks as well (Lancet,
// through weave's chunk hooks). The defaults are sized for a small CPU machine; pass
// --tokens=8192 --hidden=1024 for a layer of a mid-size model.
//
// What is real: gating, capacity, the dispatch plans, every row gathered, sent (copied between
// ranks), scattered, merged and returned, the residual add. What is emulated: the link (each
// transfer completes after latency + bytes / bandwidth, sleeping), the experts' arithmetic
// (each expert batch copies its rows scaled by a per-expert power of two, exact in bf16, then
// sleeps rows x --expert-ns-per-row, as a GPU's grouped GEMM would leave the CPU free) and
// attention (a sleep of --attention-ns-per-token per token). Prints copies per token against
// naive per-(token, expert) sending, bytes moved, exposed communication and the speedups, checks
// that the three outputs are bitwise identical, and writes a Chrome trace (chrome://tracing or
// ui.perfetto.dev) of the partitioned run.
//
//   moe_demo [--tokens=4096] [--experts=64] [--k=8] [--hidden=512] [--ranks=4] [--chunks=4]
//            [--link-gbps=0.5] [--latency-us=10] [--expert-ns-per-row=500]
//            [--attention-ns-per-token=2000] [--iterations=3] [--trace=moe_demo.trace.json]
// (`--name value` works too). `moe_demo --help` lists each option's range; a bad option ends
// the demo with one line on stderr and exit status 2.
// Under mpirun (when built with MPI) each process is one rank and MPI is the link:
//   mpirun -np 4 moe_demo
#include "command_line.hpp"

#include <weave/comm/local_world.hpp>
#include <weave/core/host_matrix.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/overlap/moe_exchange.hpp>
#include <weave/overlap/pipeline_timing.hpp>
#include <weave/placement/placement.hpp>
#include <weave/routing/gate.hpp>
#ifdef WEAVE_DEMO_MPI
#include <weave/comm/mpi_communicator.hpp>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

struct settings {
  std::size_t tokens = 4096;
  int experts = 64;
  int k = 8;
  std::size_t hidden = 512;
  int ranks = 4;
  int chunks = 4;
  double link_gbps = 0.5;
  double latency_us = 10.0;
  double expert_ns_per_row = 500.0;
  double attention_ns_per_token = 2000.0;
  int iterations = 3;
  std::string trace = "moe_demo.trace.json";
};

// The options, with ranges that keep the demo's buffers within a few GiB (see --help).
cli::options declare(settings& s) {
  cli::options o("moe_demo",
                 "weave's main demo: an MoE block on --ranks in-process ranks (or one rank per "
                 "process under mpirun),\nunpipelined, pipelined and partitioned, side by side. "
                 "Limits: --k <= --experts, --experts a multiple\nof the ranks, --tokens x "
                 "--hidden x ranks and --tokens x --experts x ranks each at most 2^28.\n");
  o.number("tokens", s.tokens, std::size_t{1}, std::size_t{1} << 20, "tokens per rank");
  o.number("experts", s.experts, 1, 4096, "experts");
  o.number("k", s.k, 1, 64, "experts per token (top-k)");
  o.number("hidden", s.hidden, std::size_t{1}, std::size_t{1} << 16, "hidden size (bf16 rows)");
  o.number("ranks", s.ranks, 1, 64, "in-process ranks (ignored under mpirun)");
  o.number("chunks", s.chunks, 1, 64, "pipeline chunks of the pipelined variants");
  o.number("link-gbps", s.link_gbps, 1e-3, 1e4, "emulated link bandwidth, GB/s");
  o.number("latency-us", s.latency_us, 0.0, 1e6, "emulated link latency, us");
  o.number("expert-ns-per-row", s.expert_ns_per_row, 0.0, 1e6, "emulated expert time per row, ns");
  o.number("attention-ns-per-token", s.attention_ns_per_token, 0.0, 1e6,
           "emulated attention time per token, ns");
  o.number("iterations", s.iterations, 1, 1000, "measured iterations (after one warm-up)");
  o.text("trace", s.trace, "PATH", "Chrome trace of the partitioned run; empty: none");
  return o;
}

// Checks what one option's range cannot: the limits of the usage's summary.
void check(const settings& s, int ranks) {
  if (s.k > s.experts)
    throw cli::bad_option("--k: " + std::to_string(s.k) + " exceeds --experts " +
                          std::to_string(s.experts));
  if (s.experts % ranks != 0)
    throw cli::bad_option("--experts: " + std::to_string(s.experts) + " is not a multiple of the " +
                          std::to_string(ranks) + " ranks");
  const auto r = static_cast<std::size_t>(ranks);
  constexpr std::size_t most = std::size_t{1} << 28; // elements; at most 2^20 x 2^16 x 64 fits
  if (s.tokens * s.hidden * r > most)
    throw cli::bad_option("--tokens x --hidden x ranks = " +
                          std::to_string(s.tokens * s.hidden * r) + " exceeds 2^28");
  if (s.tokens * static_cast<std::size_t>(s.experts) * r > most)
    throw cli::bad_option("--tokens x --experts x ranks = " +
                          std::to_string(s.tokens * static_cast<std::size_t>(s.experts) * r) +
                          " exceeds 2^28");
}

using row_t = weave::bfloat16;

// How the block runs: the layer unpipelined, the layer pipelined over chunks (the operators
// around it on the whole batch), or the operators around it partitioned into the same chunks.
enum class variant : int { unpipelined = 0, pipelined = 1, partitioned = 2 };
constexpr int variants = 3;

struct rank_data {
  weave::host_matrix<row_t> x;             // the layer's input (attention's output)
  weave::host_matrix<float> logits;        // the gate's input
  std::vector<std::int32_t> ids;           // written by the gate
  std::vector<float> weights;              // written by the gate
  weave::host_matrix<row_t> y;             // the layer's output
  weave::host_matrix<row_t> out[variants]; // the block's output x + y, per variant
};

struct measured {
  weave::pipeline_timing timing; // of the whole block: the median iteration
  double min_ms = 0, max_ms = 0; // the fastest and slowest iteration's block time
  weave::moe_stats stats;
};

// The emulated experts: expert e multiplies its rows by 2^(e mod 4) (an exponent add on the
// bf16 bits: every row is touched, cheaply and exactly), then holds the compute stream as long
// as the rows would take on an accelerator.
struct emulated_experts {
  double ns_per_row;
  void operator()(const weave::expert_batch& b) const {
    for (std::size_t l = 0; l + 1 < b.expert_offsets.size(); ++l) {
      const auto shift = static_cast<std::uint16_t>((b.experts[l] % 4) << 7);
      for (auto r = b.expert_offsets[l]; r < b.expert_offsets[l + 1]; ++r) {
        const auto in = b.input.row_as<row_t>(static_cast<std::size_t>(r));
        const auto out = b.output.row_as<row_t>(static_cast<std::size_t>(r));
        for (std::size_t h = 0; h < in.size(); ++h) // x * 2^n for normal, finite x
          out[h] = (in[h].bits & 0x7f80) == 0
                       ? in[h]
                       : row_t::from_bits(static_cast<std::uint16_t>(in[h].bits + shift));
      }
    }
    const auto rows = b.expert_offsets.back();
    std::this_thread::sleep_for(std::chrono::nanoseconds(
        static_cast<std::int64_t>(ns_per_row * static_cast<double>(rows))));
  }
};

// The operators around the layer. The producer emulates attention (a sleep) and runs the gate
// on tokens [first, first + count); the consumer adds the residual into the block's output.
struct around_ops {
  const settings* s;
  rank_data* d;
  row_t* out;
  void produce(std::size_t first, std::size_t count) const {
    std::this_thread::sleep_for(std::chrono::nanoseconds(
        static_cast<std::int64_t>(s->attention_ns_per_token * static_cast<double>(count))));
    weave::gate_options gate;
    gate.k = s->k;
    gate.renormalize = true;
    const auto k = static_cast<std::size_t>(s->k);
    (void)weave::top_k_gate(d->logits.view().subrows(first, count), gate,
                            std::span(d->ids).subspan(first * k, count * k),
                            std::span(d->weights).subspan(first * k, count * k));
  }
  void consume(std::size_t first, std::size_t count) const {
    const std::size_t H = d->x.cols();
    for (std::size_t t = first; t < first + count; ++t)
      for (std::size_t h = 0; h < H; ++h)
        out[t * H + h] = row_t(static_cast<float>(d->x(t, h)) + static_cast<float>(d->y(t, h)));
  }
};

// Runs `iterations` blocks of one variant on one rank; returns its median timing and the range.
//! [generic]
template <class Comm>
measured run_rank(Comm& comm, const settings& s, const weave::placement& where, variant v,
                  rank_data& d, weave::trace_writer* trace,
                  weave::host_event::clock::time_point origin) {
  weave::moe_options o;
  o.k = s.k;
  o.hidden = s.hidden;
  o.element = weave::dtype::bf16;
  o.max_tokens = s.tokens;
  o.chunks = v == variant::unpipelined ? 1 : s.chunks;
  weave::moe_exchange<Comm> layer(comm, where, o);
  weave::host_stream compute("compute"), comm_stream("comm");
  const around_ops around{&s, &d, d.out[static_cast<int>(v)].data()};
  const weave::moe_chunk_hooks hooks{
      [&around](std::size_t first, std::size_t count) { around.produce(first, count); },
      [&around](std::size_t first, std::size_t count) { around.consume(first, count); }};
  const bool partitioned = v == variant::partitioned;
  std::vector<weave::pipeline_timing> timings;
  for (int it = 0; it <= s.iterations; ++it) { // iteration 0 warms the buffers up
    weave::host_event begin = compute.record(), produced, forwarded, end;
    if (!partitioned) // the operators around the layer run on the whole batch
      compute.submit([&] { around.produce(0, s.tokens); });
    compute.record(produced);
    layer.forward(d.x.view(), d.ids, d.weights, d.y.view(), emulated_experts{s.expert_ns_per_row},
                  compute, comm_stream, partitioned ? &hooks : nullptr);
    compute.record(forwarded);
    if (!partitioned)
      compute.submit([&] { around.consume(0, s.tokens); });
    compute.record(end);
    compute.synchronize();
    comm_stream.synchronize();
    if (it == 0)
      continue;
    using ms = std::chrono::duration<double, std::milli>;
    weave::pipeline_timing t = weave::measure(layer.pipeline());
    t.makespan_ms = ms(end.completed_at() - begin.completed_at()).count();
    t.compute_busy_ms += ms(produced.completed_at() - begin.completed_at()).count() +
                         ms(end.completed_at() - forwarded.completed_at()).count();
    timings.push_back(t);
  }
  std::sort(timings.begin(), timings.end(),
            [](const auto& a, const auto& b) { return a.makespan_ms < b.makespan_ms; });
  if (trace)
    weave::add_to_trace(*trace, layer.pipeline(), comm.rank(), origin);
  return {timings[timings.size() / 2], timings.front().makespan_ms, timings.back().makespan_ms,
          layer.stats(compute)};
}
//! [generic]

// Every rank of an in-process world, one thread each.
std::vector<measured> run_local(const settings& s, const weave::placement& where, variant v,
                                std::vector<rank_data>& data, weave::trace_writer* trace) {
  weave::local_world_options options;
  options.link = weave::emulated_link::gbps(
      s.link_gbps, std::chrono::nanoseconds(static_cast<std::int64_t>(s.latency_us * 1e3)));
  weave::local_world world(s.ranks, options);
  std::vector<measured> result(static_cast<std::size_t>(s.ranks));
  std::mutex trace_mutex;
  const auto origin = weave::host_event::clock::now();
  world.run([&](weave::local_communicator& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    weave::trace_writer mine;
    result[r] = run_rank(comm, s, where, v, data[r], trace ? &mine : nullptr, origin);
    if (trace) {
      std::lock_guard lock(trace_mutex);
      for (const auto& e : mine.events())
        trace->add(e);
      trace->name_process(comm.rank(), "rank " + std::to_string(comm.rank()));
      trace->name_thread(comm.rank(), 0, "compute stream");
      trace->name_thread(comm.rank(), 1, "comm stream");
    }
  });
  return result;
}

// Each rank's tokens and gate logits (the same on every process: one seed). Returns the mean
// GShard auxiliary loss of the gate (softmax top-k, renormalized) over the whole batch.
double make_data(const settings& s, std::vector<rank_data>& data) {
  data.resize(static_cast<std::size_t>(s.ranks));
  std::mt19937 rng(2026);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  double aux_loss = 0;
  for (rank_data& d : data) {
    d.x = weave::host_matrix<row_t>(s.tokens, s.hidden);
    for (row_t& v : d.x.elements())
      v = row_t(normal(rng));
    d.logits = weave::host_matrix<float>(s.tokens, static_cast<std::size_t>(s.experts));
    for (float& v : d.logits.elements())
      v = 2.0f * normal(rng);
    d.ids.resize(s.tokens * static_cast<std::size_t>(s.k));
    d.weights.resize(d.ids.size());
    weave::gate_options gate;
    gate.k = s.k;
    gate.renormalize = true;
    aux_loss += weave::top_k_gate(d.logits.view(), gate, d.ids, d.weights).aux_loss;
    d.y = weave::host_matrix<row_t>(s.tokens, s.hidden);
    for (auto& out : d.out)
      out = weave::host_matrix<row_t>(s.tokens, s.hidden);
  }
  return aux_loss / s.ranks;
}

// The three variants' block outputs are bitwise identical.
bool outputs_identical(const rank_data& d) {
  const std::size_t bytes = d.x.rows() * d.x.cols() * sizeof(row_t);
  return std::memcmp(d.out[0].data(), d.out[1].data(), bytes) == 0 &&
         std::memcmp(d.out[0].data(), d.out[2].data(), bytes) == 0;
}

void print_header(const settings& s, const char* world, double aux_loss) {
  std::printf("weave MoE demo: %d ranks (%s), %zu tokens/rank, %d experts, top-%d, hidden %zu "
              "(bf16), experts %.0f ns/row, attention %.0f ns/token\n",
              s.ranks, world, s.tokens, s.experts, s.k, s.hidden, s.expert_ns_per_row,
              s.attention_ns_per_token);
  std::printf("gate: softmax top-%d, GShard aux loss %.4f (1.0 = perfectly balanced)\n", s.k,
              aux_loss);
  // Each rank drives a compute and a communication stream (a thread each); with fewer cores
  // they take turns, and the times below measure the scheduler more than the overlap.
  const unsigned cores = std::thread::hardware_concurrency();
  const int threads = 2 * s.ranks;
  if (cores != 0 && cores < static_cast<unsigned>(threads))
    std::printf("warning: %u hardware threads for %d ranks x 2 streams = %d busy threads: the "
                "timings are noise-dominated (run with fewer --ranks, or on a larger machine)\n",
                cores, s.ranks, threads);
}

// `runs[v]` holds every rank's measurement of variant v.
void report(const settings& s, const std::vector<measured> (&runs)[variants], bool identical) {
  // Volumes, summed over ranks; a naive dispatch sends one row per (token, expert).
  std::int64_t sent = 0, local = 0, naive = 0, dropped = 0;
  for (const measured& m : runs[0]) {
    sent += m.stats.sent_rows;
    local += m.stats.local_rows;
    naive += m.stats.naive_rows();
    dropped += m.stats.dropped_pairs;
  }
  const double tokens = static_cast<double>(s.tokens) * s.ranks;
  const double row_bytes = static_cast<double>(s.hidden * sizeof(row_t));
  const double mib = 1024.0 * 1024.0;
  std::printf("\ncopies per token (CT): weave %.2f vs naive %.2f per-(token, expert) rows "
              "(%.1f%% fewer rows)\n",
              static_cast<double>(sent) / tokens, static_cast<double>(naive) / tokens,
              100.0 * (1.0 - static_cast<double>(sent) / static_cast<double>(naive)));
  std::printf("bytes moved per layer (dispatch + combine, all ranks): weave %.1f MiB (%.1f MiB "
              "stay on their rank) vs naive %.1f MiB; dropped pairs: %lld\n",
              2.0 * static_cast<double>(sent) * row_bytes / mib,
              2.0 * static_cast<double>(local) * row_bytes / mib,
              2.0 * static_cast<double>(naive) * row_bytes / mib, static_cast<long long>(dropped));
  auto slowest = [](const std::vector<measured>& m) { // the slowest rank sets the block's time
    measured t{};
    for (const measured& x : m)
      if (x.timing.makespan_ms > t.timing.makespan_ms)
        t = x;
    return t;
  };
  const std::string c = std::to_string(s.chunks);
  const std::string labels[variants] = {"unpipelined (C = 1)", "layer pipelined (C = " + c + ")",
                                        "+ attention, gate, residual in the chunks"};
  std::printf("\n%-42s %11s %15s %13s %14s %11s\n", "block (attention, gate, MoE, residual)",
              "median (ms)", "min-max (ms)", "compute (ms)", "exposed comm", "comm busy");
  weave::pipeline_timing t[variants];
  for (int v = 0; v < variants; ++v) {
    const measured m = slowest(runs[v]);
    t[v] = m.timing;
    char range[48];
    std::snprintf(range, sizeof(range), "%.1f-%.1f", m.min_ms, m.max_ms);
    std::printf("%-42s %11.1f %15s %13.1f %11.1f ms %8.1f ms\n", labels[v].c_str(),
                t[v].makespan_ms, range, t[v].compute_busy_ms, t[v].exposed_comm_ms(),
                t[v].comm_busy_ms);
  }
  std::printf("(the slowest rank's median, and its fastest and slowest of %d iterations)\n",
              s.iterations);
  const auto hidden = [&](int v) {
    return t[0].exposed_comm_ms() > 0
               ? 100.0 * (1.0 - t[v].exposed_comm_ms() / t[0].exposed_comm_ms())
               : 0.0;
  };
  std::printf("\npipelining the MoE layer (Tutel) saved %.1f ms: %.0f%% of the exposed "
              "communication hidden, %.2fx\n",
              t[0].makespan_ms - t[1].makespan_ms, hidden(1), t[0].makespan_ms / t[1].makespan_ms);
  std::printf("partitioning the operators around it too (Lancet) saved %.1f ms: %.0f%% hidden, "
              "%.2fx\n",
              t[0].makespan_ms - t[2].makespan_ms, hidden(2), t[0].makespan_ms / t[2].makespan_ms);
  std::printf("outputs of the three bitwise identical: %s\n", identical ? "yes" : "NO");
}

#ifdef WEAVE_DEMO_MPI
// One rank per process under mpirun; the link is whatever MPI uses.
int run_mpi(settings s) {
  int provided = 0;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
  int status = 0, rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  try {
    weave::mpi_communicator comm(MPI_COMM_WORLD);
    s.ranks = comm.size();
    check(s, s.ranks); // every rank reaches the same verdict
    const auto where = weave::placement::contiguous(s.experts, s.ranks);
    std::vector<rank_data> data;
    const double aux_loss = make_data(s, data);
    rank_data& mine = data[static_cast<std::size_t>(comm.rank())];
    if (comm.rank() == 0)
      print_header(s, "MPI processes", aux_loss);
    const auto origin = weave::host_event::clock::now();
    weave::trace_writer trace;
    std::vector<measured> runs[variants];
    for (int v = 0; v < variants; ++v) {
      const bool traced = v == static_cast<int>(variant::partitioned);
      const measured m = run_rank(comm, s, where, static_cast<variant>(v), mine,
                                  traced ? &trace : nullptr, origin);
      runs[v].resize(static_cast<std::size_t>(s.ranks));
      MPI_Gather(&m, sizeof(measured), MPI_BYTE, runs[v].data(), sizeof(measured), MPI_BYTE, 0,
                 MPI_COMM_WORLD);
    }
    int identical = outputs_identical(mine) ? 1 : 0;
    MPI_Allreduce(MPI_IN_PLACE, &identical, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (comm.rank() == 0)
      report(s, runs, identical != 0);
    if (!s.trace.empty()) {
      trace.write_file(s.trace + ".rank" + std::to_string(comm.rank()));
      if (comm.rank() == 0)
        std::printf("traces of the partitioned block: %s.rank<N> (one per rank)\n",
                    s.trace.c_str());
    }
    status = identical ? 0 : 1;
  } catch (const cli::bad_option& e) {
    if (rank == 0) // the others say the same
      std::fprintf(stderr, "moe_demo: %s\n", e.what());
    status = 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moe_demo: rank %d: %s\n", rank, e.what());
    MPI_Abort(MPI_COMM_WORLD, 1); // the other ranks would wait for this one
  }
  MPI_Finalize();
  return status;
}
#endif

int run(int argc, char** argv) {
  settings s;
  if (!declare(s).parse(argc, argv))
    return 0; // --help
#ifdef WEAVE_DEMO_MPI
  if (std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr)
    return run_mpi(s);
#endif
  check(s, s.ranks);
  const auto where = weave::placement::contiguous(s.experts, s.ranks);
  std::vector<rank_data> data;
  const double aux_loss = make_data(s, data);
  print_header(s, "in-process", aux_loss);
  std::printf("link: %.2f GB/s + %.0f us per rank pair (emulated)\n", s.link_gbps, s.latency_us);
  weave::trace_writer trace;
  std::vector<measured> runs[variants];
  for (int v = 0; v < variants; ++v) {
    const bool traced = v == static_cast<int>(variant::partitioned);
    runs[v] = run_local(s, where, static_cast<variant>(v), data, traced ? &trace : nullptr);
  }
  bool identical = true;
  for (const rank_data& d : data)
    identical = identical && outputs_identical(d);
  report(s, runs, identical);
  if (!s.trace.empty()) {
    trace.write_file(s.trace);
    std::printf("trace of the partitioned block: %s (open in ui.perfetto.dev)\n", s.trace.c_str());
  }
  return identical ? 0 : 1;
}

} // namespace

int main(int argc, char** argv) {
  // Under mpirun every rank refuses the same bad option; rank 0 says so.
  return cli::run_main(
      "moe_demo", [&] { return run(argc, argv); }, cli::first_or_only_process());
}
