#include <doctest/doctest.h>

#include "brute_force.hpp"

#include <weave/placement/hungarian.hpp>
#include <weave/placement/migration.hpp>
#include <weave/placement/policies.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <set>
#include <tuple>
#include <vector>

namespace {

weave::placement random_placement(int E, int D, int extra, std::mt19937& rng) {
  // Every expert once plus `extra` replicas, shuffled until no device holds two copies.
  for (;;) {
    std::vector<std::int32_t> slots(static_cast<std::size_t>(E));
    std::iota(slots.begin(), slots.end(), 0);
    for (int r = 0; r < extra; ++r)
      slots.push_back(static_cast<std::int32_t>(rng() % static_cast<unsigned>(E)));
    std::shuffle(slots.begin(), slots.end(), rng);
    try {
      return weave::placement(E, D, slots);
    } catch (const weave::error&) {
    }
  }
}

std::vector<std::multiset<int>> groups(const weave::placement& p) {
  std::vector<std::multiset<int>> g(static_cast<std::size_t>(p.num_devices()));
  for (int s = 0; s < p.num_slots(); ++s)
    g[static_cast<std::size_t>(p.device_of_slot(s))].insert(p.expert_of_slot(s));
  return g;
}

// Moves needed when new device j goes to physical device perm[j].
std::size_t moves_under(const weave::placement& cur, const weave::placement& next,
                        const std::vector<int>& perm) {
  const auto c = groups(cur), n = groups(next);
  std::size_t moves = 0;
  for (std::size_t j = 0; j < n.size(); ++j)
    for (const int e : n[j])
      moves += !c[static_cast<std::size_t>(perm[j])].count(e);
  return moves;
}

} // namespace

TEST_CASE("Hungarian assignment equals the brute-force best permutation") {
  std::mt19937 rng(1);
  for (int n = 1; n <= 7; ++n)
    for (int rep = 0; rep < 20; ++rep) {
      std::vector<double> w(static_cast<std::size_t>(n * n));
      std::uniform_int_distribution<int> dist(-20, 20);
      for (auto& x : w)
        x = rep % 2 ? dist(rng) : std::uniform_real_distribution<double>(0, 1)(rng);
      const auto a = weave::max_weight_assignment(w, n);
      std::set<int> cols(a.begin(), a.end());
      CHECK(static_cast<int>(cols.size()) == n);
      double got = 0;
      for (int i = 0; i < n; ++i)
        got += w[static_cast<std::size_t>(i * n + a[static_cast<std::size_t>(i)])];
      double best = -1e300;
      brute::permutations(n, [&](const std::vector<int>& p) {
        double v = 0;
        for (int i = 0; i < n; ++i)
          v += w[static_cast<std::size_t>(i * n + p[static_cast<std::size_t>(i)])];
        best = std::max(best, v);
      });
      CHECK(got == doctest::Approx(best));
    }
  CHECK(weave::max_weight_assignment({}, 0).empty());
  CHECK_THROWS_AS(weave::max_weight_assignment(std::vector<double>(5), 2), weave::error);
  CHECK_THROWS_AS(weave::max_weight_assignment(std::vector<double>{1, std::nan(""), 0, 0}, 2),
                  weave::error);
}

