// weave-sim: compares placements, device limits M, all-to-all algorithms and pipeline degrees
// for an MoE model on a cluster, by simulation. Prints a table (or JSON with --json); see
// docs/sim.md.
#include "command_line.hpp"

#include <weave/placement.hpp>
#include <weave/sim.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <limits>
#include <string>
#include <vector>

namespace {

using namespace weave::sim;

// Bounds that keep a run's memory and time in reason: the simulated ranks (a preset's nodes x 8
// or a cluster file's GPUs), and the routed tokens (ranks x tokens simulated per rank).
constexpr int most_ranks = 32768;
constexpr std::int64_t most_routed_tokens = std::int64_t{1} << 26;

struct row {
  std::string placement;
  int limit;
  std::string a2a;
  std::int64_t degree;
  sim_result result;
};

int run(int argc, char** argv) {
  std::string preset = "h100", cluster_file, trace_file, chrome, links = "shared";
  int nodes = 2, redundant = -1, distinct = 4;
  std::vector<int> spare; // per GPU, instead of `redundant`
  bool json = false;
  moe_model m;
  m.name = "model";
  routing_source src;
  src.synthetic.zipf = 0.8;
  sim_options base;
  base.traffic.sample_tokens = 256;
  std::vector<std::string> placements = {"contiguous", "collaborative", "replicated"};
  std::vector<std::string> algorithms = {"flat"};
  std::vector<int> limits = {0};
  std::vector<std::int64_t> degrees = {1, 2, 4};

  cli::options opts(
      "weave-sim", "Compares placements, device limits, all-to-all algorithms and pipeline degrees "
                   "of an MoE model\non a cluster by simulation (docs/sim.md). At most " +
                       std::to_string(most_ranks) +
                       " GPUs (--nodes x 8, or the cluster file's)\nand at most " +
                       std::to_string(most_routed_tokens) +
                       " routed tokens (GPUs x tokens simulated per GPU).\n");
  opts.section("cluster:");
  opts.choice("cluster", preset, {"h100", "h200", "a100"}, "preset of 8 GPUs per node");
  opts.number("nodes", nodes, 1, most_ranks / 8, "nodes of the preset");
  opts.text("cluster-file", cluster_file, "PATH", "cluster file instead of a preset (docs/sim.md)");
  opts.section("model:");
  opts.number("layers", m.layers, 1, 4096, "MoE layers");
  opts.number("hidden", m.hidden, 1, 1 << 20, "hidden size");
  opts.number("ffn", m.ffn_hidden, 1, 1 << 20, "expert FFN hidden size");
  opts.number("experts", m.experts, 1, 4096, "experts");
  opts.number("k", m.k, 1, 64, "experts per token, at most --experts");
  opts.number("tokens", m.tokens_per_gpu, std::int64_t{1}, std::int64_t{1} << 30, "tokens per GPU");
  opts.number("bytes", m.bytes_per_element, 1, 8, "bytes per element");
  opts.section("routing (a trace, or the synthetic generator):");
  opts.text("trace", trace_file, "PATH",
            "trace file; layer l replays the file's layer l mod its layers");
  opts.number("zipf", src.synthetic.zipf, 0.0, 100.0, "expert popularity skew");
  opts.number("affinity", src.synthetic.affinity, 0.0, 1.0, "chance a choice stays in its cluster");
  opts.number("clusters", src.synthetic.clusters, 1, 4096, "expert clusters, at most --experts");
  opts.number("seed", src.synthetic.seed, std::uint64_t{0},
              std::numeric_limits<std::uint64_t>::max(), "generator seed");
  opts.number("distinct-layers", distinct, 1, 4096, "distinct synthetic layers");
  opts.section("compare:");
  opts.choices("placements", placements,
               {"contiguous", "collaborative", "replicated", "load_balanced"}, 4, "placements");
  opts.number("redundant", redundant, 0, 1 << 16,
              "replica slots of `replicated` (default: one per GPU, or 0 with --spare)");
  opts.numbers("spare", spare, 0, 4096, static_cast<std::size_t>(most_ranks),
               "replica slots of each GPU instead of --redundant");
  opts.numbers("limits", limits, 0, most_ranks, 16, "device limits M (0 = none)");
  opts.numbers("degrees", degrees, std::int64_t{1}, std::int64_t{64}, 16, "pipeline degrees");
  opts.choices("a2a", algorithms, {"flat", "hierarchical"}, 2, "all-to-all algorithms");
  opts.choice("links", links, {"shared", "per_peer"}, "how a rank's messages share its links");
  opts.section("other:");
  opts.number("sample", base.traffic.sample_tokens, std::int64_t{0}, std::int64_t{1} << 20,
              "tokens per GPU simulated (0 = all)");
  opts.flag("json", json, "JSON instead of a table");
  opts.text("chrome", chrome, "PATH", "Chrome trace of the fastest configuration");
  if (!opts.parse(argc, argv))
    return 0; // --help
  base.links = links == "shared" ? link_model::shared : link_model::per_peer;
  if (m.k > m.experts)
    throw cli::bad_option("--k: " + std::to_string(m.k) + " exceeds --experts " +
                          std::to_string(m.experts));
  if (src.synthetic.clusters > m.experts)
    throw cli::bad_option("--clusters: " + std::to_string(src.synthetic.clusters) +
                          " exceeds --experts " + std::to_string(m.experts));

  const cluster c =
      cluster_file.empty() ? cluster::from_preset(preset, nodes) : read_cluster_file(cluster_file);
  if (c.num_ranks() > most_ranks)
    throw cli::bad_option("--cluster-file: " + std::to_string(c.num_ranks()) +
                          " GPUs exceed the tool's " + std::to_string(most_ranks));
  const std::int64_t per_rank = base.traffic.sample_tokens > 0
                                    ? std::min(base.traffic.sample_tokens, m.tokens_per_gpu)
                                    : m.tokens_per_gpu;
  if (per_rank * c.num_ranks() > most_routed_tokens)
    throw cli::bad_option("--tokens/--sample: " + std::to_string(per_rank) + " tokens on each of " +
                          std::to_string(c.num_ranks()) + " GPUs exceed " +
                          std::to_string(most_routed_tokens) + " routed tokens");
  m.validated();
  if (!trace_file.empty())
    src.layer_traces = weave::read_trace_layers_file(trace_file).layers; // layer l: l % count
  src.distinct_layers = distinct;
  const weave::topology topo = c.topology();
  const int D = c.num_ranks();
  if (redundant < 0)
    redundant = spare.empty() ? D : 0; // one replica slot per GPU

  // One placement per distinct routing pool, from that pool's statistics.
  const int pools = routing_pool_count(src, m.layers);
  std::vector<std::pair<std::string, std::vector<weave::placement>>> policies;
  for (const std::string& name : placements) {
    std::vector<weave::placement> per_layer;
    for (int l = 0; l < pools; ++l) {
      if (name == "contiguous") {
        per_layer.push_back(weave::place_contiguous(m.experts, topo));
        continue;
      }
      const weave::routing_trace pool = routing_pool(src, m, D, base.traffic.sample_tokens, l);
      weave::expert_statistics stats(m.experts);
      stats.accumulate(pool.ids, pool.k);
      if (name == "collaborative")
        per_layer.push_back(weave::place_collaborative(stats, topo));
      else if (name == "replicated") {
        weave::replication_options ro;
        ro.redundant_slots = redundant;
        ro.spare_slots_per_device = spare;
        per_layer.push_back(weave::place_replicated(stats, topo, ro));
      } else // load_balanced: the options allow no other name
        per_layer.push_back(weave::place_load_balanced(stats, topo));
    }
    policies.emplace_back(name, std::move(per_layer));
  }

  std::vector<row> rows;
  for (const auto& [name, per_layer] : policies)
    for (const int limit : limits)
      for (const std::string& alg : algorithms)
        for (const std::int64_t degree : degrees) {
          sim_options o = base;
          o.algorithm = alg == "flat" ? a2a_algorithm::flat : a2a_algorithm::hierarchical;
          o.pipeline_degree = degree;
          o.device_limit = limit;
          rows.push_back({name, limit, alg, degree, simulate_cluster(c, m, per_layer, src, o)});
        }

  const auto best = std::min_element(rows.begin(), rows.end(), [](const row& a, const row& b) {
    return a.result.step_us < b.result.step_us;
  });
  if (json) {
    std::cout << "{\"cluster\":\"" << c.name << "\",\"ranks\":" << D << ",\"runs\":[";
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const row& r = rows[i];
      std::cout << (i ? ",\n" : "\n") << "{\"placement\":\"" << r.placement
                << "\",\"device_limit\":" << r.limit << ",\"a2a\":\"" << r.a2a
                << "\",\"degree\":" << r.degree << ",\"result\":";
      write_json(std::cout, r.result, false);
      std::cout << '}';
    }
    std::cout << "\n]}\n";
  } else {
    std::printf("cluster %s: %d nodes x %d GPUs; model: %d layers, hidden %d, ffn %d, E %d, "
                "k %d, %lld tokens/GPU\n",
                c.name.c_str(), c.nodes, c.gpus_per_node, m.layers, m.hidden, m.ffn_hidden,
                m.experts, m.k, static_cast<long long>(m.tokens_per_gpu));
    std::printf("%-14s %5s %-12s %3s %12s %12s %12s %10s\n", "placement", "M", "a2a", "C",
                "step_ms", "exposed_ms", "compute_ms", "imbalance");
    for (const row& r : rows)
      std::printf("%-14s %5s %-12s %3lld %12.3f %12.3f %12.3f %10.3f%s\n", r.placement.c_str(),
                  r.limit > 0 ? std::to_string(r.limit).c_str() : "-", r.a2a.c_str(),
                  static_cast<long long>(r.degree), r.result.step_us / 1e3,
                  r.result.exposed_comm_us / 1e3, r.result.compute_us / 1e3, r.result.imbalance_max,
                  &r == &*best ? "  <- fastest" : "");
  }
  if (!chrome.empty())
    chrome_trace(best->result).write_file(chrome);
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  return cli::run_main("weave-sim", [&] { return run(argc, argv); });
}
