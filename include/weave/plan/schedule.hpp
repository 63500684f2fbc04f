//! \file
//! `plan::partition_plan` (what the planners decide) and `plan::schedule` (the executable result).
//!
//! A plan is an op order (a topological order of the graph) cut into contiguous ranges, each
//! run whole (`parts == 1`) or split along the batch into `parts` chunks and pipelined. The
//! schedule expands it into tasks, one per (op, chunk), listed in issue order: a single host
//! thread issuing them in that order to a compute and a communication stream, each task waiting
//! for the events of its dependencies, runs the plan. Every dependency of a task is an earlier
//! task, so issue order never deadlocks, and the order of each stream is the issue order
//! restricted to it. Inside a partitioned range tasks are issued op-major (all chunks of one op,
//! then the next op), so chunk c of an op waits only for chunk c of its producers in the range:
//! the classic chunked pipeline, with the a2a of chunk c under the compute of other chunks.
#pragma once

#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/float_bits.hpp"
#include "weave/plan/graph.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

WEAVE_NAMESPACE_BEGIN
namespace plan {

//! The two streams every rank has.
enum class stream_kind : std::uint8_t {
  compute = 0, //!< kernels (compute and weight-gradient ops)
  comm = 1,    //!< all-to-all ops
};

//! Short name of a stream ("compute", "comm").
constexpr const char* to_string(stream_kind s) noexcept {
  return s == stream_kind::compute ? "compute" : "comm";
}

//! The stream an op of kind `kind` runs on.
constexpr stream_kind stream_of(op_kind kind) noexcept {
  return kind == op_kind::a2a ? stream_kind::comm : stream_kind::compute;
}

//! Positions [begin, end) of a plan's order, run as `parts` chunks.
struct op_range {
  std::size_t begin = 0;
  std::size_t end = 0;
  std::int64_t parts = 1;
};

//! What a planner decides: an op order and its cut into ranges with chunk counts.
struct partition_plan {
  std::vector<op_id> order;     //!< a topological order of every op of the graph
  std::vector<op_range> ranges; //!< contiguous, covering [0, order.size()) in order
  //! Extra time every chunk of a partitioned range pays on its stream (splitting the batch,
  //! merging outputs); unpartitioned ranges do not pay it.
  double chunk_overhead_us = 0.0;
  //! The planner's objective for this plan (sum over ranges of each range's makespan in
  //! isolation), or 0 for a hand-written plan.
  double predicted_us = 0.0;

  //! The plan that runs `order` whole, without partitioning.
  static partition_plan unpartitioned(std::vector<op_id> order) {
    partition_plan p;
    p.ranges.push_back({0, order.size(), 1});
    p.order = std::move(order);
    return p;
  }
};

//! One (op, chunk) of a schedule.
struct task {
  op_id op = 0;
  std::int64_t chunk = 0;  //!< in [0, chunks)
  std::int64_t chunks = 1; //!< the op's chunk count
  double fraction = 1.0;   //!< batch fraction this chunk processes (1 / chunks)
  stream_kind stream = stream_kind::compute;
  double predicted_us = 0.0;     //!< cost-model time, overhead included
  std::vector<std::size_t> deps; //!< earlier tasks this one waits for (any stream)
};

//! Knobs of `make_schedule`.
struct schedule_options {
  //! Make every range wait for everything before it: the schedule then runs exactly as the
  //! planner's additive model assumes (its makespan equals `plan::predicted_us`). Off by default:
  //! without barriers a range may start under the tail of the previous one, which is never slower.
  bool range_barriers = false;
};

//! The executable form of a plan: tasks in issue order.
class schedule {
 public:
  schedule() = default;

