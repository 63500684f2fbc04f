// Survivable placement, the loss check and re-placing after a loss, against direct references:
// copies counted per device and node by hand, losses checked by counting the copies left, the
// best balance of tiny instances by brute force, and moves applied slot by slot.
#include <doctest/doctest.h>

#include <weave/placement/after_loss.hpp>
#include <weave/placement/migration.hpp>
#include <weave/placement/replication.hpp>
#include <weave/placement/survivable.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace {

std::vector<double> random_loads(int E, std::mt19937& rng) {
  std::lognormal_distribution<double> d(0.0, 1.0);
  std::vector<double> l(static_cast<std::size_t>(E));
  for (double& x : l)
    x = d(rng);
  return l;
}

double peak(const weave::placement& p, const std::vector<double>& loads) {
  std::vector<double> l(static_cast<std::size_t>(p.num_devices()), 0.0);
  for (int s = 0; s < p.num_slots(); ++s)
    if (const int e = p.expert_of_slot(s); e != weave::placement::empty_slot)
      l[static_cast<std::size_t>(p.device_of_slot(s))] +=
          loads[static_cast<std::size_t>(e)] / static_cast<double>(p.slots_of(e).size());
  return *std::max_element(l.begin(), l.end());
}

// The experts with no copy outside `lost`, by counting copies slot by slot.
std::vector<std::int32_t> lost_by_counting(const weave::placement& p, const std::set<int>& lost) {
  std::vector<int> left(static_cast<std::size_t>(p.num_experts()), 0);
  for (int s = 0; s < p.num_slots(); ++s)
    if (p.expert_of_slot(s) != weave::placement::empty_slot && !lost.count(p.device_of_slot(s)))
      ++left[static_cast<std::size_t>(p.expert_of_slot(s))];
  std::vector<std::int32_t> out;
  for (int e = 0; e < p.num_experts(); ++e)
    if (left[static_cast<std::size_t>(e)] == 0)
      out.push_back(e);
  return out;
}

// Checks the loss report of `p` against counting, device by device and node by node.
void check_report(const weave::placement& p, const weave::topology& t) {
  const weave::loss_report r = weave::check_losses(p, t);
  for (int d = 0; d < p.num_devices(); ++d)
    CHECK(r.lost_by_device[static_cast<std::size_t>(d)] == lost_by_counting(p, {d}));
  for (int n = 0; n < t.nodes; ++n) {
    std::set<int> node;
    for (int i = 0; i < t.devices_per_node; ++i)
      node.insert(n * t.devices_per_node + i);
    CHECK(r.lost_by_node[static_cast<std::size_t>(n)] == lost_by_counting(p, node));
  }
}

// Two copies of every expert or more, on distinct devices (and nodes for the node domain).
void check_survivable(const weave::placement& p, const weave::topology& t,
                      weave::failure_domain domain) {
  for (int e = 0; e < p.num_experts(); ++e) {
    std::set<int> devices, nodes;
    for (const std::int32_t s : p.slots_of(e)) {
      devices.insert(p.device_of_slot(s));
      nodes.insert(t.node_of(p.device_of_slot(s)));
    }
    CHECK(p.slots_of(e).size() >= 2);
    CHECK(devices.size() == p.slots_of(e).size());
    if (domain == weave::failure_domain::node)
      CHECK(nodes.size() == p.slots_of(e).size());
  }
  const weave::loss_report r = weave::check_losses(p, t);
  CHECK(r.survives_any_device());
  if (domain == weave::failure_domain::node)
    CHECK(r.survives_any_node());
  check_report(p, t);
}

} // namespace

TEST_CASE("place_survivable: two copies of every expert in distinct domains, in the fewest slots") {
  std::mt19937 rng(7);
  const std::vector<std::tuple<int, int, int>> shapes{{4, 1, 4},  {8, 1, 4},   {9, 1, 4},
                                                      {16, 2, 4}, {64, 2, 4},  {64, 4, 8},
                                                      {30, 3, 2}, {256, 4, 8}, {7, 1, 3}};
  for (const auto& shape : shapes) {
    const int E = std::get<0>(shape), nodes = std::get<1>(shape), dpn = std::get<2>(shape);
    const weave::topology t = weave::topology::grid(nodes, dpn);
    const int D = t.num_devices();
    for (const auto domain : {weave::failure_domain::device, weave::failure_domain::node}) {
      if (domain == weave::failure_domain::node && nodes < 2)
        continue;
      CAPTURE(E);
      CAPTURE(D);
      CAPTURE(static_cast<int>(domain));
      const auto loads = random_loads(E, rng);
      const weave::placement p = weave::place_survivable(loads, t, {domain});
      CHECK(p.slots_per_device() == (2 * E + D - 1) / D); // the least that holds two copies each
      check_survivable(p, t, domain);
      // Growing from itself moves nothing.
      weave::survivable_options again{domain};
      again.current = &p;
      const weave::placement q = weave::place_survivable(loads, t, again);
      CHECK(weave::plan_migration(p, q, t).moves.empty());
    }
  }
}

