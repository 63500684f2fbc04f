// Must not compile: `not_a_tensor` has no tensor_traits specialisation.
#include <weave/core/tensor.hpp>

struct not_a_tensor {
  float values[4];
};

int main() {
  not_a_tensor t{};
  auto view = weave::make_token_view(t);
  return static_cast<int>(view.rows());
}