  std::span<const task> tasks() const noexcept { return tasks_; }
  std::size_t size() const noexcept { return tasks_.size(); }
  const task& operator[](std::size_t i) const noexcept { return tasks_[i]; }
  //! Number of ops of the graph it was made from.
  std::size_t num_ops() const noexcept { return first_task_.size(); }
  //! Chunk count of op `id`.
  std::int64_t chunks_of(op_id id) const { return tasks_.at(first_task(id)).chunks; }
  //! Index of the first task (chunk 0) of op `id`; its chunks follow consecutively.
  std::size_t first_task(op_id id) const {
    WEAVE_EXPECT(id < first_task_.size(), errc::out_of_range, "op id ", id, " names no op (",
                 first_task_.size(), " ops)");
    return first_task_[id];
  }
  //! Task indices of stream `s` in the order the stream runs them.
  std::vector<std::size_t> stream_order(stream_kind s) const {
    std::vector<std::size_t> out;
    for (std::size_t i = 0; i < tasks_.size(); ++i)
      if (tasks_[i].stream == s)
        out.push_back(i);
    return out;
  }

  //! Builds a schedule from explicit tasks (issue order). Throws `errc::invalid_argument` for a
  //! dependency that is not an earlier task, a bad chunk, or a negative/non-finite time.
  static schedule from_tasks(std::vector<task> tasks, std::size_t num_ops) {
    schedule s;
    s.first_task_.assign(num_ops, std::numeric_limits<std::size_t>::max());
    for (std::size_t i = 0; i < tasks.size(); ++i) {
      const task& t = tasks[i];
      WEAVE_EXPECT(t.op < num_ops, errc::out_of_range, "task ", i, " names op ", t.op, " of ",
                   num_ops);
      WEAVE_EXPECT(t.chunks >= 1 && t.chunk >= 0 && t.chunk < t.chunks, errc::invalid_argument,
                   "task ", i, ": chunk ", t.chunk, " of ", t.chunks);
      WEAVE_EXPECT(weave::detail::is_finite(t.predicted_us) && t.predicted_us >= 0.0,
                   errc::invalid_argument, "task ", i, ": predicted time ", t.predicted_us);
      for (std::size_t d : t.deps)
        WEAVE_EXPECT(d < i, errc::invalid_argument, "task ", i, " depends on task ", d,
                     ", which is not issued before it");
      if (t.chunk == 0) {
        WEAVE_EXPECT(s.first_task_[t.op] == std::numeric_limits<std::size_t>::max(),
                     errc::invalid_argument, "op ", t.op, " has two chunk-0 tasks");
        s.first_task_[t.op] = i;
      } else {
        WEAVE_EXPECT(i > 0 && tasks[i - 1].op == t.op && tasks[i - 1].chunk == t.chunk - 1,
                     errc::invalid_argument, "task ", i, ": chunk ", t.chunk, " of op ", t.op,
                     " does not follow its chunk ", t.chunk - 1);
      }
    }
    for (std::size_t v = 0; v < num_ops; ++v)
      WEAVE_EXPECT(s.first_task_[v] != std::numeric_limits<std::size_t>::max(),
                   errc::invalid_argument, "op ", v, " has no task");
    s.tasks_ = std::move(tasks);
    return s;
  }

