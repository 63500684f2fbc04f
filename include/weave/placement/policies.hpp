//! \file
//! The simple placement policies: contiguous (the Megatron/DeepSpeed/Tutel default),
//! round-robin, and load-balanced (equal experts per device, token load spread evenly).
//! Every policy maps statistics and a topology to a `placement`; the co-activation aware and
//! replicating ones live in `collaboration.hpp` and `replication.hpp`.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/float_bits.hpp"
#include "weave/placement/placement.hpp"
#include "weave/placement/statistics.hpp"
#include "weave/placement/topology.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

WEAVE_NAMESPACE_BEGIN

namespace detail {

//! Throws unless `num_experts` experts split evenly over the topology's devices.
inline void expect_even_split(int num_experts, const topology& topo) {
  topo.validated();
  WEAVE_EXPECT(num_experts > 0 && num_experts % topo.num_devices() == 0, errc::invalid_argument,
               num_experts, " experts do not divide evenly over ", topo.num_devices(), " devices");
}

//! Throws unless every load is finite and non-negative.
inline void expect_loads(std::span<const double> loads) {
  for (std::size_t e = 0; e < loads.size(); ++e)
    WEAVE_EXPECT(weave::detail::is_finite(loads[e]) && loads[e] >= 0.0, errc::invalid_argument,
                 "load ", loads[e], " of expert ", e, " is not a finite non-negative number");
}

//! A placement from the experts of each device; each device's experts sorted ascending so the
//! result depends only on the groups. Groups are padded with empty slots at their end to
//! `width` slots (0: the largest group's size; a larger group is not cut).
inline placement placement_from_groups(int num_experts,
                                       std::vector<std::vector<std::int32_t>> groups,
                                       std::size_t width = 0) {
  for (const auto& g : groups)
    width = std::max(width, g.size());
  std::vector<std::int32_t> slots;
  for (auto& g : groups) {
    std::sort(g.begin(), g.end());
    slots.insert(slots.end(), g.begin(), g.end());
    slots.insert(slots.end(), width - g.size(), placement::empty_slot);
  }
  return placement(num_experts, static_cast<int>(groups.size()), std::move(slots));
}

//! Device groups of a placement (the experts of each device, in slot order, empty slots left
//! out).
inline std::vector<std::vector<std::int32_t>> groups_of(const placement& p) {
  std::vector<std::vector<std::int32_t>> groups(static_cast<std::size_t>(p.num_devices()));
  for (int s = 0; s < p.num_slots(); ++s)
    if (p.expert_of_slot(s) != placement::empty_slot)
      groups[static_cast<std::size_t>(p.device_of_slot(s))].push_back(p.expert_of_slot(s));
  return groups;
}

//! Splits `items` (weights `w`) into `parts` groups of exactly `items.size() / parts` items
//! minimising the heaviest group: longest-processing-time first (heaviest item to the lightest
//! group with room), then pairwise swaps between the heaviest group and the others while one
//! lowers the maximum of the pair. Returns the group of each item.
inline std::vector<int> balanced_lpt(std::span<const double> w, int parts) {
  const std::size_t n = w.size();
  const std::size_t cap = n / static_cast<std::size_t>(parts);
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return w[a] > w[b]; });
  std::vector<int> part_of(n, -1);
  std::vector<double> load(static_cast<std::size_t>(parts), 0.0);
  std::vector<std::size_t> count(static_cast<std::size_t>(parts), 0);
  for (const std::size_t i : order) {
    int best = -1;
    for (int p = 0; p < parts; ++p)
      if (count[static_cast<std::size_t>(p)] < cap &&
          (best < 0 || load[static_cast<std::size_t>(p)] < load[static_cast<std::size_t>(best)]))
        best = p;
    part_of[i] = best;
    load[static_cast<std::size_t>(best)] += w[i];
    ++count[static_cast<std::size_t>(best)];
  }
  // Swap refinement; every accepted swap strictly lowers the pair maximum, so it terminates.
  for (std::size_t round = 0; round < 4 * n * n + 16; ++round) {
    const auto hi = static_cast<int>(std::max_element(load.begin(), load.end()) - load.begin());
    const double top = load[static_cast<std::size_t>(hi)];
    double best_peak = top;
    std::size_t best_a = n, best_b = n;
    for (std::size_t a = 0; a < n; ++a) {
      if (part_of[a] != hi)
        continue;
      for (std::size_t b = 0; b < n; ++b) {
        if (part_of[b] == hi || w[b] >= w[a])
          continue;
        const double delta = w[a] - w[b];
        const double peak =
            std::max(top - delta, load[static_cast<std::size_t>(part_of[b])] + delta);
        if (peak < best_peak - 1e-12 * std::max(1.0, top)) {
          best_peak = peak;
          best_a = a;
          best_b = b;
        }
      }
    }
    if (best_a == n)
      break;
    const int lo = part_of[best_b];
    const double delta = w[best_a] - w[best_b];
    load[static_cast<std::size_t>(hi)] -= delta;
    load[static_cast<std::size_t>(lo)] += delta;
    part_of[best_a] = lo;
    part_of[best_b] = hi;
  }
  return part_of;
}

} // namespace detail

//! Experts `[d·E/D, (d+1)·E/D)` on device `d` (`placement::contiguous` over the topology).
inline placement place_contiguous(int num_experts, const topology& topo) {
  detail::expect_even_split(num_experts, topo);
  return placement::contiguous(num_experts, topo.num_devices());
}

//! Expert `e` on device `e % D`: neighbouring expert ids land on different devices.
inline placement place_round_robin(int num_experts, const topology& topo) {
  detail::expect_even_split(num_experts, topo);
  const int D = topo.num_devices();
  std::vector<std::vector<std::int32_t>> groups(static_cast<std::size_t>(D));
  for (int e = 0; e < num_experts; ++e)
    groups[static_cast<std::size_t>(e % D)].push_back(e);
  return detail::placement_from_groups(num_experts, std::move(groups));
}

//! E/D experts per device with the heaviest device as light as the heuristic finds (LPT, then
//! swaps off the heaviest device). On a multi-node topology nodes are balanced first, then the
//! devices inside each node. Throws `errc::invalid_argument` for loads that are negative or not
//! finite, or experts that do not divide over the devices.
inline placement place_load_balanced(std::span<const double> loads, const topology& topo) {
  const int E = static_cast<int>(loads.size());
  detail::expect_even_split(E, topo);
  detail::expect_loads(loads);
  std::vector<std::vector<std::int32_t>> groups(static_cast<std::size_t>(topo.num_devices()));
  const std::vector<int> node_of = detail::balanced_lpt(loads, topo.nodes);
  for (int n = 0; n < topo.nodes; ++n) {
    std::vector<std::int32_t> members;
    std::vector<double> w;
    for (int e = 0; e < E; ++e)
      if (node_of[static_cast<std::size_t>(e)] == n) {
        members.push_back(e);
        w.push_back(loads[static_cast<std::size_t>(e)]);
      }
    const std::vector<int> dev = detail::balanced_lpt(w, topo.devices_per_node);
    for (std::size_t i = 0; i < members.size(); ++i)
      groups[static_cast<std::size_t>(n * topo.devices_per_node + dev[i])].push_back(members[i]);
  }
  return detail::placement_from_groups(E, std::move(groups));
}

//! `place_load_balanced` on the loads of `stats`.
inline placement place_load_balanced(const expert_statistics& stats, const topology& topo) {
  return place_load_balanced(stats.loads(), topo);
}

WEAVE_NAMESPACE_END
