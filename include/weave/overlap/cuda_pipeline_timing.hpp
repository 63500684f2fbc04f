//! \file
//! `measure` and `add_to_trace` for a `chunk_pipeline` on CUDA streams (component
//! `weave::cuda`): stage times come from the pipeline's CUDA events (created with timing), in
//! milliseconds from the first stage's start. Read them after the run completed; a run issued
//! while its streams were captured in a CUDA graph carries no times (`measure` returns zeros,
//! `add_to_trace` adds nothing).
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/trace_writer.hpp"
#include "weave/exec/cuda_stream.hpp"
#include "weave/overlap/pipeline.hpp"
#include "weave/overlap/pipeline_timing.hpp"

#include <string>

WEAVE_NAMESPACE_BEGIN

//! Makespan, busy time per stream and exposed communication of the last completed run.
inline pipeline_timing measure(const chunk_pipeline<cuda_stream_ref>& p) {
  if (p.captured())
    return {};
  const cuda_event& origin = p.began(pipeline_stage::prepare, 0);
  return detail::measure_with(
      p, [&origin](const cuda_event& e) { return cuda_event::elapsed_ms(origin, e); });
}

//! Adds the last run's stages of rank `rank` to `trace` (pid = rank, tid 0 = compute,
//! 1 = comm), `offset_us` after the trace's origin; `label` prefixes the event names.
inline void add_to_trace(trace_writer& trace, const chunk_pipeline<cuda_stream_ref>& p, int rank,
                         double offset_us = 0, const std::string& label = "") {
  if (p.captured())
    return;
  const cuda_event& origin = p.began(pipeline_stage::prepare, 0);
  detail::add_stages_to_trace(
      trace, p, rank,
      [&origin, offset_us](const cuda_event& e) {
        return offset_us * 1e-3 + cuda_event::elapsed_ms(origin, e);
      },
      label);
}

WEAVE_NAMESPACE_END
