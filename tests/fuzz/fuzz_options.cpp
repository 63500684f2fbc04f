// Command-line options (examples/support/command_line.hpp, which every example and tool parses
// with): any argument list, NUL-separated in the input, is parsed or refused with a one-line
// cli::bad_option; what is parsed lies in the declared ranges; the usage is generated whatever
// was parsed.
#include "command_line.hpp"
#include "fuzz_support.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  std::vector<std::string_view> args;
  for (std::size_t start = 0; start <= text.size() && args.size() < 64;) {
    const std::size_t end = std::min(text.find('\0', start), text.size());
    args.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  int ranks = 4;
  std::int64_t tokens = 1024;
  std::uint32_t chunks = 2;
  double factor = 1.25;
  float scale = 1.0f;
  std::vector<int> degrees{1, 2};
  std::vector<double> limits;
  std::string path, mode = "dynamic";
  std::vector<std::string> modes{"flat"};
  bool quiet = false;
  cli::options o("fuzz_options", "every kind of option the programs declare");
  o.number("ranks", ranks, 1, 4096, "ranks")
      .number("tokens", tokens, std::int64_t{0}, std::int64_t{1} << 26, "tokens per rank")
      .number("chunks", chunks, 1u, 64u, "chunks")
      .number("factor", factor, 0.0, 64.0, "capacity factor")
      .number("scale", scale, 1e-3f, 1e3f, "scale")
      .numbers("degrees", degrees, 1, 64, 16, "degrees")
      .numbers("limits", limits, 0.0, 1e9, 8, "limits")
      .text("trace", path, "FILE", "a trace")
      .choice("mode", mode, {"static", "dynamic", "decode"}, "mode")
      .choices("all-to-all", modes, {"flat", "2dh", "node-limited"}, 3, "kinds")
      .flag("quiet", quiet, "quiet");
  std::ostringstream help;
  try {
    o.parse(args, help);
  } catch (const cli::bad_option& e) {
    const std::string_view message = e.what();
    WEAVE_FUZZ_CHECK(!message.empty() && message.find('\n') == message.npos);
    return 0;
  }
  WEAVE_FUZZ_CHECK(ranks >= 1 && ranks <= 4096);
  WEAVE_FUZZ_CHECK(tokens >= 0 && tokens <= (std::int64_t{1} << 26));
  WEAVE_FUZZ_CHECK(chunks >= 1 && chunks <= 64);
  WEAVE_FUZZ_CHECK(std::isfinite(factor) && factor >= 0.0 && factor <= 64.0);
  WEAVE_FUZZ_CHECK(std::isfinite(scale) && scale >= 1e-3f && scale <= 1e3f);
  WEAVE_FUZZ_CHECK(degrees.size() <= 16);
  for (const int d : degrees)
    WEAVE_FUZZ_CHECK(d >= 1 && d <= 64);
  WEAVE_FUZZ_CHECK(limits.size() <= 8);
  for (const double l : limits)
    WEAVE_FUZZ_CHECK(std::isfinite(l) && l >= 0.0 && l <= 1e9);
  WEAVE_FUZZ_CHECK(mode == "static" || mode == "dynamic" || mode == "decode");
  WEAVE_FUZZ_CHECK(modes.size() <= 3);
  WEAVE_FUZZ_CHECK(!o.usage().empty());
  return 0;
}