TEST_CASE("migration plans transform current into new exactly with the fewest moves") {
  std::mt19937 rng(3);
  for (const auto& [E, D, extra, nodes] : {std::tuple{8, 2, 0, 1},
                                           {8, 4, 0, 1},
                                           {12, 4, 0, 2},
                                           {10, 4, 2, 1},
                                           {9, 3, 3, 1},
                                           {12, 6, 6, 3},
                                           {16, 4, 4, 2}}) {
    const auto topo = weave::topology::grid(nodes, D / nodes);
    for (int rep = 0; rep < 10; ++rep) {
      const auto cur = random_placement(E, D, extra, rng);
      const auto next = random_placement(E, D, extra, rng);
      const auto plan = weave::plan_migration(cur, next, topo);
      // Applying the moves to the current slots gives the plan's target exactly.
      std::vector<std::int32_t> slots(cur.slot_experts().begin(), cur.slot_experts().end());
      for (const auto& m : plan.moves) {
        CHECK(m.to_device == cur.device_of_slot(m.to_slot));
        CHECK(slots[static_cast<std::size_t>(m.to_slot)] != m.expert);
        bool holds = false;
        for (const auto s : cur.slots_of(m.expert))
          holds |= cur.device_of_slot(s) == m.from_device;
        CHECK(holds);
        slots[static_cast<std::size_t>(m.to_slot)] = m.expert;
      }
      CHECK(std::equal(slots.begin(), slots.end(), plan.target.slot_experts().begin(),
                       plan.target.slot_experts().end()));
      // The target is the requested placement with devices relabelled by device_map.
      const auto tg = groups(plan.target), ng = groups(next);
      for (int j = 0; j < D; ++j)
        CHECK(tg[static_cast<std::size_t>(plan.device_map[static_cast<std::size_t>(j)])] ==
              ng[static_cast<std::size_t>(j)]);
      // Relabelling keeps node groups together, and the move count is the brute-force minimum
      // over such relabellings.
      const int dpn = D / nodes;
      for (int j = 0; j < D; ++j)
        CHECK(plan.device_map[static_cast<std::size_t>(j)] / dpn ==
              plan.device_map[static_cast<std::size_t>(j / dpn * dpn)] / dpn);
      std::size_t best = static_cast<std::size_t>(-1);
      // `D = D`: a lambda cannot capture a structured binding before clang 16 (P1091).
      brute::permutations(D, [&, D = D](const std::vector<int>& perm) {
        for (int j = 0; j < D; ++j)
          if (perm[static_cast<std::size_t>(j)] / dpn !=
              perm[static_cast<std::size_t>(j / dpn * dpn)] / dpn)
            return;
        best = std::min(best, moves_under(cur, next, perm));
      });
      CHECK(plan.moves.size() == best);
    }
  }
}

TEST_CASE("migration between equal groups moves nothing, and moves prefer a same-node source") {
  const auto topo = weave::topology::grid(2, 2);
  const auto cur = weave::placement::contiguous(8, 4);
  // Same groups, devices permuted inside and across nodes.
  const weave::placement next(8, 4, {7, 6, 4, 5, 3, 2, 0, 1});
  const auto plan = weave::plan_migration(cur, next, topo);
  CHECK(plan.moves.empty());
  CHECK(plan.target == cur);
  // Expert 0 replicated on devices 0 and 3; new placement needs it on device 2 (node 1).
  const weave::placement rep(7, 4, {0, 1, 2, 3, 4, 5, 6, 0});
  const weave::placement want(7, 4, {1, 2, 3, 4, 0, 5, 6, 0});
  const auto p2 = weave::plan_migration(rep, want, weave::topology::flat(4));
  std::size_t best = static_cast<std::size_t>(-1);
  brute::permutations(4, [&](const std::vector<int>& perm) {
    best = std::min(best, moves_under(rep, want, perm));
  });
  CHECK(p2.moves.size() == best);
  const auto p3 = weave::plan_migration(rep, want, topo);
  for (const auto& m : p3.moves)
    if (m.expert == 0)
      CHECK(topo.node_of(m.from_device) == topo.node_of(m.to_device));
}

TEST_CASE("migration rejects placements of different shapes") {
  const auto topo = weave::topology::flat(4);
  const auto a = weave::placement::contiguous(8, 4);
  CHECK_THROWS_AS(weave::plan_migration(a, weave::placement::contiguous(12, 4), topo),
                  weave::error);
  CHECK_THROWS_AS(
      weave::plan_migration(a, weave::placement::contiguous(8, 2), weave::topology::flat(2)),
      weave::error);
  CHECK_THROWS_AS(weave::plan_migration(a, a, weave::topology::flat(2)), weave::error);
  CHECK_THROWS_AS(
      weave::plan_migration(a, weave::placement(8, 4, {0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3}), topo),
      weave::error);
}
