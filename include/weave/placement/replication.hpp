//! \file
//! Replicated placement (EPLB-style, hierarchical): spend `redundant_slots` extra slots on
//! copies of the hottest experts and pack all copies so the busiest device is as light as
//! possible.
//!
//! Spare slots per device (`spare_slots_per_device`): device d holds
//! `base_d + spare[d]` copies, `base_d = E / D + (d < E % D ? 1 : 0)` (the E primaries spread as
//! evenly as they go), so `sum(spare)` is the number of extra copies. The result has
//! `slots_per_device() = max_d capacity_d`; a smaller device's last slots are empty
//! (`placement::empty_slot`). Every packing step respects each device's own capacity.
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
#include "weave/core/float_bits.hpp"
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
  //! Or: extra slots of each device (one per device; see the file comment for the capacity
  //! rule); the result pads smaller devices with empty slots. Not with `redundant_slots` or
  //! `groups`.
  std::vector<int> spare_slots_per_device = {};
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

//! Slots of each device: from `spare_slots_per_device` when given, else E + redundant_slots
//! spread evenly (see the file comment).
inline std::vector<int> device_capacities(int E, int D, const replication_options& options) {
  if (options.spare_slots_per_device.empty()) {
    const long long slots = static_cast<long long>(E) + options.redundant_slots;
    WEAVE_EXPECT(options.redundant_slots >= 0 && slots % D == 0, errc::invalid_argument, E,
                 " experts + ", options.redundant_slots, " redundant slots do not divide over ", D,
                 " devices");
    return std::vector<int>(static_cast<std::size_t>(D), static_cast<int>(slots / D));
  }
  const auto& spare = options.spare_slots_per_device;
  WEAVE_EXPECT(options.redundant_slots == 0, errc::invalid_argument,
               "redundant_slots = ", options.redundant_slots,
               " and spare_slots_per_device are both set; give the spare slots one way");
  WEAVE_EXPECT(options.groups.groups == 0, errc::not_supported,
               "spare_slots_per_device with expert groups (groups place equal devices; use "
               "redundant_slots)");
  WEAVE_EXPECT(spare.size() == static_cast<std::size_t>(D), errc::size_mismatch,
               "spare_slots_per_device has ", spare.size(), " entries for ", D, " devices");
  std::vector<int> caps(static_cast<std::size_t>(D));
  for (int d = 0; d < D; ++d) {
    const int extra = spare[static_cast<std::size_t>(d)];
    WEAVE_EXPECT(extra >= 0, errc::invalid_argument, "spare_slots_per_device[", d, "] = ", extra);
    const long long cap = static_cast<long long>(E / D + (d < E % D ? 1 : 0)) + extra;
    WEAVE_EXPECT(cap <= E, errc::invalid_argument, "device ", d, " would hold ", cap,
                 " slots but there are only ", E, " experts (two copies of one on a device)");
    caps[static_cast<std::size_t>(d)] = static_cast<int>(cap);
  }
  return caps;
}

inline placement place_replicated(std::span<const double> loads, std::span<const double> coact,
                                  const topology& topo, const replication_options& options) {
  topo.validated();
  const int E = static_cast<int>(loads.size());
  const int D = topo.num_devices();
  WEAVE_EXPECT(E > 0, errc::invalid_argument, "no experts to place");
  const std::vector<int> caps = device_capacities(E, D, options);
  WEAVE_EXPECT(weave::detail::is_finite(options.keep_tolerance) && options.keep_tolerance >= 0,
               errc::invalid_argument, "keep_tolerance = ", options.keep_tolerance);
  detail::expect_loads(loads);
  const int S = caps[0];
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
      if (cur->expert_of_slot(s) != placement::empty_slot)
        holdings.push_back({cur->expert_of_slot(s), cur->device_of_slot(s)});
  placement p = placement_from_groups(E, pack_replicated(loads, coact, topo, caps, cur != nullptr,
                                                         holdings, options.keep_tolerance));
  return cur != nullptr ? align_slots(*cur, std::move(p), topo, true) : p;
}

} // namespace detail

//! Replicated placement of `loads.size()` experts with `options.redundant_slots` extra slots
//! or `options.spare_slots_per_device` (see the file comment). Throws `errc::invalid_argument`
//! when E + redundant_slots does not divide over the devices or the slots cannot be filled
//! without two copies on a device, for both spare forms set, a negative spare count, bad loads
//! or group constraints (naming the group or device), `errc::not_supported` for a spare list
//! with groups, `errc::out_of_range` for a listed device outside the topology, and
//! `errc::size_mismatch` for a spare list not of one entry per device or when
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
