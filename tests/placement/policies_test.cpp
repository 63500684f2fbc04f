#include <doctest/doctest.h>

#include "brute_force.hpp"

#include <weave/placement/collaboration.hpp>
#include <weave/placement/policies.hpp>
#include <weave/placement/trace.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

namespace {

// Every expert exactly once, E/D per device.
void check_balanced(const weave::placement& p, int E, int D) {
  REQUIRE(p.num_experts() == E);
  REQUIRE(p.num_devices() == D);
  CHECK(p.num_slots() == E);
  CHECK(p.slots_per_device() == E / D);
  std::vector<int> seen(static_cast<std::size_t>(E), 0);
  for (const auto e : p.slot_experts())
    ++seen[static_cast<std::size_t>(e)];
  CHECK(std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; }));
}

double max_device_load(const weave::placement& p, const std::vector<double>& loads) {
  std::vector<double> l(static_cast<std::size_t>(p.num_devices()), 0.0);
  for (int s = 0; s < p.num_slots(); ++s)
    l[static_cast<std::size_t>(p.device_of_slot(s))] +=
        loads[static_cast<std::size_t>(p.expert_of_slot(s))];
  return *std::max_element(l.begin(), l.end());
}

// Random statistics: random loads and a random symmetric co-activation matrix.
weave::expert_statistics random_stats(int E, std::mt19937& rng, int tokens = 200, int k = 3) {
  std::vector<std::int32_t> ids;
  std::uniform_int_distribution<int> pick(0, E - 1);
  for (int t = 0; t < tokens; ++t) {
    std::vector<std::int32_t> tok;
    while (static_cast<int>(tok.size()) < k) {
      const int e = pick(rng);
      if (std::find(tok.begin(), tok.end(), e) == tok.end())
        tok.push_back(e);
    }
    ids.insert(ids.end(), tok.begin(), tok.end());
  }
  weave::expert_statistics s(E);
  s.accumulate(ids, k);
  return s;
}

} // namespace

TEST_CASE("contiguous and round-robin place every expert once, E/D per device") {
  for (const auto& [E, D] : {std::pair{8, 2}, {12, 4}, {64, 8}, {256, 32}, {60, 4}}) {
    const auto topo = weave::topology::flat(D);
    const auto c = weave::place_contiguous(E, topo);
    const auto r = weave::place_round_robin(E, topo);
    check_balanced(c, E, D);
    check_balanced(r, E, D);
    for (int e = 0; e < E; ++e) {
      CHECK(c.device_of(e) == e / (E / D));
      CHECK(r.device_of(e) == e % D);
    }
  }
  CHECK_THROWS_AS(weave::place_round_robin(10, weave::topology::flat(4)), weave::error);
  CHECK_THROWS_AS(weave::place_contiguous(8, weave::topology{0, 2}), weave::error);
}

TEST_CASE("load-balanced placement is within 4/3 of the brute-force optimum, mostly optimal") {
  std::mt19937 rng(7);
  int optimal = 0, cases = 0;
  for (const auto& [E, D] : {std::pair{8, 2}, {8, 4}, {12, 2}, {12, 3}, {12, 4}}) {
    for (int rep = 0; rep < 6; ++rep) {
      std::vector<double> loads(static_cast<std::size_t>(E));
      std::exponential_distribution<double> dist(1.0);
      for (auto& l : loads)
        l = std::round(dist(rng) * 100);
      const auto p = weave::place_load_balanced(loads, weave::topology::flat(D));
      check_balanced(p, E, D);
      double best = std::numeric_limits<double>::infinity();
      // `D = D`: a lambda cannot capture a structured binding before clang 16 (P1091).
      brute::balanced_partitions(E, D, [&, D = D](const std::vector<int>& g) {
        best = std::min(best, max_device_load(brute::to_placement(g, D), loads));
      });
      const double got = max_device_load(p, loads);
      CHECK(got >= best);
      CHECK(got <= best * 4.0 / 3.0 + 1e-9);
      optimal += got == best;
      ++cases;
    }
  }
  MESSAGE("load-balanced optimal in ", optimal, " of ", cases, " cases");
  CHECK(optimal * 10 >= cases * 8);
}

