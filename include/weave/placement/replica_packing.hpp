//! \file
//! The packing engine of the replicated placement (`replication.hpp`): replica counts, then
//! copies of experts into bins (nodes or devices) of a fixed number of copies each (one number
//! for all bins, or one per bin), heaviest copy first into the lightest bin that may take it,
//! then swaps off the heaviest bin.
//!
//! Incremental: each bin keeps its copies (ascending copy index), its size and its load, and
//! placing or moving a copy updates only the two bins involved. A bin's load is always the sum
//! of its copies' weights in ascending copy index, the order a from-scratch recount adds them
//! in, so every comparison (and every tie) comes out as it would after a full recount.
//!
//! The bins and their packing steps are `detail::replica_packing`
//! (`detail/replica_packing_bins.hpp`); the placement of replicated experts on devices, flat,
//! node by node or kept where they are, is `detail::pack_replicated`
//! (`detail/replica_packing_devices.hpp`, included at the end of this header).
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/placement/detail/replica_packing_bins.hpp"
#include "weave/placement/policies.hpp"

#include <cstddef>
#include <span>
#include <vector>

WEAVE_NAMESPACE_BEGIN

namespace detail {

//! Gives up to `extra` more copies, each to the expert with the largest load per copy (lowest id
//! on ties) among those below `max_copies`; returns how many it gave (fewer only when every
//! expert reached `max_copies`).
inline long long add_copies(std::span<const double> loads, std::vector<int>& count, long long extra,
                            int max_copies) {
  const auto E = loads.size();
  std::vector<double> copies(count.begin(), count.end()); // as doubles: no conversions below
  for (long long r = 0; r < extra; ++r) {
    std::size_t best = E;
    double best_load = 0, best_copies = 1; // of `best`, kept in registers
    for (std::size_t e = 0; e < E; ++e)
      if (count[e] < max_copies && (best == E || loads[e] * best_copies > best_load * copies[e])) {
        best = e;
        best_load = loads[e];
        best_copies = copies[e];
      }
    if (best == E)
      return r;
    ++count[best];
    copies[best] += 1.0;
  }
  return extra;
}

} // namespace detail

//! Replica count per expert: one each, then each of `redundant_slots` extra slots to the expert
//! with the largest load per replica (lowest id on ties), at most `max_replicas` each.
//! Throws `errc::invalid_argument` when the slots cannot all be used.
inline std::vector<int> replica_counts(std::span<const double> loads, int redundant_slots,
                                       int max_replicas) {
  detail::expect_loads(loads);
  const auto E = loads.size();
  WEAVE_EXPECT(redundant_slots >= 0, errc::invalid_argument, "redundant_slots = ", redundant_slots);
  WEAVE_EXPECT(static_cast<long long>(redundant_slots) <=
                   static_cast<long long>(E) * (max_replicas - 1),
               errc::invalid_argument, redundant_slots, " redundant slots exceed what ", E,
               " experts with at most ", max_replicas, " replicas each can use");
  std::vector<int> count(E, 1);
  detail::add_copies(loads, count, redundant_slots, max_replicas);
  return count;
}

WEAVE_NAMESPACE_END

#include "weave/placement/detail/replica_packing_devices.hpp" // pack_replicated
