//! \file
//! Replicated placement (EPLB-style, hierarchical): spend `redundant_slots` extra slots on
//! copies of the hottest experts and pack all copies so the busiest device is as light as
//! possible.
//!
//! Replica counts: each extra slot goes to the expert with the largest load per replica
//! (never more replicas than devices). Packing (`replica_packing.hpp`): every replica carries
//! load/replicas; copies are packed heaviest first onto nodes (a node takes at most one copy per
//! device it has), then onto the devices of each node, never two copies of one expert on a
//! device; swaps between the busiest device and the others then lower the maximum while they
//! can. The flat packing (no node level) is computed too and kept when it is lighter, so the
//! result is never heavier than plain replicate-hottest + LPT.
//!
//! Starting from the current placement (`replication_options::current`), copies that can stay
//! on their device stay, the rest are packed around them, and swaps lower the maximum; that
//! result is taken when its max load is within `keep_tolerance` of the fresh packing, so a
//! rebalance moves few weights. When `current` has as many slots per device as the result, the
//! result is slot-aligned with it: devices are relabelled as `plan_migration` does and every
//! expert that stays on a device keeps its slot, so the slots whose expert differs from
//! `current` are exactly the copies to make (`plan_migration(current, result)` lists them).
//!
//! Expert groups (`replication_options::groups`, DeepSeek-V3's n_group): every copy of a group's
//! experts lands on one node (or on the group's fixed devices), so group-limited routing to
//! `topk_group` groups reaches at most `topk_group` nodes (EPLB's hierarchical policy).
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/placement/hungarian.hpp"
#include "weave/placement/migration.hpp"
#include "weave/placement/placement.hpp"
#include "weave/placement/policies.hpp"
#include "weave/placement/replica_packing.hpp"
#include "weave/placement/replication_groups.hpp"
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

//! Options of `place_replicated`.
struct replication_options {
  //! Extra slots for replicas; E + redundant_slots must divide evenly over the devices.
  int redundant_slots = 0;
  //! Placement to start from (same experts and devices; any slot count), or null.
  const placement* current = nullptr;
  //! Keep the result grown from `current` when its max load ≤ fresh max load · (1 + this).
  double keep_tolerance = 0.02;
  //! Keep expert groups on one node each (or on fixed devices); none by default.
  group_constraint groups = {};
};

namespace detail {

//! `next` slot-aligned with `current` (same slots per device; otherwise `next` unchanged):
//! devices relabelled as `plan_migration` does (`relabel`) or kept, staying experts in their
//! slots.
inline placement align_slots(const placement& current, placement next, const topology& topo,
                             bool relabel) {
  if (current.num_slots() != next.num_slots())
    return next;
  if (relabel)
    return plan_migration(current, next, topo).target;
  std::vector<std::int32_t> identity(static_cast<std::size_t>(next.num_devices()));
  std::iota(identity.begin(), identity.end(), 0);
  return migrate_with(current, next, topo, std::move(identity)).target;
}

inline placement place_replicated(std::span<const double> loads, std::span<const double> coact,
                                  const topology& topo, const replication_options& options) {
  topo.validated();
  const int E = static_cast<int>(loads.size());
  const int D = topo.num_devices();
  WEAVE_EXPECT(E > 0, errc::invalid_argument, "no experts to place");
  const long long slots = static_cast<long long>(E) + options.redundant_slots;
  WEAVE_EXPECT(options.redundant_slots >= 0 && slots % D == 0, errc::invalid_argument, E,
               " experts + ", options.redundant_slots, " redundant slots do not divide over ", D,
               " devices");
  WEAVE_EXPECT(std::isfinite(options.keep_tolerance) && options.keep_tolerance >= 0,
               errc::invalid_argument, "keep_tolerance = ", options.keep_tolerance);
  detail::expect_loads(loads);
  const int S = static_cast<int>(slots / D);
  const placement* cur = options.current;
  if (cur != nullptr)
    WEAVE_EXPECT(cur->num_experts() == E && cur->num_devices() == D, errc::size_mismatch,
                 "current placement has ", cur->num_experts(), " experts on ", cur->num_devices(),
                 " devices, expected ", E, " on ", D);
  if (options.groups.groups != 0) {
    placement p = place_grouped(loads, coact, topo, S, options.groups, cur, options.keep_tolerance);
    // Relabelling devices keeps node groups on nodes but not fixed device lists.
    return cur != nullptr ? align_slots(*cur, std::move(p), topo, options.groups.devices.empty())
                          : p;
  }
  std::vector<held_copy> holdings;
  if (cur != nullptr)
    for (int s = 0; s < cur->num_slots(); ++s)
      holdings.push_back({cur->expert_of_slot(s), cur->device_of_slot(s)});
  placement p = placement_from_groups(
      E, pack_replicated(loads, coact, topo, S, cur != nullptr, holdings, options.keep_tolerance));
  return cur != nullptr ? align_slots(*cur, std::move(p), topo, true) : p;
}

} // namespace detail

//! Replicated placement of `loads.size()` experts with `options.redundant_slots` extra slots
//! (see the file comment). Throws `errc::invalid_argument` when E + redundant_slots does not
//! divide over the devices or cannot be filled without two copies on a device, for bad loads
//! or group constraints (naming the group or device), `errc::out_of_range` for a listed device
//! outside the topology, and `errc::size_mismatch` when
//! `options.current` has other experts or devices.
inline placement place_replicated(std::span<const double> loads, const topology& topo,
                                  const replication_options& options) {
  return detail::place_replicated(loads, {}, topo, options);
}

//! `place_replicated` on the loads of `stats`; when starting from `options.current`, copies
//! that do not stay go preferably to the device they co-activate with most (among those whose
//! load stays within `keep_tolerance` of the fresh packing's maximum), so replicating a
//! collaboration-aware placement keeps collaborators together.
inline placement place_replicated(const expert_statistics& stats, const topology& topo,
                                  const replication_options& options) {
  return detail::place_replicated(stats.loads(), stats.coactivation_matrix(), topo, options);
}

WEAVE_NAMESPACE_END
