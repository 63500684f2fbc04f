//! \file
//! The routing-trace file format, so users can replay their own model's routing.
//!
//! A trace file is UTF-8/ASCII text. Version 1 holds one layer's expert ids:
//! ```
//! weave-trace 1          <- magic and format version
//! experts 64             <- E
//! k 8                    <- ids per token
//! tokens 2               <- number of token lines that follow
//! 3 17 5 60 1 0 9 42     <- one line per token: k expert ids in [0, E), or -1 for "none"
//! 8 2 -1 -1 11 4 7 30
//! ```
//! Version 2 adds layers and the gate's scores:
//! ```
//! weave-trace 2
//! experts 64
//! k 2
//! layers 2               <- MoE layers, each a block of `tokens` lines over the same tokens
//! tokens 2               <- token lines per layer
//! scores 1               <- 1: each line has k ids, then k scores; 0: ids only
//! layer 0                <- each block starts with its layer number
//! 3 17 0.41 0.22
//! 8 2 0.5 0.125
//! layer 1
//! 40 9 0.3 0.29
//! 1 63 0.61 0.07
//! ```
//! Fields are separated by spaces or tabs; lines starting with `#` and blank lines are ignored
//! anywhere. Reading checks everything and names the line of the first problem.
#pragma once

#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/float_bits.hpp"
#include "weave/placement/trace.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <istream>
#include <ostream>
#include <span>
#include <string>
#include <string_view>
#include <vector>

WEAVE_NAMESPACE_BEGIN

namespace detail {

//! Reads the next line that is neither blank nor a comment; false at end of input.
inline bool next_trace_line(std::istream& in, std::string& line, std::size_t& number) {
  while (std::getline(in, line)) {
    ++number;
    if (!line.empty() && line.back() == '\r')
      line.pop_back();
    const auto first = line.find_first_not_of(" \t");
    if (first != std::string::npos && line[first] != '#')
      return true;
  }
  return false;
}

//! The fields of `line` (separated by spaces or tabs).
inline std::vector<std::string_view> trace_tokens(std::string_view line) {
  std::vector<std::string_view> out;
  std::size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t'))
      ++i;
    if (i == line.size())
      break;
    std::size_t j = i;
    while (j < line.size() && line[j] != ' ' && line[j] != '\t')
      ++j;
    out.push_back(line.substr(i, j - i));
    i = j;
  }
  return out;
}

inline long long trace_integer(std::string_view field, std::size_t number) {
  long long v = 0;
  const auto r = std::from_chars(field.data(), field.data() + field.size(), v);
  WEAVE_EXPECT(r.ec == std::errc{} && r.ptr == field.data() + field.size(), errc::invalid_argument,
               "trace line ", number, ": '", field, "' is not an integer");
  return v;
}

inline float trace_score(std::string_view field, std::size_t number) {
  float v = 0;
  const auto r = std::from_chars(field.data(), field.data() + field.size(), v);
  WEAVE_EXPECT(
      r.ec == std::errc{} && r.ptr == field.data() + field.size() && weave::detail::is_finite(v),
      errc::invalid_argument, "trace line ", number, ": '", field, "' is not a finite score");
  return v;
}

//! Reads the `key <n>` header line.
inline long long trace_header(std::istream& in, std::string& line, std::size_t& number,
                              std::string_view key) {
  WEAVE_EXPECT(next_trace_line(in, line, number), errc::invalid_argument, "trace ends before the '",
               key, "' header");
  const auto fields = trace_tokens(line);
  WEAVE_EXPECT(fields[0] == key, errc::invalid_argument, "trace line ", number, ": expected '", key,
               " <n>', got '", line, "'");
  WEAVE_EXPECT(fields.size() == 2, errc::invalid_argument, "trace line ", number, ": '", key,
               "' takes one value, got ", fields.size() - 1);
  return trace_integer(fields[1], number);
}

