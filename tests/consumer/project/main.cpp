// Uses the installed/vendored headers the way a trainer would.
#include <weave/weave.hpp>

#include <cstdio>

int main() {
  weave::host_matrix<float> m(4, 2, 1.0f);
  weave::host_stream s;
  float sum = 0;
  s.submit([&] {
    for (float x : m.elements())
      sum += x;
  });
  s.synchronize();
  std::printf("weave %d consumer: sum = %.1f\n", WEAVE_VERSION, sum);
  return sum == 8.0f ? 0 : 1;
}
