// Checks that the code snippets of the docs are the code of compiled tests and examples.
//
// A snippet in a Markdown page is announced by a comment naming a source file and a region,
// followed by a fenced code block:
//
//   <!-- snippet: tests/routing/example_test.cpp [dispatch] -->
//   ```cpp
//   ...
//   ```
//
// The region is the text between two lines `//! [dispatch]` of that file (Doxygen's \snippet
// markers; `#! [dispatch]` in CMake and shell files). The block must equal it line for line, after
// removing the region's common indentation and trailing white space. Usage: snippet_check
// [--update] <source root> <page.md>... Exits 1 naming every stale snippet, missing region or
// malformed announcement; with --update it rewrites stale blocks from their regions instead (the
// other problems still fail).
#include <algorithm>
#include <cstddef>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace {

using lines = std::vector<std::string>;

std::optional<lines> read_lines(const std::filesystem::path& path) {
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

std::string trim_right(std::string s) {
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t'))
    s.pop_back();
  return s;
}

std::string trim(const std::string& s) {
  const auto first = s.find_first_not_of(" \t");
  return first == std::string::npos ? std::string() : trim_right(s.substr(first));
}

// The lines between the two `//! [name]` (or `#! [name]`) markers, dedented; nullopt if not
// exactly one region.
std::optional<lines> region(const lines& source, const std::string& name, std::string& why) {
  const std::string marker = "//! [" + name + "]", hash_marker = "#! [" + name + "]";
  std::vector<std::size_t> at;
  for (std::size_t i = 0; i < source.size(); ++i)
    if (trim(source[i]) == marker || trim(source[i]) == hash_marker)
      at.push_back(i);
  if (at.size() != 2) {
    why = "expected 2 lines '" + marker + "', found " + std::to_string(at.size());
    return std::nullopt;
  }
  lines body(source.begin() + static_cast<std::ptrdiff_t>(at[0]) + 1,
             source.begin() + static_cast<std::ptrdiff_t>(at[1]));
  std::size_t indent = std::string::npos;
  for (const std::string& l : body)
    if (!trim(l).empty())
      indent = std::min(indent, l.find_first_not_of(" \t"));
  for (std::string& l : body)
    l = trim(l).empty() ? std::string() : trim_right(l.substr(indent));
  return body;
}

struct announcement {
  std::string file, name;
};

// Parses `<!-- snippet: <file> [<name>] -->`.
std::optional<announcement> parse_announcement(const std::string& line) {
  const std::string t = trim(line), open = "<!-- snippet:", close = "-->";
  if (t.rfind(open, 0) != 0 || t.size() < open.size() + close.size() ||
      t.compare(t.size() - close.size(), close.size(), close) != 0)
    return std::nullopt;
  const std::string inner = trim(t.substr(open.size(), t.size() - open.size() - close.size()));
  const auto lb = inner.find(" ["), rb = inner.rfind(']');
  if (lb == std::string::npos || rb != inner.size() - 1 || rb <= lb + 2)
    return announcement{};
  return announcement{trim(inner.substr(0, lb)), inner.substr(lb + 2, rb - lb - 2)};
}

} // namespace

int main(int argc, char** argv) {
  const bool update = argc > 1 && std::string(argv[1]) == "--update";
  const int first_arg = update ? 2 : 1;
  if (argc < first_arg + 2) {
    std::cerr << "usage: snippet_check [--update] <source root> <page.md>...\n";
    return 2;
  }
  const std::filesystem::path root = argv[first_arg];
  std::map<std::string, lines> sources;
  int failures = 0, checked = 0;
  auto fail = [&](const std::string& where, const std::string& what) {
    std::cerr << where << ": " << what << '\n';
    ++failures;
  };
  for (int a = first_arg + 1; a < argc; ++a) {
    const std::filesystem::path page = argv[a];
    auto md = read_lines(page);
    if (!md) {
      fail(page.string(), "cannot read");
      continue;
    }
    bool rewritten = false;
    for (std::size_t i = 0; i < md->size(); ++i) {
      const auto ann = parse_announcement((*md)[i]);
      if (!ann)
        continue;
      const std::string where = page.string() + ":" + std::to_string(i + 1);
      if (ann->file.empty()) {
        fail(where, "malformed snippet comment (want '<!-- snippet: <file> [<name>] -->')");
        continue;
      }
      if (i + 1 >= md->size() || trim((*md)[i + 1]).rfind("```", 0) != 0) {
        fail(where, "the snippet comment is not followed by a ``` block");
        continue;
      }
      lines block;
      std::size_t j = i + 2;
      for (; j < md->size() && trim((*md)[j]) != "```"; ++j)
        block.push_back(trim_right((*md)[j]));
      if (j == md->size()) {
        fail(where, "unterminated ``` block");
        continue;
      }
      if (!sources.count(ann->file)) {
        const auto src = read_lines(root / ann->file);
        if (!src) {
          fail(where, "cannot read " + ann->file);
          continue;
        }
        sources[ann->file] = *src;
      }
      std::string why;
      const auto expected = region(sources[ann->file], ann->name, why);
      if (!expected) {
        fail(where, ann->file + " [" + ann->name + "]: " + why);
        continue;
      }
      ++checked;
      if (block == *expected)
        continue;
      if (update) {
        md->erase(md->begin() + static_cast<std::ptrdiff_t>(i) + 2,
                  md->begin() + static_cast<std::ptrdiff_t>(j));
        md->insert(md->begin() + static_cast<std::ptrdiff_t>(i) + 2, expected->begin(),
                   expected->end());
        rewritten = true;
        std::cout << where << ": updated from " << ann->file << " [" << ann->name << "]\n";
        continue;
      }
      std::size_t k = 0;
      while (k < block.size() && k < expected->size() && block[k] == (*expected)[k])
        ++k;
      fail(where, "snippet differs from " + ann->file + " [" + ann->name + "] at its line " +
                      std::to_string(k + 1) +
                      ":\n  page:   " + (k < block.size() ? block[k] : "<end>") +
                      "\n  source: " + (k < expected->size() ? (*expected)[k] : "<end>"));
    }
    if (rewritten) {
      std::ofstream out(page, std::ios::trunc);
      for (const std::string& l : *md)
        out << l << '\n';
      if (!out)
        fail(page.string(), "cannot write");
    }
  }
  std::cout << checked << " snippets checked, " << failures << " problems\n";
  return failures == 0 && checked > 0 ? 0 : 1;
}
