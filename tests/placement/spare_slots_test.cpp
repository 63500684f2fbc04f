// Empty slots in a placement and per-device spare slots in the replicated placement: the
// packing against brute force on tiny shapes, the capacity rule, migrations into and out of
// empty slots, and bad input.
#include <doctest/doctest.h>

#include <weave/placement/metrics.hpp>
#include <weave/placement/migration.hpp>
#include <weave/placement/replication.hpp>
#include <weave/placement/replication_layers.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <vector>

namespace {

constexpr std::int32_t empty = weave::placement::empty_slot;

// The capacity rule, written out: the E primaries spread as evenly as they go, lowest devices
// first, plus each device's spare slots.
std::vector<int> capacities(int E, const std::vector<int>& spare) {
  const int D = static_cast<int>(spare.size());
  std::vector<int> caps;
  int primaries = E;
  for (int d = 0; d < D; ++d) {
    const int share = (primaries + (D - d) - 1) / (D - d); // ceil of what is left
    primaries -= share;
    caps.push_back(share + spare[static_cast<std::size_t>(d)]);
  }
  return caps;
}

// Copy weights: expert e's copies carry loads[e] / count[e].
struct copy {
  int expert;
  double weight;
};

std::vector<copy> copies_of(const std::vector<double>& loads, const std::vector<int>& count) {
  std::vector<copy> c;
  for (std::size_t e = 0; e < loads.size(); ++e)
    for (int i = 0; i < count[e]; ++i)
      c.push_back({static_cast<int>(e), loads[e] / count[e]});
  return c;
}

// Brute force: the lightest possible peak over every assignment of the copies to devices that
// fills each device to its capacity with distinct experts; +inf when there is none.
double brute_peak(const std::vector<copy>& copies, const std::vector<int>& caps, int E) {
  const std::size_t D = caps.size();
  std::vector<double> load(D, 0.0);
  std::vector<int> size(D, 0);
  std::vector<char> held(D * static_cast<std::size_t>(E), 0);
  double best = std::numeric_limits<double>::infinity();
  auto rec = [&](auto&& self, std::size_t i) -> void {
    if (i == copies.size()) {
      best = std::min(best, *std::max_element(load.begin(), load.end()));
      return;
    }
    const auto e = static_cast<std::size_t>(copies[i].expert);
    for (std::size_t d = 0; d < D; ++d) {
      if (size[d] == caps[d] || held[d * static_cast<std::size_t>(E) + e])
        continue;
      load[d] += copies[i].weight;
      ++size[d];
      held[d * static_cast<std::size_t>(E) + e] = 1;
      self(self, i + 1);
      load[d] -= copies[i].weight;
      --size[d];
      held[d * static_cast<std::size_t>(E) + e] = 0;
    }
  };
  rec(rec, 0);
  return best;
}

// Reference: LPT (heaviest copy to the lightest device with room not holding its expert).
double lpt_peak(std::vector<copy> copies, const std::vector<int>& caps) {
  std::stable_sort(copies.begin(), copies.end(),
                   [](const copy& a, const copy& b) { return a.weight > b.weight; });
  const std::size_t D = caps.size();
  std::vector<double> load(D, 0.0);
  std::vector<std::set<int>> held(D);
  for (const copy& c : copies) {
    std::size_t best = D;
    for (std::size_t d = 0; d < D; ++d)
      if (static_cast<int>(held[d].size()) < caps[d] && !held[d].count(c.expert) &&
          (best == D || load[d] < load[best]))
        best = d;
    if (best == D)
      return std::numeric_limits<double>::infinity();
    load[best] += c.weight;
    held[best].insert(c.expert);
  }
  return *std::max_element(load.begin(), load.end());
}

double peak_load(const weave::placement& p, const std::vector<double>& loads) {
  std::vector<double> l(static_cast<std::size_t>(p.num_devices()), 0.0);
  for (int s = 0; s < p.num_slots(); ++s) {
    const int e = p.expert_of_slot(s);
    if (e != empty)
      l[static_cast<std::size_t>(p.device_of_slot(s))] +=
          loads[static_cast<std::size_t>(e)] / static_cast<double>(p.slots_of(e).size());
  }
  return *std::max_element(l.begin(), l.end());
}

} // namespace

