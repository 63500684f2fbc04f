//! \file
//! Survivable placement: at least two copies of every expert, in different failure domains
//! (devices, or nodes of the topology), so that losing any one domain leaves a copy of each and
//! the layer can go on without a restart (docs/faults.md); and the check of any placement for
//! the single-device and single-node losses it survives.
//!
//! Copies: two of every expert, then each remaining slot to the expert with the largest load per
//! copy (EPLB's rule, as `replica_counts`), at most one copy per domain; slots that no expert
//! can use stay empty. Packing: heaviest copy first into the lightest domain that may take it,
//! then swaps off the heaviest (`replica_packing.hpp`); with the node domain, copies go onto
//! nodes first (one per node), then onto each node's devices. Grown from `current` (re-placing
//! after a loss), copies that can stay on their device stay and the rest are packed around
//! them; that is kept when its busiest device is within `keep_tolerance` of the fresh packing's,
//! and the result is slot-aligned with `current` as `place_replicated` does, so
//! `plan_migration(current, result)` lists exactly the copies to make.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/float_bits.hpp"
#include "weave/placement/placement.hpp"
#include "weave/placement/policies.hpp"
#include "weave/placement/replica_packing.hpp"
#include "weave/placement/replication.hpp"
#include "weave/placement/topology.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

WEAVE_NAMESPACE_BEGIN

//! What one failure takes down: a device, or a whole node of the topology.
enum class failure_domain : int {
  device = 0, //!< one device (GPU, rank)
  node = 1,   //!< one node and every device on it
};

//! Options of `place_survivable`.
struct survivable_options {
  //! The copies of every expert are spread over distinct domains of this kind.
  failure_domain domain = failure_domain::device;
  //! Slots of every device; 0: the fewest that hold two copies of each expert, ceil(2E / D).
  int slots_per_device = 0;
  //! Placement to grow from (same experts and devices; any slot count), or null.
  const placement* current = nullptr;
  //! Keep the result grown from `current` when its max load ≤ fresh max load · (1 + this).
  double keep_tolerance = 0.02;
};

namespace detail {

// Domains of kind `domain` on `topo`, and the copies of E experts they hold with S slots per
// device, one copy of an expert per domain.
struct survivable_room {
  int domains = 0;
  int domain_slots = 0;
  long long copies = 0;
  survivable_room(int E, const topology& topo, failure_domain domain, int S) {
    const bool by_node = domain == failure_domain::node;
    domains = by_node ? topo.nodes : topo.num_devices();
    domain_slots = by_node ? S * topo.devices_per_node : S;
    copies = static_cast<long long>(domains) * std::min(domain_slots, E);
  }
  //! Whether two copies of every expert fit, in two domains or more.
  bool fits_two(int E) const { return domains >= 2 && 2LL * E <= copies; }
};

// Copies of `experts` (weights `weights`) into `bins` of `capacity`, one copy of an expert per
// bin; `held[i]` is a bin copy i starts in (-1: none). The fresh packing, or the one grown from
// `held` when it is within `tolerance` of it. Returns each copy's bin.
inline std::vector<int> pack_one_per_bin(const std::vector<std::int32_t>& experts,
                                         const std::vector<double>& weights, int bins, int capacity,
                                         const std::vector<int>& held, double tolerance) {
  replica_packing fresh;
  fresh.bins = bins;
  fresh.capacity = capacity;
  fresh.per_bin = 1;
  fresh.expert = experts;
  fresh.weight = weights;
  fresh.bin_of.assign(experts.size(), -1);
  fresh.sync();
  if (!fresh.try_pack_rest())
    fresh.pack_by_room();
  fresh.refine();
  const double fresh_peak = experts.empty() ? 0.0 : peak_of(fresh.bin_loads());
  if (std::none_of(held.begin(), held.end(), [](int b) { return b >= 0; }))
    return fresh.bin_of;
  replica_packing sticky = fresh;
  sticky.bin_of = held;
  std::vector<int> kept(static_cast<std::size_t>(bins), 0);
  for (int& b : sticky.bin_of) // a bin keeps no more copies than it has slots
    if (b >= 0 && kept[static_cast<std::size_t>(b)]++ >= capacity)
      b = -1;
  sticky.sync();
  sticky.cap = fresh_peak * (1.0 + tolerance);
  if (!sticky.try_pack_rest())
    return fresh.bin_of;
  sticky.refine(sticky.cap);
  return peak_of(sticky.bin_loads()) <= fresh_peak * (1.0 + tolerance) ? sticky.bin_of
                                                                       : fresh.bin_of;
}

} // namespace detail