TEST_CASE("place_survivable balances like the brute-force best on tiny instances") {
  std::mt19937 rng(11);
  // 4 experts, 4 devices of 2 slots: every way to put two copies of each on distinct devices.
  for (int trial = 0; trial < 20; ++trial) {
    const auto loads = random_loads(4, rng);
    double best = 1e300;
    std::vector<int> fill(4, 0);
    std::vector<std::int32_t> slots(8, weave::placement::empty_slot);
    std::function<void(int)> place = [&](int copy) {
      if (copy == 8) {
        std::vector<std::int32_t> s(8);
        std::vector<int> at(4, 0);
        std::vector<std::vector<std::int32_t>> dev(4);
        for (int c = 0; c < 8; ++c)
          dev[static_cast<std::size_t>(slots[static_cast<std::size_t>(c)])].push_back(c / 2);
        std::vector<std::int32_t> flat;
        for (auto& g : dev)
          flat.insert(flat.end(), g.begin(), g.end());
        best = std::min(best, peak(weave::placement(4, 4, flat), loads));
        return;
      }
      const int e = copy / 2;
      for (int d = 0; d < 4; ++d) {
        if (fill[static_cast<std::size_t>(d)] == 2 ||
            (copy % 2 == 1 && slots[static_cast<std::size_t>(copy - 1)] >= d))
          continue; // full, or not after the first copy's device (distinct, unordered)
        (void)e;
        slots[static_cast<std::size_t>(copy)] = d;
        ++fill[static_cast<std::size_t>(d)];
        place(copy + 1);
        --fill[static_cast<std::size_t>(d)];
      }
    };
    place(0);
    const weave::placement p = weave::place_survivable(loads, weave::topology::flat(4));
    CAPTURE(trial);
    CHECK(peak(p, loads) <= best * 1.25 + 1e-12);
  }
  // Equal loads balance perfectly.
  const std::vector<double> equal(12, 1.0);
  const weave::placement p = weave::place_survivable(equal, weave::topology::flat(8));
  CHECK(peak(p, equal) == doctest::Approx(3.0 * 0.5));
}

TEST_CASE("place_survivable refuses what it cannot place, naming why") {
  const std::vector<double> loads(8, 1.0);
  CHECK_THROWS_AS(weave::place_survivable(loads, weave::topology::flat(1)), weave::error);
  CHECK_THROWS_AS(
      weave::place_survivable(loads, weave::topology::grid(1, 4), {weave::failure_domain::node}),
      weave::error);
  weave::survivable_options small;
  small.slots_per_device = 3; // 4 devices x 3 slots < 16 copies
  try {
    (void)weave::place_survivable(loads, weave::topology::flat(4), small);
    FAIL("no error");
  } catch (const weave::error& e) {
    CHECK(e.code() == weave::errc::invalid_argument);
    CHECK(e.message().find("two copies") != std::string::npos);
  }
  const std::vector<double> bad{1.0, -1.0};
  CHECK_THROWS_AS(weave::place_survivable(bad, weave::topology::flat(4)), weave::error);
  const weave::placement other = weave::placement::contiguous(8, 2);
  weave::survivable_options grow;
  grow.current = &other;
  CHECK_THROWS_AS(weave::place_survivable(loads, weave::topology::flat(4), grow), weave::error);
}

TEST_CASE("check_losses names the experts each device and node takes with it") {
  std::mt19937 rng(3);
  const weave::topology t = weave::topology::grid(2, 4);
  check_report(weave::placement::contiguous(16, 8), t);
  const auto loads = random_loads(16, rng);
  weave::replication_options o;
  o.redundant_slots = 8;
  const weave::placement replicated = weave::place_replicated(loads, t, o);
  check_report(replicated, t);
  CHECK_FALSE(weave::check_losses(replicated, t).survives_any_device()); // cold experts: 1 copy
  CHECK_THROWS_AS(weave::check_losses(replicated, weave::topology::flat(4)), weave::error);
}