TEST_CASE("load-balanced placement on two levels balances nodes, then devices") {
  std::mt19937 rng(3);
  std::vector<double> loads(64);
  std::uniform_real_distribution<double> dist(0.0, 10.0);
  for (auto& l : loads)
    l = dist(rng);
  const auto topo = weave::topology::grid(2, 4);
  const auto p = weave::place_load_balanced(loads, topo);
  check_balanced(p, 64, 8);
  // Far better than contiguous on random loads.
  const double mean = std::accumulate(loads.begin(), loads.end(), 0.0) / 8;
  CHECK(max_device_load(p, loads) <= mean * 1.05);
  CHECK(max_device_load(p, loads) <= max_device_load(weave::place_contiguous(64, topo), loads));
  std::vector<double> bad = loads;
  bad[3] = std::nan("");
  CHECK_THROWS_AS(weave::place_load_balanced(bad, topo), weave::error);
  bad[3] = -1;
  try {
    weave::place_load_balanced(bad, topo);
    FAIL("negative load accepted");
  } catch (const weave::error& e) {
    CHECK(e.code() == weave::errc::invalid_argument);
    CHECK(e.message().find("expert 3") != std::string::npos);
  }
}

TEST_CASE("collaboration-aware placement vs brute force on small instances") {
  std::mt19937 rng(11);
  int optimal = 0, cases = 0;
  double worst = 1.0;
  for (const auto& [E, D] : {std::pair{8, 2}, {8, 4}, {12, 2}, {12, 3}, {12, 4}}) {
    for (int rep = 0; rep < 5; ++rep) {
      const auto stats = random_stats(E, rng);
      const auto p = weave::place_collaborative(stats, weave::topology::flat(D));
      check_balanced(p, E, D);
      double best = -1;
      brute::balanced_partitions(E, D, [&, D = D](const std::vector<int>& g) {
        best = std::max(best, weave::kept_coactivation(stats, brute::to_placement(g, D)));
      });
      const double got = weave::kept_coactivation(stats, p);
      CHECK(got <= best + 1e-9);
      // Local optimum: no swap of two experts on different devices keeps more.
      auto slots = std::vector<std::int32_t>(p.slot_experts().begin(), p.slot_experts().end());
      for (std::size_t a = 0; a < slots.size(); ++a)
        for (std::size_t b = a + 1; b < slots.size(); ++b) {
          if (p.device_of_slot(static_cast<int>(a)) == p.device_of_slot(static_cast<int>(b)))
            continue;
          std::swap(slots[a], slots[b]);
          CHECK(weave::kept_coactivation(stats, weave::placement(E, D, slots)) <= got + 1e-9);
          std::swap(slots[a], slots[b]);
        }
      worst = std::min(worst, got / best);
      optimal += got >= best - 1e-9;
      ++cases;
    }
  }
  MESSAGE("collaborative optimal in ", optimal, " of ", cases, ", worst ratio ", worst);
  CHECK(worst >= 0.9);
  CHECK(optimal * 10 >= cases * 7);
}

TEST_CASE("collaboration-aware placement finds planted clusters exactly") {
  // Experts dealt into D clusters at random; tokens only co-activate inside a cluster, so the
  // optimum puts each cluster on one device and reaches the CT lower bound.
  for (const auto& [E, D, seed] : {std::tuple{12, 3, 1}, {16, 4, 2}, {64, 8, 3}, {256, 32, 4}}) {
    weave::trace_options o;
    o.num_experts = E;
    o.k = E / D;
    o.clusters = D;
    o.affinity = 1.0;
    o.tokens = 3000;
    o.seed = static_cast<std::uint64_t>(seed);
    const auto trace = weave::generate_trace(o);
    weave::expert_statistics stats(E);
    stats.accumulate(trace.ids, o.k);
    const auto p = weave::place_collaborative(stats, weave::topology::flat(D));
    check_balanced(p, E, D);
    for (int a = 0; a < E; ++a)
      for (int b = 0; b < E; ++b)
        CHECK((p.device_of(a) == p.device_of(b)) ==
              (trace.cluster_of[static_cast<std::size_t>(a)] ==
               trace.cluster_of[static_cast<std::size_t>(b)]));
  }
}

TEST_CASE("collaboration objective with a load term matches brute force within the bound") {
  std::mt19937 rng(5);
  double worst = 1.0;
  for (const auto& [E, D] : {std::pair{8, 2}, {12, 3}, {12, 4}}) {
    for (int rep = 0; rep < 4; ++rep) {
      auto stats = random_stats(E, rng, 300, 2);
      weave::collaboration_options o;
      o.load_weight = 0.5;
      const auto p = weave::place_collaborative(stats, weave::topology::flat(D), o);
      check_balanced(p, E, D);
      double best = -std::numeric_limits<double>::infinity();
      double lo = std::numeric_limits<double>::infinity();
      brute::balanced_partitions(E, D, [&, D = D](const std::vector<int>& g) {
        const double v = weave::collaboration_objective(stats, brute::to_placement(g, D), o);
        best = std::max(best, v);
        lo = std::min(lo, v);
      });
      const double got = weave::collaboration_objective(stats, p, o);
      CHECK(got <= best + 1e-9);
      // Normalised position between the worst and the best partition.
      worst = std::min(worst, best > lo ? (got - lo) / (best - lo) : 1.0);
    }
  }
  MESSAGE("collaborative with load term: worst normalised score ", worst);
  CHECK(worst >= 0.9);
}

