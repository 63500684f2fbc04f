//! \file
//! Re-placing after a loss: from the copies the surviving devices hold, the placement the layer
//! continues with on the survivors, and the copies of weights and optimizer state that get it
//! there (docs/faults.md, "Losing a rank").
//!
//! Every expert must still have a copy on a survivor: otherwise `plan_after_loss` throws
//! `errc::experts_lost` naming them, on every rank alike (they all plan from the same
//! placement and the same survivors). The survivors keep the slots they have. When their slots
//! allow it (`loss_recovery_options::survivable` and two copies of every expert fit in
//! different domains), the new placement is survivable again (`place_survivable`), so a second
//! loss is survived too; otherwise it is the replicated placement of those slots
//! (`place_replicated`). Either is grown from what the survivors hold and planned with
//! `plan_migration`, so only the copies the new balance needs move.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/placement/migration.hpp"
#include "weave/placement/placement.hpp"
#include "weave/placement/replication.hpp"
#include "weave/placement/survivable.hpp"
#include "weave/placement/topology.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

WEAVE_NAMESPACE_BEGIN

//! Options of `plan_after_loss`.
struct loss_recovery_options {
  //! The topology of the current placement; nodes == 0: one node of all its devices.
  topology topo{0, 0};
  //! The failure domain of the layer's survivable placement.
  failure_domain domain = failure_domain::device;
  //! Re-place survivably when the survivors' slots allow it (else: replicated).
  bool survivable = true;
  //! As `replication_options::keep_tolerance`: how much balance to give up to move less.
  double keep_tolerance = 0.02;
};

//! What the survivors of a loss continue with (`plan_after_loss`). Devices are numbered as the
//! survivors' communicator numbers its ranks: new device i is the i-th survivor in old order.
struct loss_recovery {
  std::vector<int> survivors; //!< old device of each new device (ascending)
  std::vector<int> lost;      //!< old devices lost (ascending)
  topology topo;              //!< the survivors' topology
  placement held;             //!< what the survivors hold now, on new device numbers
  //! `plan.target` is the placement to rebuild the layer with; `plan.moves` are the copies of
  //! expert state (weights, optimizer state) to make, on new device numbers.
  migration_plan plan;
  //! True when `plan.target` survives the loss of any one more device (or node).
  bool survivable = false;
};

//! Plans the survivors' placement after devices `lost` of `current` failed (see the file
//! comment), balancing `loads` (one per expert; empty: equal loads). Throws
//! `errc::experts_lost` naming the experts every copy of which was lost, `errc::out_of_range`
//! for a lost device outside the placement, `errc::invalid_argument` when every device is lost
//! or for bad loads, `errc::size_mismatch` for loads or a topology of another size.
inline loss_recovery plan_after_loss(const placement& current, std::span<const int> lost,
                                     std::span<const double> loads = {},
                                     const loss_recovery_options& options = {}) {
  const int E = current.num_experts(), D = current.num_devices(), S = current.slots_per_device();
  const topology topo = options.topo.nodes == 0 ? topology::flat(D) : options.topo.validated();
  WEAVE_EXPECT(topo.num_devices() == D, errc::size_mismatch, "topology has ", topo.num_devices(),
               " devices, the placement ", D);
  WEAVE_EXPECT(loads.empty() || loads.size() == static_cast<std::size_t>(E), errc::size_mismatch,
               loads.size(), " loads for ", E, " experts");
  loss_recovery r;
  std::vector<char> gone(static_cast<std::size_t>(D), 0);
  for (const int d : lost) {
    WEAVE_EXPECT(d >= 0 && d < D, errc::out_of_range, "lost device ", d, " outside a placement of ",
                 D, " devices");
    gone[static_cast<std::size_t>(d)] = 1;
  }
  for (int d = 0; d < D; ++d)
    (gone[static_cast<std::size_t>(d)] ? r.lost : r.survivors).push_back(d);
  WEAVE_EXPECT(!r.survivors.empty(), errc::invalid_argument,
               "every device of the placement is lost");
  const std::vector<std::int32_t> without = experts_lost(current, r.lost);
  if (!without.empty()) {
    std::string ids;
    for (std::size_t i = 0; i < without.size() && i < 32; ++i)
      ids += (i ? ", " : "") + std::to_string(without[i]);
    if (without.size() > 32)
      ids += ", ...";
    std::string devices;
    for (std::size_t i = 0; i < r.lost.size(); ++i)
      devices += (i ? ", " : "") + std::to_string(r.lost[i]);
    WEAVE_THROW(errc::experts_lost, "losing device(s) {", devices, "} lost every copy of ",
                without.size(), " expert(s) {", ids,
                "}: the layer cannot go on without them (restore them from a checkpoint; a "
                "survivable placement keeps two copies of each)");
  }
  // The survivors' topology: whole nodes lost keep the grid; anything else is one flat group.
  const int Dn = static_cast<int>(r.survivors.size());
  const int dpn = topo.devices_per_node;
  bool whole_nodes = topo.nodes > 1;
  for (int n = 0; n < topo.nodes && whole_nodes; ++n) {
    const char first = gone[static_cast<std::size_t>(n * dpn)];
    for (int i = 1; i < dpn; ++i)
      whole_nodes = whole_nodes && gone[static_cast<std::size_t>(n * dpn + i)] == first;
  }
  r.topo = whole_nodes ? topology::grid(Dn / dpn, dpn) : topology::flat(Dn);
  std::vector<std::int32_t> slots;
  for (const int d : r.survivors)
    for (int l = 0; l < S; ++l)
      slots.push_back(current.expert_of_slot(d * S + l));
  r.held = placement(E, Dn, std::move(slots));

  const std::vector<double> equal(static_cast<std::size_t>(E), 1.0);
  const std::span<const double> l = loads.empty() ? std::span<const double>(equal) : loads;
  const failure_domain domain = options.domain == failure_domain::node && r.topo.nodes >= 2
                                    ? failure_domain::node
                                    : failure_domain::device;
  placement next;
  if (options.survivable && detail::survivable_room(E, r.topo, domain, S).fits_two(E)) {
    next = place_survivable(l, r.topo, {domain, S, &r.held, options.keep_tolerance});
    r.survivable = true;
  } else {
    replication_options ro;
    ro.redundant_slots = Dn * S - E;
    ro.current = &r.held;
    ro.keep_tolerance = options.keep_tolerance;
    next = place_replicated(l, r.topo, ro);
    const loss_report check = check_losses(next, r.topo);
    r.survivable = domain == failure_domain::node ? check.survives_any_node() && r.topo.nodes >= 2
                                                  : check.survives_any_device() && Dn >= 2;
  }
  r.plan = plan_migration(r.held, next, r.topo);
  return r;
}

WEAVE_NAMESPACE_END