TEST_CASE("plan_after_loss: every expert served from the survivors' copies, moves that are real") {
  std::mt19937 rng(5);
  for (const auto& shape : std::vector<std::tuple<int, int, int, int>>{
           {8, 1, 4, 0}, {16, 1, 8, 0}, {8, 1, 8, 4}, {32, 2, 4, 0}, {64, 2, 8, 12}}) {
    const int E = std::get<0>(shape), nodes = std::get<1>(shape), dpn = std::get<2>(shape),
              spd = std::get<3>(shape);
    const weave::topology t = weave::topology::grid(nodes, dpn);
    const auto loads = random_loads(E, rng);
    weave::survivable_options so;
    so.slots_per_device = spd;
    const weave::placement p = weave::place_survivable(loads, t, so);
    for (int lost = 0; lost < t.num_devices(); ++lost) {
      CAPTURE(E);
      CAPTURE(lost);
      const int gone[] = {lost};
      weave::loss_recovery_options ro;
      ro.topo = t;
      const weave::loss_recovery r = weave::plan_after_loss(p, gone, loads, ro);
      CHECK(r.lost == std::vector<int>{lost});
      REQUIRE(r.survivors.size() == static_cast<std::size_t>(t.num_devices() - 1));
      // held: the survivors' slots as they were.
      for (std::size_t i = 0; i < r.survivors.size(); ++i)
        for (int l = 0; l < p.slots_per_device(); ++l)
          CHECK(r.held.expert_of_slot(static_cast<int>(i) * p.slots_per_device() + l) ==
                p.expert_of_slot(r.survivors[i] * p.slots_per_device() + l));
      // Applying the moves to what the survivors hold gives the target, each copied from a
      // device that holds it.
      std::vector<std::int32_t> slots(r.held.slot_experts().begin(), r.held.slot_experts().end());
      const weave::placement& target = r.plan.target;
      for (int s = 0; s < target.num_slots(); ++s)
        if (target.expert_of_slot(s) == weave::placement::empty_slot)
          slots[static_cast<std::size_t>(s)] = weave::placement::empty_slot;
      for (const weave::expert_move& m : r.plan.moves) {
        bool holds = false;
        for (const std::int32_t s : r.held.slots_of(m.expert))
          holds = holds || r.held.device_of_slot(s) == m.from_device;
        CHECK(holds);
        slots[static_cast<std::size_t>(m.to_slot)] = m.expert;
      }
      CHECK(slots ==
            std::vector<std::int32_t>(target.slot_experts().begin(), target.slot_experts().end()));
      // Survivable again when two copies of each fit the survivors' slots.
      const bool room = 2 * E <= (t.num_devices() - 1) * p.slots_per_device();
      CHECK(r.survivable == room);
      if (room)
        CHECK(weave::check_losses(target, r.topo).survives_any_device());
    }
  }
}

TEST_CASE("plan_after_loss: a whole node keeps the grid, a loss of every copy is experts_lost") {
  const weave::topology t = weave::topology::grid(3, 4);
  const std::vector<double> loads(24, 1.0);
  const weave::placement p = weave::place_survivable(loads, t, {weave::failure_domain::node});
  const int node1[] = {4, 5, 6, 7};
  weave::loss_recovery_options ro;
  ro.topo = t;
  ro.domain = weave::failure_domain::node;
  const weave::loss_recovery r = weave::plan_after_loss(p, node1, loads, ro);
  CHECK(r.topo == weave::topology::grid(2, 4));
  CHECK(r.survivors == std::vector<int>{0, 1, 2, 3, 8, 9, 10, 11});
  // Two nodes lost: some experts had both copies there.
  const int two_nodes[] = {0, 1, 2, 3, 4, 5, 6, 7};
  const auto gone = weave::experts_lost(p, two_nodes);
  REQUIRE_FALSE(gone.empty());
  try {
    (void)weave::plan_after_loss(p, two_nodes, loads, ro);
    FAIL("no error");
  } catch (const weave::error& e) {
    CHECK(e.code() == weave::errc::experts_lost);
    CHECK(e.message().find(std::to_string(gone.front())) != std::string::npos);
  }
  const int outside[] = {12};
  CHECK_THROWS_AS(weave::plan_after_loss(p, outside, loads, ro), weave::error);
}
