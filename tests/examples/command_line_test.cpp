#include <doctest/doctest.h>

#include "command_line.hpp"

#include <cstdint>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace {

// The message of the bad_option `f` throws; "" when it throws none.
template <class F>
std::string refusal(F&& f) {
  try {
    f();
  } catch (const cli::bad_option& e) {
    return e.what();
  }
  return "";
}

bool parse(cli::options& o, std::vector<std::string_view> args) {
  std::ostringstream help;
  return o.parse(args, help);
}

} // namespace

TEST_CASE("numbers parse into their own type and range, or are refused naming the option") {
  CHECK(cli::parse_number<int>("--n", "42", 1, 100) == 42);
  CHECK(cli::parse_number<int>("--n", "-5", -10, 10) == -5);
  CHECK(cli::parse_number<std::uint64_t>("--seed", "18446744073709551615", 0,
                                         std::numeric_limits<std::uint64_t>::max()) ==
        std::numeric_limits<std::uint64_t>::max());
  CHECK(cli::parse_number<double>("--x", "1e3", 0.0, 1e4) == 1000.0);
  CHECK(cli::parse_number<double>("--x", "0.5", 0.0, 1.0) == 0.5);
  // Out of the type (no narrowing, no wrap), out of the range, garbage, empty, signs,
  // white space, NaN and infinities: all refused, the message naming the option and the text.
  for (const char* text : {"4294967297", "99999999999999999999", "0", "101", "-1", "4x", "", "x4",
                           " 4", "4 ", "+4", "0x10", "1.5", "1e2"})
    CHECK(refusal([&] { (void)cli::parse_number<int>("--nodes", text, 1, 100); }) ==
          std::string("--nodes: expected an integer in [1, 100], got '") + text + "'");
  CHECK(refusal([] { (void)cli::parse_number<std::size_t>("--t", "-1", 0, 10); }) != "");
  CHECK(refusal([] {
          (void)cli::parse_number<std::uint32_t>("--s", "4294967296", 0, 4294967295u);
        }) != "");
  for (const char* text : {"nan", "-nan", "inf", "-inf", "infinity", "1e999", "2", "-0.5", "", "."})
    CHECK(refusal([&] { (void)cli::parse_number<double>("--affinity", text, 0.0, 1.0); }) ==
          std::string("--affinity: expected a number in [0, 1], got '") + text + "'");
}

TEST_CASE("echoed text is one printable line of bounded length") {
  CHECK(cli::printable("abc") == "abc");
  CHECK(cli::printable("a\nb\tc\x7f") == "a\\x0ab\\x09c\\x7f");
  CHECK(cli::printable("\xff") == "\\xff");
  CHECK(cli::printable(std::string(100, 'x')) == std::string(60, 'x') + "...");
  CHECK(refusal([] { (void)cli::parse_number<int>("--k", "1\n2", 1, 9); }) ==
        "--k: expected an integer in [1, 9], got '1\\x0a2'");
}

TEST_CASE("options: both spellings, lists, choices, flags, and the last occurrence wins") {
  int n = 4;
  double x = 0.5;
  std::vector<int> list = {1, 2};
  std::vector<std::string> algos = {"flat"};
  std::string mode = "a", path;
  bool flag = false;
  cli::options o("tool", "A tool.");
  o.number("n", n, 1, 64, "count")
      .number("x", x, 0.0, 1.0, "fraction")
      .numbers("list", list, 0, 9, 3, "values")
      .choices("algos", algos, {"flat", "hierarchical"}, 2, "algorithms")
      .choice("mode", mode, {"a", "b"}, "mode")
      .text("path", path, "PATH", "a file")
      .flag("flag", flag, "a switch");
  CHECK(parse(o, {"--n=8", "--x", "0.25", "--list=3,0,9", "--algos", "hierarchical,flat",
                  "--mode=b", "--path", "--n", "--flag", "--n", "9"}));
  CHECK(n == 9);
  CHECK(x == 0.25);
  CHECK(list == std::vector<int>{3, 0, 9});
  CHECK(algos == std::vector<std::string>{"hierarchical", "flat"});
  CHECK(mode == "b");
  CHECK(path == "--n"); // a value may look like an option
  CHECK(flag);
  CHECK(parse(o, {"--path="}));
  CHECK(path.empty());
}

