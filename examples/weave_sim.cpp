// weave-sim: compares placements, device limits M, all-to-all algorithms and pipeline degrees
// for an MoE model on a cluster, by simulation. Prints a table (or JSON with --json); see
// docs/sim.md.
#include <weave/placement.hpp>
#include <weave/sim.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

using namespace weave::sim;

const char* usage = R"(usage: weave-sim [options]
cluster:  --cluster h100|h200|a100   --nodes N   --cluster-file PATH
model:    --layers N --hidden N --ffn N --experts N --k N --tokens N (per GPU) --bytes N
routing:  --trace PATH (layer l replays the file's layer l mod its layers) | synthetic: --zipf S --affinity A
          --clusters N --seed N --distinct-layers N (default 4)
compare:  --placements contiguous,collaborative,replicated   --redundant N (replica slots)
          --limits 0,4 (device limit M, 0 = none)   --degrees 1,2,4
          --a2a flat,hierarchical   --links shared|per_peer
other:    --sample N (tokens per rank simulated, default 256; 0 = all)
          --json   --chrome PATH (trace of the fastest configuration)   --help
)";

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty())
      out.push_back(item);
  return out;
}

long long number(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0')
    throw std::runtime_error(flag + ": '" + v + "' is not an integer");
  return x;
}

double real(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0')
    throw std::runtime_error(flag + ": '" + v + "' is not a number");
  return x;
}

struct row {
  std::string placement;
  int limit;
  std::string a2a;
  long long degree;
  sim_result result;
};

int run(int argc, char** argv) {
  std::string preset = "h100", cluster_file, trace_file, chrome;
  int nodes = 2, redundant = -1, distinct = 4;
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
  std::vector<long long> degrees = {1, 2, 4};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::cout << usage;
      return 0;
    }
    if (a == "--json") {
      json = true;
      continue;
    }
    if (i + 1 >= argc)
      throw std::runtime_error(a + " needs a value (see --help)");
    const std::string v = argv[++i];
    if (a == "--cluster")
      preset = v;
    else if (a == "--cluster-file")
      cluster_file = v;
    else if (a == "--nodes")
      nodes = static_cast<int>(number(a, v));
    else if (a == "--layers")
      m.layers = static_cast<int>(number(a, v));
    else if (a == "--hidden")
      m.hidden = static_cast<int>(number(a, v));
    else if (a == "--ffn")
      m.ffn_hidden = static_cast<int>(number(a, v));
    else if (a == "--experts")
      m.experts = static_cast<int>(number(a, v));
    else if (a == "--k")
      m.k = static_cast<int>(number(a, v));
    else if (a == "--tokens")
      m.tokens_per_gpu = number(a, v);
    else if (a == "--bytes")
      m.bytes_per_element = static_cast<int>(number(a, v));
    else if (a == "--trace")
      trace_file = v;
    else if (a == "--zipf")
      src.synthetic.zipf = real(a, v);
    else if (a == "--affinity")
      src.synthetic.affinity = real(a, v);
    else if (a == "--clusters")
      src.synthetic.clusters = static_cast<int>(number(a, v));
    else if (a == "--seed")
      src.synthetic.seed = static_cast<std::uint64_t>(number(a, v));
    else if (a == "--distinct-layers")
      distinct = static_cast<int>(number(a, v));
    else if (a == "--placements")
      placements = split(v);
    else if (a == "--redundant")
      redundant = static_cast<int>(number(a, v));
    else if (a == "--limits") {
      limits.clear();
      for (const auto& x : split(v))
        limits.push_back(static_cast<int>(number(a, x)));
    } else if (a == "--degrees") {
      degrees.clear();
      for (const auto& x : split(v))
        degrees.push_back(number(a, x));
    } else if (a == "--a2a")
      algorithms = split(v);
    else if (a == "--links") {
      if (v != "shared" && v != "per_peer")
        throw std::runtime_error("--links: expected shared or per_peer, got '" + v + "'");
      base.links = v == "shared" ? link_model::shared : link_model::per_peer;
    } else if (a == "--sample")
      base.traffic.sample_tokens = number(a, v);
    else if (a == "--chrome")
      chrome = v;
    else
      throw std::runtime_error("unknown option '" + a + "' (see --help)");
  }
  const cluster c =
      cluster_file.empty() ? cluster::from_preset(preset, nodes) : read_cluster_file(cluster_file);
  m.validated();
  if (!trace_file.empty())
    src.layer_traces = weave::read_trace_layers_file(trace_file).layers; // layer l: l % count
  src.distinct_layers = distinct;
  const weave::topology topo = c.topology();
  const int D = c.num_ranks();
  if (redundant < 0)
    redundant = D; // one replica slot per GPU

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
        per_layer.push_back(weave::place_replicated(stats, topo, ro));
      } else if (name == "load_balanced")
        per_layer.push_back(weave::place_load_balanced(stats, topo));
      else
        throw std::runtime_error("unknown placement '" + name + "'");
    }
    policies.emplace_back(name, std::move(per_layer));
  }

  std::vector<row> rows;
  for (const auto& [name, per_layer] : policies)
    for (const int limit : limits)
      for (const std::string& alg : algorithms)
        for (const long long degree : degrees) {
          if (alg != "flat" && alg != "hierarchical")
            throw std::runtime_error("--a2a: expected flat or hierarchical, got '" + alg + "'");
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
                  r.limit > 0 ? std::to_string(r.limit).c_str() : "-", r.a2a.c_str(), r.degree,
                  r.result.step_us / 1e3, r.result.exposed_comm_us / 1e3, r.result.compute_us / 1e3,
                  r.result.imbalance_max, &r == &*best ? "  <- fastest" : "");
  }
  if (!chrome.empty())
    chrome_trace(best->result).write_file(chrome);
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "weave-sim: " << e.what() << '\n';
    return 2;
  }
}
