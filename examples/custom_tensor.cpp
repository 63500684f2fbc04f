// Adapting a tensor type weave has never seen: specialise weave::tensor_traits once, then every
// weave API that takes token rows accepts it.
#include <weave/core/tensor.hpp>

#include <cstdio>
#include <vector>

namespace mylib {
// A minimal framework tensor: row-major fp32 with a shape.
struct tensor {
  std::vector<float> values;
  long shape[2];
};
} // namespace mylib

template <>
struct weave::tensor_traits<mylib::tensor> {
  static void* data(mylib::tensor& t) { return t.values.data(); }
  static const void* data(const mylib::tensor& t) { return t.values.data(); }
  static long rows(const mylib::tensor& t) { return t.shape[0]; }
  static long cols(const mylib::tensor& t) { return t.shape[1]; }
  static weave::dtype element_type(const mylib::tensor&) { return weave::dtype::f32; }
  static weave::memory_space space(const mylib::tensor&) { return weave::memory_space::host; }
};

int main() {
  mylib::tensor t{std::vector<float>(6 * 3, 1.5f), {6, 3}};
  weave::token_view rows = weave::make_token_view(t);
  float total = 0;
  for (std::size_t r = 0; r < rows.rows(); ++r)
    for (float x : rows.row_as<float>(r))
      total += x;
  std::printf("%zu tokens x %zu, sum %.1f\n", rows.rows(), rows.cols(), total);
  return total == 27.0f ? 0 : 1;
}
