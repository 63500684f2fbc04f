//! \file
//! Two-stream timeline simulator: when every task of a schedule starts and ends on every rank,
//! and the makespan and exposed communication that follow.
//!
//! The model is the execution model of the schedule itself: each rank has a compute and a
//! communication stream running their tasks in issue order; a task starts when its stream is
//! free and its dependencies (on the same rank) have finished. An all-to-all is a collective: it
//! starts on every rank once every rank could start it, and ends when the slowest rank's part
//! ends. Times are microseconds from 0. The same `timeline` type holds measured times (the
//! executor fills one), so prediction and measurement are analysed by the same code.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/float_bits.hpp"
#include "weave/plan/schedule.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

WEAVE_NAMESPACE_BEGIN
namespace plan {

//! When one task ran, in microseconds.
struct interval {
  double begin_us = 0.0;
  double end_us = 0.0;
};

//! Begin/end of every task of a schedule on every rank.
class timeline {
 public:
  timeline() = default;
  timeline(std::size_t ranks, std::size_t tasks)
      : ranks_(ranks)
      , tasks_(tasks)
      , data_(ranks * tasks) {}

  std::size_t ranks() const noexcept { return ranks_; }
  std::size_t tasks() const noexcept { return tasks_; }
  interval& at(std::size_t rank, std::size_t task) noexcept { return data_[rank * tasks_ + task]; }
  const interval& at(std::size_t rank, std::size_t task) const noexcept {
    return data_[rank * tasks_ + task];
  }

  //! Latest end over every task and rank (the step time when the timeline starts at 0).
  double makespan_us() const noexcept {
    double m = 0.0;
    for (const interval& i : data_)
      m = std::max(m, i.end_us);
    return m;
  }

 private:
  std::size_t ranks_ = 0;
  std::size_t tasks_ = 0;
  std::vector<interval> data_;
};

//! What one rank's timeline amounts to.
struct rank_stats {
  double makespan_us = 0.0;     //!< latest end on this rank
  double compute_busy_us = 0.0; //!< time the compute stream runs something
  double comm_busy_us = 0.0;    //!< time the communication stream runs something
  //! Time the communication stream is busy while the compute stream is idle: the communication
  //! the schedule failed to hide.
  double exposed_comm_us = 0.0;
};

namespace detail {

// Length of the union of intervals sorted by begin (a stream's intervals never overlap, but a
// measured timeline may touch or jitter; the union is robust to both).
inline std::vector<interval> merged(std::vector<interval> v) {
  std::sort(v.begin(), v.end(),
            [](const interval& a, const interval& b) { return a.begin_us < b.begin_us; });
  std::vector<interval> out;
  for (const interval& i : v) {
    if (i.end_us <= i.begin_us)
      continue;
    if (!out.empty() && i.begin_us <= out.back().end_us)
      out.back().end_us = std::max(out.back().end_us, i.end_us);
    else
      out.push_back(i);
  }
  return out;
}

inline double total_length(const std::vector<interval>& v) {
  double s = 0.0;
  for (const interval& i : v)
    s += i.end_us - i.begin_us;
  return s;
}

// Length of the intersection of two merged interval lists.
inline double overlap_length(const std::vector<interval>& a, const std::vector<interval>& b) {
  double s = 0.0;
  std::size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    const double lo = std::max(a[i].begin_us, b[j].begin_us);
    const double hi = std::min(a[i].end_us, b[j].end_us);
    if (hi > lo)
      s += hi - lo;
    if (a[i].end_us < b[j].end_us)
      ++i;
    else
      ++j;
  }
  return s;
}

} // namespace detail

//! Busy and exposed times of rank `rank` of `t`, a timeline of schedule `s`.
inline rank_stats analyze(const plan::schedule& s, const timeline& t, std::size_t rank) {
  WEAVE_EXPECT(t.tasks() == s.size(), errc::size_mismatch, "timeline of ", t.tasks(),
               " tasks for a schedule of ", s.size());
  WEAVE_EXPECT(rank < t.ranks(), errc::out_of_range, "rank ", rank, " of ", t.ranks());
  std::vector<interval> compute, comm;
  rank_stats out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    const interval& iv = t.at(rank, i);
    out.makespan_us = std::max(out.makespan_us, iv.end_us);
    (s[i].stream == plan::stream_kind::comm ? comm : compute).push_back(iv);
  }
  compute = detail::merged(std::move(compute));
  comm = detail::merged(std::move(comm));
  out.compute_busy_us = detail::total_length(compute);
  out.comm_busy_us = detail::total_length(comm);
  out.exposed_comm_us = out.comm_busy_us - detail::overlap_length(compute, comm);
  return out;
}

//! The worst rank: each field is the maximum over ranks.
inline rank_stats analyze_worst(const plan::schedule& s, const timeline& t) {
  rank_stats w;
  for (std::size_t r = 0; r < t.ranks(); ++r) {
    const rank_stats x = analyze(s, t, r);
    w.makespan_us = std::max(w.makespan_us, x.makespan_us);
    w.compute_busy_us = std::max(w.compute_busy_us, x.compute_busy_us);
    w.comm_busy_us = std::max(w.comm_busy_us, x.comm_busy_us);
    w.exposed_comm_us = std::max(w.exposed_comm_us, x.exposed_comm_us);
  }
  return w;
}

//! Simulates `s` on `ranks` ranks, task `i` on rank `r` lasting `duration_us(r, i)` (which must
//! be finite and non-negative: `errc::invalid_argument` otherwise). Per-rank durations model
//! load imbalance; an all-to-all lasts as long as its slowest rank.
template <class Duration>
timeline simulate(const plan::schedule& s, std::size_t ranks, Duration&& duration_us) {
  WEAVE_EXPECT(ranks >= 1, errc::invalid_argument, "ranks = ", ranks);
  timeline t(ranks, s.size());
  std::vector<double> free(2 * ranks, 0.0); // [rank][stream]
  for (std::size_t i = 0; i < s.size(); ++i) {
    const plan::task& task = s[i];
    const auto stream = static_cast<std::size_t>(task.stream);
    auto ready_on = [&](std::size_t r) {
      double ready = free[2 * r + stream];
      for (std::size_t d : task.deps)
        ready = std::max(ready, t.at(r, d).end_us);
      return ready;
    };
    auto length_on = [&](std::size_t r) {
      const double d = static_cast<double>(duration_us(r, i));
      WEAVE_EXPECT(weave::detail::is_finite(d) && d >= 0.0, errc::invalid_argument, "task ", i,
                   " on rank ", r, " lasts ", d, " us");
      return d;
    };
    if (task.stream == plan::stream_kind::comm) {
      double start = 0.0, length = 0.0;
      for (std::size_t r = 0; r < ranks; ++r) {
        start = std::max(start, ready_on(r));
        length = std::max(length, length_on(r));
      }
      for (std::size_t r = 0; r < ranks; ++r) {
        t.at(r, i) = {start, start + length};
        free[2 * r + stream] = start + length;
      }
    } else {
      for (std::size_t r = 0; r < ranks; ++r) {
        const double start = ready_on(r);
        t.at(r, i) = {start, start + length_on(r)};
        free[2 * r + stream] = t.at(r, i).end_us;
      }
    }
  }
  return t;
}

//! Simulates `s` with every task lasting its `predicted_us` on every rank.
inline timeline simulate(const plan::schedule& s, std::size_t ranks = 1) {
  return simulate(s, ranks, [&s](std::size_t, std::size_t i) { return s[i].predicted_us; });
}

} // namespace plan
WEAVE_NAMESPACE_END
