// Command-line options for weave's examples, tools and benchmark drivers.
//
// Every program that takes options declares them here with their type and their range, and
// gets the same behaviour: `--name=value` or `--name value`; numbers parsed by `std::from_chars`
// straight into the option's type (no narrowing, no sign wrap, no garbage suffix such as `4x`,
// no silently ignored overflow) and checked against a closed range; lists as `a,b,c` with a
// bounded length; unknown options, missing values and stray arguments refused; `--help` prints
// a usage generated from the declarations, so the documented ranges are the enforced ones. A
// later occurrence of an option replaces an earlier one.
//
// A bad command line throws `cli::bad_option`, whose message is one line naming the option.
// `cli::run_main` wraps a program's body: a `bad_option` becomes "<program>: <message>" on
// stderr and exit status 2; any other exception (a `weave::error` included) the same line and
// status 1. So a program never crashes, aborts or lets an exception escape on bad input. (Under
// mpirun only rank 0 needs to say it: `first_or_only_process`.) The parser itself never exits
// or prints, so it can be driven by tests and fuzzers.
//
// Not part of weave's public API: a helper of this repository's programs (header-only, no
// dependency on weave).
#pragma once

#include <algorithm>
#include <charconv>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <iostream>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

namespace cli {

//! A bad command line; `what()` is one line naming the option.
class bad_option : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

//! `text` as it may be echoed in a one-line message: bytes outside printable ASCII as `\xNN`,
//! cut after 60 characters.
inline std::string printable(std::string_view text) {
  constexpr std::size_t limit = 60;
  std::string out;
  for (std::size_t i = 0; i < text.size() && i < limit; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      constexpr char hex[] = "0123456789abcdef";
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  if (text.size() > limit)
    out += "...";
  return out;
}

//! A number as the usage and messages write it (the shortest form that reads back).
template <class T>
std::string to_text(T value) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, value);
  return std::string(buf, r.ptr);
}

//! Parses all of `text` as a `T` in [lo, hi] (`T` an integer or floating-point type); throws
//! `bad_option` naming `option` otherwise. NaN and infinities are outside every range.
template <class T>
T parse_number(std::string_view option, std::string_view text, T lo, T hi) {
  static_assert(std::is_arithmetic_v<T> && !std::is_same_v<T, bool>);
  T value{};
  const char* const end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  // `!(a && b)` rather than `<`/`>`: a NaN fails both comparisons and is refused.
  if (ec != std::errc{} || ptr != end || !(value >= lo && value <= hi))
    throw bad_option(std::string(option) + ": expected " +
                     (std::is_integral_v<T> ? "an integer" : "a number") + " in [" + to_text(lo) +
                     ", " + to_text(hi) + "], got '" + printable(text) + "'");
  return value;
}

//! The items of a comma-separated list; an empty item, an empty list or more than
//! `max_items` items throw `bad_option` naming `option`.
inline std::vector<std::string_view> split_list(std::string_view option, std::string_view text,
                                                std::size_t max_items) {
  std::vector<std::string_view> items;
  std::size_t start = 0;
  while (true) {
    const std::size_t comma = text.find(',', start);
    const std::string_view item = text.substr(
        start, comma == std::string_view::npos ? std::string_view::npos : comma - start);
    if (item.empty())
      throw bad_option(std::string(option) + ": empty item in the list '" + printable(text) + "'");
    items.push_back(item);
    if (items.size() > max_items)
      throw bad_option(std::string(option) + ": more than " + std::to_string(max_items) +
                       " items in '" + printable(text) + "'");
    if (comma == std::string_view::npos)
      return items;
    start = comma + 1;
  }
}

//! The options of one program; see the file comment.
class options {
 public:
  //! `program` prefixes messages and the usage; `summary` (any number of lines) follows the
  //! usage line.
  options(std::string program, std::string summary)
      : program_(std::move(program))
      , summary_(std::move(summary)) {}

  const std::string& program() const noexcept { return program_; }

  //! Starts a group of options in the usage.
  options& section(std::string title) {
    entries_.push_back({"", "", std::move(title), false, {}});
    return *this;
  }

  //! An integer or floating-point option in [lo, hi].
  template <class T>
  options& number(std::string name, T& field, T lo, T hi, std::string help) {
    help += ", in [" + to_text(lo) + ", " + to_text(hi) + "]";
    if (field >= lo && field <= hi) // else the help says what the default means
      help += " (default " + to_text(field) + ")";
    const std::string flag = "--" + name;
    return add(
        std::move(name), std::is_integral_v<T> ? "N" : "X", std::move(help), true,
        [&field, lo, hi, flag](std::string_view v) { field = parse_number<T>(flag, v, lo, hi); });
  }

