// Expert groups in the replicated placement: every copy of a group on one node (or on the
// group's fixed devices), checked slot by slot, and the heaviest device against the brute-force
// optimum over every group-on-node layout on small cases.
#include <doctest/doctest.h>

#include "brute_force.hpp"

#include <weave/placement/metrics.hpp>
#include <weave/placement/migration.hpp>
#include <weave/placement/replication.hpp>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <tuple>
#include <vector>

namespace {

// The heaviest device when each expert's load splits evenly over its replicas.
double peak_load(const weave::placement& p, const std::vector<double>& loads) {
  const double total = std::accumulate(loads.begin(), loads.end(), 0.0);
  return weave::expected_max_mean_load(p, loads) * total / p.num_devices();
}

// The devices holding any copy of any expert of each group of `size` experts.
std::vector<std::set<int>> group_devices(const weave::placement& p, int size) {
  std::vector<std::set<int>> out(static_cast<std::size_t>(p.num_experts() / size));
  for (int s = 0; s < p.num_slots(); ++s)
    out[static_cast<std::size_t>(p.expert_of_slot(s) / size)].insert(p.device_of_slot(s));
  return out;
}

void check_groups_on_nodes(const weave::placement& p, int G, const weave::topology& topo) {
  const int size = p.num_experts() / G;
  std::vector<int> groups_on_node(static_cast<std::size_t>(topo.nodes), 0);
  for (const auto& devices : group_devices(p, size)) {
    std::set<int> nodes;
    for (const int d : devices)
      nodes.insert(topo.node_of(d));
    REQUIRE(nodes.size() == 1);
    ++groups_on_node[static_cast<std::size_t>(*nodes.begin())];
  }
  for (const int n : groups_on_node)
    CHECK(n == G / topo.nodes);
}

// Brute force: the lightest heaviest device over every layout with each group on one node
// (G / nodes groups per node), any replica counts, each device S distinct experts of its node.
double brute_force_peak(const std::vector<double>& loads, int G, const weave::topology& topo,
                        int S) {
  const int size = static_cast<int>(loads.size()) / G;
  const int dpn = topo.devices_per_node;
  // The best heaviest device of one node holding `experts`.
  auto node_best = [&](const std::vector<int>& experts) {
    const int X = static_cast<int>(experts.size());
    std::vector<unsigned> masks;
    for (unsigned m = 0; m < (1u << X); ++m)
      if (std::popcount(m) == S)
        masks.push_back(m);
    double best = std::numeric_limits<double>::infinity();
    std::vector<unsigned> chosen(static_cast<std::size_t>(dpn));
    std::function<void(int)> rec = [&](int d) {
      if (d == dpn) {
        unsigned all = 0;
        for (const unsigned m : chosen)
          all |= m;
        if (all != (1u << X) - 1)
          return;
        double peak = 0;
        for (const unsigned m : chosen) {
          double l = 0;
          for (int x = 0; x < X; ++x)
            if (m >> x & 1u) {
              int copies = 0;
              for (const unsigned o : chosen)
                copies += o >> x & 1u;
              l += loads[static_cast<std::size_t>(experts[static_cast<std::size_t>(x)])] / copies;
            }
          peak = std::max(peak, l);
        }
        best = std::min(best, peak);
        return;
      }
      for (const unsigned m : masks) {
        chosen[static_cast<std::size_t>(d)] = m;
        rec(d + 1);
      }
    };
    rec(0);
    return best;
  };
  double best = std::numeric_limits<double>::infinity();
  brute::balanced_partitions(G, topo.nodes, [&](const std::vector<int>& node_of_group) {
    double peak = 0;
    for (int n = 0; n < topo.nodes; ++n) {
      std::vector<int> experts;
      for (int g = 0; g < G; ++g)
        if (node_of_group[static_cast<std::size_t>(g)] == n)
          for (int i = 0; i < size; ++i)
            experts.push_back(g * size + i);
      peak = std::max(peak, node_best(experts));
    }
    best = std::min(best, peak);
  });
  return best;
}

} // namespace

