//! \file
//! Migration: how to get from the current placement to a new one moving the fewest experts.
//!
//! Policies choose device groups, not device names: any relabelling of the new placement's
//! devices is equally good (on a multi-node topology, any relabelling that keeps groups of a
//! node on one node). `plan_migration` picks the relabelling that keeps the most experts where
//! they are (a maximum-weight assignment of new groups to devices, node by node then device by
//! device), keeps staying experts in their local slots, and lists the (expert, from, to) copies
//! the trainer must make, weights and optimizer state alike.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/placement/hungarian.hpp"
#include "weave/placement/placement.hpp"
#include "weave/placement/topology.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <vector>

WEAVE_NAMESPACE_BEGIN

//! One expert copy of a migration: `expert` goes from device `from_device` (one that holds it
//! now) into physical slot `to_slot` of device `to_device`.
struct expert_move {
  std::int32_t expert = 0;      //!< logical expert
  std::int32_t from_device = 0; //!< a device holding it in the current placement
  std::int32_t to_device = 0;   //!< device receiving it
  std::int32_t to_slot = 0;     //!< physical slot it lands in (on `to_device`)
  friend bool operator==(const expert_move&, const expert_move&) = default;
};

//! The result of `plan_migration`.
struct migration_plan {
  //! The new placement with devices relabelled and slots ordered to keep experts in place:
  //! writing each move's expert into its slot of the current placement (and emptying the slots
  //! `target` has empty) gives exactly this.
  placement target;
  //! Physical device that each device of the requested new placement was mapped to.
  std::vector<std::int32_t> device_map;
  //! Copies to perform, by destination slot. Slots whose expert stays are not listed; experts
  //! that leave a device need no action beyond being overwritten.
  std::vector<expert_move> moves;
};

namespace detail {

inline std::vector<double> overlap_matrix(const placement& current, const placement& next,
                                          std::span<const int> cur_devices,
                                          std::span<const int> next_devices) {
  const std::size_t n = cur_devices.size();
  std::vector<double> w(n * n, 0.0);
  const int S = current.slots_per_device();
  for (std::size_t j = 0; j < n; ++j)
    for (int ls = 0; ls < S; ++ls) {
      const int e = next.expert_of_slot(next_devices[j] * S + ls);
      if (e == placement::empty_slot)
        continue;
      for (const std::int32_t s : current.slots_of(e))
        for (std::size_t i = 0; i < n; ++i)
          if (current.device_of_slot(s) == cur_devices[i])
            w[i * n + j] += 1.0;
    }
  return w;
}

//! The migration from `current` to `next` with new device j on physical device
//! `device_map[j]` (shapes already checked): staying experts keep their local slot, the other
//! slots of a device take its incoming experts in ascending id order, slots of departing
//! experts first, then empty ones; slots left over become (or stay) empty and need no copy.
inline migration_plan migrate_with(const placement& current, const placement& next,
                                   const topology& topo, std::vector<std::int32_t> device_map) {
  const int D = current.num_devices(), S = current.slots_per_device();
  std::vector<std::int32_t> slots(current.slot_experts().begin(), current.slot_experts().end());
  std::vector<expert_move> moves;
  for (int j = 0; j < D; ++j) {
    const int dev = device_map[static_cast<std::size_t>(j)];
    std::vector<std::int32_t> incoming;
    std::vector<char> keep(static_cast<std::size_t>(S), 0);
    for (int ls = 0; ls < S; ++ls) {
      const std::int32_t e = next.expert_of_slot(j * S + ls);
      if (e == placement::empty_slot)
        continue;
      int here = -1;
      for (int cs = 0; cs < S; ++cs)
        if (current.expert_of_slot(dev * S + cs) == e)
          here = cs;
      if (here >= 0)
        keep[static_cast<std::size_t>(here)] = 1;
      else
        incoming.push_back(e);
    }
    std::sort(incoming.begin(), incoming.end());
    // Free slots: those of departing experts, then empty ones (fewest raw slot changes).
    std::vector<int> free_slots;
    for (const bool empty : {false, true})
      for (int cs = 0; cs < S; ++cs)
        if (!keep[static_cast<std::size_t>(cs)] &&
            (current.expert_of_slot(dev * S + cs) == placement::empty_slot) == empty)
          free_slots.push_back(cs);
    for (int cs = 0; cs < S; ++cs)
      if (!keep[static_cast<std::size_t>(cs)])
        slots[static_cast<std::size_t>(dev * S + cs)] = placement::empty_slot;
    for (std::size_t in = 0; in < incoming.size(); ++in) {
      const int cs = free_slots[in];
      const std::int32_t e = incoming[in];
      // Copy from a current holder, preferring one on the destination's node.
      int from = -1;
      for (const std::int32_t s : current.slots_of(e)) {
        const int d = current.device_of_slot(s);
        if (from < 0 ||
            (topo.node_of(d) == topo.node_of(dev) && topo.node_of(from) != topo.node_of(dev)))
          from = d;
      }
      slots[static_cast<std::size_t>(dev * S + cs)] = e;
      moves.push_back(expert_move{e, from, dev, dev * S + cs});
    }
  }
  return migration_plan{placement(current.num_experts(), D, std::move(slots)),
                        std::move(device_map), std::move(moves)};
}

} // namespace detail

