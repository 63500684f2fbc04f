//! \file
//! Expert groups in the replicated placement: every copy of a group's experts on one node (the
//! group-on-node constraint of EPLB's hierarchical policy) or on the group's fixed devices.
//!
//! The devices split into domains (one per node, or one per distinct device list), each domain
//! takes whole groups, and each domain is packed on its own by the replicated placement with
//! its share of the slots. On nodes, groups are dealt G / nodes per node by load (LPT, then
//! swaps, as `place_load_balanced`), and when starting from a current placement each node's
//! bundle of groups goes to the node that holds most of its copies now (an assignment).
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/placement/hungarian.hpp"
#include "weave/placement/placement.hpp"
#include "weave/placement/policies.hpp"
#include "weave/placement/replica_packing.hpp"
#include "weave/placement/topology.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

WEAVE_NAMESPACE_BEGIN

//! Expert groups that must stay together: experts `[g·E/G, (g+1)·E/G)` form group g (the
//! contiguous groups of DeepSeek-V3's `n_group`, as `group_limit` routes them).
struct group_constraint {
  int groups = 0; //!< G; 0 means no groups
  //! Optional fixed devices of each group (G lists): group g's copies go only to `devices[g]`.
  //! Lists of different groups must be equal or disjoint and together cover every device.
  //! Empty: the policy puts each group on one node, G / nodes groups per node.
  std::vector<std::vector<int>> devices;
};

