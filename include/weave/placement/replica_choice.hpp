//! \file
//! `replica_router`: which replica of each chosen expert a token is sent to.
//!
//! `placement::slot_for` is the stateless default (own device, else in turn). The router adds
//! policies that need the topology or running state: prefer a replica on the token's node
//! (intra-node links are cheaper), prefer a device the token already visits for another expert
//! (no extra copy, the Occult view of replicas), and send the rest to the least loaded replica.
//! All state is sized at construction; `route` does not allocate.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/placement/placement.hpp"
#include "weave/placement/topology.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

WEAVE_NAMESPACE_BEGIN

//! How a token picks among the replicas of an expert not on its own device.
enum class replica_policy {
  in_turn,      //!< replicas in turn by token index (`placement::slot_for`)
  same_node,    //!< a replica on the token's node, else any; in turn among candidates
  least_loaded, //!< the candidate replica whose device has received the fewest rows so far
};

//! Options of a `replica_router`.
struct replica_options {
  replica_policy policy = replica_policy::in_turn; //!< choice among remote replicas
  //! Before the policy, use a replica on a device the token already sends a copy to: the row
  //! is sent once per device, so this replica costs no extra copy.
  bool prefer_visited = false;
};

//! Resolves the logical experts of one token to physical slots under a placement. Borrows the
//! placement: it must outlive the router.
class replica_router {
 public:
  //! Throws `errc::size_mismatch` unless the topology has `p.num_devices()` devices.
  replica_router(const placement& p, const topology& topo, replica_options options = {})
      : placement_(&p)
      , topology_(topo.validated())
      , options_(options)
      , device_rows_(static_cast<std::size_t>(p.num_devices()), 0) {
    WEAVE_EXPECT(topo.num_devices() == p.num_devices(), errc::size_mismatch, "topology has ",
                 topo.num_devices(), " devices, placement ", p.num_devices());
  }

  //! Writes the slot of each expert of `experts` into `slots` (same size) for token number
  //! `token` coming from `source_device`. Negative ids ("no expert") map to -1. Throws
  //! `errc::out_of_range` for an expert id or device outside the placement.
  void route(std::span<const std::int32_t> experts, std::size_t token, int source_device,
             std::span<std::int32_t> slots) {
    const placement& p = *placement_;
    WEAVE_EXPECT(slots.size() == experts.size(), errc::size_mismatch, slots.size(),
                 " output slots for ", experts.size(), " experts");
    WEAVE_EXPECT(source_device >= 0 && source_device < p.num_devices(), errc::out_of_range,
                 "source device ", source_device, " outside [0, ", p.num_devices(), ")");
    // Pass 1: experts with one choice (single replica, or one on the source device).
    for (std::size_t i = 0; i < experts.size(); ++i) {
      const std::int32_t e = experts[i];
      slots[i] = -1;
      if (e < 0)
        continue;
      WEAVE_EXPECT(e < p.num_experts(), errc::out_of_range, "expert id ", e, " of token ", token,
                   " >= num_experts ", p.num_experts());
      const auto replicas = p.slots_of(e);
      if (replicas.size() == 1) {
        slots[i] = replicas[0];
        continue;
      }
      for (const std::int32_t s : replicas)
        if (p.device_of_slot(s) == source_device)
          slots[i] = s;
    }
    // Pass 2: the rest, in position order so the result is deterministic.
    for (std::size_t i = 0; i < experts.size(); ++i) {
      if (experts[i] < 0 || slots[i] >= 0)
        continue;
      slots[i] = choose(experts[i], token, source_device, slots.first(i), slots.subspan(i + 1));
    }
    for (const std::int32_t s : slots)
      if (s >= 0)
        ++device_rows_[static_cast<std::size_t>(p.device_of_slot(s))];
  }

  //! Rows (token, expert pairs) routed to each device since construction or `reset`.
  std::span<const std::int64_t> device_rows() const noexcept { return device_rows_; }
  //! Forgets the running per-device counts.
  void reset() noexcept {
    for (auto& r : device_rows_)
      r = 0;
  }

 private:
  bool visited(int device, std::span<const std::int32_t> before,
               std::span<const std::int32_t> after) const noexcept {
    for (const auto* part : {&before, &after})
      for (const std::int32_t s : *part)
        if (s >= 0 && placement_->device_of_slot(s) == device)
          return true;
    return false;
  }

  int choose(int expert, std::size_t token, int source, std::span<const std::int32_t> before,
             std::span<const std::int32_t> after) const noexcept {
    const placement& p = *placement_;
    const auto replicas = p.slots_of(expert);
    if (options_.prefer_visited)
      for (const std::int32_t s : replicas)
        if (visited(p.device_of_slot(s), before, after))
          return s;
    switch (options_.policy) {
    case replica_policy::in_turn:
      break;
    case replica_policy::same_node: {
      const int node = topology_.node_of(source);
      std::size_t on_node = 0;
      for (const std::int32_t s : replicas)
        on_node += topology_.node_of(p.device_of_slot(s)) == node;
      if (on_node == 0)
        break;
      std::size_t pick = token % on_node;
      for (const std::int32_t s : replicas)
        if (topology_.node_of(p.device_of_slot(s)) == node && pick-- == 0)
          return s;
      break;
    }
    case replica_policy::least_loaded: {
      std::int32_t best = replicas[0];
      for (const std::int32_t s : replicas)
        if (device_rows_[static_cast<std::size_t>(p.device_of_slot(s))] <
            device_rows_[static_cast<std::size_t>(p.device_of_slot(best))])
          best = s;
      return best;
    }
    }
    return replicas[token % replicas.size()];
  }

  const placement* placement_;
  topology topology_;
  replica_options options_;
  std::vector<std::int64_t> device_rows_;
};

WEAVE_NAMESPACE_END