//! Reads one layer's `tokens` lines into `t` (E and k set) and, if `scores`, its scores.
inline void read_trace_layer(std::istream& in, std::string& line, std::size_t& number,
                             routing_trace& t, std::size_t tokens, std::vector<float>* scores) {
  const auto k = static_cast<std::size_t>(t.k);
  const std::size_t fields_per_line = scores != nullptr ? 2 * k : k;
  t.ids.reserve(std::min<std::size_t>(checked_mul(tokens, k, "trace ids"), std::size_t{1} << 24));
  if (scores != nullptr)
    scores->reserve(t.ids.capacity());
  for (std::size_t read = 0; read < tokens; ++read) {
    WEAVE_EXPECT(next_trace_line(in, line, number), errc::size_mismatch, "trace has ", read,
                 " token lines, header says ", tokens);
    const auto fields = trace_tokens(line);
    WEAVE_EXPECT(fields.size() == fields_per_line, errc::size_mismatch, "trace line ", number,
                 " has ", fields.size(), " fields, expected ", fields_per_line,
                 scores != nullptr ? " (k ids, then k scores)" : " (k ids)");
    for (std::size_t i = 0; i < k; ++i) {
      const long long id = trace_integer(fields[i], number);
      WEAVE_EXPECT(id >= -1 && id < t.num_experts, errc::out_of_range, "trace line ", number,
                   ": expert id ", id, " outside [-1, ", t.num_experts, ")");
      t.ids.push_back(static_cast<std::int32_t>(id));
    }
    if (scores != nullptr)
      for (std::size_t i = k; i < 2 * k; ++i)
        scores->push_back(trace_score(fields[i], number));
  }
}

//! Checks one layer: whole tokens, valid ids.
inline void check_trace(const routing_trace& t) {
  WEAVE_EXPECT(t.num_experts > 0 && t.k > 0 && t.k <= t.num_experts, errc::invalid_argument,
               "trace of k = ", t.k, " over ", t.num_experts, " experts");
  WEAVE_EXPECT(t.ids.size() % static_cast<std::size_t>(t.k) == 0, errc::size_mismatch, t.ids.size(),
               " ids are not a whole number of tokens with k = ", t.k);
  for (std::size_t i = 0; i < t.ids.size(); ++i)
    WEAVE_EXPECT(t.ids[i] >= -1 && t.ids[i] < t.num_experts, errc::out_of_range, "expert id ",
                 t.ids[i], " of token ", i / static_cast<std::size_t>(t.k), " outside [-1, ",
                 t.num_experts, ")");
}

//! Checks what `write_trace_layers` writes: layers of one shape, scores for all or none.
inline void check_trace_layers(const layered_trace& trace) {
  WEAVE_EXPECT(!trace.layers.empty(), errc::invalid_argument, "no trace layers to write");
  WEAVE_EXPECT(trace.scores.empty() || trace.scores.size() == trace.layers.size(),
               errc::size_mismatch, trace.scores.size(), " score lists for ", trace.layers.size(),
               " trace layers");
  const routing_trace& first = trace.layers[0];
  for (std::size_t l = 0; l < trace.layers.size(); ++l) {
    const routing_trace& t = trace.layers[l];
    check_trace(t);
    WEAVE_EXPECT(t.num_experts == first.num_experts && t.k == first.k &&
                     t.ids.size() == first.ids.size(),
                 errc::size_mismatch, "trace layer ", l, " (", t.num_experts, " experts, k = ", t.k,
                 ", ", t.num_tokens(), " tokens) differs in shape from layer 0 (",
                 first.num_experts, ", k = ", first.k, ", ", first.num_tokens(), ")");
    if (trace.scores.empty())
      continue;
    const auto& sc = trace.scores[l];
    WEAVE_EXPECT(sc.size() == t.ids.size(), errc::size_mismatch, sc.size(), " scores for ",
                 t.ids.size(), " ids in trace layer ", l);
    for (std::size_t i = 0; i < sc.size(); ++i)
      WEAVE_EXPECT(weave::detail::is_finite(sc[i]), errc::invalid_argument, "score ", sc[i],
                   " of token ", i / static_cast<std::size_t>(t.k), " in trace layer ", l,
                   " is not finite");
  }
}

