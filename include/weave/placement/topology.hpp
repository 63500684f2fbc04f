//! \file
//! `topology`: the devices experts are placed on, as `nodes` machines of `devices_per_node`
//! devices each. Device `d` lives on node `d / devices_per_node`; links inside a node are
//! assumed faster than links between nodes, which is what two-level policies exploit.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"

WEAVE_NAMESPACE_BEGIN

//! Nodes × devices per node. Devices are numbered node-major.
struct topology {
  int nodes = 1;            //!< number of machines
  int devices_per_node = 1; //!< devices on each machine

  //! One node of `devices` devices.
  static topology flat(int devices) { return topology{1, devices}.validated(); }
  //! `nodes` nodes of `devices_per_node` devices each.
  static topology grid(int nodes, int devices_per_node) {
    return topology{nodes, devices_per_node}.validated();
  }

  //! Throws `errc::invalid_argument` unless both counts are positive; returns `*this`.
  const topology& validated() const {
    WEAVE_EXPECT(nodes > 0, errc::invalid_argument, "topology with ", nodes, " nodes");
    WEAVE_EXPECT(devices_per_node > 0, errc::invalid_argument, "topology with ", devices_per_node,
                 " devices per node");
    WEAVE_EXPECT(static_cast<long long>(nodes) * devices_per_node <= (1LL << 30),
                 errc::size_overflow, "topology of ", nodes, " x ", devices_per_node,
                 " devices is too large");
    return *this;
  }

  int num_devices() const noexcept { return nodes * devices_per_node; }
  //! Node of device `device`.
  int node_of(int device) const noexcept { return device / devices_per_node; }

  friend bool operator==(const topology&, const topology&) = default;
};

WEAVE_NAMESPACE_END
