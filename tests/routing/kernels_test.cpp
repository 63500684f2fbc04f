// gather_rows / merge_rows against element-by-element loops, for f32, bf16 and f16 rows, packed
// and strided, directly and on a host_stream; bad input gets the right error code.
#include <doctest/doctest.h>

#include <weave/core/host_matrix.hpp>
#include <weave/routing/kernels_async.hpp>

#include <random>
#include <vector>

namespace {

template <class T>
weave::host_matrix<T> random_rows(std::size_t rows, std::size_t cols, std::mt19937& rng) {
  weave::host_matrix<T> m(rows, cols);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& v : m.elements())
    v = T(normal(rng));
  return m;
}

template <class T>
void check_kernels(std::mt19937& rng) {
  for (int trial = 0; trial < 20; ++trial) {
    const std::size_t n_src = 1 + rng() % 50, n_dst = rng() % 60, cols = 1 + rng() % 600;
    const int k = 1 + static_cast<int>(rng() % 5);
    const auto src = random_rows<T>(n_src, cols, rng);
    std::vector<std::int64_t> index(n_dst), merge_index(n_dst * static_cast<std::size_t>(k));
    std::vector<float> scale(n_dst), weight(merge_index.size());
    for (std::size_t i = 0; i < n_dst; ++i) {
      index[i] = static_cast<std::int64_t>(rng() % n_src);
      scale[i] = std::uniform_real_distribution<float>(-2, 2)(rng);
    }
    for (std::size_t i = 0; i < merge_index.size(); ++i) {
      merge_index[i] = rng() % 4 == 0 ? -1 : static_cast<std::int64_t>(rng() % n_src);
      weight[i] = std::uniform_real_distribution<float>(0, 1)(rng);
    }
    weave::host_matrix<T> gathered(n_dst, cols), scaled(n_dst, cols), merged(n_dst, cols),
        summed(n_dst, cols);
    weave::gather_rows(src.view(), gathered.view(), index);
    weave::gather_rows(src.view(), scaled.view(), index, scale);
    weave::merge_rows(src.view(), merged.view(), merge_index, k, weight);
    weave::merge_rows(src.view(), summed.view(), merge_index, k);
    for (std::size_t i = 0; i < n_dst; ++i)
      for (std::size_t c = 0; c < cols; ++c) {
        const T x = src(static_cast<std::size_t>(index[i]), c);
        REQUIRE(gathered(i, c) == x);
        REQUIRE(scaled(i, c) == T(scale[i] * static_cast<float>(x)));
        float acc = 0, plain = 0;
        for (int j = 0; j < k; ++j) {
          const auto q = i * static_cast<std::size_t>(k) + static_cast<std::size_t>(j);
          if (merge_index[q] < 0)
            continue;
          const float v = static_cast<float>(src(static_cast<std::size_t>(merge_index[q]), c));
          acc += weight[q] * v;
          plain += v;
        }
        REQUIRE(merged(i, c) == T(acc));
        REQUIRE(summed(i, c) == T(plain));
      }
  }
}

} // namespace

TEST_CASE("gather_rows and merge_rows equal element-wise loops (f32, bf16, f16)") {
  std::mt19937 rng(2);
  check_kernels<float>(rng);
  check_kernels<weave::bfloat16>(rng);
  check_kernels<weave::half>(rng);
}

