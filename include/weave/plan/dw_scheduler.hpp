//! \file
//! Backward-pass weight-gradient scheduling (Lancet): move dW ops into the shadows of
//! all-to-alls, where the compute stream would otherwise sit idle waiting for the a2a.
//!
//! A dW op's output is needed only by the optimizer, so it can run anywhere its dependencies
//! allow. For each all-to-all X (in issue order) the shadow is the compute-stream gap before the
//! first compute op that waits for X. Candidates are dW ops with no ordering relation to X
//! (neither ancestor nor descendant) whose dependencies are issued before the gap, are done when
//! it opens, and whose dependants are issued after it. The greedy fills the gap closest-fit, as
//! Lancet does (the largest op that still fits), and goes one step further: a dW op issued
//! before X's last compute producer delays X itself, so moving it into the shadow starts X
//! earlier by as much as it fills; such ops are taken first, whatever their length. Every move is
//! simulated and kept only if the makespan drops, so the result is never slower than the input
//! order, and only dW ops move.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/plan/graph.hpp"
#include "weave/plan/schedule.hpp"
#include "weave/plan/timeline.hpp"

#include <algorithm>
#include <cstddef>
#include <limits>
#include <vector>

WEAVE_NAMESPACE_BEGIN
namespace plan {

//! What `schedule_weight_grads` did.
struct dw_result {
  partition_plan plan;       //!< unpartitioned plan over the new order
  double baseline_us = 0.0;  //!< simulated makespan of the input order
  double scheduled_us = 0.0; //!< simulated makespan of the new order (<= baseline_us)
  std::size_t moved = 0;     //!< dW ops placed into an a2a shadow
};

namespace detail {

inline double makespan_of(const graph& g, const std::vector<op_id>& order) {
  return simulate(make_schedule(g, partition_plan::unpartitioned(order))).makespan_us();
}

// Marks every op reachable from `start` along `next` (start itself excluded).
inline void mark_reachable(op_id start, const std::vector<std::vector<op_id>>& next,
                           std::vector<char>& mark) {
  std::vector<op_id> stack(next[start].begin(), next[start].end());
  while (!stack.empty()) {
    const op_id v = stack.back();
    stack.pop_back();
    if (mark[v])
      continue;
    mark[v] = 1;
    stack.insert(stack.end(), next[v].begin(), next[v].end());
  }
}

} // namespace detail

//! Places dW ops of `g` into a2a shadows, starting from `order` (a topological order of `g`;
//! `errc::invalid_argument` otherwise). Nothing is partitioned.
inline dw_result schedule_weight_grads(const graph& g, std::vector<op_id> order) {
  const std::size_t n = g.size();
  dw_result out;
  out.plan = partition_plan::unpartitioned(std::move(order));
  (void)make_schedule(g, out.plan); // validates the order
  std::vector<op_id> cur = out.plan.order;
  out.baseline_us = detail::makespan_of(g, cur);
  double current = out.baseline_us;

  const auto succ = g.successors();
  std::vector<std::vector<op_id>> pred(n);
  for (op_id v = 0; v < n; ++v)
    pred[v] = g.ops()[v].deps;
  std::vector<char> placed(n, 0);
  std::vector<op_id> a2as;
  for (op_id v : cur)
    if (g.ops()[v].kind == op_kind::a2a)
      a2as.push_back(v);

  std::vector<std::size_t> pos(n);
  auto refresh_pos = [&] {
    for (std::size_t i = 0; i < n; ++i)
      pos[cur[i]] = i;
  };

  for (op_id x : a2as) {
    std::vector<char> descendants(n, 0), ancestors(n, 0), rejected(n, 0);
    detail::mark_reachable(x, succ, descendants);
    detail::mark_reachable(x, pred, ancestors);
    for (;;) {
      refresh_pos();
      // Q: the first compute op (in issue order) that waits for x.
      std::size_t q_pos = n;
      for (std::size_t i = pos[x] + 1; i < n && q_pos == n; ++i)
        if (descendants[cur[i]] && stream_of(g.ops()[cur[i]].kind) == stream_kind::compute)
          q_pos = i;
      if (q_pos == n)
        break;
      const schedule s = make_schedule(g, partition_plan::unpartitioned(cur));
      const timeline t = simulate(s);
      double gap_open = 0.0;
      for (std::size_t i = q_pos; i-- > 0;)
        if (stream_of(g.ops()[cur[i]].kind) == stream_kind::compute) {
          gap_open = t.at(0, s.first_task(cur[i])).end_us;
          break;
        }
      const double gap = t.at(0, s.first_task(cur[q_pos])).begin_us - gap_open;
      if (gap <= 0.0)
        break;
      // Compute issued before x's last compute producer delays x itself: moving such a dW op
      // into the shadow starts x earlier by as much as it fills, so it needs no room.
      std::size_t producer_pos = 0;
      for (op_id a = 0; a < n; ++a)
        if (ancestors[a] && stream_of(g.ops()[a].kind) == stream_kind::compute)
          producer_pos = std::max(producer_pos, pos[a]);

      op_id pick = n;
      bool pick_delays = false;
      double pick_length = -1.0;
      for (op_id d = 0; d < n; ++d) {
        const op& o = g.ops()[d];
        if (o.kind != op_kind::weight_grad || placed[d] || rejected[d] || descendants[d] ||
            ancestors[d])
          continue;
        const bool delays = pos[d] < producer_pos;
        const double length = o.cost.at(1.0);
        if (!delays && length > gap)
          continue;
        // Closest fit: ops that delay x first, then the largest that fits.
        if (pick != n && (pick_delays > delays || (pick_delays == delays && length <= pick_length)))
          continue;
        bool legal = true;
        double ready = 0.0;
        for (op_id p : pred[d]) {
          legal = legal && pos[p] < q_pos;
          ready = std::max(ready, t.at(0, s.first_task(p)).end_us);
        }
        for (op_id c : succ[d])
          legal = legal && pos[c] > q_pos;
        if (!legal || ready > gap_open)
          continue;
        pick = d;
        pick_delays = delays;
        pick_length = length;
      }
      if (pick == n)
        break;
      std::vector<op_id> trial = cur;
      trial.erase(trial.begin() + static_cast<std::ptrdiff_t>(pos[pick]));
      trial.insert(std::find(trial.begin(), trial.end(), cur[q_pos]), pick);
      const double tried = detail::makespan_of(g, trial);
      if (tried < current) {
        cur = std::move(trial);
        current = tried;
        placed[pick] = 1;
        ++out.moved;
      } else {
        rejected[pick] = 1; // not better here; a later shadow may still take it
      }
    }
  }
  out.plan = partition_plan::unpartitioned(std::move(cur));
  out.scheduled_us = current;
  return out;
}

//! `schedule_weight_grads` from the graph's own topological order.
inline dw_result schedule_weight_grads(const graph& g) {
  return schedule_weight_grads(g, g.topological_order());
}

} // namespace plan
WEAVE_NAMESPACE_END