  //! A comma-separated list of numbers in [lo, hi], at most `max_items` of them.
  template <class T>
  options& numbers(std::string name, std::vector<T>& field, T lo, T hi, std::size_t max_items,
                   std::string help) {
    help += ", each in [" + to_text(lo) + ", " + to_text(hi) + "], at most " +
            std::to_string(max_items);
    if (!field.empty())
      help += " (default " + join_numbers(field) + ")";
    const std::string flag = "--" + name;
    return add(std::move(name), "N,...", std::move(help), true,
               [&field, lo, hi, max_items, flag](std::string_view v) {
                 std::vector<T> parsed;
                 for (const std::string_view item : split_list(flag, v, max_items))
                   parsed.push_back(parse_number<T>(flag, item, lo, hi));
                 field = std::move(parsed);
               });
  }

  //! A free-form text option (a path, a name); `metavar` names it in the usage.
  options& text(std::string name, std::string& field, std::string metavar, std::string help) {
    if (!field.empty())
      help += " (default " + field + ")";
    return add(std::move(name), std::move(metavar), std::move(help), true,
               [&field](std::string_view v) { field = std::string(v); });
  }

  //! One of `choices`.
  options& choice(std::string name, std::string& field, std::vector<std::string> choices,
                  std::string help) {
    help += " (default " + field + ")";
    const std::string flag = "--" + name;
    std::string metavar = join(choices, "|");
    return add(std::move(name), std::move(metavar), std::move(help), true,
               [&field, choices, flag](std::string_view v) { field = pick(flag, v, choices); });
  }

  //! A comma-separated list of `choices`, at most `max_items` of them.
  options& choices(std::string name, std::vector<std::string>& field,
                   std::vector<std::string> choices, std::size_t max_items, std::string help) {
    help += " (default " + join(field, ",") + ")";
    const std::string flag = "--" + name;
    std::string metavar = join(choices, "|") + ",...";
    return add(std::move(name), std::move(metavar), std::move(help), true,
               [&field, choices, max_items, flag](std::string_view v) {
                 std::vector<std::string> parsed;
                 for (const std::string_view item : split_list(flag, v, max_items))
                   parsed.push_back(pick(flag, item, choices));
                 field = std::move(parsed);
               });
  }

  //! An option whose value `set` interprets (throwing `bad_option` for a bad one), for what
  //! the kinds above do not cover; `help` should state the accepted values.
  options& custom(std::string name, std::string metavar, std::string help,
                  std::function<void(std::string_view)> set) {
    return add(std::move(name), std::move(metavar), std::move(help), true, std::move(set));
  }

  //! An option without a value that sets `field` to true.
  options& flag(std::string name, bool& field, std::string help) {
    return add(std::move(name), "", std::move(help), false,
               [&field](std::string_view) { field = true; });
  }

  //! Parses `args` (the arguments after the program name). Returns false, having written the
  //! usage to `help_out`, for `--help` or `-h`; throws `bad_option` for a bad command line.
  bool parse(std::span<const std::string_view> args, std::ostream& help_out) {
    for (std::size_t i = 0; i < args.size(); ++i) {
      const std::string_view arg = args[i];
      if (arg == "--help" || arg == "-h") {
        help_out << usage();
        return false;
      }
      if (arg.substr(0, 2) != "--" || arg.size() == 2)
        throw bad_option("unexpected argument '" + printable(arg) + "' (see --help)");
      const std::size_t eq = arg.find('=');
      const std::string_view name = arg.substr(2, eq == std::string_view::npos ? arg.npos : eq - 2);
      const entry* e = find(name);
      if (e == nullptr)
        throw bad_option("unknown option '--" + printable(name) + "' (see --help)");
      if (!e->takes_value) {
        if (eq != std::string_view::npos)
          throw bad_option("--" + e->name + " takes no value, got '" + printable(arg) + "'");
        e->set({});
      } else if (eq != std::string_view::npos) {
        e->set(arg.substr(eq + 1));
      } else {
        if (i + 1 >= args.size())
          throw bad_option("--" + e->name + " needs a value (see --help)");
        e->set(args[++i]);
      }
    }
    return true;
  }

