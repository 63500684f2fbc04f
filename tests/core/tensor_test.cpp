#include <doctest/doctest.h>

#include <weave/core/host_matrix.hpp>
#include <weave/core/tensor.hpp>

#include <array>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

namespace user {
// A trainer's own tensor: strided rows inside a wider buffer, on "device" 3.
struct strided_tensor {
  std::vector<std::uint16_t> storage;
  std::int64_t n_rows, n_cols, stride_elems;
};
} // namespace user

template <>
struct weave::tensor_traits<user::strided_tensor> {
  static void* data(user::strided_tensor& t) { return t.storage.data(); }
  static const void* data(const user::strided_tensor& t) { return t.storage.data(); }
  static std::int64_t rows(const user::strided_tensor& t) { return t.n_rows; }
  static std::int64_t cols(const user::strided_tensor& t) { return t.n_cols; }
  static weave::dtype element_type(const user::strided_tensor&) { return weave::dtype::bf16; }
  static weave::memory_space space(const user::strided_tensor&) {
    return weave::memory_space::pinned;
  }
  static int device(const user::strided_tensor&) { return 3; }
  static std::int64_t row_stride_bytes(const user::strided_tensor& t) { return t.stride_elems * 2; }
};

TEST_CASE("a user-defined tensor type is borrowed through tensor_traits") {
  user::strided_tensor t{std::vector<std::uint16_t>(5 * 8), 5, 6, 8};
  for (std::size_t i = 0; i < t.storage.size(); ++i)
    t.storage[i] = static_cast<std::uint16_t>(i);
  weave::token_view v = weave::make_token_view(t);
  CHECK(v.rows() == 5);
  CHECK(v.cols() == 6);
  CHECK(v.row_bytes() == 12);
  CHECK(v.row_stride() == 16);
  CHECK_FALSE(v.packed());
  CHECK(v.device() == 3);
  CHECK(v.space() == weave::memory_space::pinned);
  auto row2 = v.row_as<weave::bfloat16>(2);
  CHECK(row2.size() == 6);
  CHECK(row2[0].bits == 16);
  CHECK(row2[5].bits == 21);
  CHECK_THROWS_AS((void)v.row_as<float>(0), weave::error);

  const user::strided_tensor& ct = t;
  auto cv = weave::make_token_view(ct);
  static_assert(std::is_same_v<decltype(cv), weave::const_token_view>);
  CHECK(cv.row(4) == reinterpret_cast<const std::byte*>(t.storage.data() + 32));
}

TEST_CASE("vector and span adapters view flat storage as rows") {
  std::vector<float> flat(12);
  for (std::size_t i = 0; i < flat.size(); ++i)
    flat[i] = static_cast<float>(i);
  auto v = weave::make_token_view(flat, 4);
  static_assert(std::is_same_v<decltype(v), weave::token_view>);
  CHECK(v.rows() == 3);
  CHECK(v.element_type() == weave::dtype::f32);
  CHECK(v.row_as<float>(2)[1] == 9.0f);
  v.row_as<float>(1)[0] = -1.0f;
  CHECK(flat[4] == -1.0f);

  const std::vector<float>& cflat = flat;
  auto cv = weave::make_token_view(cflat, 6);
  static_assert(std::is_same_v<decltype(cv), weave::const_token_view>);
  CHECK(cv.rows() == 2);

  std::array<std::int32_t, 6> ints{};
  auto iv = weave::make_token_view(std::span(ints), 3, weave::memory_space::managed, 1);
  CHECK(iv.element_type() == weave::dtype::i32);
  CHECK(iv.space() == weave::memory_space::managed);
  CHECK_THROWS_AS((void)weave::make_token_view(flat, 5), weave::error);
  CHECK_THROWS_AS((void)weave::make_token_view(flat, 0), weave::error);
}

TEST_CASE("subrows slices rows and rejects ranges past the end") {
  weave::host_matrix<float> m(10, 3);
  for (std::size_t r = 0; r < 10; ++r)
    m(r, 0) = static_cast<float>(r);
  auto v = m.view();
  auto s = v.subrows(4, 3);
  CHECK(s.rows() == 3);
  CHECK(s.row_as<float>(0)[0] == 4.0f);
  CHECK(v.subrows(10, 0).rows() == 0);
  CHECK_THROWS_AS((void)v.subrows(8, 3), weave::error);
  CHECK_THROWS_AS((void)v.subrows(11, 0), weave::error);
  weave::const_token_view cv = v; // mutable -> const conversion
  CHECK(cv.rows() == 10);
}

TEST_CASE("token_view rejects inconsistent shapes") {
  float x[4]{};
  auto* data = reinterpret_cast<std::byte*>(x);
  CHECK_THROWS_AS(
      weave::token_view(data, 2, 2, weave::dtype::f32, weave::memory_space::host, -1, 4),
      weave::error); // stride shorter than a row
  CHECK_THROWS_AS(weave::token_view(nullptr, 2, 2, weave::dtype::f32), weave::error);
  CHECK_THROWS_AS(weave::token_view(data, std::size_t{1} << 62, 8, weave::dtype::f64),
                  weave::error); // byte size overflows
  CHECK_NOTHROW(weave::token_view(nullptr, 0, 2, weave::dtype::f32));
}
