// Checks that the example files the docs show parse as shown, with weave's own readers.
//
// An example file in a Markdown page is announced by a comment naming its format, followed by a
// fenced block holding the file:
//
//   <!-- format: weave-cluster -->
//   ```
//   weave-cluster 1               # magic and format version
//   ...
//   ```
//
// Formats: `weave-cluster` (read by `sim::read_cluster`) and `weave-trace` (`read_trace_layers`,
// and `read_trace` too for a version 1 file). Each example must parse, and what it parses to must
// survive a write and a second read unchanged. A fenced block that starts with a format's magic
// word but has no announcement fails too, so a new example cannot escape the check. Usage:
// format_check [--each-format] <page.md>... Exits 1 naming every problem; with --each-format it
// also fails when some format has no example at all (the docs should show each).
#include <weave/placement/trace_io.hpp>
#include <weave/sim/cluster.hpp>

#include <algorithm>
#include <exception>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using lines = std::vector<std::string>;

const std::vector<std::string> formats = {"weave-cluster", "weave-trace"};

std::optional<lines> read_lines(const std::string& path) {
  std::ifstream in(path);
  if (!in)
    return std::nullopt;
  lines out;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line.back() == '\r')
      line.pop_back();
    out.push_back(line);
  }
  return out;
}

std::string trim(const std::string& s) {
  const auto first = s.find_first_not_of(" \t");
  if (first == std::string::npos)
    return {};
  const auto last = s.find_last_not_of(" \t");
  return s.substr(first, last - first + 1);
}

bool is_fence(const std::string& line) {
  return trim(line).rfind("```", 0) == 0;
}

// The format named by `<!-- format: <name> -->`; "" for a malformed one; nullopt for another line.
std::optional<std::string> parse_announcement(const std::string& line) {
  const std::string t = trim(line), open = "<!-- format:", close = "-->";
  if (t.rfind(open, 0) != 0)
    return std::nullopt;
  if (t.size() < open.size() + close.size() ||
      t.compare(t.size() - close.size(), close.size(), close) != 0)
    return std::string();
  return trim(t.substr(open.size(), t.size() - open.size() - close.size()));
}

// The format whose magic word starts `block` (its first line that is not blank or a comment).
std::string magic_of(const lines& block) {
  for (const std::string& l : block) {
    const std::string t = trim(l);
    if (t.empty() || t[0] == '#')
      continue;
    for (const std::string& f : formats)
      if (t.rfind(f + " ", 0) == 0 || t.rfind(f + "\t", 0) == 0 || t == f)
        return f;
    return {};
  }
  return {};
}

std::string join(const lines& block) {
  std::string text;
  for (const std::string& l : block)
    text += l + '\n';
  return text;
}

// Parses `text` as `format`, writes what it read and reads that back; throws on any problem.
void check_example(const std::string& format, const std::string& text) {
  if (format == "weave-cluster") {
    std::istringstream in(text);
    weave::sim::cluster c = weave::sim::read_cluster(in);
    if (c.name.empty())
      c.name = "unnamed"; // write_cluster needs a name; read_cluster leaves "custom" otherwise
    std::stringstream again;
    weave::sim::write_cluster(again, c);
    if (!(weave::sim::read_cluster(again) == c))
      throw std::runtime_error("the cluster does not read back the same after write_cluster");
    return;
  }
  std::istringstream in(text);
  const weave::layered_trace t = weave::read_trace_layers(in);
  std::stringstream again;
  weave::write_trace_layers(again, t);
  if (!(weave::read_trace_layers(again) == t))
    throw std::runtime_error("the trace does not read back the same after write_trace_layers");
  if (text.find("weave-trace 1") != std::string::npos) { // version 1: read_trace takes it too
    std::istringstream v1(text);
    const weave::routing_trace one = weave::read_trace(v1);
    if (t.layers.size() != 1 || !(one == t.layers[0]))
      throw std::runtime_error("read_trace and read_trace_layers disagree");
  }
}

} // namespace

int main(int argc, char** argv) {
  const bool each_format = argc > 1 && std::string(argv[1]) == "--each-format";
  const int first_page = each_format ? 2 : 1;
  if (argc <= first_page) {
    std::cerr << "usage: format_check [--each-format] <page.md>...\n";
    return 2;
  }
  int failures = 0;
  std::map<std::string, int> checked;
  auto fail = [&](const std::string& where, const std::string& what) {
    std::cerr << where << ": " << what << '\n';
    ++failures;
  };
  for (int a = first_page; a < argc; ++a) {
    const std::string page = argv[a];
    const auto md = read_lines(page);
    if (!md) {
      fail(page, "cannot read");
      continue;
    }
    std::string announced; // the format announced for the next block, if any
    std::size_t announced_at = 0;
    for (std::size_t i = 0; i < md->size(); ++i) {
      const std::string where = page + ":" + std::to_string(i + 1);
      if (const auto format = parse_announcement((*md)[i])) {
        if (std::find(formats.begin(), formats.end(), *format) == formats.end()) {
          fail(where, "unknown format '" + *format + "' (want '<!-- format: <name> -->' with " +
                          "weave-cluster or weave-trace)");
          continue;
        }
        if (i + 1 >= md->size() || !is_fence((*md)[i + 1])) {
          fail(where, "the format comment is not followed by a ``` block");
          continue;
        }
        announced = *format;
        announced_at = i + 1;
        continue;
      }
      if (!is_fence((*md)[i]))
        continue;
      lines block;
      std::size_t j = i + 1;
      for (; j < md->size() && trim((*md)[j]) != "```"; ++j)
        block.push_back((*md)[j]);
      if (j == md->size()) {
        fail(where, "unterminated ``` block");
        break;
      }
      const std::string format = announced;
      const std::size_t at = announced_at;
      announced.clear();
      i = j; // past the closing fence
      if (format.empty()) {
        const std::string magic = magic_of(block);
        if (!magic.empty())
          fail(where,
               "an example " + magic + " file without '<!-- format: " + magic + " -->' before it");
        continue;
      }
      try {
        check_example(format, join(block));
        ++checked[format];
      } catch (const std::exception& e) {
        fail(page + ":" + std::to_string(at + 1),
             "the " + format + " example does not parse: " + e.what());
      }
    }
  }
  if (each_format)
    for (const std::string& f : formats)
      if (checked[f] == 0)
        fail("docs", "no example of a " + f + " file");
  int total = 0;
  for (const auto& [format, n] : checked)
    total += n;
  std::cout << total << " example files parsed, " << failures << " problems\n";
  return failures == 0 && total > 0 ? 0 : 1;
}