TEST_CASE("expert groups stay on one node each, G / nodes per node, at every shape") {
  std::mt19937 rng(31);
  for (int rep = 0; rep < 150; ++rep) {
    const int nodes = 1 + static_cast<int>(rng() % 4);
    const int dpn = 1 + static_cast<int>(rng() % 4);
    const int G = nodes * (1 + static_cast<int>(rng() % 3));
    const int size = 1 + static_cast<int>(rng() % 5);
    const int E = G * size;
    const auto topo = weave::topology::grid(nodes, dpn);
    // Slots per device so a node's experts fill its devices without two copies on one.
    const int per_node = E / nodes;
    std::vector<int> S_options;
    for (int S = 1; S <= per_node; ++S)
      if (dpn * S >= per_node)
        S_options.push_back(S);
    const int S = S_options[rng() % S_options.size()];
    weave::replication_options o;
    o.redundant_slots = topo.num_devices() * S - E;
    o.groups.groups = G;
    std::vector<double> loads(static_cast<std::size_t>(E));
    std::exponential_distribution<double> dist(1.0);
    for (auto& l : loads)
      l = dist(rng);
    const auto p = weave::place_replicated(loads, topo, o);
    REQUIRE(p.num_slots() == topo.num_devices() * S);
    check_groups_on_nodes(p, G, topo);
    // Grown from a placement of other loads: still on nodes, and slot-aligned.
    std::shuffle(loads.begin(), loads.end(), rng);
    o.current = &p;
    const auto q = weave::place_replicated(loads, topo, o);
    check_groups_on_nodes(q, G, topo);
    int raw = 0;
    for (int s = 0; s < p.num_slots(); ++s)
      raw += p.expert_of_slot(s) != q.expert_of_slot(s);
    CHECK(raw == static_cast<int>(weave::plan_migration(p, q, topo).moves.size()));
  }
}

TEST_CASE("groups on nodes: the heaviest device against the brute-force optimum") {
  std::mt19937 rng(32);
  int optimal = 0, cases = 0;
  double worst = 1.0;
  for (const auto& [E, G, nodes, dpn, S] : {std::tuple{8, 4, 2, 2, 2},
                                            {8, 4, 2, 2, 3},
                                            {8, 4, 2, 2, 4},
                                            {12, 4, 2, 3, 2},
                                            {12, 4, 2, 3, 3},
                                            {12, 6, 3, 2, 2},
                                            {12, 6, 3, 2, 3},
                                            {12, 12, 2, 2, 3}}) {
    const auto topo = weave::topology::grid(nodes, dpn);
    for (int rep = 0; rep < 6; ++rep) {
      std::vector<double> loads(static_cast<std::size_t>(E));
      std::lognormal_distribution<double> dist(0.0, 1.0);
      for (auto& l : loads)
        l = dist(rng);
      weave::replication_options o;
      o.redundant_slots = topo.num_devices() * S - E;
      o.groups.groups = G;
      const auto p = weave::place_replicated(loads, topo, o);
      check_groups_on_nodes(p, G, topo);
      const double ours = peak_load(p, loads);
      const double best = brute_force_peak(loads, G, topo, S);
      CHECK(ours >= best * (1 - 1e-12));
      CHECK(ours <= best * 1.25);
      worst = std::max(worst, ours / best);
      optimal += ours <= best * (1 + 1e-12);
      ++cases;
    }
  }
  MESSAGE("groups on nodes: optimal in ", optimal, " of ", cases, ", worst ratio ", worst);
  CHECK(optimal * 2 >= cases);
}