TEST_CASE("a placement with empty slots: counts, replicas, routing and bad input") {
  // Device 0 holds 0 and 2, device 1 holds 1, 2 and 3; device 2 only 0.
  const weave::placement p(4, 3, {0, 2, empty, 1, 2, 3, empty, 0, empty});
  CHECK(p.slots_per_device() == 3);
  CHECK(p.num_slots() == 9);
  CHECK(p.num_filled_slots() == 6);
  CHECK(p.has_empty_slots());
  CHECK(p.replicated());
  CHECK(p.filled_slots_on(0) == 2);
  CHECK(p.filled_slots_on(1) == 3);
  CHECK(p.filled_slots_on(2) == 1);
  CHECK(std::vector<std::int32_t>(p.slots_of(0).begin(), p.slots_of(0).end()) ==
        std::vector<std::int32_t>{0, 7});
  CHECK(std::vector<std::int32_t>(p.slots_of(2).begin(), p.slots_of(2).end()) ==
        std::vector<std::int32_t>{1, 4});
  for (int e = 0; e < 4; ++e)
    for (std::size_t t = 0; t < 6; ++t)
      for (int src = 0; src < 3; ++src)
        CHECK(p.expert_of_slot(p.slot_for(e, t, src)) == e);
  // Four filled slots for four experts: full, not replicated.
  const weave::placement q(4, 2, {0, 1, 2, 3, empty, empty});
  CHECK_FALSE(q.replicated());
  CHECK(!weave::placement::contiguous(4, 2).has_empty_slots());
  // Metrics skip empty slots: device loads {1 + 2 + 3, 4} for q, mean 5.
  const std::vector<double> loads{1, 2, 3, 4};
  CHECK(weave::expected_max_mean_load(q, loads) == doctest::Approx(6.0 / 5));
  auto code = [](auto f) {
    try {
      f();
    } catch (const weave::error& e) {
      return e.code();
    }
    return weave::errc{};
  };
  CHECK(code([] {
          weave::placement(3, 2, {0, 1, empty, empty});
        }) == weave::errc::invalid_argument); // expert 2 has no slot
  CHECK(code([] { weave::placement(3, 2, {0, 1, -2, 2}); }) == weave::errc::out_of_range);
  CHECK(code([] { weave::placement(3, 2, {0, 0, 1, 2}); }) == weave::errc::invalid_argument);
}

TEST_CASE("spare slots per device: capacity, invariants and peak against brute force") {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> u(0.0, 10.0);
  int cases = 0, optimal = 0, infeasible = 0;
  struct shape {
    int E, nodes, per_node;
  };
  const std::vector<shape> shapes{{1, 1, 2}, {2, 1, 2}, {3, 1, 2}, {4, 1, 2}, {2, 1, 3}, {3, 1, 3},
                                  {4, 1, 3}, {3, 2, 1}, {4, 2, 1}, {4, 3, 1}, {4, 2, 2}};
  for (const shape& sh : shapes) {
    const int D = sh.nodes * sh.per_node;
    const auto topo = weave::topology::grid(sh.nodes, sh.per_node);
    std::vector<int> spare(static_cast<std::size_t>(D), 0);
    // Every spare list with entries in {0, 1, 2} (D <= 4: at most 81 lists).
    for (;;) {
      const auto caps = capacities(sh.E, spare);
      for (int trial = 0; trial < 2; ++trial) {
        std::vector<double> loads(static_cast<std::size_t>(sh.E));
        for (auto& l : loads)
          l = trial == 0 ? std::floor(u(rng)) + 1 : u(rng) * u(rng);
        CAPTURE(sh.E);
        CAPTURE(D);
        CAPTURE(sh.nodes);
        CAPTURE(spare);
        weave::replication_options o;
        o.spare_slots_per_device = spare;
        const bool too_big = *std::max_element(caps.begin(), caps.end()) > sh.E;
        const int extra = std::accumulate(spare.begin(), spare.end(), 0);
        if (too_big || extra > sh.E * (D - 1)) {
          CHECK_THROWS_AS(weave::place_replicated(loads, topo, o), weave::error);
          continue;
        }
        const auto count = weave::replica_counts(loads, extra, D);
        const auto copies = copies_of(loads, count);
        const double opt = brute_peak(copies, caps, sh.E);
        if (opt == std::numeric_limits<double>::infinity()) {
          // No assignment exists for these replica counts: a typed error, not a bad placement.
          try {
            (void)weave::place_replicated(loads, topo, o);
            FAIL("an infeasible spare list was placed");
          } catch (const weave::error& e) {
            CHECK(e.code() == weave::errc::invalid_argument);
          }
          ++infeasible;
          continue;
        }
        const auto p = weave::place_replicated(loads, topo, o);
        REQUIRE(p.num_devices() == D);
        CHECK(p.slots_per_device() == *std::max_element(caps.begin(), caps.end()));
        for (int d = 0; d < D; ++d) {
          CHECK(p.filled_slots_on(d) == caps[static_cast<std::size_t>(d)]);
          // Empty slots only after a device's experts.
          for (int l = 0; l + 1 < p.slots_per_device(); ++l)
            CHECK_FALSE((p.expert_of_slot(d * p.slots_per_device() + l) == empty &&
                         p.expert_of_slot(d * p.slots_per_device() + l + 1) != empty));
        }
        for (int e = 0; e < sh.E; ++e) {
          CHECK(static_cast<int>(p.slots_of(e).size()) == count[static_cast<std::size_t>(e)]);
          std::set<int> devs;
          for (const auto s : p.slots_of(e))
            devs.insert(p.device_of_slot(s));
          CHECK(devs.size() == p.slots_of(e).size());
        }
        const double ours = peak_load(p, loads);
        CHECK(ours >= opt * (1 - 1e-12));
        CHECK(ours <= lpt_peak(copies, caps) * (1 + 1e-12));
        optimal += ours <= opt * (1 + 1e-12);
        ++cases;
      }
      std::size_t i = 0;
      while (i < spare.size() && spare[i] == 2)
        spare[i++] = 0;
      if (i == spare.size())
        break;
      ++spare[i];
    }
  }
  MESSAGE("spare lists: optimal peak in ", optimal, " of ", cases, " placements; ", infeasible,
          " infeasible replica counts rejected");
  CHECK(cases > 200);
}