TEST_CASE("the load term trades kept co-activation for balance") {
  weave::trace_options o;
  o.num_experts = 64;
  o.k = 8;
  o.clusters = 8;
  o.affinity = 0.9;
  o.zipf = 1.0;
  o.tokens = 8000;
  const auto trace = weave::generate_trace(o);
  weave::expert_statistics stats(64);
  stats.accumulate(trace.ids, 8);
  const auto topo = weave::topology::flat(8);
  const auto plain = weave::place_collaborative(stats, topo);
  weave::collaboration_options lo;
  lo.load_weight = 10.0;
  const auto balanced = weave::place_collaborative(stats, topo, lo);
  const std::vector<double> loads(stats.loads().begin(), stats.loads().end());
  CHECK(max_device_load(balanced, loads) < max_device_load(plain, loads));
  CHECK(weave::kept_coactivation(stats, balanced) <= weave::kept_coactivation(stats, plain));
  CHECK(weave::kept_coactivation(stats, balanced) >
        weave::kept_coactivation(stats, weave::place_contiguous(64, topo)));
}

TEST_CASE("two-level collaboration-aware placement keeps node groups together") {
  // Four planted clusters of 8 on 2 nodes x 2 devices: each cluster must land on one device.
  weave::trace_options o;
  o.num_experts = 32;
  o.k = 8;
  o.clusters = 4;
  o.affinity = 1.0;
  o.tokens = 4000;
  const auto trace = weave::generate_trace(o);
  weave::expert_statistics stats(32);
  stats.accumulate(trace.ids, 8);
  const auto topo = weave::topology::grid(2, 2);
  const auto p = weave::place_collaborative(stats, topo);
  check_balanced(p, 32, 4);
  for (int a = 0; a < 32; ++a)
    for (int b = 0; b < 32; ++b)
      if (trace.cluster_of[static_cast<std::size_t>(a)] ==
          trace.cluster_of[static_cast<std::size_t>(b)])
        CHECK(p.device_of(a) == p.device_of(b));
  // The node level on its own is optimal vs brute force over node partitions (E = 12, 2 x 3).
  std::mt19937 rng(9);
  for (int rep = 0; rep < 4; ++rep) {
    const auto s = random_stats(12, rng);
    const auto q = weave::place_collaborative(s, weave::topology::grid(2, 2));
    check_balanced(q, 12, 4);
    auto node_kept = [&](const weave::placement& x, int devices_per_node) {
      double kept = 0;
      for (int a = 0; a < 12; ++a)
        for (int b = a + 1; b < 12; ++b)
          if (x.device_of(a) / devices_per_node == x.device_of(b) / devices_per_node)
            kept += s.coactivation(a, b);
      return kept;
    };
    double best = 0;
    brute::balanced_partitions(12, 2, [&](const std::vector<int>& g) {
      best = std::max(best, node_kept(brute::to_placement(g, 2), 1));
    });
    CHECK(node_kept(q, 2) >= 0.9 * best);
    CHECK(node_kept(q, 2) <= best + 1e-9);
  }
}

TEST_CASE("collaboration-aware placement rejects bad input") {
  weave::expert_statistics s(12);
  CHECK_THROWS_AS(weave::place_collaborative(s, weave::topology::flat(5)), weave::error);
  weave::collaboration_options o;
  o.load_weight = -1;
  CHECK_THROWS_AS(weave::place_collaborative(s, weave::topology::flat(4), o), weave::error);
  s.raw()[20] = std::nan("");
  CHECK_THROWS_AS(weave::place_collaborative(s, weave::topology::flat(4)), weave::error);
  CHECK_THROWS_AS(
      weave::collaboration_objective(weave::expert_statistics(8),
                                     weave::place_contiguous(12, weave::topology::flat(4))),
      weave::error);
  // All-zero statistics still give a valid placement.
  check_balanced(weave::place_collaborative(weave::expert_statistics(12), weave::topology::flat(4)),
                 12, 4);
}