 private:
  std::vector<task> tasks_;
  std::vector<std::size_t> first_task_; // by op id
};

namespace detail {

inline void check_plan(const graph& g, const partition_plan& p) {
  const std::size_t n = g.size();
  WEAVE_EXPECT(p.order.size() == n, errc::size_mismatch, "plan orders ", p.order.size(),
               " ops, the graph has ", n);
  WEAVE_EXPECT(weave::detail::is_finite(p.chunk_overhead_us) && p.chunk_overhead_us >= 0.0,
               errc::invalid_argument, "chunk overhead ", p.chunk_overhead_us, " us");
  std::vector<std::size_t> pos(n, std::numeric_limits<std::size_t>::max());
  for (std::size_t i = 0; i < n; ++i) {
    const op_id v = p.order[i];
    WEAVE_EXPECT(v < n, errc::out_of_range, "plan position ", i, " names op ", v, " of ", n);
    WEAVE_EXPECT(pos[v] == std::numeric_limits<std::size_t>::max(), errc::invalid_argument, "op ",
                 v, " appears twice in the plan order");
    pos[v] = i;
  }
  for (std::size_t i = 0; i < n; ++i)
    for (op_id d : g.at(p.order[i]).deps)
      WEAVE_EXPECT(pos[d] < i, errc::invalid_argument, "plan order puts op ", p.order[i],
                   " before its dependency ", d, " (a cycle, or not a topological order)");
  std::size_t next = 0;
  for (const op_range& r : p.ranges) {
    WEAVE_EXPECT(r.begin == next && r.end > r.begin && r.end <= n, errc::invalid_argument,
                 "range [", r.begin, ", ", r.end, ") does not continue at position ", next);
    WEAVE_EXPECT(r.parts >= 1, errc::invalid_argument, "range [", r.begin, ", ", r.end,
                 ") has parts = ", r.parts);
    if (r.parts > 1)
      for (std::size_t i = r.begin; i < r.end; ++i)
        WEAVE_EXPECT(g.at(p.order[i]).partitionable, errc::invalid_argument, "op ", p.order[i],
                     " '", g.at(p.order[i]).name, "' is not partitionable but its range has ",
                     r.parts, " parts");
    next = r.end;
  }
  WEAVE_EXPECT(next == n, errc::invalid_argument, "plan ranges cover ", next, " of ", n, " ops");
}

} // namespace detail

//! Expands `p` into tasks. Throws `errc::invalid_argument` if the order is not a topological
//! order of `g` (which also rejects a cyclic graph), the ranges do not tile it, a range has
//! parts < 1, or a non-partitionable op sits in a partitioned range.
inline schedule make_schedule(const graph& g, const partition_plan& p,
                              const schedule_options& options = {}) {
  detail::check_plan(g, p);
  const std::size_t n = g.size();
  std::vector<std::size_t> range_of(n), first(n);
  std::vector<task> tasks;
  std::size_t total = 0;
  for (const op_range& r : p.ranges)
    total = checked_add(total, checked_mul(r.end - r.begin, static_cast<std::size_t>(r.parts)));
  tasks.reserve(total);
  std::size_t barrier[2] = {std::numeric_limits<std::size_t>::max(),
                            std::numeric_limits<std::size_t>::max()};
  for (std::size_t ri = 0; ri < p.ranges.size(); ++ri) {
    const op_range& r = p.ranges[ri];
    const double fraction = 1.0 / static_cast<double>(r.parts);
    const double overhead = r.parts > 1 ? p.chunk_overhead_us : 0.0;
    for (std::size_t i = r.begin; i < r.end; ++i) {
      const op_id v = p.order[i];
      const op& o = g.at(v);
      range_of[v] = ri;
      first[v] = tasks.size();
      for (std::int64_t c = 0; c < r.parts; ++c) {
        task t;
        t.op = v;
        t.chunk = c;
        t.chunks = r.parts;
        t.fraction = fraction;
        t.stream = stream_of(o.kind);
        t.predicted_us = o.cost.at(fraction) + overhead;
        for (op_id d : o.deps) {
          const std::size_t dc = tasks[first[d]].chunks;
          // Same range: chunk c feeds chunk c. Earlier range: wait for the producer's last chunk
          // (its chunks run in order on one stream, so that is all of it).
          t.deps.push_back(range_of[d] == ri ? first[d] + static_cast<std::size_t>(c)
                                             : first[d] + dc - 1);
        }
        if (options.range_barriers)
          for (std::size_t b : barrier)
            if (b != std::numeric_limits<std::size_t>::max())
              t.deps.push_back(b);
        tasks.push_back(std::move(t));
      }
    }
    for (std::size_t i = r.begin; i < r.end; ++i) {
      const std::size_t last = first[p.order[i]] + static_cast<std::size_t>(r.parts) - 1;
      const auto s = static_cast<std::size_t>(tasks[last].stream);
      if (barrier[s] == std::numeric_limits<std::size_t>::max() || barrier[s] < last)
        barrier[s] = last;
    }
  }
  return schedule::from_tasks(std::move(tasks), n);
}

} // namespace plan
WEAVE_NAMESPACE_END
