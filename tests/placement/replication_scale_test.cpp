// The replicated placement at scale: the incremental packing against today's from-scratch
// packing (kept verbatim in replication_reference.hpp), slot-aligned re-placement against
// plan_migration, and many layers in one call against one call per layer.
#include <doctest/doctest.h>

#include "replication_reference.hpp"

#include <weave/placement/migration.hpp>
#include <weave/placement/replication.hpp>
#include <weave/placement/replication_layers.hpp>
#include <weave/placement/statistics.hpp>
#include <weave/placement/trace.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <tuple>
#include <vector>

namespace {

// Loads of several shapes: Zipf, lognormal, exact ties (copies of equal weight), some zeros.
std::vector<double> random_loads(int E, int kind, std::mt19937& rng) {
  std::vector<double> loads(static_cast<std::size_t>(E));
  std::lognormal_distribution<double> lognormal(0.0, 1.0);
  for (int e = 0; e < E; ++e) {
    double& l = loads[static_cast<std::size_t>(e)];
    switch (kind % 4) {
    case 0:
      l = 1000.0 / std::pow(e + 1.0, 0.6 + 0.2 * (kind / 4 % 3));
      break;
    case 1:
      l = lognormal(rng);
      break;
    case 2:
      l = static_cast<double>(rng() % 4); // many exact ties and zeros
      break;
    default:
      l = e % 3 == 0 ? 0.0 : lognormal(rng);
    }
  }
  std::shuffle(loads.begin(), loads.end(), rng);
  return loads;
}

// What the slot-aligned result must be: the reference's packing with its devices relabelled
// and staying experts in their slots, as plan_migration lays out its target.
weave::placement aligned(const weave::placement& current, const weave::placement& next,
                         const weave::topology& topo) {
  if (current.num_slots() != next.num_slots())
    return next;
  return weave::plan_migration(current, next, topo).target;
}

int slots_changed(const weave::placement& a, const weave::placement& b) {
  int n = 0;
  for (int s = 0; s < a.num_slots(); ++s)
    n += a.expert_of_slot(s) != b.expert_of_slot(s);
  return n;
}

weave::expert_statistics statistics_for(int E, int k, std::uint64_t seed) {
  weave::trace_options o;
  o.num_experts = E;
  o.k = std::min(k, E);
  o.clusters = std::max(1, E / 8);
  o.zipf = 0.8;
  o.tokens = 2000;
  o.seed = seed;
  weave::expert_statistics s(E);
  s.accumulate(weave::generate_trace(o).ids, o.k);
  return s;
}

} // namespace

TEST_CASE("incremental packing equals the from-scratch packing on random shapes") {
  std::mt19937 rng(5);
  int cases = 0;
  auto check = [&](const std::vector<double>& loads, const weave::topology& topo, int R) {
    weave::replication_options o;
    o.redundant_slots = R;
    const auto ours = weave::place_replicated(loads, topo, o);
    const auto ref = replication_reference::place_replicated(loads, {}, topo, o);
    REQUIRE(ours == ref);
    ++cases;
  };
  // DeepSeek-V3's shape (256 experts, 8 nodes x 8 GPUs, 320 slots), 64 experts on 8 GPUs with
  // 80 slots, and 256 on 4 x 8 with one spare slot per GPU.
  for (int kind = 0; kind < 6; ++kind) {
    check(random_loads(256, kind, rng), weave::topology::grid(8, 8), 64);
    check(random_loads(64, kind, rng), weave::topology::flat(8), 16);
    check(random_loads(256, kind, rng), weave::topology::grid(4, 8), 32);
  }
  for (int rep = 0; rep < 400; ++rep) {
    const int nodes = 1 + static_cast<int>(rng() % 4);
    const int per_node = 1 + static_cast<int>(rng() % 6);
    const int D = nodes * per_node;
    const int E = 1 + static_cast<int>(rng() % 70);
    std::vector<int> feasible;
    for (int R = 0; R <= std::min(E * (D - 1), 3 * D); ++R)
      if ((E + R) % D == 0)
        feasible.push_back(R);
    if (feasible.empty())
      continue;
    check(random_loads(E, rep, rng), weave::topology::grid(nodes, per_node),
          feasible[rng() % feasible.size()]);
  }
  MESSAGE(cases, " shapes identical");
}

TEST_CASE("grown from a current placement: the reference's packing, slot-aligned") {
  std::mt19937 rng(6);
  for (int rep = 0; rep < 120; ++rep) {
    const int nodes = 1 + static_cast<int>(rng() % 3);
    const int per_node = 2 + static_cast<int>(rng() % 4);
    const int D = nodes * per_node;
    const int E = D * (1 + static_cast<int>(rng() % 6));
    const int R = D * static_cast<int>(rng() % 3);
    const auto topo = weave::topology::grid(nodes, per_node);
    const auto stats = statistics_for(E, 4, 100 + static_cast<std::uint64_t>(rep));
    weave::replication_options o;
    o.redundant_slots = R;
    // Start from a replicated layout of other loads, or from an unreplicated one.
    const auto start_loads = random_loads(E, rep, rng);
    weave::replication_options so;
    so.redundant_slots = rep % 4 == 0 ? 0 : R;
    const auto current = weave::place_replicated(start_loads, topo, so);
    o.current = &current;
    const auto ours = weave::place_replicated(stats, topo, o);
    const auto ref = replication_reference::place_replicated(stats.loads(),
                                                             stats.coactivation_matrix(), topo, o);
    REQUIRE(ours == aligned(current, ref, topo));
  }
}

