// wire_bytes: the bytes one MoE layer (moe_exchange forward: dispatch and combine, fp32 rows)
// puts on each node's uplink, per placement, against weave's prediction of the cross-node
// payload (weave::sim::layer_traffic_of, the simulator's traffic model). Run under weave-cluster;
// the first rank of each node reads its node's link counters (/sys/class/net/eth0/statistics)
// and the bytes TCP retransmitted (`ss`) around each measured step; the ratio to the prediction
// leaves retransmissions out.
//
// Usage: wire_bytes --trace FILE [--layer L] [--tokens N] [--hidden H] [--check TOLERANCE]
// --check: exit 1 unless every node sent between 1 and 1 + TOLERANCE times the predicted payload.
// Routing: the trace's first half profiles the expert statistics the placements are built from;
// rank r routes tokens r*N+i (i < N, modulo the second half's size) of the second half, as the
// simulator does.
#include <weave/comm/mpi_communicator.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/overlap/moe_exchange.hpp>
#include <weave/placement.hpp>
#include <weave/sim/moe_model.hpp>

#include "node_split.hpp"

#include <mpi.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

namespace {

std::array<std::int64_t, 2> link_counters() { // bytes sent, received by this node's eth0
  std::array<std::int64_t, 2> v{};
  const char* names[2] = {"/sys/class/net/eth0/statistics/tx_bytes",
                          "/sys/class/net/eth0/statistics/rx_bytes"};
  for (int i = 0; i < 2; ++i) {
    std::ifstream f(names[i]);
    f >> v[std::size_t(i)];
  }
  return v;
}

// Bytes TCP retransmitted on this node's connections so far (`ss`'s bytes_retrans summed over
// the namespace's sockets; they live as long as MPI does).
std::int64_t retransmitted_bytes() {
  std::int64_t total = 0;
  if (FILE* p = popen("ss -tinH 2>/dev/null", "r")) {
    char word[256];
    while (std::fscanf(p, "%255s", word) == 1) {
      long long v = 0;
      if (std::sscanf(word, "bytes_retrans:%lld", &v) == 1)
        total += v;
    }
    pclose(p);
  }
  return total;
}

using cluster_test::node_split;

// Per node: bytes its uplink sent and received, and bytes TCP retransmitted, while `step` ran
// (barriers around it).
std::vector<std::int64_t> measure(const node_split& s, const std::function<void()>& step) {
  const auto read = [&] {
    if (s.local_rank != 0)
      return std::array<std::int64_t, 3>{};
    const auto link = link_counters();
    return std::array<std::int64_t, 3>{link[0], link[1], retransmitted_bytes()};
  };
  MPI_Barrier(MPI_COMM_WORLD);
  const auto before = read();
  MPI_Barrier(MPI_COMM_WORLD);
  step();
  MPI_Barrier(MPI_COMM_WORLD);
  const auto after = read();
  std::array<std::int64_t, 3> delta{after[0] - before[0], after[1] - before[1],
                                    after[2] - before[2]};
  std::vector<std::int64_t> all(3 * std::size_t(s.ranks));
  MPI_Allgather(delta.data(), 3, MPI_INT64_T, all.data(), 3, MPI_INT64_T, MPI_COMM_WORLD);
  std::vector<std::int64_t> per_node;
  for (int n = 0; n < s.nodes; ++n) // the node's first rank measured
    for (std::size_t i = 0; i < 3; ++i)
      per_node.push_back(all[3 * std::size_t(n * s.local) + i]);
  return per_node;
}

} // namespace

namespace {

// Everything between MPI_Init and MPI_Finalize (the node split frees its communicators first).
int run(int argc, char** argv) {
  std::string trace_path;
  int layer = 0;
  std::int64_t tokens = 1024;
  int hidden = 1024;
  double tolerance = -1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string key = argv[i];
    if (key == "--trace")
      trace_path = argv[i + 1];
    else if (key == "--layer")
      layer = std::stoi(argv[i + 1]);
    else if (key == "--tokens")
      tokens = std::stoll(argv[i + 1]);
    else if (key == "--hidden")
      hidden = std::stoi(argv[i + 1]);
    else if (key == "--check")
      tolerance = std::stod(argv[i + 1]);
  }
  const node_split s;
  if (trace_path.empty() || s.ranks % s.local != 0) {
    if (s.rank == 0)
      std::fprintf(stderr, "usage: wire_bytes --trace FILE [--layer L] [--tokens N] [--hidden H]"
                           " (under weave-cluster, equal ranks per node)\n");
    return 2;
  }
  const auto layers = weave::read_trace_layers_file(trace_path).layers;
  const weave::routing_trace& t = layers.at(std::size_t(layer));
  const std::size_t half = t.num_tokens() / 2 * std::size_t(t.k);
  weave::expert_statistics stats(t.num_experts);
  stats.accumulate(std::span<const std::int32_t>(t.ids).first(half), t.k);
  weave::routing_trace eval{
      t.num_experts, t.k, {t.ids.begin() + std::ptrdiff_t(half), t.ids.end()}};
  const auto topo = weave::topology::grid(s.nodes, s.local);

