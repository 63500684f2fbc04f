//! \file
//! What a `chunk_pipeline` run on host streams measured: makespan, busy time per stream and
//! exposed communication, and its export to a Chrome trace (one lane per stream and rank).
#pragma once

#include "weave/core/config.hpp"
#include "weave/exec/host_stream.hpp"
#include "weave/overlap/pipeline.hpp"
#include "weave/overlap/trace.hpp"

#include <algorithm>
#include <chrono>
#include <string>

WEAVE_NAMESPACE_BEGIN

//! Times of one pipelined layer call, in milliseconds.
struct pipeline_timing {
  double makespan_ms = 0;     //!< first stage start to last stage end
  double compute_busy_ms = 0; //!< time the compute stream spent in stages
  double comm_busy_ms = 0;    //!< time the comm stream spent in stages
  //! Communication not hidden behind compute: makespan minus the compute alone.
  double exposed_comm_ms() const noexcept { return std::max(0.0, makespan_ms - compute_busy_ms); }
};

//! Reads the stage events of the pipeline's last (completed) run.
inline pipeline_timing measure(const chunk_pipeline<host_stream>& p) {
  using clock = host_event::clock;
  pipeline_timing t;
  clock::time_point first = clock::time_point::max(), last = clock::time_point::min();
  for (int c = 0; c < p.chunks(); ++c)
    for (int s = 0; s < pipeline_stage_count; ++s) {
      const auto stage = static_cast<pipeline_stage>(s);
      const auto begin = p.began(stage, c).completed_at(), end = p.ended(stage, c).completed_at();
      first = std::min(first, begin);
      last = std::max(last, end);
      const double ms = std::chrono::duration<double, std::milli>(end - begin).count();
      (on_comm_stream(stage) ? t.comm_busy_ms : t.compute_busy_ms) += ms;
    }
  t.makespan_ms = std::chrono::duration<double, std::milli>(last - first).count();
  return t;
}

//! Adds the last run's stages of rank `rank` to `trace` (pid = rank, tid 0 = compute,
//! 1 = comm), with times relative to `origin`; `label` prefixes the event names.
inline void add_to_trace(overlap::trace_writer& trace, const chunk_pipeline<host_stream>& p,
                         int rank, host_event::clock::time_point origin,
                         const std::string& label = "") {
  trace.name_process(rank, "rank " + std::to_string(rank));
  trace.name_thread(rank, 0, "compute stream");
  trace.name_thread(rank, 1, "comm stream");
  for (int c = 0; c < p.chunks(); ++c)
    for (int s = 0; s < pipeline_stage_count; ++s) {
      const auto stage = static_cast<pipeline_stage>(s);
      const auto begin = p.began(stage, c).completed_at(), end = p.ended(stage, c).completed_at();
      overlap::trace_event e;
      e.name = label + to_string(stage) + " " + std::to_string(c);
      e.category = on_comm_stream(stage) ? "a2a" : "compute";
      e.pid = rank;
      e.tid = on_comm_stream(stage) ? 1 : 0;
      e.ts_us = std::chrono::duration<double, std::micro>(begin - origin).count();
      e.dur_us = std::max(0.0, std::chrono::duration<double, std::micro>(end - begin).count());
      e.args = {{"chunk", std::to_string(c)}};
      trace.add(std::move(e));
    }
}

WEAVE_NAMESPACE_END