TEST_CASE("re-placement on drifting loads: raw slot changes equal plan_migration's moves") {
  std::mt19937 rng(9);
  for (const auto& [E, nodes, per_node, R] :
       {std::tuple{64, 1, 8, 16}, {256, 8, 8, 64}, {60, 2, 4, 4}, {128, 4, 4, 16}}) {
    const auto topo = weave::topology::grid(nodes, per_node);
    auto loads = random_loads(E, 0, rng);
    weave::replication_options o;
    o.redundant_slots = R;
    weave::placement current = weave::place_replicated(loads, topo, o);
    int raw_total = 0, unaligned_total = 0;
    std::lognormal_distribution<double> drift(0.0, 0.25);
    for (int window = 0; window < 10; ++window) {
      for (auto& l : loads)
        l *= drift(rng);
      o.current = &current;
      const auto next = weave::place_replicated(loads, topo, o);
      const auto plan = weave::plan_migration(current, next, topo);
      const int raw = slots_changed(current, next);
      CHECK(raw == static_cast<int>(plan.moves.size()));
      // Every expert that stays on a device keeps its slot there.
      const int S = current.slots_per_device();
      for (int d = 0; d < current.num_devices(); ++d)
        for (int a = 0; a < S; ++a)
          for (int b = 0; b < S; ++b)
            if (current.expert_of_slot(d * S + a) == next.expert_of_slot(d * S + b))
              CHECK(a == b);
      // What loading the packing as it comes (devices sorted, unaligned) would change.
      const auto unaligned = replication_reference::place_replicated(loads, {}, topo, o);
      raw_total += raw;
      unaligned_total += slots_changed(current, unaligned);
      current = next;
    }
    MESSAGE("E=", E, " on ", nodes, "x", per_node, " (", E + R,
            " slots), 10 windows: slots rewritten ", raw_total, " aligned vs ", unaligned_total,
            " as packed");
    CHECK(raw_total < unaligned_total);
  }
}

TEST_CASE("many layers in one call equal one call per layer, on any number of threads") {
  std::mt19937 rng(12);
  const int E = 64, L = 9;
  const auto topo = weave::topology::grid(2, 4);
  std::vector<double> loads;
  std::vector<weave::expert_statistics> stats;
  for (int l = 0; l < L; ++l) {
    const auto one = random_loads(E, l, rng);
    loads.insert(loads.end(), one.begin(), one.end());
    stats.push_back(statistics_for(E, 6, 500 + static_cast<std::uint64_t>(l)));
  }
  weave::layer_replication_options o;
  o.layer.redundant_slots = 8;
  std::vector<weave::placement> alone, current;
  for (int l = 0; l < L; ++l) {
    alone.push_back(weave::place_replicated(
        std::span<const double>(loads).subspan(static_cast<std::size_t>(l * E), E), topo, o.layer));
    current.push_back(weave::place_contiguous(E, topo));
  }
  for (const int threads : {1, 3, 0}) {
    o.threads = threads;
    o.current = {};
    CHECK(weave::place_replicated_layers(loads, E, topo, o) == alone);
    o.current = current;
    const auto grown = weave::place_replicated_layers(stats, topo, o);
    REQUIRE(grown.size() == static_cast<std::size_t>(L));
    for (int l = 0; l < L; ++l) {
      weave::replication_options one = o.layer;
      one.current = &current[static_cast<std::size_t>(l)];
      CHECK(grown[static_cast<std::size_t>(l)] ==
            weave::place_replicated(stats[static_cast<std::size_t>(l)], topo, one));
    }
  }
  // A bad layer names itself; the shapes are checked first.
  auto bad = loads;
  bad[static_cast<std::size_t>(5 * E + 3)] = -1.0;
  o.current = {};
  o.threads = 2;
  try {
    (void)weave::place_replicated_layers(bad, E, topo, o);
    FAIL("no error");
  } catch (const weave::error& e) {
    CHECK(e.code() == weave::errc::invalid_argument);
    CHECK(e.message().rfind("layer 5: ", 0) == 0);
  }
  CHECK_THROWS_AS(
      weave::place_replicated_layers(std::span<const double>(loads).first(100), E, topo, o),
      weave::error);
  o.current = std::span<const weave::placement>(current).first(3);
  CHECK_THROWS_AS(weave::place_replicated_layers(loads, E, topo, o), weave::error);
  o.current = {};
  o.layer.current = &current[0];
  CHECK_THROWS_AS(weave::place_replicated_layers(loads, E, topo, o), weave::error);
  o.layer.current = nullptr;
  o.threads = -1;
  CHECK_THROWS_AS(weave::place_replicated_layers(loads, E, topo, o), weave::error);
}