//! One token line: k ids, then k scores when `scores` is not empty.
inline void write_trace_line(std::ostream& out, const routing_trace& t,
                             std::span<const float> scores, std::size_t token) {
  const auto k = static_cast<std::size_t>(t.k);
  for (std::size_t i = 0; i < k; ++i)
    out << t.ids[token * k + i] << (i + 1 < k || !scores.empty() ? ' ' : '\n');
  if (scores.empty())
    return;
  char buf[32];
  for (std::size_t i = 0; i < k; ++i) {
    // Shortest form that reads back to the same float.
    const auto r = std::to_chars(buf, buf + sizeof buf, scores[token * k + i]);
    out << std::string_view(buf, static_cast<std::size_t>(r.ptr - buf)) << (i + 1 < k ? ' ' : '\n');
  }
}

} // namespace detail

//! Reads every layer of a trace (a version 1 file is one layer without scores). Throws
//! `errc::invalid_argument` for a bad magic, version, header, id, score or layer line,
//! `errc::size_mismatch` for a token line without exactly k ids (and k scores when the file has
//! scores) or a token count that does not match the header, `errc::out_of_range` for an id
//! outside [-1, E). Messages name the line.
inline layered_trace read_trace_layers(std::istream& in) {
  std::string line;
  std::size_t number = 0;
  const long long version = detail::trace_header(in, line, number, "weave-trace");
  WEAVE_EXPECT(version == 1 || version == 2, errc::invalid_argument, "trace format version ",
               version, " is not supported (expected 1 or 2)");
  const long long E = detail::trace_header(in, line, number, "experts");
  WEAVE_EXPECT(E > 0 && E <= (1LL << 30), errc::invalid_argument, "trace line ", number,
               ": experts = ", E);
  const long long k = detail::trace_header(in, line, number, "k");
  WEAVE_EXPECT(k > 0 && k <= E, errc::invalid_argument, "trace line ", number, ": k = ", k,
               " outside [1, ", E, "]");
  long long layers = 1;
  if (version == 2) {
    layers = detail::trace_header(in, line, number, "layers");
    WEAVE_EXPECT(layers > 0 && layers <= (1LL << 20), errc::invalid_argument, "trace line ", number,
                 ": layers = ", layers);
  }
  const long long tokens = detail::trace_header(in, line, number, "tokens");
  WEAVE_EXPECT(tokens >= 0, errc::invalid_argument, "trace line ", number, ": tokens = ", tokens);
  bool scores = false;
  if (version == 2) {
    const long long s = detail::trace_header(in, line, number, "scores");
    WEAVE_EXPECT(s == 0 || s == 1, errc::invalid_argument, "trace line ", number, ": scores = ", s,
                 " (0 or 1)");
    scores = s == 1;
  }
  layered_trace out;
  out.layers.resize(static_cast<std::size_t>(layers));
  if (scores)
    out.scores.resize(static_cast<std::size_t>(layers));
  for (std::size_t l = 0; l < out.layers.size(); ++l) {
    if (version == 2)
      WEAVE_EXPECT(detail::trace_header(in, line, number, "layer") == static_cast<long long>(l),
                   errc::invalid_argument, "trace line ", number, ": expected 'layer ", l, "'");
    routing_trace& t = out.layers[l];
    t.num_experts = static_cast<int>(E);
    t.k = static_cast<int>(k);
    detail::read_trace_layer(in, line, number, t, static_cast<std::size_t>(tokens),
                             scores ? &out.scores[l] : nullptr);
  }
  WEAVE_EXPECT(!detail::next_trace_line(in, line, number), errc::size_mismatch, "trace line ",
               number, ": more token lines than the ", tokens, " per layer in the header");
  return out;
}