TEST_CASE("a uniform spare list places exactly as the equivalent redundant_slots count") {
  std::mt19937 rng(3);
  std::uniform_real_distribution<double> u(0.1, 5.0);
  for (const auto& [E, nodes, per_node, R] :
       {std::tuple{8, 1, 4, 4}, {10, 2, 2, 2}, {16, 2, 4, 8}, {30, 2, 4, 10}}) {
    const int D = nodes * per_node;
    std::vector<double> loads(static_cast<std::size_t>(E));
    for (auto& l : loads)
      l = u(rng) * u(rng);
    const auto topo = weave::topology::grid(nodes, per_node);
    weave::replication_options by_count;
    by_count.redundant_slots = R;
    weave::replication_options by_list;
    const int S = (E + R) / D;
    for (int d = 0; d < D; ++d)
      by_list.spare_slots_per_device.push_back(S - (E / D + (d < E % D ? 1 : 0)));
    CHECK(weave::place_replicated(loads, topo, by_list) ==
          weave::place_replicated(loads, topo, by_count));
  }
}

TEST_CASE("spare lists grown from a current placement and over many layers") {
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> u(0.1, 5.0);
  const int E = 12;
  const auto topo = weave::topology::grid(2, 2);
  weave::replication_options o;
  o.spare_slots_per_device = {2, 0, 1, 3};
  std::vector<double> loads(static_cast<std::size_t>(E) * 3);
  for (auto& l : loads)
    l = u(rng) * u(rng);
  const std::span<const double> all(loads);
  weave::placement cur = weave::place_replicated(all.subspan(0, E), topo, o);
  REQUIRE(cur.has_empty_slots());
  for (int w = 1; w < 3; ++w) {
    weave::replication_options g = o;
    g.current = &cur;
    const auto next =
        weave::place_replicated(all.subspan(static_cast<std::size_t>(w) * E, E), topo, g);
    for (int d = 0; d < 4; ++d)
      CHECK(next.filled_slots_on(d) == cur.filled_slots_on(d)); // capacities kept, no relabel
    // Slot-aligned: each slot that now holds an expert it did not hold is one planned copy.
    int changed = 0;
    for (int s = 0; s < next.num_slots(); ++s)
      changed += next.expert_of_slot(s) != empty && next.expert_of_slot(s) != cur.expert_of_slot(s);
    const auto plan = weave::plan_migration(cur, next, topo);
    CHECK(plan.target == next);
    CHECK(static_cast<int>(plan.moves.size()) == changed);
    cur = next;
  }
  weave::layer_replication_options lo;
  lo.layer = o;
  lo.threads = 2;
  const auto layers = weave::place_replicated_layers(loads, E, topo, lo);
  REQUIRE(layers.size() == 3);
  for (std::size_t l = 0; l < 3; ++l)
    CHECK(layers[l] == weave::place_replicated(all.subspan(l * E, E), topo, o));
}

