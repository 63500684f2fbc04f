#include <doctest/doctest.h>

#include <weave/placement/metrics.hpp>
#include <weave/placement/migration.hpp>
#include <weave/placement/replica_choice.hpp>
#include <weave/placement/replication.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <tuple>
#include <vector>

namespace {

// Expected load per device when each expert's load splits evenly over its replicas.
double peak_load(const weave::placement& p, const std::vector<double>& loads) {
  std::vector<double> l(static_cast<std::size_t>(p.num_devices()), 0.0);
  for (int s = 0; s < p.num_slots(); ++s) {
    const int e = p.expert_of_slot(s);
    l[static_cast<std::size_t>(p.device_of_slot(s))] +=
        loads[static_cast<std::size_t>(e)] / static_cast<double>(p.slots_of(e).size());
  }
  return *std::max_element(l.begin(), l.end());
}

// Reference: replicate the hottest (load per replica) expert R times, then LPT onto the
// lightest device with room that does not hold the expert. Returns +inf if LPT gets stuck.
double reference_peak(const std::vector<double>& loads, int D, int R) {
  const int E = static_cast<int>(loads.size());
  const int S = (E + R) / D;
  std::vector<int> count(static_cast<std::size_t>(E), 1);
  for (int r = 0; r < R; ++r) {
    int best = -1;
    for (int e = 0; e < E; ++e)
      if (count[static_cast<std::size_t>(e)] < D &&
          (best < 0 ||
           loads[static_cast<std::size_t>(e)] / count[static_cast<std::size_t>(e)] >
               loads[static_cast<std::size_t>(best)] / count[static_cast<std::size_t>(best)]))
        best = e;
    ++count[static_cast<std::size_t>(best)];
  }
  std::vector<std::pair<double, int>> copies;
  for (int e = 0; e < E; ++e)
    for (int c = 0; c < count[static_cast<std::size_t>(e)]; ++c)
      copies.emplace_back(loads[static_cast<std::size_t>(e)] / count[static_cast<std::size_t>(e)],
                          e);
  std::stable_sort(copies.begin(), copies.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<double> load(static_cast<std::size_t>(D), 0.0);
  std::vector<std::set<int>> held(static_cast<std::size_t>(D));
  for (const auto& [w, e] : copies) {
    int best = -1;
    for (int d = 0; d < D; ++d)
      if (static_cast<int>(held[static_cast<std::size_t>(d)].size()) < S &&
          !held[static_cast<std::size_t>(d)].count(e) &&
          (best < 0 || load[static_cast<std::size_t>(d)] < load[static_cast<std::size_t>(best)]))
        best = d;
    if (best < 0)
      return std::numeric_limits<double>::infinity();
    load[static_cast<std::size_t>(best)] += w;
    held[static_cast<std::size_t>(best)].insert(e);
  }
  return *std::max_element(load.begin(), load.end());
}

std::vector<double> zipf_loads(int E, double s, std::mt19937& rng) {
  std::vector<double> loads(static_cast<std::size_t>(E));
  for (int e = 0; e < E; ++e)
    loads[static_cast<std::size_t>(e)] = 1000.0 / std::pow(e + 1.0, s);
  std::shuffle(loads.begin(), loads.end(), rng);
  return loads;
}

} // namespace

TEST_CASE("replica_counts gives extra slots to the largest load per replica") {
  const std::vector<double> loads = {10, 1, 4, 0};
  // Naive: replicas proportional-ish; 10 -> 5 -> 4 (expert 2) ...
  const auto c = weave::replica_counts(loads, 3, 4);
  CHECK(c == std::vector<int>{3, 1, 2, 1}); // 10/1 > 4/1 -> 10/2=5 > 4 -> 4/1=4 > 10/3
  CHECK(weave::replica_counts(loads, 0, 4) == std::vector<int>{1, 1, 1, 1});
  CHECK(weave::replica_counts(loads, 12, 4) == std::vector<int>{4, 4, 4, 4});
  CHECK_THROWS_AS(weave::replica_counts(loads, 13, 4), weave::error);
  CHECK_THROWS_AS(weave::replica_counts(loads, -1, 4), weave::error);
}

TEST_CASE("replicated placement: invariants and never worse than replicate-hottest + LPT") {
  std::mt19937 rng(21);
  int strictly_better = 0, cases = 0;
  for (const auto& [E, D, R, nodes] : {std::tuple{8, 4, 4, 1},
                                       {12, 4, 4, 2},
                                       {60, 8, 4, 1},
                                       {60, 8, 12, 2},
                                       {64, 16, 16, 4},
                                       {256, 32, 32, 4},
                                       {64, 8, 64, 1}}) {
    for (const double s : {0.0, 0.6, 1.2}) {
      const auto loads = zipf_loads(E, s, rng);
      const auto topo = weave::topology::grid(nodes, D / nodes);
      weave::replication_options o;
      o.redundant_slots = R;
      const auto p = weave::place_replicated(loads, topo, o);
      // Constructor already refuses two replicas on one device; check the shape and counts.
      REQUIRE(p.num_slots() == E + R);
      REQUIRE(p.num_devices() == D);
      const auto counts = weave::replica_counts(loads, R, D);
      for (int e = 0; e < E; ++e) {
        CHECK(static_cast<int>(p.slots_of(e).size()) == counts[static_cast<std::size_t>(e)]);
        std::set<int> devs;
        for (const auto sl : p.slots_of(e))
          devs.insert(p.device_of_slot(sl));
        CHECK(devs.size() == p.slots_of(e).size());
      }
      const double ours = peak_load(p, loads);
      const double ref = reference_peak(loads, D, R);
      CHECK(ours <= ref * (1 + 1e-12));
      CHECK(weave::expected_max_mean_load(p, loads) ==
            doctest::Approx(ours * D / std::accumulate(loads.begin(), loads.end(), 0.0)));
      strictly_better += ours < ref * (1 - 1e-9);
      ++cases;
    }
  }
  MESSAGE("replicated strictly lighter than the reference in ", strictly_better, " of ", cases);
}

TEST_CASE("replicated placement with enough slots reaches near-perfect balance") {
  std::mt19937 rng(4);
  const auto loads = zipf_loads(64, 1.0, rng);
  weave::replication_options o;
  o.redundant_slots = 64; // two slots per expert on average
  const auto p = weave::place_replicated(loads, weave::topology::flat(16), o);
  CHECK(weave::expected_max_mean_load(p, loads) <= 1.1);
  CHECK(weave::expected_max_mean_load(weave::placement::contiguous(64, 16), loads) > 1.5);
}

TEST_CASE("replicated placement grown from the current placement moves fewer experts") {
  std::mt19937 rng(8);
  int fewer = 0, cases = 0;
  for (const auto& [E, D, R] : {std::tuple{64, 8, 8}, {64, 16, 16}, {256, 32, 32}}) {
    const auto topo = weave::topology::flat(D);
    const auto loads = zipf_loads(E, 0.8, rng);
    weave::replication_options o;
    o.redundant_slots = R;
    const auto current = weave::place_replicated(loads, topo, o);
    // Loads drift by up to 20 %.
    auto drifted = loads;
    std::uniform_real_distribution<double> noise(0.8, 1.2);
    for (auto& l : drifted)
      l *= noise(rng);
    const auto fresh = weave::place_replicated(drifted, topo, o);
    o.current = &current;
    const auto sticky = weave::place_replicated(drifted, topo, o);
    CHECK(peak_load(sticky, drifted) <= peak_load(fresh, drifted) * (1 + o.keep_tolerance) + 1e-9);
    const auto moves_sticky = weave::plan_migration(current, sticky, topo).moves.size();
    const auto moves_fresh = weave::plan_migration(current, fresh, topo).moves.size();
    MESSAGE("E=", E, " D=", D, ": moves sticky ", moves_sticky, " fresh ", moves_fresh);
    CHECK(moves_sticky <= moves_fresh);
    fewer += moves_sticky < moves_fresh;
    ++cases;
  }
  CHECK(fewer >= 1);
  // An unreplicated current placement (fewer slots per device) is a valid start too.
  const auto loads = zipf_loads(64, 0.8, rng);
  const auto start = weave::placement::contiguous(64, 8);
  weave::replication_options o;
  o.redundant_slots = 8;
  o.current = &start;
  const auto p = weave::place_replicated(loads, weave::topology::flat(8), o);
  CHECK(p.num_slots() == 72);
  const auto other = weave::placement::contiguous(32, 8);
  o.current = &other;
  CHECK_THROWS_AS(weave::place_replicated(loads, weave::topology::flat(8), o), weave::error);
}

TEST_CASE("replicated placement rejects bad input") {
  const std::vector<double> loads(12, 1.0);
  weave::replication_options o;
  o.redundant_slots = 3; // 15 slots over 4 devices
  CHECK_THROWS_AS(weave::place_replicated(loads, weave::topology::flat(4), o), weave::error);
  o.redundant_slots = 40; // 52 slots: 13 per device but only 12 experts
  CHECK_THROWS_AS(weave::place_replicated(loads, weave::topology::flat(4), o), weave::error);
  o.redundant_slots = 4;
  auto bad = loads;
  bad[5] = -2;
  CHECK_THROWS_AS(weave::place_replicated(bad, weave::topology::flat(4), o), weave::error);
  o.keep_tolerance = std::nan("");
  CHECK_THROWS_AS(weave::place_replicated(loads, weave::topology::flat(4), o), weave::error);
}

TEST_CASE("replica router policies against a naive choice") {
  // 2 nodes x 2 devices x 3 slots; expert 0 on devices 0, 2, 3; expert 1 on devices 1, 3.
  const weave::placement p(9, 4, {0, 2, 3, 1, 4, 5, 0, 6, 7, 0, 1, 8});
  const auto topo = weave::topology::grid(2, 2);
  std::vector<std::int32_t> out(2);
  const std::vector<std::int32_t> tok = {0, 1};

  weave::replica_router in_turn(p, topo);
  for (std::size_t t = 0; t < 12; ++t)
    for (int src = 0; src < 4; ++src) {
      in_turn.route(tok, t, src, out);
      CHECK(out[0] == p.slot_for(0, t, src));
      CHECK(out[1] == p.slot_for(1, t, src));
    }

  weave::replica_router same_node(p, topo, {weave::replica_policy::same_node, false});
  for (std::size_t t = 0; t < 6; ++t) {
    same_node.route(tok, t, 1, out); // node 0: expert 0 only on device 0 there; expert 1 local
    CHECK(out == std::vector<std::int32_t>{0, 3});
    same_node.route(tok, t, 0, out); // expert 0 local; expert 1 on device 1 (same node)
    CHECK(out == std::vector<std::int32_t>{0, 3});
  }

  // A token already visiting device 3 (expert 8) takes expert 0's replica there.
  weave::replica_router visited(p, topo, {weave::replica_policy::in_turn, true});
  const std::vector<std::int32_t> tok2 = {8, 0};
  for (std::size_t t = 0; t < 6; ++t) {
    visited.route(tok2, t, 1, out);
    CHECK(out == std::vector<std::int32_t>{11, 9});
  }

  // Least loaded: naive argmin over the devices' running counts.
  weave::replica_router least(p, topo, {weave::replica_policy::least_loaded, false});
  std::vector<std::int64_t> naive(4, 0);
  std::mt19937 rng(2);
  for (std::size_t t = 0; t < 300; ++t) {
    const std::int32_t e = static_cast<std::int32_t>(rng() % 9);
    const int src = 1;
    std::vector<std::int32_t> one = {e}, slot(1);
    least.route(one, t, src, slot);
    int expect = -1;
    for (const auto s : p.slots_of(e))
      if (p.device_of_slot(s) == src)
        expect = s;
    if (expect < 0)
      for (const auto s : p.slots_of(e))
        if (expect < 0 || naive[static_cast<std::size_t>(p.device_of_slot(s))] <
                              naive[static_cast<std::size_t>(p.device_of_slot(expect))])
          expect = s;
    CHECK(slot[0] == expect);
    ++naive[static_cast<std::size_t>(p.device_of_slot(expect))];
  }
  CHECK(std::vector<std::int64_t>(least.device_rows().begin(), least.device_rows().end()) == naive);
  least.reset();
  CHECK(least.device_rows()[0] == 0);

  const std::vector<std::int32_t> bad = {9, 0};
  CHECK_THROWS_AS(in_turn.route(bad, 0, 0, out), weave::error);
  CHECK_THROWS_AS(in_turn.route(tok, 0, 4, out), weave::error);
  std::vector<std::int32_t> small(1);
  CHECK_THROWS_AS(in_turn.route(tok, 0, 0, small), weave::error);
  CHECK_THROWS_AS(weave::replica_router(p, weave::topology::flat(3)), weave::error);
  const std::vector<std::int32_t> none = {-1, 4};
  in_turn.route(none, 0, 0, out);
  CHECK(out == std::vector<std::int32_t>{-1, 4});
}

#include <weave/placement/collaboration.hpp>
#include <weave/placement/trace.hpp>

TEST_CASE("replicating a collaboration-aware placement keeps collaborators together") {
  for (const auto& [E, k, D] : {std::tuple{64, 8, 8}, {256, 8, 16}}) {
    weave::trace_options o;
    o.num_experts = E;
    o.k = k;
    o.clusters = E / 8;
    o.affinity = 0.8;
    o.zipf = 0.6;
    o.tokens = 10000;
    const auto trace = weave::generate_trace(o);
    weave::expert_statistics stats(E);
    stats.accumulate(trace.ids, k);
    const auto topo = weave::topology::flat(D);
    const auto base = weave::place_collaborative(stats, topo);
    weave::replication_options ro;
    ro.redundant_slots = D;
    const auto fresh = weave::place_replicated(stats, topo, ro);
    ro.current = &base;
    const auto grown = weave::place_replicated(stats, topo, ro);
    const std::vector<double> loads(stats.loads().begin(), stats.loads().end());
    CHECK(peak_load(grown, loads) <= peak_load(fresh, loads) * (1 + ro.keep_tolerance) + 1e-9);
    const auto ct_fresh = weave::evaluate_placement(fresh, topo, trace.ids, k).copies_per_token;
    const auto ct_grown = weave::evaluate_placement(grown, topo, trace.ids, k).copies_per_token;
    const auto ct_base = weave::evaluate_placement(base, topo, trace.ids, k).copies_per_token;
    MESSAGE("E=", E, " D=", D, ": CT collaborative ", ct_base, ", grown ", ct_grown, ", fresh ",
            ct_fresh);
    CHECK(ct_grown < 0.8 * ct_fresh);
  }
}

TEST_CASE("replicated placement packs every feasible shape, up to every expert everywhere") {
  std::mt19937 rng(17);
  for (int rep = 0; rep < 300; ++rep) {
    const int nodes = 1 + static_cast<int>(rng() % 3);
    const int per_node = 1 + static_cast<int>(rng() % 4);
    const int D = nodes * per_node;
    const int E = 1 + static_cast<int>(rng() % 24);
    // Any R with (E + R) % D == 0 and R <= E·(D − 1).
    std::vector<int> options;
    for (int R = 0; R <= E * (D - 1); ++R)
      if ((E + R) % D == 0)
        options.push_back(R);
    if (options.empty())
      continue;
    weave::replication_options o;
    o.redundant_slots = options[rng() % options.size()];
    std::vector<double> loads(static_cast<std::size_t>(E));
    std::exponential_distribution<double> dist(1.0);
    for (auto& l : loads)
      l = rep % 5 == 0 ? 0.0 : dist(rng);
    const auto topo = weave::topology::grid(nodes, per_node);
    const auto p = weave::place_replicated(loads, topo, o);
    CHECK(p.num_slots() == E + o.redundant_slots);
    // Grown from a shuffled version of itself.
    std::vector<std::int32_t> slots(p.slot_experts().begin(), p.slot_experts().end());
    for (int tries = 0; tries < 20; ++tries) {
      std::shuffle(slots.begin(), slots.end(), rng);
      weave::placement cur;
      try {
        cur = weave::placement(E, D, slots);
      } catch (const weave::error& e) {
        REQUIRE(e.code() == weave::errc::invalid_argument); // the shuffle put two on a device
        continue;
      }
      o.current = &cur;
      const auto q = weave::place_replicated(loads, topo, o);
      CHECK(q.num_slots() == p.num_slots());
      o.current = nullptr;
      break;
    }
  }
}