//! Reads a one-layer trace (version 1, or version 2 with one layer; its scores are not
//! returned). Throws as `read_trace_layers` does, and `errc::invalid_argument` for a file of
//! several layers.
inline routing_trace read_trace(std::istream& in) {
  auto trace = read_trace_layers(in);
  WEAVE_EXPECT(trace.layers.size() == 1, errc::invalid_argument, "trace has ", trace.layers.size(),
               " layers; read it with read_trace_layers");
  return std::move(trace.layers[0]);
}

namespace detail {
inline std::ifstream open_trace(const std::string& path) {
  std::ifstream in(path);
  WEAVE_EXPECT(in.good(), errc::invalid_argument, "cannot open trace file '", path, "'");
  return in;
}
} // namespace detail

//! Reads the trace file at `path`; throws `errc::invalid_argument` if it cannot be opened.
inline routing_trace read_trace_file(const std::string& path) {
  auto in = detail::open_trace(path);
  return read_trace(in);
}

//! Reads every layer of the trace file at `path`.
inline layered_trace read_trace_layers_file(const std::string& path) {
  auto in = detail::open_trace(path);
  return read_trace_layers(in);
}

//! Writes `trace` in format version 2. Throws `errc::invalid_argument` for no layers, a
//! non-finite score or when the stream fails, `errc::size_mismatch` for ids that are not whole
//! tokens, layers of other shapes or score counts other than the id counts,
//! `errc::out_of_range` for an id outside [-1, E).
inline void write_trace_layers(std::ostream& out, const layered_trace& trace) {
  detail::check_trace_layers(trace);
  const routing_trace& first = trace.layers[0];
  out << "weave-trace 2\nexperts " << first.num_experts << "\nk " << first.k << "\nlayers "
      << trace.layers.size() << "\ntokens " << first.num_tokens() << "\nscores "
      << (trace.scores.empty() ? 0 : 1) << '\n';
  for (std::size_t l = 0; l < trace.layers.size(); ++l) {
    out << "layer " << l << '\n';
    const std::span<const float> scores =
        trace.scores.empty() ? std::span<const float>{} : std::span<const float>(trace.scores[l]);
    for (std::size_t t = 0; t < first.num_tokens(); ++t)
      detail::write_trace_line(out, trace.layers[l], scores, t);
  }
  out.flush();
  WEAVE_EXPECT(out.good(), errc::invalid_argument, "writing the trace failed");
}

//! Writes `t` in format version 1. Throws `errc::size_mismatch` when the ids are not whole
//! tokens, `errc::out_of_range` for an id outside [-1, E), `errc::invalid_argument` when the
//! stream fails.
inline void write_trace(std::ostream& out, const routing_trace& t) {
  detail::check_trace(t);
  out << "weave-trace 1\nexperts " << t.num_experts << "\nk " << t.k << "\ntokens "
      << t.num_tokens() << '\n';
  for (std::size_t i = 0; i < t.num_tokens(); ++i)
    detail::write_trace_line(out, t, {}, i);
  out.flush();
  WEAVE_EXPECT(out.good(), errc::invalid_argument, "writing the trace failed");
}

namespace detail {
inline std::ofstream create_trace(const std::string& path) {
  std::ofstream out(path);
  WEAVE_EXPECT(out.good(), errc::invalid_argument, "cannot create trace file '", path, "'");
  return out;
}
} // namespace detail

//! Writes `t` to the file at `path` (replacing it).
inline void write_trace_file(const std::string& path, const routing_trace& t) {
  auto out = detail::create_trace(path);
  write_trace(out, t);
}

//! Writes `trace` to the file at `path` (replacing it).
inline void write_trace_layers_file(const std::string& path, const layered_trace& trace) {
  auto out = detail::create_trace(path);
  write_trace_layers(out, trace);
}

WEAVE_NAMESPACE_END
