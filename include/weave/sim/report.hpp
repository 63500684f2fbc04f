//! \file
//! Output of a cluster simulation: a JSON summary (step time, exposed communication, imbalance,
//! per-layer figures) and a Chrome trace of one step (the kept ranks' two streams, layers one
//! after another) through `trace_writer`.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/float_bits.hpp"
#include "weave/core/trace_writer.hpp"
#include "weave/sim/cluster.hpp"
#include "weave/sim/cluster_sim.hpp"
#include "weave/sim/moe_model.hpp"

#include <cmath>
#include <cstdio>
#include <ostream>
#include <string>
#include <string_view>

WEAVE_NAMESPACE_BEGIN
namespace sim {

namespace detail {

inline void json_number(std::ostream& out, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.6g", weave::detail::is_finite(v) ? v : 0.0);
  out << buf;
}

inline void json_string(std::ostream& out, std::string_view s) {
  out << '"';
  for (const char ch : s) {
    if (ch == '"' || ch == '\\')
      out << '\\' << ch;
    else if (static_cast<unsigned char>(ch) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(ch));
      out << buf;
    } else
      out << ch;
  }
  out << '"';
}

} // namespace detail

//! Writes one JSON object describing `r` (times in us, bytes in bytes): the totals, then
//! `"layers"`, an array of per-layer objects unless `with_layers` is false.
inline void write_json(std::ostream& out, const sim_result& r, bool with_layers = true) {
  auto field = [&](const char* key, double v, bool comma = true) {
    out << '"' << key << "\":";
    detail::json_number(out, v);
    if (comma)
      out << ',';
  };
  out << '{';
  field("step_us", r.step_us);
  field("exposed_comm_us", r.exposed_comm_us);
  field("comm_us", r.comm_us);
  field("compute_us", r.compute_us);
  field("imbalance_max", r.imbalance_max);
  field("imbalance_mean", r.imbalance_mean, with_layers);
  if (with_layers) {
    out << "\"layers\":[";
    for (std::size_t i = 0; i < r.layers.size(); ++i) {
      const layer_result& l = r.layers[i];
      out << (i ? ",{" : "{");
      field("makespan_us", l.makespan_us);
      field("dispatch_us", l.dispatch_us);
      field("combine_us", l.combine_us);
      field("compute_us", l.compute_us);
      field("exposed_comm_us", l.exposed_comm_us);
      field("imbalance", l.imbalance);
      field("max_sent_bytes", l.max_sent_bytes);
      field("inter_bytes", l.inter_bytes, false);
      out << '}';
    }
    out << ']';
  }
  out << '}';
}

//! A Chrome trace of one simulated step: one process lane per kept rank with a compute and a
//! comm thread; layer l's tasks are shifted by the makespans of the layers before it.
inline trace_writer chrome_trace(const sim_result& r) {
  trace_writer w;
  for (const int rank : r.trace_ranks) {
    w.name_process(rank, "rank " + std::to_string(rank));
    w.name_thread(rank, 0, "compute");
    w.name_thread(rank, 1, "comm");
  }
  double offset = 0;
  for (std::size_t l = 0; l < r.traced.size(); ++l) {
    for (std::size_t k = 0; k < r.trace_ranks.size(); ++k) {
      const auto& iv = r.traced[l][k];
      for (std::size_t i = 0; i < r.schedule.size(); ++i) {
        const plan::task& t = r.schedule[i];
        const bool comm = t.stream == plan::stream_kind::comm;
        std::string name = "L" + std::to_string(l) + " " + r.schedule_names[t.op];
        if (t.chunks > 1)
          name += " #" + std::to_string(t.chunk);
        w.add({std::move(name),
               comm ? "a2a" : "compute",
               r.trace_ranks[k],
               comm ? 1 : 0,
               offset + iv[i].begin_us,
               iv[i].end_us - iv[i].begin_us,
               {}});
      }
    }
    offset += r.layers[l].makespan_us;
  }
  return w;
}

} // namespace sim
WEAVE_NAMESPACE_END
