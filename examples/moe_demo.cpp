// weave's main demo: one MoE layer (gate -> dispatch -> experts -> combine) on 4 in-process
// ranks joined by an emulated network link, run unpipelined and pipelined side by side.
// The defaults are sized for a small CPU machine; pass --tokens=8192 --hidden=1024 for a
// layer of a mid-size model.
//
// What is real: gating, capacity, the dispatch plans, every row gathered, sent (copied between
// ranks), scattered, merged and returned. What is emulated: the link (each transfer completes
// after latency + bytes / bandwidth, sleeping) and the experts' arithmetic cost (each expert
// batch copies its rows scaled by a per-expert power of two (exact in bf16, so cheap), then
// sleeps rows x --expert-ns-per-row, as a GPU's grouped GEMM would leave the CPU free). Prints
// copies per token against naive per-(token, expert) sending, bytes moved, exposed communication
// and the speedup, and writes a Chrome trace (chrome://tracing or ui.perfetto.dev) of the pipelined
// run.
//
//   moe_demo [--tokens=4096] [--experts=64] [--k=8] [--hidden=512] [--ranks=4] [--chunks=4]
//            [--link-gbps=0.5] [--latency-us=10] [--expert-ns-per-row=500] [--iterations=3]
//            [--trace=moe_demo.trace.json]
// Under mpirun (when built with MPI) each process is one rank and MPI is the link:
//   mpirun -np 4 moe_demo
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
#include <map>
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
  int iterations = 3;
  std::string trace = "moe_demo.trace.json";
};

settings parse(int argc, char** argv) {
  std::map<std::string, std::string> args;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    const auto eq = a.find('=');
    if (a.rfind("--", 0) != 0 || eq == std::string::npos) {
      std::fprintf(stderr, "moe_demo: arguments are --name=value (got '%s')\n", a.c_str());
      std::exit(2);
    }
    args[a.substr(2, eq - 2)] = a.substr(eq + 1);
  }
  settings s;
  auto take = [&](const char* name, auto& field) {
    const auto it = args.find(name);
    if (it == args.end())
      return;
    if constexpr (std::is_same_v<std::decay_t<decltype(field)>, std::string>)
      field = it->second;
    else
      field = static_cast<std::decay_t<decltype(field)>>(std::stod(it->second));
    args.erase(it);
  };
  take("tokens", s.tokens);
  take("experts", s.experts);
  take("k", s.k);
  take("hidden", s.hidden);
  take("ranks", s.ranks);
  take("chunks", s.chunks);
  take("link-gbps", s.link_gbps);
  take("latency-us", s.latency_us);
  take("expert-ns-per-row", s.expert_ns_per_row);
  take("iterations", s.iterations);
  take("trace", s.trace);
  if (!args.empty()) {
    std::fprintf(stderr, "moe_demo: unknown argument --%s\n", args.begin()->first.c_str());
    std::exit(2);
  }
  return s;
}

using row_t = weave::bfloat16;

struct rank_data {
  weave::host_matrix<row_t> x, y_unpipelined, y_pipelined;
  std::vector<std::int32_t> ids;
  std::vector<float> weights;
};

