//! \file
//! What a `chunk_pipeline` run on host streams measured: makespan, busy time per stream and
//! exposed communication, and its export to a Chrome trace (one lane per stream and rank).
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/trace_writer.hpp"
#include "weave/exec/host_stream.hpp"
#include "weave/overlap/pipeline.hpp"

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

namespace detail {

// Calls f(stage, chunk, begin_ms, end_ms) for every stage of the last run, with times from
// `ms_of(event)` (milliseconds from a common reference).
template <class Stream, class MsOf, class F>
void for_each_stage_time(const chunk_pipeline<Stream>& p, MsOf&& ms_of, F&& f) {
  for (int c = 0; c < p.chunks(); ++c)
    for (int s = 0; s < pipeline_stage_count; ++s) {
      const auto stage = static_cast<pipeline_stage>(s);
      f(stage, c, ms_of(p.began(stage, c)), ms_of(p.ended(stage, c)));
    }
}

template <class Stream, class MsOf>
pipeline_timing measure_with(const chunk_pipeline<Stream>& p, MsOf&& ms_of) {
  pipeline_timing t;
  double first = 0, last = 0;
  bool any = false;
  for_each_stage_time(p, ms_of, [&](pipeline_stage stage, int, double begin, double end) {
    first = any ? std::min(first, begin) : begin;
    last = any ? std::max(last, end) : end;
    any = true;
    (on_comm_stream(stage) ? t.comm_busy_ms : t.compute_busy_ms) += end - begin;
  });
  t.makespan_ms = last - first;
  return t;
}

template <class Stream, class MsOf>
void add_stages_to_trace(trace_writer& trace, const chunk_pipeline<Stream>& p, int rank,
                         MsOf&& ms_of, const std::string& label) {
  trace.name_process(rank, "rank " + std::to_string(rank));
  trace.name_thread(rank, 0, "compute stream");
  trace.name_thread(rank, 1, "comm stream");
  for_each_stage_time(p, ms_of, [&](pipeline_stage stage, int c, double begin, double end) {
    trace_event e;
    e.name = label + to_string(stage) + " " + std::to_string(c);
    e.category = on_comm_stream(stage) ? "a2a" : "compute";
    e.pid = rank;
    e.tid = on_comm_stream(stage) ? 1 : 0;
    e.ts_us = begin * 1e3;
    e.dur_us = std::max(0.0, (end - begin) * 1e3);
    e.args = {{"chunk", std::to_string(c)}};
    trace.add(std::move(e));
  });
}

} // namespace detail

//! Reads the stage events of the pipeline's last (completed) run.
inline pipeline_timing measure(const chunk_pipeline<host_stream>& p) {
  const auto origin = p.began(pipeline_stage::prepare, 0).completed_at();
  return detail::measure_with(p, [origin](const host_event& e) {
    return std::chrono::duration<double, std::milli>(e.completed_at() - origin).count();
  });
}

//! Adds the last run's stages of rank `rank` to `trace` (pid = rank, tid 0 = compute,
//! 1 = comm), with times relative to `origin`; `label` prefixes the event names.
inline void add_to_trace(trace_writer& trace, const chunk_pipeline<host_stream>& p, int rank,
                         host_event::clock::time_point origin, const std::string& label = "") {
  detail::add_stages_to_trace(
      trace, p, rank,
      [origin](const host_event& e) {
        return std::chrono::duration<double, std::milli>(e.completed_at() - origin).count();
      },
      label);
}

WEAVE_NAMESPACE_END