//! A placement of `loads.size()` experts on `topo` in which every expert has at least two copies
//! in different `options.domain`s (see the file comment). Throws `errc::invalid_argument` for
//! bad loads, fewer than two domains, or slots that cannot hold two copies of each expert one
//! per domain; `errc::size_mismatch` when `options.current` has other experts or devices.
inline placement place_survivable(std::span<const double> loads, const topology& topo,
                                  const survivable_options& options = {}) {
  topo.validated();
  detail::expect_loads(loads);
  const int E = static_cast<int>(loads.size());
  const int D = topo.num_devices();
  const bool by_node = options.domain == failure_domain::node;
  WEAVE_EXPECT(E > 0, errc::invalid_argument, "no experts to place");
  const int S = options.slots_per_device > 0 ? options.slots_per_device : (2 * E + D - 1) / D;
  const detail::survivable_room room(E, topo, options.domain, S);
  const int domains = room.domains;
  WEAVE_EXPECT(domains >= 2, errc::invalid_argument, "a survivable placement needs two ",
               by_node ? "nodes" : "devices", " or more; the topology has ", domains);
  WEAVE_EXPECT(weave::detail::is_finite(options.keep_tolerance) && options.keep_tolerance >= 0,
               errc::invalid_argument, "keep_tolerance = ", options.keep_tolerance);
  WEAVE_EXPECT(options.slots_per_device >= 0 && S <= E, errc::invalid_argument,
               "slots_per_device = ", options.slots_per_device, " for ", E, " experts");
  const int bin_slots = room.domain_slots;
  WEAVE_EXPECT(room.fits_two(E), errc::invalid_argument, domains, by_node ? " nodes" : " devices",
               " of ", bin_slots, " slots cannot hold two copies of each of ", E,
               " experts in different domains");
  const placement* cur = options.current;
  if (cur != nullptr)
    WEAVE_EXPECT(cur->num_experts() == E && cur->num_devices() == D, errc::size_mismatch,
                 "current placement has ", cur->num_experts(), " experts on ", cur->num_devices(),
                 " devices, expected ", E, " on ", D);
  // Two copies of each, then the room left to the experts with the most load per copy.
  std::vector<int> count(static_cast<std::size_t>(E), 2);
  detail::add_copies(loads, count, room.copies - 2LL * E, domains);

  std::vector<std::int32_t> experts;
  std::vector<double> weights;
  for (int e = 0; e < E; ++e)
    for (int c = 0; c < count[static_cast<std::size_t>(e)]; ++c) {
      experts.push_back(e);
      weights.push_back(loads[static_cast<std::size_t>(e)] / count[static_cast<std::size_t>(e)]);
    }
  // Where the current placement holds each copy (one copy of an expert per device it is on).
  std::vector<int> held_device(experts.size(), -1);
  if (cur != nullptr) {
    std::size_t first = 0;
    for (int e = 0; e < E; ++e) {
      const auto slots = cur->slots_of(e);
      const auto n = static_cast<std::size_t>(count[static_cast<std::size_t>(e)]);
      std::vector<int> nodes_taken;
      std::size_t c = 0;
      for (std::size_t i = 0; i < slots.size() && c < n; ++i) {
        const int d = cur->device_of_slot(slots[i]);
        const int node = topo.node_of(d);
        if (by_node && std::find(nodes_taken.begin(), nodes_taken.end(), node) != nodes_taken.end())
          continue;
        nodes_taken.push_back(node);
        held_device[first + c++] = d;
      }
      first += n;
    }
  }
  std::vector<int> device_of(experts.size(), -1);
  if (!by_node) {
    device_of =
        detail::pack_one_per_bin(experts, weights, D, S, held_device, options.keep_tolerance);
  } else {
    std::vector<int> held_node(experts.size(), -1);
    for (std::size_t i = 0; i < experts.size(); ++i)
      if (held_device[i] >= 0)
        held_node[i] = topo.node_of(held_device[i]);
    const std::vector<int> node_of = detail::pack_one_per_bin(
        experts, weights, topo.nodes, bin_slots, held_node, options.keep_tolerance);
    const int dpn = topo.devices_per_node;
    for (int n = 0; n < topo.nodes; ++n) {
      std::vector<std::size_t> ids;
      std::vector<std::int32_t> ex;
      std::vector<double> w;
      std::vector<int> held;
      for (std::size_t i = 0; i < experts.size(); ++i)
        if (node_of[i] == n) {
          ids.push_back(i);
          ex.push_back(experts[i]);
          w.push_back(weights[i]);
          held.push_back(held_node[i] == n ? held_device[i] - n * dpn : -1);
        }
      const std::vector<int> inner =
          detail::pack_one_per_bin(ex, w, dpn, S, held, options.keep_tolerance);
      for (std::size_t c = 0; c < ids.size(); ++c)
        device_of[ids[c]] = n * dpn + inner[c];
    }
  }
  std::vector<std::vector<std::int32_t>> groups(static_cast<std::size_t>(D));
  for (std::size_t i = 0; i < experts.size(); ++i)
    groups[static_cast<std::size_t>(device_of[i])].push_back(experts[i]);
  placement p = detail::placement_from_groups(E, std::move(groups), static_cast<std::size_t>(S));
  return cur != nullptr ? detail::align_slots(*cur, std::move(p), topo, true) : p;
}