struct measured {
  weave::pipeline_timing timing;
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

// Runs `iterations` forwards with `chunks` on one rank; returns its median timing.
//! [generic]
template <class Comm>
measured run_rank(Comm& comm, const settings& s, const weave::placement& where, int chunks,
                  rank_data& d, bool pipelined_output, weave::overlap::trace_writer* trace,
                  weave::host_event::clock::time_point origin) {
  weave::moe_options o;
  o.k = s.k;
  o.hidden = s.hidden;
  o.element = weave::dtype::bf16;
  o.max_tokens = s.tokens;
  o.chunks = chunks;
  weave::moe_exchange<Comm> layer(comm, where, o);
  weave::host_stream compute("compute"), comm_stream("comm");
  auto& y = pipelined_output ? d.y_pipelined : d.y_unpipelined;
  std::vector<weave::pipeline_timing> timings;
  for (int it = 0; it <= s.iterations; ++it) { // iteration 0 warms the buffers up
    layer.forward(d.x.view(), d.ids, d.weights, y.view(), emulated_experts{s.expert_ns_per_row},
                  compute, comm_stream);
    compute.synchronize();
    comm_stream.synchronize();
    if (it > 0)
      timings.push_back(weave::measure(layer.pipeline()));
  }
  std::sort(timings.begin(), timings.end(),
            [](const auto& a, const auto& b) { return a.makespan_ms < b.makespan_ms; });
  if (trace)
    weave::add_to_trace(*trace, layer.pipeline(), comm.rank(), origin);
  return {timings[timings.size() / 2], layer.stats()};
}
//! [generic]

// Every rank of an in-process world, one thread each.
std::vector<measured> run_local(const settings& s, const weave::placement& where, int chunks,
                                std::vector<rank_data>& data, bool pipelined_output,
                                weave::overlap::trace_writer* trace) {
  weave::local_world_options options;
  options.link = weave::emulated_link::gbps(
      s.link_gbps, std::chrono::nanoseconds(static_cast<std::int64_t>(s.latency_us * 1e3)));
  weave::local_world world(s.ranks, options);
  std::vector<measured> result(static_cast<std::size_t>(s.ranks));
  std::mutex trace_mutex;
  const auto origin = weave::host_event::clock::now();
  world.run([&](weave::local_communicator& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    weave::overlap::trace_writer mine;
    result[r] = run_rank(comm, s, where, chunks, data[r], pipelined_output, trace ? &mine : nullptr,
                         origin);
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

// Each rank's tokens and gate logits (the same on every process: one seed); the gate picks
// top-k with softmax weights. Returns the mean GShard auxiliary loss.
double make_data(const settings& s, std::vector<rank_data>& data) {
  data.resize(static_cast<std::size_t>(s.ranks));
  std::mt19937 rng(2026);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  double aux_loss = 0;
  for (rank_data& d : data) {
    d.x = weave::host_matrix<row_t>(s.tokens, s.hidden);
    for (row_t& v : d.x.elements())
      v = row_t(normal(rng));
    weave::host_matrix<float> logits(s.tokens, static_cast<std::size_t>(s.experts));
    for (float& v : logits.elements())
      v = 2.0f * normal(rng);
    d.ids.resize(s.tokens * static_cast<std::size_t>(s.k));
    d.weights.resize(d.ids.size());
    weave::gate_options gate;
    gate.k = s.k;
    gate.renormalize = true;
    aux_loss += weave::top_k_gate(logits.view(), gate, d.ids, d.weights).aux_loss;
    d.y_unpipelined = weave::host_matrix<row_t>(s.tokens, s.hidden);
    d.y_pipelined = weave::host_matrix<row_t>(s.tokens, s.hidden);
  }
  return aux_loss / s.ranks;
}

bool outputs_identical(const rank_data& d) {
  return std::memcmp(d.y_unpipelined.data(), d.y_pipelined.data(),
                     d.x.rows() * d.x.cols() * sizeof(row_t)) == 0;
}

void print_header(const settings& s, const char* world, double aux_loss) {
  std::printf("weave MoE demo: %d ranks (%s), %zu tokens/rank, %d experts, top-%d, hidden %zu "
              "(bf16), experts %.0f ns/row\n",
              s.ranks, world, s.tokens, s.experts, s.k, s.hidden, s.expert_ns_per_row);
  std::printf("gate: softmax top-%d, GShard aux loss %.4f (1.0 = perfectly balanced)\n", s.k,
              aux_loss);
}

void report(const settings& s, const std::vector<measured>& plain,
            const std::vector<measured>& piped, bool identical) {
  // Volumes, summed over ranks; a naive dispatch sends one row per (token, expert).
  std::int64_t sent = 0, local = 0, naive = 0, dropped = 0;
  for (const measured& m : plain) {
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
  auto slowest = [](const std::vector<measured>& m) { // the slowest rank sets the layer's time
    weave::pipeline_timing t{};
    for (const measured& x : m)
      if (x.timing.makespan_ms > t.makespan_ms)
        t = x.timing;
    return t;
  };
  const auto a = slowest(plain), b = slowest(piped);
  std::printf("\n%-22s %12s %12s %14s %12s\n", "", "layer (ms)", "compute (ms)", "exposed comm",
              "comm busy");
  std::printf("%-22s %12.1f %12.1f %11.1f ms %9.1f ms\n", "unpipelined (C = 1)", a.makespan_ms,
              a.compute_busy_ms, a.exposed_comm_ms(), a.comm_busy_ms);
  std::printf("%-22s %12.1f %12.1f %11.1f ms %9.1f ms\n",
              ("pipelined (C = " + std::to_string(s.chunks) + ")").c_str(), b.makespan_ms,
              b.compute_busy_ms, b.exposed_comm_ms(), b.comm_busy_ms);
  const double hidden_pct =
      a.exposed_comm_ms() > 0 ? 100.0 * (1.0 - b.exposed_comm_ms() / a.exposed_comm_ms()) : 0.0;
  std::printf("\npipelining saved %.1f ms per layer: %.0f%% of the exposed communication hidden, "
              "%.2fx speedup\n",
              a.makespan_ms - b.makespan_ms, hidden_pct, a.makespan_ms / b.makespan_ms);
  std::printf("pipelined output bitwise identical to unpipelined: %s\n", identical ? "yes" : "NO");
}

#ifdef WEAVE_DEMO_MPI
// One rank per process under mpirun; the link is whatever MPI uses.
int run_mpi(settings s) {
  int provided = 0;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
  int status = 0;
  {
    weave::mpi_communicator comm(MPI_COMM_WORLD);
    s.ranks = comm.size();
    if (s.experts % s.ranks != 0) {
      if (comm.rank() == 0)
        std::fprintf(stderr, "moe_demo: --experts must be a multiple of the MPI ranks\n");
      status = 2;
    } else {
      const auto where = weave::placement::contiguous(s.experts, s.ranks);
      std::vector<rank_data> data;
      const double aux_loss = make_data(s, data);
      rank_data& mine = data[static_cast<std::size_t>(comm.rank())];
      if (comm.rank() == 0)
        print_header(s, "MPI processes", aux_loss);
      const auto origin = weave::host_event::clock::now();
      weave::overlap::trace_writer trace;
      const measured plain = run_rank(comm, s, where, 1, mine, false, nullptr, origin);
      const measured piped = run_rank(comm, s, where, s.chunks, mine, true, &trace, origin);
      std::vector<measured> all_plain(static_cast<std::size_t>(s.ranks));
      std::vector<measured> all_piped(all_plain.size());
      MPI_Gather(&plain, sizeof(measured), MPI_BYTE, all_plain.data(), sizeof(measured), MPI_BYTE,
                 0, MPI_COMM_WORLD);
      MPI_Gather(&piped, sizeof(measured), MPI_BYTE, all_piped.data(), sizeof(measured), MPI_BYTE,
                 0, MPI_COMM_WORLD);
      int identical = outputs_identical(mine) ? 1 : 0;
      MPI_Allreduce(MPI_IN_PLACE, &identical, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
      if (comm.rank() == 0)
        report(s, all_plain, all_piped, identical != 0);
      if (!s.trace.empty()) {
        trace.write_file(s.trace + ".rank" + std::to_string(comm.rank()));
        if (comm.rank() == 0)
          std::printf("traces of the pipelined layer: %s.rank<N> (one per rank)\n",
                      s.trace.c_str());
      }
      status = identical ? 0 : 1;
    }
  }
  MPI_Finalize();
  return status;
}
#endif

} // namespace

int main(int argc, char** argv) {
  const settings s = parse(argc, argv);
#ifdef WEAVE_DEMO_MPI
  if (std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr)
    return run_mpi(s);
#endif
  if (s.experts % s.ranks != 0) {
    std::fprintf(stderr, "moe_demo: --experts must be a multiple of --ranks\n");
    return 2;
  }
  const auto where = weave::placement::contiguous(s.experts, s.ranks);
  std::vector<rank_data> data;
  const double aux_loss = make_data(s, data);
  print_header(s, "in-process", aux_loss);
  std::printf("link: %.2f GB/s + %.0f us per rank pair (emulated)\n", s.link_gbps, s.latency_us);
  const auto plain = run_local(s, where, 1, data, false, nullptr);
  weave::overlap::trace_writer trace;
  const auto piped = run_local(s, where, s.chunks, data, true, &trace);
  bool identical = true;
  for (const rank_data& d : data)
    identical = identical && outputs_identical(d);
  report(s, plain, piped, identical);
  if (!s.trace.empty()) {
    trace.write_file(s.trace);
    std::printf("trace of the pipelined layer: %s (open in ui.perfetto.dev)\n", s.trace.c_str());
  }
  return identical ? 0 : 1;
}