namespace detail {

//! Devices and groups of each domain.
struct group_domains {
  std::vector<std::vector<int>> devices; // domain -> devices, ascending
  std::vector<std::vector<int>> groups;  // domain -> groups, ascending
};

//! Domains from fixed device lists: one per distinct list.
inline group_domains fixed_domains(const group_constraint& gc, int D) {
  const int G = gc.groups;
  WEAVE_EXPECT(static_cast<int>(gc.devices.size()) == G, errc::size_mismatch, gc.devices.size(),
               " device lists for ", G, " expert groups");
  group_domains out;
  std::vector<int> domain_of_device(static_cast<std::size_t>(D), -1);
  for (int g = 0; g < G; ++g) {
    std::vector<int> set = gc.devices[static_cast<std::size_t>(g)];
    std::sort(set.begin(), set.end());
    WEAVE_EXPECT(!set.empty(), errc::invalid_argument, "expert group ", g, " has no devices");
    for (std::size_t i = 0; i < set.size(); ++i) {
      WEAVE_EXPECT(set[i] >= 0 && set[i] < D, errc::out_of_range, "expert group ", g,
                   " lists device ", set[i], ", outside [0, ", D, ")");
      WEAVE_EXPECT(i == 0 || set[i] != set[i - 1], errc::invalid_argument, "expert group ", g,
                   " lists device ", set[i], " twice");
    }
    const auto same = std::find(out.devices.begin(), out.devices.end(), set);
    if (same != out.devices.end()) {
      out.groups[static_cast<std::size_t>(same - out.devices.begin())].push_back(g);
      continue;
    }
    for (const int d : set)
      WEAVE_EXPECT(
          domain_of_device[static_cast<std::size_t>(d)] < 0, errc::invalid_argument, "device ", d,
          " is in the lists of expert groups ",
          out.groups[static_cast<std::size_t>(domain_of_device[static_cast<std::size_t>(d)])]
              .front(),
          " and ", g, ", which differ (lists must be equal or disjoint)");
    for (const int d : set)
      domain_of_device[static_cast<std::size_t>(d)] = static_cast<int>(out.devices.size());
    out.devices.push_back(std::move(set));
    out.groups.push_back({g});
  }
  for (int d = 0; d < D; ++d)
    WEAVE_EXPECT(domain_of_device[static_cast<std::size_t>(d)] >= 0, errc::invalid_argument,
                 "device ", d, " is in no expert group's device list");
  return out;
}

//! Domains on nodes: G / nodes groups per node, balanced by load, each bundle on the node that
//! holds most of its copies in `current` (if any).
inline group_domains node_domains(std::span<const double> loads, int G, const topology& topo,
                                  const placement* current) {
  const int nodes = topo.nodes, dpn = topo.devices_per_node;
  WEAVE_EXPECT(G % nodes == 0, errc::invalid_argument, G, " expert groups do not divide over ",
               nodes, " nodes");
  const std::size_t per_group = loads.size() / static_cast<std::size_t>(G);
  std::vector<double> group_load(static_cast<std::size_t>(G), 0.0);
  for (std::size_t e = 0; e < loads.size(); ++e)
    group_load[e / per_group] += loads[e];
  const std::vector<int> bundle_of = balanced_lpt(group_load, nodes);
  std::vector<int> node_of_bundle(static_cast<std::size_t>(nodes));
  for (int b = 0; b < nodes; ++b)
    node_of_bundle[static_cast<std::size_t>(b)] = b;
  if (current != nullptr) {
    std::vector<double> overlap(static_cast<std::size_t>(nodes) * static_cast<std::size_t>(nodes));
    for (int s = 0; s < current->num_slots(); ++s) {
      if (current->expert_of_slot(s) == placement::empty_slot)
        continue;
      const auto g = static_cast<std::size_t>(current->expert_of_slot(s)) / per_group;
      const int n = topo.node_of(current->device_of_slot(s));
      overlap[static_cast<std::size_t>(bundle_of[g]) * static_cast<std::size_t>(nodes) +
              static_cast<std::size_t>(n)] += 1.0;
    }
    node_of_bundle = max_weight_assignment(overlap, nodes);
  }
  group_domains out;
  out.devices.resize(static_cast<std::size_t>(nodes));
  out.groups.resize(static_cast<std::size_t>(nodes));
  for (int n = 0; n < nodes; ++n)
    for (int i = 0; i < dpn; ++i)
      out.devices[static_cast<std::size_t>(n)].push_back(n * dpn + i);
  for (int g = 0; g < G; ++g)
    out
        .groups[static_cast<std::size_t>(
            node_of_bundle[static_cast<std::size_t>(bundle_of[static_cast<std::size_t>(g)])])]
        .push_back(g);
  return out;
}

//! The replicated placement under a group constraint (shapes and options already checked), not
//! yet slot-aligned with `current`.
inline placement place_grouped(std::span<const double> loads, std::span<const double> coact,
                               const topology& topo, int S, const group_constraint& gc,
                               const placement* current, double keep_tolerance) {
  const int E = static_cast<int>(loads.size()), D = topo.num_devices(), G = gc.groups;
  WEAVE_EXPECT(G >= 1 && G <= E && E % G == 0, errc::invalid_argument, E,
               " experts do not split into ", G, " equal expert groups");
  const int per_group = E / G;
  const group_domains domains =
      gc.devices.empty() ? node_domains(loads, G, topo, current) : fixed_domains(gc, D);
  std::vector<std::vector<std::int32_t>> device_experts(static_cast<std::size_t>(D));
  std::vector<int> local_expert(static_cast<std::size_t>(E)),
      local_device(static_cast<std::size_t>(D));
  for (std::size_t m = 0; m < domains.devices.size(); ++m) {
    const auto& devices = domains.devices[m];
    std::vector<std::int32_t> experts;
    for (const int g : domains.groups[m])
      for (int i = 0; i < per_group; ++i)
        experts.push_back(g * per_group + i);
    const auto Em = static_cast<long long>(experts.size());
    const auto Dm = static_cast<long long>(devices.size());
    WEAVE_EXPECT(Em <= Dm * S && Dm * S - Em <= Em * (Dm - 1), errc::invalid_argument,
                 "expert group ", domains.groups[m].front(), ": ", Em,
                 " experts of its domain cannot fill ", Dm, " devices x ", S,
                 " slots (each expert at most once per device)");
    std::fill(local_expert.begin(), local_expert.end(), -1);
    std::fill(local_device.begin(), local_device.end(), -1);
    std::vector<double> sub_loads;
    for (std::size_t i = 0; i < experts.size(); ++i) {
      local_expert[static_cast<std::size_t>(experts[i])] = static_cast<int>(i);
      sub_loads.push_back(loads[static_cast<std::size_t>(experts[i])]);
    }
    for (std::size_t j = 0; j < devices.size(); ++j)
      local_device[static_cast<std::size_t>(devices[j])] = static_cast<int>(j);
    std::vector<double> sub_coact;
    if (!coact.empty())
      for (const std::int32_t a : experts)
        for (const std::int32_t b : experts)
          sub_coact.push_back(coact[static_cast<std::size_t>(a) * static_cast<std::size_t>(E) +
                                    static_cast<std::size_t>(b)]);
    std::vector<held_copy> holdings;
    if (current != nullptr)
      for (int s = 0; s < current->num_slots(); ++s) {
        if (current->expert_of_slot(s) == placement::empty_slot)
          continue;
        const int e = local_expert[static_cast<std::size_t>(current->expert_of_slot(s))];
        const int d = local_device[static_cast<std::size_t>(current->device_of_slot(s))];
        if (e >= 0 && d >= 0)
          holdings.push_back({e, d});
      }
    const std::vector<int> caps(Dm, S);
    const auto packed = pack_replicated(sub_loads, sub_coact, topology::flat(static_cast<int>(Dm)),
                                        caps, current != nullptr, holdings, keep_tolerance);
    for (std::size_t j = 0; j < packed.size(); ++j)
      for (const std::int32_t e : packed[j])
        device_experts[static_cast<std::size_t>(devices[j])].push_back(
            experts[static_cast<std::size_t>(e)]);
  }
  return placement_from_groups(E, std::move(device_experts));
}

} // namespace detail

WEAVE_NAMESPACE_END