//! The experts a placement loses with devices `lost` (every copy on them), ascending. Throws
//! `errc::out_of_range` for a device outside the placement.
inline std::vector<std::int32_t> experts_lost(const placement& p, std::span<const int> lost) {
  std::vector<char> gone(static_cast<std::size_t>(p.num_devices()), 0);
  for (const int d : lost) {
    WEAVE_EXPECT(d >= 0 && d < p.num_devices(), errc::out_of_range, "lost device ", d,
                 " outside a placement of ", p.num_devices(), " devices");
    gone[static_cast<std::size_t>(d)] = 1;
  }
  std::vector<std::int32_t> out;
  for (int e = 0; e < p.num_experts(); ++e) {
    const auto slots = p.slots_of(e);
    if (std::all_of(slots.begin(), slots.end(), [&](std::int32_t s) {
          return gone[static_cast<std::size_t>(p.device_of_slot(s))] != 0;
        }))
      out.push_back(e);
  }
  return out;
}

//! Which single losses a placement survives (`check_losses`).
struct loss_report {
  //! Experts lost with each device alone (empty: that loss is survived).
  std::vector<std::vector<std::int32_t>> lost_by_device;
  //! Experts lost with each node alone.
  std::vector<std::vector<std::int32_t>> lost_by_node;

  //! Devices (or nodes) whose loss takes some expert with it.
  static std::vector<int> fatal(const std::vector<std::vector<std::int32_t>>& by) {
    std::vector<int> out;
    for (std::size_t i = 0; i < by.size(); ++i)
      if (!by[i].empty())
        out.push_back(static_cast<int>(i));
    return out;
  }
  std::vector<int> fatal_devices() const { return fatal(lost_by_device); }
  std::vector<int> fatal_nodes() const { return fatal(lost_by_node); }
  //! True when the loss of any one device leaves every expert a copy.
  bool survives_any_device() const { return fatal_devices().empty(); }
  //! True when the loss of any one node leaves every expert a copy.
  bool survives_any_node() const { return fatal_nodes().empty(); }
};

//! The single-device and single-node losses `p` survives on `topo`. Throws
//! `errc::size_mismatch` when the topology has another number of devices.
inline loss_report check_losses(const placement& p, const topology& topo) {
  topo.validated();
  WEAVE_EXPECT(topo.num_devices() == p.num_devices(), errc::size_mismatch, "topology has ",
               topo.num_devices(), " devices, the placement ", p.num_devices());
  loss_report r;
  for (int d = 0; d < p.num_devices(); ++d) {
    const int one[] = {d};
    r.lost_by_device.push_back(experts_lost(p, one));
  }
  for (int n = 0; n < topo.nodes; ++n) {
    std::vector<int> devices;
    for (int i = 0; i < topo.devices_per_node; ++i)
      devices.push_back(n * topo.devices_per_node + i);
    r.lost_by_node.push_back(experts_lost(p, devices));
  }
  return r;
}

WEAVE_NAMESPACE_END
