// Runner for CUDA tests: without a usable GPU it reports the whole executable as skipped
// (exit 77, CTest's SKIP_RETURN_CODE) instead of passing vacuously. doctest's queries (help,
// version, counting and listing test cases) run without a GPU: bench/gpu/run.sh lists the cases
// of the carried binaries on a machine that has none.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <weave/core/cuda_error.hpp>

#include <cstdio>
#include <string_view>

namespace {

// doctest's query options, long or short, with or without the "dt-" prefix.
bool is_query(std::string_view arg) {
  while (!arg.empty() && arg.front() == '-')
    arg.remove_prefix(1);
  if (arg.starts_with("dt-"))
    arg.remove_prefix(3);
  arg = arg.substr(0, arg.find('='));
  for (const std::string_view q :
       {"?", "h", "help", "v", "version", "c", "count", "ltc", "list-test-cases", "lts",
        "list-test-suites", "lr", "list-reporters"})
    if (arg == q)
      return true;
  return false;
}

} // namespace

int main(int argc, char** argv) {
  bool query = false;
  for (int i = 1; i < argc; ++i)
    query = query || is_query(argv[i]);
  if (!query && weave::cuda_device_count() == 0) {
    std::printf("skipped: no GPU\n");
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
