//! \file
//! Feeding routing decisions into `expert_statistics` (per-expert load, E×E co-activation):
//! the kept choices of a `dispatch_plan`, so dropped pairs do not count as load.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/placement/statistics.hpp"
#include "weave/routing/dispatch_plan.hpp"

WEAVE_NAMESPACE_BEGIN

//! Adds the plan's kept (token, expert) choices to `stats` with `weight` per token.
//! Throws `errc::size_mismatch` if the statistics track another number of experts.
inline void accumulate(expert_statistics& stats, const dispatch_plan& plan, double weight = 1.0) {
  WEAVE_EXPECT(stats.num_experts() == plan.where().num_experts(), errc::size_mismatch,
               "statistics of ", stats.num_experts(), " experts for a plan over ",
               plan.where().num_experts());
  if (plan.tokens() > 0)
    stats.accumulate(plan.kept_experts(), plan.k(), weight);
}

WEAVE_NAMESPACE_END
