//! \file
//! The routing-trace file format, so users can replay their own model's routing.
//!
//! A trace file is UTF-8/ASCII text:
//! ```
//! weave-trace 1          <- magic and format version
//! experts 64             <- E
//! k 8                    <- ids per token
//! tokens 2               <- number of token lines that follow
//! 3 17 5 60 1 0 9 42     <- one line per token: k expert ids in [0, E), or -1 for "none"
//! 8 2 -1 -1 11 4 7 30
//! ```
//! Fields are separated by spaces or tabs; lines starting with `#` and blank lines are ignored
//! anywhere. Reading checks everything and names the line of the first problem.
#pragma once

#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/placement/trace.hpp"

#include <algorithm>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <istream>
#include <ostream>
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

//! Splits `line` into integer fields; throws naming the line on anything that is not one.
inline std::vector<long long> trace_fields(std::string_view line, std::size_t number) {
  std::vector<long long> out;
  std::size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t'))
      ++i;
    if (i == line.size())
      break;
    std::size_t j = i;
    while (j < line.size() && line[j] != ' ' && line[j] != '\t')
      ++j;
    long long v = 0;
    const auto r = std::from_chars(line.data() + i, line.data() + j, v);
    WEAVE_EXPECT(r.ec == std::errc{} && r.ptr == line.data() + j, errc::invalid_argument,
                 "trace line ", number, ": '", line.substr(i, j - i), "' is not an integer");
    out.push_back(v);
    i = j;
  }
  return out;
}

inline long long trace_header(std::istream& in, std::string& line, std::size_t& number,
                              std::string_view key) {
  WEAVE_EXPECT(next_trace_line(in, line, number), errc::invalid_argument, "trace ends before the '",
               key, "' header");
  const auto first = line.find_first_not_of(" \t");
  const std::string_view rest = std::string_view(line).substr(first);
  WEAVE_EXPECT(rest.starts_with(key) && rest.size() > key.size() &&
                   (rest[key.size()] == ' ' || rest[key.size()] == '\t'),
               errc::invalid_argument, "trace line ", number, ": expected '", key, " <n>', got '",
               line, "'");
  const auto fields = trace_fields(rest.substr(key.size()), number);
  WEAVE_EXPECT(fields.size() == 1, errc::invalid_argument, "trace line ", number, ": '", key,
               "' takes one value, got ", fields.size());
  return fields[0];
}

} // namespace detail

//! Reads a trace. Throws `errc::invalid_argument` for a bad magic, version, header or field,
//! `errc::size_mismatch` for a token line without exactly `k` ids or a token count that does
//! not match the header, `errc::out_of_range` for an id outside [-1, E).
inline routing_trace read_trace(std::istream& in) {
  std::string line;
  std::size_t number = 0;
  const long long version = detail::trace_header(in, line, number, "weave-trace");
  WEAVE_EXPECT(version == 1, errc::invalid_argument, "trace format version ", version,
               " is not supported (expected 1)");
  const long long E = detail::trace_header(in, line, number, "experts");
  WEAVE_EXPECT(E > 0 && E <= (1LL << 30), errc::invalid_argument, "trace line ", number,
               ": experts = ", E);
  const long long k = detail::trace_header(in, line, number, "k");
  WEAVE_EXPECT(k > 0 && k <= E, errc::invalid_argument, "trace line ", number, ": k = ", k,
               " outside [1, ", E, "]");
  const long long tokens = detail::trace_header(in, line, number, "tokens");
  WEAVE_EXPECT(tokens >= 0, errc::invalid_argument, "trace line ", number, ": tokens = ", tokens);
  routing_trace t;
  t.num_experts = static_cast<int>(E);
  t.k = static_cast<int>(k);
  const auto expected =
      checked_mul(static_cast<std::size_t>(tokens), static_cast<std::size_t>(k), "trace ids");
  t.ids.reserve(std::min<std::size_t>(expected, std::size_t{1} << 24));
  std::size_t read = 0;
  while (detail::next_trace_line(in, line, number)) {
    const auto ids = detail::trace_fields(line, number);
    WEAVE_EXPECT(ids.size() == static_cast<std::size_t>(k), errc::size_mismatch, "trace line ",
                 number, " has ", ids.size(), " ids, expected k = ", k);
    WEAVE_EXPECT(read < static_cast<std::size_t>(tokens), errc::size_mismatch, "trace line ",
                 number, ": more token lines than the ", tokens, " in the header");
    for (const long long id : ids) {
      WEAVE_EXPECT(id >= -1 && id < E, errc::out_of_range, "trace line ", number, ": expert id ",
                   id, " outside [-1, ", E, ")");
      t.ids.push_back(static_cast<std::int32_t>(id));
    }
    ++read;
  }
  WEAVE_EXPECT(read == static_cast<std::size_t>(tokens), errc::size_mismatch, "trace has ", read,
               " token lines, header says ", tokens);
  return t;
}

//! Reads the trace file at `path`; throws `errc::invalid_argument` if it cannot be opened.
inline routing_trace read_trace_file(const std::string& path) {
  std::ifstream in(path);
  WEAVE_EXPECT(in.good(), errc::invalid_argument, "cannot open trace file '", path, "'");
  return read_trace(in);
}

//! Writes `t` in the trace format. Throws `errc::size_mismatch` when the ids are not whole
//! tokens, `errc::out_of_range` for an id outside [-1, E), `errc::invalid_argument` when the
//! stream fails.
inline void write_trace(std::ostream& out, const routing_trace& t) {
  WEAVE_EXPECT(t.num_experts > 0 && t.k > 0 && t.k <= t.num_experts, errc::invalid_argument,
               "trace of k = ", t.k, " over ", t.num_experts, " experts");
  WEAVE_EXPECT(t.ids.size() % static_cast<std::size_t>(t.k) == 0, errc::size_mismatch, t.ids.size(),
               " ids are not a whole number of tokens with k = ", t.k);
  out << "weave-trace 1\nexperts " << t.num_experts << "\nk " << t.k << "\ntokens "
      << t.num_tokens() << '\n';
  for (std::size_t i = 0; i < t.ids.size(); ++i) {
    const std::int32_t id = t.ids[i];
    WEAVE_EXPECT(id >= -1 && id < t.num_experts, errc::out_of_range, "expert id ", id, " of token ",
                 i / static_cast<std::size_t>(t.k), " outside [-1, ", t.num_experts, ")");
    out << id << ((i + 1) % static_cast<std::size_t>(t.k) == 0 ? '\n' : ' ');
  }
  out.flush();
  WEAVE_EXPECT(out.good(), errc::invalid_argument, "writing the trace failed");
}

//! Writes `t` to the file at `path` (replacing it).
inline void write_trace_file(const std::string& path, const routing_trace& t) {
  std::ofstream out(path);
  WEAVE_EXPECT(out.good(), errc::invalid_argument, "cannot create trace file '", path, "'");
  write_trace(out, t);
}

WEAVE_NAMESPACE_END