TEST_CASE("options: every bad command line is refused with one line naming the option") {
  int n = 4;
  std::vector<int> list;
  std::vector<std::string> algos = {"flat"};
  std::string mode = "a";
  bool flag = false;
  cli::options o("tool", "");
  o.number("n", n, 1, 64, "count")
      .numbers("list", list, 0, 9, 3, "values")
      .choices("algos", algos, {"flat", "hierarchical"}, 2, "algorithms")
      .choice("mode", mode, {"a", "b"}, "mode")
      .flag("flag", flag, "a switch");
  const std::vector<std::pair<std::vector<std::string_view>, std::string>> cases = {
      {{"--n=0"}, "--n: expected an integer in [1, 64], got '0'"},
      {{"--n", "65"}, "--n: expected an integer in [1, 64], got '65'"},
      {{"--n"}, "--n needs a value (see --help)"},
      {{"--n="}, "--n: expected an integer in [1, 64], got ''"},
      {{"--list=1,,2"}, "--list: empty item in the list '1,,2'"},
      {{"--list=1,2,"}, "--list: empty item in the list '1,2,'"},
      {{"--list="}, "--list: empty item in the list ''"},
      {{"--list=1,2,3,4"}, "--list: more than 3 items in '1,2,3,4'"},
      {{"--list=1,-2"}, "--list: expected an integer in [0, 9], got '-2'"},
      {{"--algos=flat,ring"}, "--algos: expected one of flat, hierarchical, got 'ring'"},
      {{"--mode", "c"}, "--mode: expected one of a, b, got 'c'"},
      {{"--flag=1"}, "--flag takes no value, got '--flag=1'"},
      {{"--bogus=1"}, "unknown option '--bogus' (see --help)"},
      {{"--"}, "unexpected argument '--' (see --help)"},
      {{"-n"}, "unexpected argument '-n' (see --help)"},
      {{"stray"}, "unexpected argument 'stray' (see --help)"},
  };
  for (const auto& c : cases) { // no structured binding: CAPTURE's lambda (clang 14)
    const std::string& message = c.second;
    CAPTURE(message);
    CHECK(refusal([&] { parse(o, c.first); }) == message);
  }
  CHECK(n == 4); // refused values are not stored
}

TEST_CASE("--help prints the usage with every range and default, and stops the parse") {
  int n = 4;
  double x = 0.5;
  std::vector<std::int64_t> degrees = {1, 2};
  cli::options o("tool", "Does things.\nTwo lines.");
  o.section("group:");
  o.number("n", n, 1, 64, "count").number("x", x, 0.0, 1.0, "fraction");
  o.numbers("degrees", degrees, std::int64_t{1}, std::int64_t{64}, 16, "degrees");
  std::ostringstream help;
  const std::vector<std::string_view> args = {"--n=2", "--help", "--bogus"};
  CHECK_FALSE(o.parse(args, help));
  CHECK(n == 2);
  const std::string text = help.str();
  CHECK(text.rfind("usage: tool [options]\nDoes things.\nTwo lines.\n\ngroup:\n", 0) == 0);
  CHECK(text.find("--n N") != std::string::npos);
  CHECK(text.find("count, in [1, 64] (default 4)") != std::string::npos);
  CHECK(text.find("fraction, in [0, 1] (default 0.5)") != std::string::npos);
  CHECK(text.find("degrees, each in [1, 64], at most 16 (default 1,2)") != std::string::npos);
  CHECK(text.find("Exit status: 0 success, 1 failure, 2 bad options") != std::string::npos);
}

TEST_CASE("run_main turns every escaping exception into a status") {
  CHECK(cli::run_main("t", [] { return 0; }) == 0);
  CHECK(cli::run_main("t", [] { return 3; }) == 3);
  CHECK(cli::run_main("t", []() -> int { throw cli::bad_option("--n: bad"); }) == 2);
  CHECK(cli::run_main("t", []() -> int { throw std::runtime_error("line 1\nline 2"); }) == 1);
  CHECK(cli::run_main("t", []() -> int { throw 42; }) == 1);
  CHECK(cli::run_main(
            "t", []() -> int { throw cli::bad_option("--n: bad"); }, false) == 2);
  CHECK(cli::run_main("t", []() -> int { throw std::runtime_error(std::string(5000, 'x')); }) == 1);
}