//! Plans the move from `current` to `next` (same experts, devices and slots per device) on
//! `topo`. The number of moves is the minimum over all admissible device relabellings of
//! `next`, except when either placement has empty slots: those may stand for devices of
//! different capacities, which a relabelling would break, so devices keep their labels. An
//! empty slot in `next` needs no copy; an expert copied into a slot that was empty is a move
//! like any other. Throws `errc::size_mismatch` when the shapes differ or the topology has
//! another number of devices.
inline migration_plan plan_migration(const placement& current, const placement& next,
                                     const topology& topo) {
  topo.validated();
  WEAVE_EXPECT(current.num_experts() == next.num_experts(), errc::size_mismatch, "migrating ",
               current.num_experts(), " experts to a placement of ", next.num_experts());
  WEAVE_EXPECT(
      current.num_devices() == next.num_devices() && current.num_slots() == next.num_slots(),
      errc::size_mismatch, "migrating ", current.num_devices(), " devices x ",
      current.slots_per_device(), " slots to ", next.num_devices(), " x ", next.slots_per_device());
  WEAVE_EXPECT(topo.num_devices() == current.num_devices(), errc::size_mismatch, "topology has ",
               topo.num_devices(), " devices, placements ", current.num_devices());
  const int D = current.num_devices();
  if (current.has_empty_slots() || next.has_empty_slots()) {
    std::vector<std::int32_t> identity(static_cast<std::size_t>(D));
    std::iota(identity.begin(), identity.end(), 0);
    return detail::migrate_with(current, next, topo, std::move(identity));
  }
  const int dpn = topo.devices_per_node;
  // device_map[j]: physical device for new device j. Nodes first, then devices inside nodes;
  // with one node this is a single assignment over all devices.
  std::vector<std::int32_t> device_map(static_cast<std::size_t>(D));
  std::vector<std::vector<int>> inner(static_cast<std::size_t>(topo.nodes) *
                                      static_cast<std::size_t>(topo.nodes));
  std::vector<double> node_w(static_cast<std::size_t>(topo.nodes) *
                             static_cast<std::size_t>(topo.nodes));
  auto devices_of = [&](int node) {
    std::vector<int> ds(static_cast<std::size_t>(dpn));
    for (int i = 0; i < dpn; ++i)
      ds[static_cast<std::size_t>(i)] = node * dpn + i;
    return ds;
  };
  for (int a = 0; a < topo.nodes; ++a)
    for (int b = 0; b < topo.nodes; ++b) {
      const auto w = detail::overlap_matrix(current, next, devices_of(a), devices_of(b));
      const auto idx = static_cast<std::size_t>(a) * static_cast<std::size_t>(topo.nodes) +
                       static_cast<std::size_t>(b);
      // Rows: new devices of node b; columns: current devices of node a.
      std::vector<double> t(w.size());
      for (int i = 0; i < dpn; ++i)
        for (int j = 0; j < dpn; ++j)
          t[static_cast<std::size_t>(j * dpn + i)] = w[static_cast<std::size_t>(i * dpn + j)];
      inner[idx] = max_weight_assignment(t, dpn);
      double value = 0;
      for (int j = 0; j < dpn; ++j)
        value += t[static_cast<std::size_t>(j * dpn + inner[idx][static_cast<std::size_t>(j)])];
      node_w[static_cast<std::size_t>(b) * static_cast<std::size_t>(topo.nodes) +
             static_cast<std::size_t>(a)] = value;
    }
  const std::vector<int> node_map = max_weight_assignment(node_w, topo.nodes);
  for (int b = 0; b < topo.nodes; ++b) {
    const int a = node_map[static_cast<std::size_t>(b)];
    const auto& in = inner[static_cast<std::size_t>(a) * static_cast<std::size_t>(topo.nodes) +
                           static_cast<std::size_t>(b)];
    for (int j = 0; j < dpn; ++j)
      device_map[static_cast<std::size_t>(b * dpn + j)] = a * dpn + in[static_cast<std::size_t>(j)];
  }
  return detail::migrate_with(current, next, topo, std::move(device_map));
}

WEAVE_NAMESPACE_END
