//! \file
//! Exports a schedule's timeline (simulated or measured) through `trace_writer`: one process
//! lane per rank, thread lanes "compute" (tid 0) and "comm" (tid 1), one event per task named
//! "<op name> [chunk/chunks]" with the op kind as category.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/trace_writer.hpp"
#include "weave/plan/graph.hpp"
#include "weave/plan/schedule.hpp"
#include "weave/plan/timeline.hpp"

#include <cstdint>
#include <string>

WEAVE_NAMESPACE_BEGIN
namespace plan {

//! Appends every task of `t` (a timeline of `s`, made from `g`) to `out`. Rank r goes to
//! process lane `pid_base + r` named "<label> rank r", so a predicted and a measured timeline
//! can sit side by side in one trace (give them different `pid_base`).
inline void append_timeline(trace_writer& out, const graph& g, const schedule& s, const timeline& t,
                            const std::string& label = "predicted", std::int64_t pid_base = 0) {
  WEAVE_EXPECT(t.tasks() == s.size(), errc::size_mismatch, "timeline of ", t.tasks(),
               " tasks for a schedule of ", s.size());
  WEAVE_EXPECT(s.num_ops() == g.size(), errc::size_mismatch, "schedule of ", s.num_ops(),
               " ops for a graph of ", g.size());
  for (std::size_t r = 0; r < t.ranks(); ++r) {
    const std::int64_t pid = pid_base + static_cast<std::int64_t>(r);
    out.name_process(pid, label + " rank " + std::to_string(r));
    out.name_thread(pid, 0, "compute");
    out.name_thread(pid, 1, "comm");
    for (std::size_t i = 0; i < s.size(); ++i) {
      const task& k = s[i];
      const op& o = g.at(k.op);
      const interval& iv = t.at(r, i);
      trace_event e;
      e.name = o.name + " [" + std::to_string(k.chunk) + "/" + std::to_string(k.chunks) + "]";
      e.category = to_string(o.kind);
      e.pid = pid;
      e.tid = static_cast<std::int64_t>(k.stream);
      e.ts_us = iv.begin_us;
      e.dur_us = iv.end_us > iv.begin_us ? iv.end_us - iv.begin_us : 0.0;
      e.args = {{"op", std::to_string(k.op)},
                {"fraction", std::to_string(k.fraction)},
                {"predicted_us", std::to_string(k.predicted_us)}};
      out.add(std::move(e));
    }
  }
}

} // namespace plan
WEAVE_NAMESPACE_END
