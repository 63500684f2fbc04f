//! \file
//! Co-activation profiling over training: per-step accumulation of routing decisions into
//! `expert_statistics`, exponential decay between steps so placements follow drifting routing,
//! and a cross-rank sum through any all-reduce the caller has (the communicator is the caller's
//! choice: a callable summing a `std::span<double>` in place over ranks).
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/placement/statistics.hpp"

#include <concepts>
#include <cstdint>
#include <span>
#include <utility>

WEAVE_NAMESPACE_BEGIN

//! A callable that sums a buffer of doubles element-wise across ranks, in place (every rank
//! ends with the total), e.g. a lambda around `MPI_Allreduce(MPI_IN_PLACE, ...)`.
template <class F>
concept statistics_all_reduce = std::invocable<F&, std::span<double>>;

//! Sums `stats` over ranks through `all_reduce` (one call on the contiguous `raw()` buffer).
//! Every rank must call it with statistics of the same number of experts.
template <statistics_all_reduce F>
void all_reduce_statistics(expert_statistics& stats, F&& all_reduce) {
  std::forward<F>(all_reduce)(stats.raw());
}

//! Per-rank profiler: `record` the top-k ids of each routing step (the ids a dispatch plan is
//! built from), `end_step` to decay, `synchronize` to get the global view.
class coactivation_profiler {
 public:
  //! Counts of a step weigh `decay` times less after each later `end_step` (1 = keep forever).
  //! Throws `errc::invalid_argument` for `decay` outside [0, 1] or `num_experts` <= 0.
  coactivation_profiler(int num_experts, double decay)
      : local_(num_experts)
      , decay_(decay) {
    WEAVE_EXPECT(decay >= 0.0 && decay <= 1.0, errc::invalid_argument, "decay factor ", decay,
                 " outside [0, 1]");
  }

  //! Adds the routing of some tokens of this step (k ids per token; negative = none).
  void record(std::span<const std::int32_t> ids, int k) { local_.accumulate(ids, k); }
  //! Ends a step: older counts fade by the decay factor.
  void end_step() {
    local_.decay(decay_);
    ++steps_;
  }

  //! This rank's decayed counts.
  const expert_statistics& local() const noexcept { return local_; }
  //! Steps ended so far.
  std::int64_t steps() const noexcept { return steps_; }

  //! The sum of every rank's local counts (a collective: all ranks call it together). The
  //! local counts are left as they are.
  template <statistics_all_reduce F>
  expert_statistics synchronize(F&& all_reduce) const {
    expert_statistics global = local_;
    all_reduce_statistics(global, std::forward<F>(all_reduce));
    return global;
  }

 private:
  expert_statistics local_;
  double decay_;
  std::int64_t steps_ = 0;
};

WEAVE_NAMESPACE_END