  weave::sim::cluster c;
  c.nodes = s.nodes;
  c.gpus_per_node = s.local;
  weave::sim::moe_model m;
  m.hidden = hidden;
  m.experts = t.num_experts;
  m.k = t.k;
  m.tokens_per_gpu = tokens;
  m.bytes_per_element = 4;

  // This rank's tokens: eval tokens rank*N + i (mod its size).
  const std::size_t K = std::size_t(t.k), pool = eval.num_tokens();
  std::vector<std::int32_t> ids(std::size_t(tokens) * K);
  for (std::int64_t i = 0; i < tokens; ++i) {
    const auto token =
        eval.token(std::size_t((std::int64_t(s.rank) * tokens + i) % std::int64_t(pool)));
    std::copy(token.begin(), token.end(), ids.begin() + std::ptrdiff_t(std::size_t(i) * K));
  }
  std::vector<float> weights(ids.size(), 1.0f / float(K));
  std::vector<float> x(std::size_t(tokens) * std::size_t(hidden), 1.0f), y(x.size());

  weave::mpi_communicator comm(MPI_COMM_WORLD);
  weave::host_stream compute("compute"), stream("comm");
  const auto idle = measure(s, [] {}); // the barriers' own bytes
  if (s.rank == 0) {
    std::printf("# %d nodes x %d ranks, trace %s layer %d (E = %d, k = %d), %lld tokens per rank, "
                "rows of %d fp32 (%d bytes)\n",
                s.nodes, s.local, trace_path.c_str(), layer, t.num_experts, t.k,
                static_cast<long long>(tokens), hidden, 4 * hidden);
    std::printf("placement\tnode\tpredicted_tx\tmeasured_tx\tmeasured_rx\tidle_tx\tretransmitted"
                "\tratio\n");
  }
  weave::replication_options replicas; // one spare slot per device (EPLB-style replicas)
  replicas.redundant_slots = s.ranks;
  const std::pair<const char*, weave::placement> placements[] = {
      {"contiguous", weave::place_contiguous(t.num_experts, topo)},
      {"round_robin", weave::place_round_robin(t.num_experts, topo)},
      {"load_balanced", weave::place_load_balanced(stats, topo)},
      {"collaborative", weave::place_collaborative(stats, topo)},
      {"replicated", weave::place_replicated(stats, topo, replicas)},
  };
  int failed = 0;
  for (const auto& [name, p] : placements) {
    const auto traffic = weave::sim::layer_traffic_of(c, m, p, eval);
    weave::moe_options o;
    o.k = t.k;
    o.hidden = std::size_t(hidden);
    o.max_tokens = std::size_t(tokens);
    weave::moe_exchange<weave::mpi_communicator> ex(comm, p, o);
    const auto experts = [](const weave::expert_batch& b) {
      for (std::size_t r = 0; r < b.input.rows(); ++r) {
        const auto in = b.input.row_as<float>(r);
        const auto out = b.output.row_as<float>(r);
        std::copy(in.begin(), in.end(), out.begin());
      }
    };
    const auto step = [&] {
      ex.forward(weave::make_token_view(x, std::size_t(hidden)), ids, weights,
                 weave::make_token_view(y, std::size_t(hidden)), experts, compute, stream);
      ex.synchronize(compute, stream);
    };
    step(); // warm-up: connections, buffers
    const auto wire = measure(s, step);
    if (s.rank == 0)
      for (int n = 0; n < s.nodes; ++n) {
        double predicted = 0; // dispatch rows leaving the node, plus the combine's (its transpose)
        for (int r = n * s.local; r < (n + 1) * s.local; ++r)
          predicted += traffic.flat[std::size_t(r)].sent.inter_bytes +
                       traffic.flat[std::size_t(r)].received.inter_bytes;
        const auto tx = wire[3 * std::size_t(n)], rx = wire[3 * std::size_t(n) + 1];
        const auto retransmitted = wire[3 * std::size_t(n) + 2];
        const auto idle_tx = idle[3 * std::size_t(n)];
        // What the step sent once: retransmitted payload (a loaded machine drops packets in the
        // veth backlog) is counted on its own.
        const double ratio = predicted > 0 ? double(tx - idle_tx - retransmitted) / predicted : 0.0;
        std::printf("%s\t%d\t%.0f\t%lld\t%lld\t%lld\t%lld\t%.4f\n", name, n, predicted,
                    static_cast<long long>(tx), static_cast<long long>(rx),
                    static_cast<long long>(idle_tx), static_cast<long long>(retransmitted), ratio);
        if (tolerance >= 0 && !(ratio >= 1.0 && ratio <= 1.0 + tolerance)) {
          std::printf("FAILED: node %d sent %.4f x the predicted payload, outside [1, %.4f]\n", n,
                      ratio, 1.0 + tolerance);
          failed = 1;
        }
      }
  }
  MPI_Bcast(&failed, 1, MPI_INT, 0, MPI_COMM_WORLD);
  return failed;
}

} // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  const int status = run(argc, argv);
  MPI_Finalize();
  return status;
}