TEST_CASE("expert groups on fixed device lists stay on them") {
  std::mt19937 rng(33);
  const int E = 32, G = 4;
  const auto topo = weave::topology::grid(2, 4); // 8 devices
  weave::replication_options o;
  o.redundant_slots = 8; // 5 slots per device
  o.groups.groups = G;
  // Groups 0 and 1 share devices 0-3 (two groups, 16 experts, 20 slots); group 2 on 4 and 5,
  // group 3 on 6 and 7 (8 experts, 10 slots each): lists cut across and along nodes.
  o.groups.devices = {{3, 2, 1, 0}, {0, 1, 2, 3}, {4, 5}, {7, 6}};
  std::vector<double> loads(static_cast<std::size_t>(E));
  std::exponential_distribution<double> dist(1.0);
  for (auto& l : loads)
    l = dist(rng);
  const auto p = weave::place_replicated(loads, topo, o);
  const auto devices = group_devices(p, E / G);
  CHECK(std::includes(std::set<int>{0, 1, 2, 3}.begin(), std::set<int>{0, 1, 2, 3}.end(),
                      devices[0].begin(), devices[0].end()));
  CHECK(std::includes(std::set<int>{0, 1, 2, 3}.begin(), std::set<int>{0, 1, 2, 3}.end(),
                      devices[1].begin(), devices[1].end()));
  CHECK(devices[2] == std::set<int>{4, 5});
  CHECK(devices[3] == std::set<int>{6, 7});
  // Re-placed from itself with other loads: devices are never relabelled across lists.
  std::shuffle(loads.begin(), loads.end(), rng);
  o.current = &p;
  const auto q = weave::place_replicated(loads, topo, o);
  const auto moved = group_devices(q, E / G);
  CHECK(moved[2] == std::set<int>{4, 5});
  CHECK(moved[3] == std::set<int>{6, 7});
  for (int d = 0; d < 8; ++d)
    for (int a = 0; a < 5; ++a)
      for (int b = 0; b < 5; ++b)
        if (p.expert_of_slot(d * 5 + a) == q.expert_of_slot(d * 5 + b))
          CHECK(a == b);
}

TEST_CASE("expert group constraints reject what cannot hold") {
  const std::vector<double> loads(16, 1.0);
  const auto topo = weave::topology::grid(2, 2);
  weave::replication_options o;
  o.redundant_slots = 4; // 5 slots per device
  auto fails = [&](weave::errc code) {
    try {
      (void)weave::place_replicated(loads, topo, o);
    } catch (const weave::error& e) {
      CHECK(e.code() == code);
      return;
    }
    FAIL("no error");
  };
  o.groups.groups = 3; // 16 experts do not split into 3
  fails(weave::errc::invalid_argument);
  o.groups.groups = -1;
  fails(weave::errc::invalid_argument);
  o.groups.groups = 1; // one group cannot be dealt over two nodes
  fails(weave::errc::invalid_argument);
  o.groups.groups = 4;
  o.groups.devices = {{0, 1}, {0, 1}, {2, 3}}; // three lists for four groups
  fails(weave::errc::size_mismatch);
  o.groups.devices = {{0, 1}, {1, 2}, {2, 3}, {2, 3}}; // lists overlap without being equal
  fails(weave::errc::invalid_argument);
  o.groups.devices = {{0, 1}, {0, 1}, {2}, {2}}; // device 3 in no list
  fails(weave::errc::invalid_argument);
  o.groups.devices = {{0, 1}, {0, 1}, {2, 4}, {2, 4}};
  fails(weave::errc::out_of_range);
  o.groups.devices = {{0, 0}, {0, 0}, {2, 3}, {2, 3}};
  fails(weave::errc::invalid_argument);
  o.groups.devices = {{}, {0, 1, 2}, {3}, {3}};
  fails(weave::errc::invalid_argument);
  o.groups.devices = {{0, 1, 2}, {0, 1, 2}, {0, 1, 2}, {3}}; // 4 experts cannot fill 5 slots
  fails(weave::errc::invalid_argument);
  o.groups.devices = {{0}, {1, 2, 3}, {1, 2, 3}, {1, 2, 3}}; // 4 experts need 5 slots of device 0
  fails(weave::errc::invalid_argument);
  o.groups.devices = {{0, 1}, {0, 1}, {2, 3}, {2, 3}};
  CHECK_NOTHROW((void)weave::place_replicated(loads, topo, o));
}
