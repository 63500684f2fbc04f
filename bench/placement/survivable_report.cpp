// What surviving a loss costs: survivable placements (two copies of every expert on distinct
// devices, or nodes) against the plain replicated placement with the same slots and with one
// spare slot per device, on the layers of a recorded routing trace (by default the learned one
// in bench/placement/traces). Statistics are profiled on the first half of each layer's tokens
// and every placement judged on the second half: slots per device, extra copies beyond one per
// expert, max/mean device load, copies per token (CT), and how many single devices and nodes
// take some expert with them. Each row is the mean over the trace's layers.
//
//   survivable_report [--trace FILE]
#include "command_line.hpp"

#include <weave/placement.hpp>

#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace {

struct policy {
  std::string name;
  // The placement, or false when this policy does not apply to the topology.
  std::function<bool(const weave::expert_statistics&, const weave::topology&, weave::placement&)>
      place;
};

} // namespace

int main(int argc, char** argv) {
  std::string trace_file = WEAVE_LEARNED_TRACE;
  try {
    cli::options o("survivable_report",
                   "Survivable vs replicated placements on the layers of a routing trace.\n");
    o.text("trace", trace_file, "FILE", "trace file (default: the learned trace)");
    if (!o.parse(argc, argv))
      return 0;
  } catch (const cli::bad_option& e) {
    std::fprintf(stderr, "survivable_report: %s\n", e.what());
    return 2;
  }
  const auto layers = weave::read_trace_layers_file(trace_file).layers;
  const auto survivable_slots = [](int E, int D) { return (2 * E + D - 1) / D; };
  const std::vector<policy> policies{
      {"replicated, +1 slot/device",
       [](const weave::expert_statistics& s, const weave::topology& t, weave::placement& p) {
         weave::replication_options r;
         r.redundant_slots = t.num_devices();
         if ((s.num_experts() + r.redundant_slots) % t.num_devices() != 0)
           return false;
         p = weave::place_replicated(s, t, r);
         return true;
       }},
      {"replicated, survivable's slots",
       [&](const weave::expert_statistics& s, const weave::topology& t, weave::placement& p) {
         weave::replication_options r;
         r.redundant_slots =
             survivable_slots(s.num_experts(), t.num_devices()) * t.num_devices() - s.num_experts();
         p = weave::place_replicated(s, t, r);
         return true;
       }},
      {"survivable (device)",
       [](const weave::expert_statistics& s, const weave::topology& t, weave::placement& p) {
         p = weave::place_survivable(s.loads(), t, {weave::failure_domain::device});
         return true;
       }},
      {"survivable (node)",
       [](const weave::expert_statistics& s, const weave::topology& t, weave::placement& p) {
         if (t.nodes < 2)
           return false;
         p = weave::place_survivable(s.loads(), t, {weave::failure_domain::node});
         return true;
       }},
  };
  std::printf("trace %s: %zu layers, %d experts, top-%d\n\n", trace_file.c_str(), layers.size(),
              layers.front().num_experts, layers.front().k);
  std::printf("| devices | policy | slots/device | extra copies | max/mean load | CT | fatal "
              "devices | fatal nodes |\n|---|---|---|---|---|---|---|---|\n");
  for (const int D : {8, 16, 32}) {
    const auto topo = D <= 8 ? weave::topology::flat(D) : weave::topology::grid(D / 8, 8);
    for (const policy& pol : policies) {
      double slots = 0, extra = 0, load = 0, ct = 0, fatal_d = 0, fatal_n = 0;
      int n = 0;
      for (const auto& t : layers) {
        const std::size_t half = t.num_tokens() / 2 * static_cast<std::size_t>(t.k);
        const std::span<const std::int32_t> ids(t.ids);
        weave::expert_statistics stats(t.num_experts);
        stats.accumulate(ids.first(half), t.k);
        weave::placement p;
        if (!pol.place(stats, topo, p))
          break;
        const auto m = weave::evaluate_placement(p, topo, ids.subspan(half), t.k);
        const auto losses = weave::check_losses(p, topo);
        slots += p.slots_per_device();
        extra += p.num_filled_slots() - p.num_experts();
        load += m.max_mean_load;
        ct += m.copies_per_token;
        fatal_d += static_cast<double>(losses.fatal_devices().size());
        fatal_n += static_cast<double>(losses.fatal_nodes().size());
        ++n;
      }
      if (n == 0)
        continue;
      std::printf("| %d (%dx%d) | %s | %.0f | %.0f | %.3f | %.2f | %.1f of %d | %.1f of %d |\n", D,
                  topo.nodes, topo.devices_per_node, pol.name.c_str(), slots / n, extra / n,
                  load / n, ct / n, fatal_d / n, D, fatal_n / n, topo.nodes);
    }
  }
  return 0;
}