TEST_CASE("migration into and out of empty slots") {
  const auto topo = weave::topology::flat(2);
  // Hand-derived: expert 2 leaves device 0 (its slot becomes empty, no copy) and lands in
  // device 1's first empty slot, copied from device 0.
  const weave::placement cur(4, 2, {0, 1, 2, 3, empty, empty});
  const weave::placement next(4, 2, {0, 1, empty, 3, 2, empty});
  const auto plan = weave::plan_migration(cur, next, topo);
  CHECK(plan.target == weave::placement(4, 2, {0, 1, empty, 3, 2, empty}));
  REQUIRE(plan.moves.size() == 1);
  CHECK(plan.moves[0] == weave::expert_move{2, 0, 1, 4});
  CHECK(plan.device_map == std::vector<std::int32_t>{0, 1});
  // Random pairs: applying the moves (and emptying what the target has empty) to the current
  // slots gives the target; the move count is the (device, expert) pairs new to a device.
  std::mt19937 rng(5);
  for (int trial = 0; trial < 200; ++trial) {
    const int E = 6, D = 3, S = 4;
    auto random_placement = [&] {
      for (;;) {
        std::vector<std::int32_t> slots;
        for (int d = 0; d < D; ++d) {
          std::vector<std::int32_t> experts(static_cast<std::size_t>(E));
          std::iota(experts.begin(), experts.end(), 0);
          std::shuffle(experts.begin(), experts.end(), rng);
          const int filled = std::uniform_int_distribution<int>(1, S)(rng);
          for (int l = 0; l < S; ++l)
            slots.push_back(l < filled ? experts[static_cast<std::size_t>(l)] : empty);
          std::shuffle(slots.end() - S, slots.end(), rng);
        }
        std::set<int> present(slots.begin(), slots.end());
        present.erase(empty);
        if (static_cast<int>(present.size()) == E)
          return weave::placement(E, D, slots);
      }
    };
    const auto a = random_placement(), b = random_placement();
    const auto m = weave::plan_migration(a, b, weave::topology::flat(D));
    std::vector<std::int32_t> slots(a.slot_experts().begin(), a.slot_experts().end());
    for (const auto& mv : m.moves) {
      CHECK(mv.to_slot / S == mv.to_device);
      bool held = false;
      for (const auto s : a.slots_of(mv.expert))
        held = held || a.device_of_slot(s) == mv.from_device;
      CHECK(held);
      slots[static_cast<std::size_t>(mv.to_slot)] = mv.expert;
    }
    for (int s = 0; s < D * S; ++s)
      if (m.target.expert_of_slot(s) == empty)
        slots[static_cast<std::size_t>(s)] = empty;
    CHECK(weave::placement(E, D, slots) == m.target);
    int fresh = 0;
    for (int d = 0; d < D; ++d)
      for (int l = 0; l < S; ++l) {
        const int e = b.expert_of_slot(d * S + l);
        bool here = false;
        for (int c = 0; c < S; ++c)
          here = here || a.expert_of_slot(d * S + c) == e;
        fresh += e != empty && !here;
      }
    CHECK(static_cast<int>(m.moves.size()) == fresh);
    // Same experts per device as requested (no relabelling with empty slots).
    for (int d = 0; d < D; ++d) {
      std::multiset<int> want, got;
      for (int l = 0; l < S; ++l) {
        want.insert(b.expert_of_slot(d * S + l));
        got.insert(m.target.expert_of_slot(d * S + l));
      }
      CHECK(want == got);
    }
  }
}

TEST_CASE("spare slot lists reject bad input with typed errors") {
  const std::vector<double> loads{4, 3, 2, 1, 1, 1};
  const auto topo = weave::topology::flat(3);
  auto code = [&](weave::replication_options o) {
    try {
      (void)weave::place_replicated(loads, topo, o);
    } catch (const weave::error& e) {
      return e.code();
    }
    return weave::errc{};
  };
  weave::replication_options o;
  o.spare_slots_per_device = {1, 0, 0};
  CHECK(code(o) == weave::errc{});
  o.redundant_slots = 3;
  CHECK(code(o) == weave::errc::invalid_argument); // both forms
  o.redundant_slots = 0;
  o.spare_slots_per_device = {1, 0};
  CHECK(code(o) == weave::errc::size_mismatch);
  o.spare_slots_per_device = {1, -1, 0};
  CHECK(code(o) == weave::errc::invalid_argument);
  o.spare_slots_per_device = {5, 0, 0}; // 7 slots on device 0 for 6 experts
  CHECK(code(o) == weave::errc::invalid_argument);
  o.spare_slots_per_device = {1, 0, 0};
  o.groups.groups = 2;
  CHECK(code(o) == weave::errc::not_supported);
}

TEST_CASE("docs: spare slots per device") {
  //! [spare_slots]
  // 10 experts on 4 devices; device 0 has memory for two spare copies, device 3 for one.
  const std::vector<double> loads{9, 1, 1, 1, 1, 1, 1, 1, 1, 5};
  weave::replication_options o;
  o.spare_slots_per_device = {2, 0, 0, 1}; // base shares 3, 3, 2, 2 -> capacities 5, 3, 2, 3
  const weave::placement p = weave::place_replicated(loads, weave::topology::flat(4), o);
  // Five slots per device (the largest capacity): device 2 has three empty ones at its end.
  //! [spare_slots]
  CHECK(p.slots_per_device() == 5);
  CHECK(p.filled_slots_on(0) == 5);
  CHECK(p.filled_slots_on(1) == 3);
  CHECK(p.filled_slots_on(2) == 2);
  CHECK(p.filled_slots_on(3) == 3);
  CHECK(p.expert_of_slot(2 * 5 + 2) == weave::placement::empty_slot);
  CHECK(p.num_filled_slots() == 13);
}
