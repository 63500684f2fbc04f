// Checks of the torch::Tensor adapter against torch's own view of the same memory: shapes,
// dtypes, strided rows (a column slice of a wider tensor), the round trip back to a tensor, and
// the rejected cases with their error codes. Exits non-zero on the first failure.
#include "torch_tensor.hpp"

#include <torch/torch.h>

#include <weave/core/error.hpp>
#include <weave/core/tensor.hpp>

#include <cstdio>
#include <cstring>
#include <functional>
#include <utility>

namespace {

int failures = 0;

void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "FAILED: %s\n", what);
    ++failures;
  }
}

void check_throws(const std::function<void()>& f, weave::errc want, const char* what) {
  try {
    f();
  } catch (const weave::error& e) {
    check(e.code() == want, what);
    return;
  }
  check(false, what);
}

// Every row of `v` must hold the bytes torch has for row r of `t`.
bool same_rows(weave::const_token_view v, const torch::Tensor& t) {
  if (v.rows() != static_cast<std::size_t>(t.size(0)) ||
      v.cols() != static_cast<std::size_t>(t.size(1)))
    return false;
  for (std::int64_t r = 0; r < t.size(0); ++r) {
    const auto row = t[r].contiguous();
    if (std::memcmp(v.row(static_cast<std::size_t>(r)), row.data_ptr(), v.row_bytes()) != 0)
      return false;
  }
  return true;
}

} // namespace

int main() {
  torch::manual_seed(3);
  const std::pair<c10::ScalarType, weave::dtype> types[] = {{torch::kFloat32, weave::dtype::f32},
                                                            {torch::kBFloat16, weave::dtype::bf16},
                                                            {torch::kFloat16, weave::dtype::f16}};
  for (const auto& [torch_type, weave_type] : types) {
    const auto t = torch::randn({7, 5}).to(torch_type);
    const weave::const_token_view v = weave::make_token_view(t);
    check(v.element_type() == weave_type, "dtype maps");
    check(v.packed() && same_rows(v, t), "packed rows match torch");
    check(torch::equal(weave_torch::as_tensor(v), t), "as_tensor round trip (packed)");

    // Columns [2, 5) of a 9-column tensor: rows 9 elements apart.
    const auto wide = torch::randn({6, 9}).to(torch_type);
    const auto slice = wide.narrow(1, 2, 3);
    const weave::const_token_view s = weave::make_token_view(slice);
    check(!s.packed() && s.row_stride() == 9 * s.row_bytes() / 3, "strided rows keep stride(0)");
    check(same_rows(s, slice), "strided rows match torch");
    check(torch::equal(weave_torch::as_tensor(s), slice), "as_tensor round trip (strided)");
  }

  // Writes through a mutable view land in the tensor.
  auto out = torch::zeros({4, 3});
  const weave::token_view w = weave::make_token_view(out);
  w.row_as<float>(2)[1] = 5.0f;
  check(out[2][1].item<float>() == 5.0f && out.sum().item<float>() == 5.0f, "writes reach torch");

  // A single row: torch may give it any stride; the view is packed.
  const auto one = torch::randn({1, 4});
  check(weave::make_token_view(one).packed(), "one row is packed");

  const auto transposed = torch::randn({4, 3}).t();
  check_throws([&] { (void)weave::make_token_view(transposed); }, weave::errc::invalid_argument,
               "transposed tensor rejected");
  const auto cube = torch::randn({2, 3, 4});
  check_throws([&] { (void)weave::make_token_view(cube); }, weave::errc::invalid_argument,
               "3-D tensor rejected");
  const auto integers = torch::zeros({2, 3}, torch::kInt64);
  check_throws([&] { (void)weave::make_token_view(integers); }, weave::errc::not_supported,
               "int64 tensor rejected");
  check_throws([] { (void)weave_torch::to_torch_dtype(weave::dtype::i8); },
               weave::errc::not_supported, "i8 has no torch token type");

  std::printf("torch adapter: %s\n", failures == 0 ? "all checks passed" : "FAILED");
  return failures == 0 ? 0 : 1;
}
