//! \file
//! Group-limited routing (DeepSeek-V3): the experts form `groups` contiguous groups, each token
//! keeps its `top_groups` best groups and top-k runs over their experts only.
//!
//! As DeepSeek-V3's gate (`Gate.forward` in its inference/model.py) defines it: the group score
//! is computed from the selection scores (scores plus the per-expert bias when the model has
//! one): the sum of the group's two highest selection scores when there is a bias, the highest
//! one when there is not. The `top_groups` highest-scoring groups are kept, every other
//! expert's selection score becomes -inf, and top-k follows; weights stay the unbiased scores.
//! One difference: torch.topk leaves the order of equal group scores unspecified, weave keeps
//! the lower group. `top_k_gate` applies the rule when `gate_options::groups` is set.
//!
//! With a placement that keeps every group on one node (`group_constraint` in
//! `weave/placement/replication_groups.hpp`), a token reaches at most `top_groups` nodes.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

WEAVE_NAMESPACE_BEGIN

//! Which expert groups a token may use.
struct group_limit {
  int groups = 1;     //!< n_group: experts [g·E/groups, (g+1)·E/groups) form group g
  int top_groups = 1; //!< topk_group: groups each token keeps (1..groups)
  //! Best selection scores summed per group; 0 means DeepSeek-V3's rule (2 with a bias, 1
  //! without).
  int scores_per_group = 0;
};

//! Scratch for `select_groups`, reused across tokens (no allocation per token).
struct group_select_scratch {
  std::vector<float> score;       // per group
  std::vector<std::uint8_t> kept; // per group
  std::vector<float> best;        // the group's best scores while summing
};

namespace detail {

inline void validate_group_limit(const group_limit& limit, int num_experts, int k) {
  WEAVE_EXPECT(limit.groups >= 1 && limit.groups <= num_experts && num_experts % limit.groups == 0,
               errc::invalid_argument, num_experts,
               " experts do not split into groups = ", limit.groups, " equal groups");
  WEAVE_EXPECT(limit.top_groups >= 1 && limit.top_groups <= limit.groups, errc::invalid_argument,
               "top_groups = ", limit.top_groups, " outside 1..", limit.groups);
  const int size = num_experts / limit.groups;
  WEAVE_EXPECT(limit.scores_per_group >= 0 && limit.scores_per_group <= size,
               errc::invalid_argument, "scores_per_group = ", limit.scores_per_group,
               " outside 0..", size, " (experts per group)");
  WEAVE_EXPECT(static_cast<long long>(limit.top_groups) * size >= k, errc::invalid_argument,
               "k = ", k, " experts cannot fit in top_groups = ", limit.top_groups, " groups of ",
               size, " experts");
}

} // namespace detail

//! The group rule for one token: sets the selection score of every expert outside the token's
//! `top_groups` best groups to -inf (ties: lower group). `biased` tells whether the selection
//! scores include a bias (DeepSeek-V3's rule sums the best two then, else takes the best one).
//! The limit must have been validated for `selection.size()` experts.
inline void select_groups(const group_limit& limit, std::span<float> selection, bool biased,
                          group_select_scratch& s) {
  const std::size_t G = static_cast<std::size_t>(limit.groups);
  const std::size_t size = selection.size() / G;
  const std::size_t top = limit.scores_per_group > 0
                              ? static_cast<std::size_t>(limit.scores_per_group)
                              : (biased && size >= 2 ? 2 : 1);
  s.score.resize(G);
  s.kept.assign(G, 0);
  s.best.resize(top);
  for (std::size_t g = 0; g < G; ++g) {
    // The group's `top` best scores, descending (insertion; `top` is small).
    std::size_t filled = 0;
    for (std::size_t e = g * size; e < (g + 1) * size; ++e) {
      const float x = selection[e];
      if (filled == top && !(x > s.best[top - 1]))
        continue;
      std::size_t at = filled < top ? filled : top - 1;
      while (at > 0 && x > s.best[at - 1]) {
        s.best[at] = s.best[at - 1];
        --at;
      }
      s.best[at] = x;
      filled += filled < top ? 1 : 0;
    }
    float sum = 0.0f;
    for (std::size_t i = 0; i < top; ++i)
      sum += s.best[i];
    s.score[g] = sum;
  }
  for (int chosen = 0; chosen < limit.top_groups; ++chosen) {
    std::size_t pick = G;
    for (std::size_t g = 0; g < G; ++g)
      if (!s.kept[g] && (pick == G || s.score[g] > s.score[pick]))
        pick = g;
    s.kept[pick] = 1;
  }
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  for (std::size_t g = 0; g < G; ++g)
    if (!s.kept[g])
      for (std::size_t e = g * size; e < (g + 1) * size; ++e)
        selection[e] = neg_inf;
}

WEAVE_NAMESPACE_END
