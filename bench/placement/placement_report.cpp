// Placement report: copies per token (CT), cross-device bytes per token and max/mean device
// load for each placement policy, on synthetic traces shaped like OLMoE, DeepSeek-MoE,
// Qwen-MoE and a 256-expert model, and on recorded traces (every layer of a trace file, e.g.
// the learned one in bench/placement/traces), at 4..32 devices. Statistics are profiled on the
// first half of each trace and the placements evaluated on the second half.
//
//   placement_report [--tokens N] [--affinity A] [--zipf S] [--cluster-size C]
//                    [--load-weight L] [--spare-per-device R] [--synthetic all|none|NAME,...]
//                    [--trace FILE] [--trace-hidden H] [--json FILE]

#include "command_line.hpp"

#include <weave/placement.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <vector>

namespace {

struct model {
  const char* name;
  int experts, k, hidden;
};

// A trace split into the tokens statistics are profiled on and those placements are judged on.
struct workload {
  std::string name;
  int experts = 0, k = 0, hidden = 0;
  std::vector<std::int32_t> profile, eval;
  std::string group; // layers of one recorded trace share a group (averaged in the summary)
};

struct row {
  std::string model, policy, group;
  int experts = 0, k = 0, devices = 0, nodes = 0, slots_per_device = 0;
  double ct = 0, lower = 0, upper = 0, random = 0, remote = 0, cross_node = 0, bytes = 0;
  double max_mean = 0, vs_contiguous = 0;
};

using place_fn = std::function<bool(const weave::expert_statistics&, const weave::topology&,
                                    weave::placement&, weave::replica_options&)>;

struct policy {
  std::string name;
  place_fn place; // false when the policy does not apply to this shape
};

// `spare` slots per device, plus padding so E + redundant divides over the devices.
int spare = 1;
int redundant_for(int E, int D) {
  return spare * D + (D - E % D) % D;
}

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

int run(int argc, char** argv) {
  std::size_t tokens = 20000;
  double affinity = 0.8, zipf = 0.6;
  int cluster_size = 8;
  double load_weight = 4.0;
  std::string json, trace_file;
  std::vector<std::string> synthetic_models = {"all"};
  int trace_hidden = 2048;
  cli::options opts(
      "placement_report",
      "Copies per token, cross-device bytes and load of each placement policy on "
      "model-shaped synthetic traces\nand recorded trace files, at 4 to 32 devices.\n");
  opts.number("tokens", tokens, std::size_t{1}, std::size_t{1} << 22,
              "tokens to profile on, and as many to evaluate on");
  opts.number("affinity", affinity, 0.0, 1.0, "synthetic: chance a choice stays in its cluster");
  opts.number("zipf", zipf, 0.0, 100.0, "synthetic: expert popularity skew");
  opts.number("cluster-size", cluster_size, 1, 256, "synthetic: experts per cluster");
  opts.number("load-weight", load_weight, 0.0, 1e6, "collaborative placement's load weight");
  opts.number("spare-per-device", spare, 0, 64, "replica slots per device");
  opts.choices("synthetic", synthetic_models,
               {"all", "none", "OLMoE", "DeepSeek-MoE", "Qwen-MoE", "E256-k8"}, 6,
               "synthetic traces to evaluate");
  opts.text("trace", trace_file, "FILE", "trace file whose every layer is evaluated too");
  opts.number("trace-hidden", trace_hidden, 1, 1 << 20, "hidden size of the trace's rows");
  opts.text("json", json, "FILE", "also write the rows as JSON");
  if (!opts.parse(argc, argv))
    return 0; // --help
  std::string synthetic;
  for (const std::string& name : synthetic_models)
    synthetic += (synthetic.empty() ? "" : ",") + name;
  const std::vector<model> models = {{"OLMoE", 64, 8, 2048},
                                     {"DeepSeek-MoE", 64, 6, 2048},
                                     {"Qwen-MoE", 60, 4, 2048},
                                     {"E256-k8", 256, 8, 7168}};
  const weave::replica_options plain{};
  const weave::replica_options visited{weave::replica_policy::in_turn, true};
  auto even = [](const weave::expert_statistics& s, const weave::topology& t) {
    return s.num_experts() % t.num_devices() == 0;
  };
  // Collaboration-aware placement, then replicated starting from it (few experts move).
  auto collab_replicated = [&](const weave::expert_statistics& s, const weave::topology& t,
                               weave::placement& p, weave::replica_options& r,
                               const weave::replica_options& router) {
    if (!even(s, t))
      return false;
    weave::collaboration_options c;
    c.load_weight = load_weight;
    const auto base = weave::place_collaborative(s, t, c);
    weave::replication_options o;
    o.redundant_slots = redundant_for(s.num_experts(), t.num_devices());
    o.current = &base;
    o.keep_tolerance = 0.05;
    p = weave::place_replicated(s, t, o);
    r = router;
    return true;
  };
  const std::vector<policy> policies = {
      {"contiguous",
       [&](const auto& s, const auto& t, auto& p, auto& r) {
         if (!even(s, t))
           return false;
         p = weave::place_contiguous(s.num_experts(), t);
         r = plain;
         return true;
       }},
      {"round-robin",
       [&](const auto& s, const auto& t, auto& p, auto& r) {
         if (!even(s, t))
           return false;
         p = weave::place_round_robin(s.num_experts(), t);
         r = plain;
         return true;
       }},
      {"load-balanced",
       [&](const auto& s, const auto& t, auto& p, auto& r) {
         if (!even(s, t))
           return false;
         p = weave::place_load_balanced(s, t);
         r = plain;
         return true;
       }},
      {"collab",
       [&](const auto& s, const auto& t, auto& p, auto& r) {
         if (!even(s, t))
           return false;
         p = weave::place_collaborative(s, t);
         r = plain;
         return true;
       }},
      {"collab-flat",
       [&](const auto& s, const auto& t, auto& p, auto& r) {
         if (!even(s, t) || t.nodes == 1)
           return false;
         weave::collaboration_options o;
         o.two_level = false;
         p = weave::place_collaborative(s, t, o);
         r = plain;
         return true;
       }},
      {"collab+load",
       [&](const auto& s, const auto& t, auto& p, auto& r) {
         if (!even(s, t))
           return false;
         weave::collaboration_options o;
         o.load_weight = load_weight;
         p = weave::place_collaborative(s, t, o);
         r = plain;
         return true;
       }},
      {"replicated",
       [&](const auto& s, const auto& t, auto& p, auto& r) {
         weave::replication_options o;
         o.redundant_slots = redundant_for(s.num_experts(), t.num_devices());
         p = weave::place_replicated(s, t, o);
         r = plain;
         return true;
       }},
      {"collab+replicated", [&](const auto& s, const auto& t, auto& p,
                                auto& r) { return collab_replicated(s, t, p, r, plain); }},
      {"collab+replicated/visited",
       [&](const auto& s, const auto& t, auto& p, auto& r) {
         return collab_replicated(s, t, p, r, visited);
       }},
  };

  std::vector<workload> workloads;
  for (const model& m : models) {
    if (synthetic == "none" ||
        (synthetic != "all" &&
         ("," + synthetic + ",").find(std::string(",") + m.name + ",") == std::string::npos))
      continue;
    weave::trace_options o;
    o.num_experts = m.experts;
    o.k = m.k;
    o.tokens = 2 * tokens;
    o.clusters = std::max(1, m.experts / cluster_size);
    o.affinity = affinity;
    o.zipf = zipf;
    o.seed = 42;
    const auto trace = weave::generate_trace(o);
    const auto half = trace.ids.begin() + static_cast<std::ptrdiff_t>(tokens * m.k);
    workloads.push_back(
        {m.name, m.experts, m.k, m.hidden, {trace.ids.begin(), half}, {half, trace.ids.end()}, ""});
  }
  if (!trace_file.empty()) {
    const auto layers = weave::read_trace_layers_file(trace_file).layers;
    const std::string stem = std::filesystem::path(trace_file).stem().string();
    for (std::size_t l = 0; l < layers.size(); ++l) {
      const auto& t = layers[l];
      const std::size_t half = t.num_tokens() / 2 * static_cast<std::size_t>(t.k);
      workloads.push_back({stem + " L" + std::to_string(l),
                           t.num_experts,
                           t.k,
                           trace_hidden,
                           {t.ids.begin(), t.ids.begin() + static_cast<std::ptrdiff_t>(half)},
                           {t.ids.begin() + static_cast<std::ptrdiff_t>(half), t.ids.end()},
                           stem});
    }
  }

  std::vector<row> rows;
  for (const workload& w : workloads) {
    const model m{w.name.c_str(), w.experts, w.k, w.hidden};
    const std::span<const std::int32_t> eval(w.eval);
    weave::expert_statistics stats(m.experts);
    stats.accumulate(w.profile, m.k);
    for (const int D : {4, 8, 16, 32}) {
      const auto topo = D <= 8 ? weave::topology::flat(D) : weave::topology::grid(D / 8, 8);
      double contiguous_ct = 0;
      for (const policy& pol : policies) {
        weave::placement p;
        weave::replica_options ro;
        if (!pol.place(stats, topo, p, ro))
          continue;
        const auto r = weave::evaluate_placement(p, topo, eval, m.k, 2.0 * m.hidden, {}, ro);
        if (pol.name == "contiguous")
          contiguous_ct = r.copies_per_token;
        row x;
        x.model = w.name;
        x.group = w.group;
        x.policy = pol.name;
        x.experts = m.experts;
        x.k = m.k;
        x.devices = D;
        x.nodes = topo.nodes;
        x.slots_per_device = p.slots_per_device();
        x.ct = r.copies_per_token;
        x.lower = weave::copies_per_token_lower_bound(m.experts, m.k, D);
        x.upper = weave::copies_per_token_upper_bound(m.k, D);
        x.random = m.experts % D == 0 ? weave::copies_per_token_random(m.experts, m.k, D) : -1;
        x.remote = r.remote_per_token;
        x.cross_node = r.cross_node_per_token;
        x.bytes = r.bytes_per_token;
        x.max_mean = r.max_mean_load;
        x.vs_contiguous = contiguous_ct > 0 ? 1.0 - r.copies_per_token / contiguous_ct : 0.0;
        rows.push_back(x);
      }
    }
  }

  // Recorded traces: each (devices, policy) averaged over the trace's layers.
  std::map<std::tuple<std::string, int, std::string>, std::pair<row, int>> means;
  std::vector<std::tuple<std::string, int, std::string>> order;
  for (const row& x : rows) {
    if (x.group.empty())
      continue;
    const auto key = std::make_tuple(x.group, x.devices, x.policy);
    auto [it, fresh] = means.try_emplace(key, x, 0);
    if (fresh) {
      order.push_back(key);
    } else {
      row& m = it->second.first;
      m.ct += x.ct;
      m.remote += x.remote;
      m.cross_node += x.cross_node;
      m.bytes += x.bytes;
      m.max_mean += x.max_mean;
    }
    ++it->second.second;
  }
  for (const auto& key : order) {
    auto [m, n] = means.at(key);
    m.model = m.group + " (mean of " + std::to_string(n) + " layers)";
    m.ct /= n;
    m.remote /= n;
    m.cross_node /= n;
    m.bytes /= n;
    m.max_mean /= n;
    const auto& base = means.at(std::make_tuple(m.group, m.devices, std::string("contiguous")));
    m.vs_contiguous = 1.0 - m.ct / (base.first.ct / base.second);
    rows.push_back(m);
  }

  std::printf("tokens %zu (profile) + %zu (evaluate), affinity %.2f, zipf %.2f, cluster size %d, "
              "load weight %.2f, %d spare slot(s) per device, bf16 rows\n\n",
              tokens, tokens, affinity, zipf, cluster_size, load_weight, spare);
  std::printf(
      "| model | E | k | D | nodes | policy | slots/dev | CT | CT lb | min(k,D) | CT random "
      "| CT vs contiguous | remote/token | cross-node/token | KiB/token | max/mean load |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const row& x : rows) {
    const std::string random = x.random < 0 ? "-" : fixed(x.random, 3);
    const bool baseline = x.policy == "contiguous" || x.vs_contiguous == 0;
    const std::string delta = baseline ? "-" : fixed(-100.0 * x.vs_contiguous, 1) + " %";
    std::printf("| %s | %d | %d | %d | %d | %s | %d | %.3f | %.0f | %.0f | %s | %s | %.3f | %.3f "
                "| %.1f | %.3f |\n",
                x.model.c_str(), x.experts, x.k, x.devices, x.nodes, x.policy.c_str(),
                x.slots_per_device, x.ct, x.lower, x.upper, random.c_str(), delta.c_str(), x.remote,
                x.cross_node, x.bytes / 1024.0, x.max_mean);
  }
  if (!json.empty()) {
    std::ofstream out(json);
    out << "{\"tokens\": " << tokens << ", \"affinity\": " << affinity << ", \"zipf\": " << zipf
        << ", \"cluster_size\": " << cluster_size << ", \"load_weight\": " << load_weight
        << ", \"spare_per_device\": " << spare << ", \"rows\": [\n";
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const row& x = rows[i];
      out << "  {\"model\": \"" << x.model << "\", \"policy\": \"" << x.policy
          << "\", \"experts\": " << x.experts << ", \"k\": " << x.k
          << ", \"devices\": " << x.devices << ", \"nodes\": " << x.nodes
          << ", \"slots_per_device\": " << x.slots_per_device << ", \"ct\": " << x.ct
          << ", \"ct_lower_bound\": " << x.lower << ", \"ct_upper_bound\": " << x.upper
          << ", \"ct_random\": " << x.random
          << ", \"ct_reduction_vs_contiguous\": " << x.vs_contiguous
          << ", \"remote_per_token\": " << x.remote
          << ", \"cross_node_per_token\": " << x.cross_node << ", \"bytes_per_token\": " << x.bytes
          << ", \"max_mean_load\": " << x.max_mean << "}" << (i + 1 < rows.size() ? ",\n" : "\n");
    }
    out << "]}\n";
  }
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  return cli::run_main("placement_report", [&] { return run(argc, argv); });
}
