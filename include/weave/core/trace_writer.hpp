//! \file
//! `trace_writer`: Chrome trace-event JSON (loads in chrome://tracing and Perfetto).
//!
//! Generic on purpose: it knows complete events ("ph": "X") on (process, thread) lanes and lane
//! names, nothing about schedules, so the planner's predicted timeline and the MoE exchange's
//! measured one export through the same writer. Times are microseconds, the format's unit.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/float_bits.hpp"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>
#include <ostream>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

WEAVE_NAMESPACE_BEGIN

//! One complete event: something named that ran on lane (pid, tid) over [ts, ts + dur).
struct trace_event {
  std::string name;
  std::string category; //!< "cat": lets a viewer filter (e.g. "compute", "a2a", "predicted")
  std::int64_t pid = 0; //!< process lane: the rank
  std::int64_t tid = 0; //!< thread lane: the stream
  double ts_us = 0.0;   //!< start, microseconds
  double dur_us = 0.0;  //!< duration, microseconds (>= 0)
  //! Extra key/value strings shown with the event ("args").
  std::vector<std::pair<std::string, std::string>> args;
};

//! Collects events and lane names, then writes `{"traceEvents": [...]}`.
class trace_writer {
 public:
  //! Adds an event. Throws `errc::invalid_argument` for a non-finite time or negative duration.
  void add(trace_event e) {
    WEAVE_EXPECT(weave::detail::is_finite(e.ts_us), errc::invalid_argument, "trace event '", e.name,
                 "': ts = ", e.ts_us);
    WEAVE_EXPECT(weave::detail::is_finite(e.dur_us) && e.dur_us >= 0.0, errc::invalid_argument,
                 "trace event '", e.name, "': dur = ", e.dur_us);
    events_.push_back(std::move(e));
  }

  //! Names process lane `pid` (shown instead of the number).
  void name_process(std::int64_t pid, std::string name) { processes_[pid] = std::move(name); }
  //! Names thread lane `tid` of process `pid`.
  void name_thread(std::int64_t pid, std::int64_t tid, std::string name) {
    threads_[{pid, tid}] = std::move(name);
  }

  std::size_t size() const noexcept { return events_.size(); }
  const std::vector<trace_event>& events() const noexcept { return events_; }

  //! Writes the JSON document: metadata events first (in lane order), then events as added.
  void write(std::ostream& out) const {
    out << "{\"traceEvents\":[";
    bool first = true;
    auto sep = [&] {
      out << (first ? "\n" : ",\n");
      first = false;
    };
    for (const auto& [pid, name] : processes_) {
      sep();
      out << "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" << pid
          << ",\"tid\":0,\"args\":{\"name\":";
      quote(out, name);
      out << "}}";
    }
    for (const auto& [lane, name] : threads_) {
      sep();
      out << "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" << lane.first
          << ",\"tid\":" << lane.second << ",\"args\":{\"name\":";
      quote(out, name);
      out << "}}";
    }
    for (const trace_event& e : events_) {
      sep();
      out << "{\"name\":";
      quote(out, e.name);
      out << ",\"cat\":";
      quote(out, e.category);
      out << ",\"ph\":\"X\",\"pid\":" << e.pid << ",\"tid\":" << e.tid << ",\"ts\":";
      number(out, e.ts_us);
      out << ",\"dur\":";
      number(out, e.dur_us);
      if (!e.args.empty()) {
        out << ",\"args\":{";
        for (std::size_t i = 0; i < e.args.size(); ++i) {
          if (i)
            out << ',';
          quote(out, e.args[i].first);
          out << ':';
          quote(out, e.args[i].second);
        }
        out << '}';
      }
      out << '}';
    }
    out << "\n]}\n";
  }

  //! The JSON document as a string.
  std::string str() const {
    std::ostringstream out;
    write(out);
    return out.str();
  }

  //! Writes the document to `path`; `errc::invalid_state` if the file cannot be written.
  void write_file(const std::string& path) const {
    std::ofstream file(path, std::ios::binary | std::ios::trunc);
    WEAVE_EXPECT(file.good(), errc::invalid_state, "cannot open trace file '", path, "'");
    write(file);
    file.flush();
    WEAVE_EXPECT(file.good(), errc::invalid_state, "cannot write trace file '", path, "'");
  }

 private:
  static void quote(std::ostream& out, std::string_view s) {
    out << '"';
    for (const char ch : s) {
      const auto c = static_cast<unsigned char>(ch);
      switch (c) {
      case '"':
        out << "\\\"";
        break;
      case '\\':
        out << "\\\\";
        break;
      case '\n':
        out << "\\n";
        break;
      case '\t':
        out << "\\t";
        break;
      case '\r':
        out << "\\r";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
          out << buf;
        } else {
          out << ch;
        }
      }
    }
    out << '"';
  }

  // Fixed notation with nanosecond resolution: JSON has no NaN/inf (rejected in add) and the
  // viewers expect plain decimals.
  static void number(std::ostream& out, double v) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.3f", v);
    out << buf;
  }

  std::vector<trace_event> events_;
  std::map<std::int64_t, std::string> processes_;
  std::map<std::pair<std::int64_t, std::int64_t>, std::string> threads_;
};

WEAVE_NAMESPACE_END
