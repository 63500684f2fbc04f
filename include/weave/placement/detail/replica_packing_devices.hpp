//! \file
//! `detail::pack_replicated`: the experts of each device of the replicated placement, packed
//! flat, node by node, and (when growing from a layout) kept where they are, the best of them
//! taken; and `detail::copies_fit`, whether replica counts can fill bins of given sizes at all.
//! Included by `replica_packing.hpp`.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/placement/detail/replica_packing_bins.hpp"
#include "weave/placement/placement.hpp"
#include "weave/placement/replica_packing.hpp"
#include "weave/placement/topology.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <numeric>
#include <span>
#include <vector>

WEAVE_NAMESPACE_BEGIN

namespace detail {

//! A copy the current layout holds: `expert` on `device`.
struct held_copy {
  int expert = 0;
  int device = 0;
};

//! Whether copies of experts with `count[e]` copies each fit bins of `capacity[b]` copies, at
//! most one copy of an expert per bin, every bin full (Gale-Ryser: a simple bipartite graph
//! with these degrees exists).
inline bool copies_fit(std::vector<int> capacity, std::span<const int> count) {
  std::sort(capacity.begin(), capacity.end(), std::greater<>());
  long long need = 0, total = 0;
  for (const int c : count)
    total += c;
  for (const int c : capacity)
    need += c;
  if (need != total)
    return false;
  need = 0;
  for (std::size_t k = 1; k <= capacity.size(); ++k) {
    need += capacity[k - 1];
    long long have = 0;
    for (const int c : count)
      have += std::min<long long>(c, static_cast<long long>(k));
    if (need > have)
      return false;
  }
  return true;
}

//! Device -> experts of the replicated placement of `loads` on `topo` with `caps[d]` slots on
//! device d (see the file comment). With `grow`, the copies in `holdings` (slot order) are a
//! start. Throws `errc::invalid_argument` when the replica counts cannot fill the devices
//! without two copies of an expert on one.
inline std::vector<std::vector<std::int32_t>>
pack_replicated(std::span<const double> loads, std::span<const double> coact, const topology& topo,
                std::span<const int> caps, bool grow, std::span<const held_copy> holdings,
                double keep_tolerance) {
  const int E = static_cast<int>(loads.size());
  const int D = topo.num_devices();
  const int S = *std::max_element(caps.begin(), caps.end());
  const bool uniform = std::all_of(caps.begin(), caps.end(), [&](int c) { return c == S; });
  // Per-bin capacities only where they differ (the uniform path stays as it always was).
  auto caps_of = [&](int first, int n) {
    return uniform ? std::vector<int>{}
                   : std::vector<int>(caps.begin() + first, caps.begin() + first + n);
  };
  const long long slots = std::accumulate(caps.begin(), caps.end(), 0LL);
  const std::vector<int> count = replica_counts(loads, static_cast<int>(slots - E), D);
  if (!uniform)
    WEAVE_EXPECT(copies_fit(std::vector<int>(caps.begin(), caps.end()), count),
                 errc::invalid_argument,
                 "the per-device slot counts cannot be filled with the replica counts of these "
                 "loads without two copies of an expert on one device");

  // Flat: replicate-hottest + LPT + swaps.
  auto flat = make_copies(loads, count, D, S, 1, caps_of(0, D));
  if (!flat.try_pack_rest()) // unequal capacities only: the Gale-Ryser check passed above
    flat.pack_by_room();
  flat.refine();
  const replica_packing* best = &flat;
  replica_packing hier, sticky;
  if (topo.nodes > 1) {
    // Hierarchical: copies onto nodes first, then onto each node's devices.
    const int dpn = topo.devices_per_node;
    std::vector<int> node_caps;
    if (!uniform)
      for (int n = 0; n < topo.nodes; ++n)
        node_caps.push_back(
            std::accumulate(caps.begin() + n * dpn, caps.begin() + (n + 1) * dpn, 0));
    auto nodes = make_copies(loads, count, topo.nodes, S * dpn, dpn, std::move(node_caps));
    bool packed = nodes.try_pack_rest(); // fails only with unequal capacities: flat it is
    if (packed)
      nodes.refine();
    hier = make_copies(loads, count, D, S, 1, caps_of(0, D)); // the same copies, node by node
    for (int n = 0; n < topo.nodes && packed; ++n) {
      replica_packing inner;
      inner.bins = dpn;
      inner.capacity = S;
      inner.capacities = caps_of(n * dpn, dpn);
      std::vector<std::size_t> ids;
      for (std::size_t i = 0; i < nodes.bin_of.size(); ++i)
        if (nodes.bin_of[i] == n) {
          ids.push_back(i);
          inner.expert.push_back(nodes.expert[i]);
          inner.weight.push_back(nodes.weight[i]);
          inner.bin_of.push_back(-1);
        }
      if (!uniform) {
        // Unequal devices: a node's share may not split over its devices; then flat it is.
        std::vector<int> node_count(static_cast<std::size_t>(E), 0);
        for (const std::int32_t e : inner.expert)
          ++node_count[static_cast<std::size_t>(e)];
        packed = copies_fit(inner.capacities, node_count);
        if (!packed)
          break;
      }
      packed = inner.try_pack_rest();
      if (!packed)
        break;
      inner.refine();
      for (std::size_t c = 0; c < ids.size(); ++c)
        hier.bin_of[ids[c]] = n * dpn + inner.bin_of[c];
    }
    if (packed) {
      hier.refine();
      if (peak_of(hier.bin_loads()) <= peak_of(flat.bin_loads()))
        best = &hier;
    }
  }
  if (grow) {
    sticky = make_copies(loads, count, D, S, 1, caps_of(0, D));
    // Keep each expert's copies on the devices that hold it now, heaviest first per device.
    std::vector<int> kept(static_cast<std::size_t>(E), 0), size(static_cast<std::size_t>(D), 0);
    std::vector<std::size_t> first_copy(static_cast<std::size_t>(E) + 1, 0);
    for (int e = 0; e < E; ++e)
      first_copy[static_cast<std::size_t>(e) + 1] =
          first_copy[static_cast<std::size_t>(e)] +
          static_cast<std::size_t>(count[static_cast<std::size_t>(e)]);
    std::vector<std::size_t> order(holdings.size());
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      const auto ea = static_cast<std::size_t>(holdings[a].expert);
      const auto eb = static_cast<std::size_t>(holdings[b].expert);
      return loads[ea] / count[ea] > loads[eb] / count[eb];
    });
    for (const std::size_t h : order) {
      const auto e = static_cast<std::size_t>(holdings[h].expert);
      const auto d = static_cast<std::size_t>(holdings[h].device);
      if (kept[e] < count[e] && size[d] < caps[d]) {
        sticky.bin_of[first_copy[e] + static_cast<std::size_t>(kept[e]++)] = static_cast<int>(d);
        ++size[d];
      }
    }
    sticky.affinity = coact;
    sticky.cap = peak_of(best->bin_loads()) * (1.0 + keep_tolerance);
    if (sticky.try_pack_rest()) {
      sticky.refine(sticky.cap);
      if (peak_of(sticky.bin_loads()) <= peak_of(best->bin_loads()) * (1.0 + keep_tolerance))
        best = &sticky;
    }
  }
  return groups_of_packing(*best);
}

} // namespace detail

WEAVE_NAMESPACE_END