TEST_CASE("kernels read and write strided views and run in order on a host_stream") {
  std::mt19937 rng(4);
  auto wide = random_rows<float>(10, 12, rng);
  // Columns 2..9 of each row, as a strided view.
  const weave::const_token_view src(reinterpret_cast<const std::byte*>(wide.data() + 2), 10, 8,
                                    weave::dtype::f32, weave::memory_space::host, -1,
                                    12 * sizeof(float));
  weave::host_matrix<float> dst_wide(4, 16, 9.0f);
  const weave::token_view dst(reinterpret_cast<std::byte*>(dst_wide.data() + 4), 4, 8,
                              weave::dtype::f32, weave::memory_space::host, -1, 16 * sizeof(float));
  const std::vector<std::int64_t> index = {9, 0, 3, 3};
  weave::host_matrix<float> merged(2, 8);
  const std::vector<std::int64_t> pairs = {0, 2, -1, 1};
  {
    weave::host_stream stream;
    weave::gather_rows(stream, src, dst, index);
    weave::merge_rows(stream, dst, merged.view(), pairs, 2); // reads the gather's output
    stream.synchronize();
  }
  for (std::size_t i = 0; i < 4; ++i)
    for (std::size_t c = 0; c < 16; ++c)
      CHECK(dst_wide(i, c) ==
            (c >= 4 && c < 12 ? wide(static_cast<std::size_t>(index[i]), c - 2) : 9.0f));
  for (std::size_t c = 0; c < 8; ++c) {
    CHECK(merged(0, c) == wide(9, c + 2) + wide(3, c + 2));
    CHECK(merged(1, c) == wide(0, c + 2));
  }
}

TEST_CASE("kernels reject bad input with the right error code") {
  auto code = [](auto&& f) {
    try {
      f();
    } catch (const weave::error& e) {
      return e.code();
    }
    return weave::errc::internal;
  };
  weave::host_matrix<float> src(4, 8), dst(2, 8), narrow(2, 7);
  weave::host_matrix<weave::bfloat16> other(2, 8);
  weave::host_matrix<std::int32_t> ints(4, 8), int_dst(2, 8);
  std::vector<std::int64_t> index = {0, 3};
  CHECK(code([&] { weave::gather_rows(src.view(), dst.view(), index); }) == weave::errc::internal);
  CHECK(code([&] { weave::gather_rows(ints.view(), int_dst.view(), index); }) ==
        weave::errc::internal);
  index[1] = 4;
  CHECK(code([&] { weave::gather_rows(src.view(), dst.view(), index); }) ==
        weave::errc::out_of_range);
  index[1] = -1;
  CHECK(code([&] { weave::gather_rows(src.view(), dst.view(), index); }) ==
        weave::errc::out_of_range);
  index[1] = 1;
  CHECK(code([&] { weave::gather_rows(src.view(), narrow.view(), index); }) ==
        weave::errc::size_mismatch);
  CHECK(code([&] { weave::gather_rows(src.view(), other.view(), index); }) ==
        weave::errc::invalid_argument);
  CHECK(code([&] { weave::gather_rows(src.view(), dst.view(), std::span(index).first(1)); }) ==
        weave::errc::size_mismatch);
  const std::vector<float> scale(1, 1.0f);
  CHECK(code([&] { weave::gather_rows(src.view(), dst.view(), index, scale); }) ==
        weave::errc::size_mismatch);
  const std::vector<float> scale2(2, 1.0f);
  CHECK(code([&] { weave::gather_rows(ints.view(), int_dst.view(), index, scale2); }) ==
        weave::errc::not_supported);
  std::vector<std::int64_t> pairs = {0, -1, 2, 3};
  CHECK(code([&] { weave::merge_rows(src.view(), dst.view(), pairs, 2); }) ==
        weave::errc::internal);
  CHECK(code([&] { weave::merge_rows(src.view(), dst.view(), pairs, 3); }) ==
        weave::errc::size_mismatch);
  CHECK(code([&] { weave::merge_rows(ints.view(), int_dst.view(), pairs, 2); }) ==
        weave::errc::not_supported);
  pairs[0] = -2;
  CHECK(code([&] { weave::merge_rows(src.view(), dst.view(), pairs, 2); }) ==
        weave::errc::out_of_range);
  const weave::const_token_view device(reinterpret_cast<const std::byte*>(src.data()), 4, 8,
                                       weave::dtype::f32, weave::memory_space::device, 0);
  CHECK(code([&] { weave::gather_rows(device, dst.view(), index); }) ==
        weave::errc::invalid_argument);
}
