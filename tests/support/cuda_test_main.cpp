// Runner for CUDA tests: without a usable GPU it reports the whole executable as skipped
// (exit 77, CTest's SKIP_RETURN_CODE) instead of passing vacuously.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <weave/core/cuda_error.hpp>

#include <cstdio>

int main(int argc, char** argv) {
  if (weave::cuda_device_count() == 0) {
    std::printf("skipped: no GPU\n");
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
