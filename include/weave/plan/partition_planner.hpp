//! \file
//! Forward-pass partitioning (Lancet): which contiguous ranges of ops to split along the batch,
//! and into how many chunks, so the all-to-alls run under the compute of other chunks.
//!
//! A dynamic program over the op order, F(i) = min_j F(j) + t(j, i), where t(j, i) is the best,
//! over n in [1, max_parts], of the makespan of ops [j, i) run in isolation as n pipelined chunks
//! (n = 1: unpartitioned, still overlapping independent ops of the range). Splitting costs what
//! the cost model says it costs: every chunk pays each op's fixed cost (launch, a2a latency)
//! plus `chunk_overhead_us`, so small chunks stop paying off. t is evaluated exactly by the
//! schedule's own execution model, incrementally: with op-major issue order, extending a range
//! by one op only appends tasks, so all t(j, ·, n) for one j and n cost one pass. The whole plan
//! costs O(N · L · P² · deg) for N ops, ranges of at most L ops and P parts.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/float_bits.hpp"
#include "weave/plan/graph.hpp"
#include "weave/plan/schedule.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

WEAVE_NAMESPACE_BEGIN
namespace plan {

//! Knobs of `plan_partitions`.
struct partition_options {
  std::int64_t max_parts = 8;     //!< largest chunk count tried per range (>= 1)
  std::size_t max_range_ops = 32; //!< longest range tried, in ops; 0 = unbounded (O(N²))
  double chunk_overhead_us = 0.0; //!< extra time each chunk of a partitioned range pays
};

//! The DP-optimal partition of `order` (a topological order of `g`). The returned plan's
//! `predicted_us` is F(N): the sum over its ranges of each range's isolated makespan, which is
//! the makespan of `make_schedule(g, plan, {.range_barriers = true})` and an upper bound on the
//! makespan without barriers. Ties go to the earliest start and then the fewest parts.
//! Throws `errc::invalid_argument` for max_parts < 1, a negative overhead, or a bad order.
inline partition_plan plan_partitions_in_order(const graph& g, std::vector<op_id> order,
                                               const partition_options& options = {}) {
  WEAVE_EXPECT(options.max_parts >= 1, errc::invalid_argument, "max_parts = ", options.max_parts);
  WEAVE_EXPECT(weave::detail::is_finite(options.chunk_overhead_us) &&
                   options.chunk_overhead_us >= 0.0,
               errc::invalid_argument, "chunk overhead ", options.chunk_overhead_us, " us");
  const std::size_t n = g.size();
  partition_plan unchecked;
  unchecked.order = std::move(order);
  unchecked.ranges.push_back({0, n, 1});
  if (n == 0)
    unchecked.ranges.clear();
  detail::check_plan(g, unchecked); // order is a topological permutation
  std::vector<op_id> ord = std::move(unchecked.order);

  std::vector<std::size_t> pos(n);
  for (std::size_t i = 0; i < n; ++i)
    pos[ord[i]] = i;
  const std::size_t max_len = options.max_range_ops == 0 ? n : options.max_range_ops;
  const auto max_parts = static_cast<std::size_t>(options.max_parts);

  constexpr double inf = std::numeric_limits<double>::infinity();
  std::vector<double> best(n + 1, inf);
  std::vector<std::size_t> from(n + 1, 0);
  std::vector<std::int64_t> parts(n + 1, 1);
  best[0] = 0.0;
  // end[(position - j) * parts + chunk] for the range being extended.
  std::vector<double> end(std::min(max_len, n) * max_parts);

  for (std::size_t j = 0; j < n; ++j) {
    const std::size_t limit = std::min(n, j + max_len);
    for (std::size_t p = 1; p <= max_parts; ++p) {
      const double fraction = 1.0 / static_cast<double>(p);
      const double overhead = p > 1 ? options.chunk_overhead_us : 0.0;
      double free[2] = {0.0, 0.0};
      for (std::size_t i = j; i < limit; ++i) {
        const op& o = g.ops()[ord[i]];
        if (p > 1 && !o.partitionable)
          break; // every longer range contains it too
        const double length = o.cost.at(fraction) + overhead;
        double& stream_free = free[static_cast<std::size_t>(stream_of(o.kind))];
        for (std::size_t c = 0; c < p; ++c) {
          double ready = stream_free;
          for (op_id d : o.deps)
            if (pos[d] >= j) // producers before the range finished before it started
              ready = std::max(ready, end[(pos[d] - j) * p + c]);
          stream_free = ready + length;
          end[(i - j) * p + c] = stream_free;
        }
        const double candidate = best[j] + std::max(free[0], free[1]);
        if (candidate < best[i + 1]) {
          best[i + 1] = candidate;
          from[i + 1] = j;
          parts[i + 1] = static_cast<std::int64_t>(p);
        }
      }
    }
  }

  partition_plan out;
  out.order = std::move(ord);
  out.chunk_overhead_us = options.chunk_overhead_us;
  out.predicted_us = best[n];
  for (std::size_t i = n; i > 0; i = from[i])
    out.ranges.push_back({from[i], i, parts[i]});
  std::reverse(out.ranges.begin(), out.ranges.end());
  return out;
}

//! `plan_partitions_in_order` over the graph's own topological order (`graph::topological_order`),
//! which throws `errc::invalid_argument` for a cyclic graph.
inline partition_plan plan_partitions(const graph& g, const partition_options& options = {}) {
  return plan_partitions_in_order(g, g.topological_order(), options);
}

} // namespace plan
WEAVE_NAMESPACE_END