  //! `parse` of `argv[1]` to `argv[argc - 1]`, the usage to stdout.
  bool parse(int argc, const char* const* argv) {
    std::vector<std::string_view> args;
    for (int i = 1; i < argc; ++i)
      args.emplace_back(argv[i]);
    return parse(args, std::cout);
  }

  //! The usage: the summary and one line per option, with its range and default.
  std::string usage() const {
    std::string out = "usage: " + program_ + " [options]\n" + summary_;
    if (!summary_.empty() && summary_.back() != '\n')
      out += '\n';
    for (const entry& e : entries_) {
      if (e.name.empty()) {
        out += '\n' + e.help + '\n';
        continue;
      }
      constexpr std::size_t column = 30;
      std::string head = "  --" + e.name + (e.metavar.empty() ? "" : " " + e.metavar);
      if (head.size() + 2 > column) // a long head gets a line of its own
        head += '\n';
      head.resize(head.back() == '\n' ? head.size() + column : column, ' ');
      out += head + e.help + '\n';
    }
    out += "  --help                      this text\n"
           "Exit status: 0 success, 1 failure, 2 bad options (one line on stderr).\n";
    return out;
  }

 private:
  struct entry {
    std::string name, metavar, help;
    bool takes_value = true;
    std::function<void(std::string_view)> set;
  };

  options& add(std::string name, std::string metavar, std::string help, bool takes_value,
               std::function<void(std::string_view)> set) {
    entries_.push_back(
        {std::move(name), std::move(metavar), std::move(help), takes_value, std::move(set)});
    return *this;
  }

  const entry* find(std::string_view name) const {
    for (const entry& e : entries_)
      if (!e.name.empty() && e.name == name)
        return &e;
    return nullptr;
  }

  static std::string pick(const std::string& flag, std::string_view value,
                          const std::vector<std::string>& choices) {
    for (const std::string& c : choices)
      if (c == value)
        return c;
    throw bad_option(flag + ": expected one of " + join(choices, ", ") + ", got '" +
                     printable(value) + "'");
  }

  static std::string join(const std::vector<std::string>& items, const char* separator) {
    std::string out;
    for (const std::string& s : items)
      out += (out.empty() ? "" : separator) + s;
    return out;
  }

  template <class T>
  static std::string join_numbers(const std::vector<T>& items) {
    std::string out;
    for (const T& x : items)
      out += (out.empty() ? "" : ",") + to_text(x);
    return out;
  }

  std::string program_, summary_;
  std::vector<entry> entries_;
};

namespace detail {

// Writes "<program>: <message>\n" to stderr in one write, without allocating: control
// characters of the message as spaces (so the report is one line even when the message has
// several), cut at 2000 characters. One write keeps the line whole when processes share stderr.
inline void report(std::string_view program, const char* message) noexcept {
  char line[2048];
  std::size_t n = 0;
  const auto put = [&](char c) {
    if (n < sizeof line - 5)
      line[n++] = c;
  };
  for (const char c : program)
    put(c);
  put(':');
  put(' ');
  for (const char* p = message; *p != '\0'; ++p)
    put(static_cast<unsigned char>(*p) < 0x20 ? ' ' : *p);
  if (n == sizeof line - 5)
    for (const char c : {'.', '.', '.'})
      line[n++] = c;
  line[n++] = '\n';
  std::fwrite(line, 1, n, stderr);
}

} // namespace detail

//! Runs `body` (returning the exit status) so that nothing escapes: a `bad_option` becomes one
//! line on stderr and status 2, any other exception one line and status 1. With `report` false
//! the line is not written (e.g. on all ranks of an MPI job but one, which all see the same bad
//! option).
template <class F>
int run_main(std::string_view program, F&& body, bool report = true) noexcept {
  try {
    return std::forward<F>(body)();
  } catch (const bad_option& e) {
    if (report)
      detail::report(program, e.what());
    return 2;
  } catch (const std::exception& e) {
    if (report)
      detail::report(program, e.what());
    return 1;
  } catch (...) {
    if (report)
      detail::report(program, "an exception of unknown type");
    return 1;
  }
}

//! False in the processes of an MPI job (started by mpirun, as Open MPI and PMI-based launchers
//! say in the environment) other than rank 0: where a tool that parses its options before
//! `MPI_Init` should keep quiet, since every rank refuses the same options.
inline bool first_or_only_process() noexcept {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"})
    if (const char* rank = std::getenv(name))
      return std::string_view(rank) == "0";
  return true;
}

} // namespace cli
