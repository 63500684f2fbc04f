// Block-scaled FP8 quantisation against a brute-force reference: per block, the scale from the
// documented definition (amax in double, the power of two by log2/ceil), every code by searching
// the nearest of the 256 FP8 values (tests/support/fp8_reference.hpp), and every dequantised
// element within the FP8 rounding bound of the original: half an FP8 ulp at the scaled
// magnitude, times the scale, plus the few f32 roundings around it.
#include <doctest/doctest.h>

#include <weave/core/host_matrix.hpp>
#include <weave/routing/gate.hpp>
#include <weave/routing/host_quant_moves.hpp>
#include <weave/routing/quantize.hpp>

#include "block_quant_reference.hpp"
#include "error_code.hpp"
#include "fp8_reference.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace {

using weave::block_quantization;
using weave::scale_rounding;

template <class Fp8>
fp8_ref::format format_of() {
  return std::is_same_v<Fp8, weave::fp8_e4m3> ? fp8_ref::e4m3 : fp8_ref::e5m2;
}

template <class T>
weave::host_matrix<T> random_rows(std::mt19937& rng, std::size_t rows, std::size_t cols,
                                  std::size_t block) {
  weave::host_matrix<T> out(rows, cols);
  std::normal_distribution<float> normal(0, 1);
  // Spread over f32's range; within half's (an f16 block stays below 65504).
  const int spread = std::is_same_v<T, weave::half> ? 8 : 30;
  std::uniform_int_distribution<int> magnitude(-spread, spread);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t b = 0; b < cols / block; ++b) {
      // Each block has its own magnitude; a few elements are tiny (FP8 subnormals after scaling).
      const float m = std::ldexp(1.0f, magnitude(rng));
      for (std::size_t j = 0; j < block; ++j) {
        const float tiny = rng() % 8 == 0 ? std::ldexp(1.0f, -8 - int(rng() % 8)) : 1.0f;
        out.row(r)[b * block + j] = T(normal(rng) * m * tiny);
      }
    }
  return out;
}

// Quantises `src` and checks codes, scales and dequantised values against the reference.
template <class Fp8, class T>
void check_quantisation(const weave::host_matrix<T>& src, const block_quantization& q) {
  const std::size_t rows = src.rows(), cols = src.cols(), blocks = cols / q.block;
  weave::host_matrix<Fp8> codes(rows, cols);
  weave::host_matrix<float> scales(rows, blocks);
  weave::quantize_rows(src.view(), codes.view(), scales.view(), q);
  weave::host_matrix<float> back(rows, cols);
  weave::dequantize_rows(codes.view(), scales.view(), back.view(), q);
  weave::host_matrix<weave::bfloat16> back16(rows, cols);
  weave::dequantize_rows(codes.view(), scales.view(), back16.view(), q);

  const fp8_ref::table table(format_of<Fp8>());
  const auto max_finite = static_cast<float>(table.max_finite());
  std::vector<float> x(q.block);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t b = 0; b < blocks; ++b) {
      for (std::size_t j = 0; j < q.block; ++j)
        x[j] = static_cast<float>(src.row(r)[b * q.block + j]);
      const auto [scale, multiplier] = fp8_ref::reference_scale(x.data(), q.block, q, max_finite);
      REQUIRE(scales.row(r)[b] == scale);
      for (std::size_t j = 0; j < q.block; ++j) {
        const std::size_t c = b * q.block + j;
        const float y = x[j] * multiplier;
        const std::uint8_t want = table.round(y, weave::fp8_overflow::saturate);
        if (codes.row(r)[c].bits != want)
          FAIL("row ", r, " col ", c, ": x = ", x[j], " code ", +codes.row(r)[c].bits, ", want ",
               +want);
        // |dequantised - x| <= half an FP8 ulp at |y|, times the scale, plus f32 roundings of
        // y, of the multiplier/scale pair and of the product (a few 2^-24 relative).
        const double dq = back.row(r)[c];
        const double bound =
            0.5 * table.ulp(std::fabs(y)) * scale + 8 * 0x1p-24 * (std::fabs(x[j]) + std::fabs(dq));
        if (!(std::fabs(dq - x[j]) <= bound))
          FAIL("row ", r, " col ", c, ": x = ", x[j], " dequantised to ", dq, ", bound ", bound);
        // bf16 output: the f32 result rounded once more, exactly as bfloat16(float) does.
        const double d16 = static_cast<float>(back16.row(r)[c]);
        CHECK(std::fabs(d16 - x[j]) <= bound + std::ldexp(std::fabs(dq), -8));
        if (back16.row(r)[c].bits != weave::bfloat16(back.row(r)[c]).bits)
          FAIL("row ", r, " col ", c, ": bf16 dequantised ", +back16.row(r)[c].bits, ", want ",
               +weave::bfloat16(back.row(r)[c]).bits);
      }
    }
}

} // namespace

TEST_CASE("quantize_rows: codes, scales and dequantised rows against the brute-force reference") {
  std::mt19937 rng(5);
  for (auto rounding : {scale_rounding::exact, scale_rounding::power_of_two})
    for (std::size_t block : {128u, 64u, 32u}) {
      block_quantization q;
      q.block = block;
      q.rounding = rounding;
      check_quantisation<weave::fp8_e4m3>(random_rows<float>(rng, 17, 512, block), q);
      check_quantisation<weave::fp8_e4m3>(random_rows<weave::bfloat16>(rng, 9, 256, block), q);
      check_quantisation<weave::fp8_e4m3>(random_rows<weave::half>(rng, 5, 384, block), q);
      check_quantisation<weave::fp8_e5m2>(random_rows<float>(rng, 7, 256, block), q);
    }
  // Blocks that are no multiple of the kernels' eight lanes (their scalar tails).
  for (std::size_t block : {12u, 5u, 1u}) {
    block_quantization q;
    q.block = block;
    check_quantisation<weave::fp8_e4m3>(random_rows<float>(rng, 3, 60, block), q);
    check_quantisation<weave::fp8_e4m3>(random_rows<weave::bfloat16>(rng, 3, 60, block), q);
    check_quantisation<weave::fp8_e5m2>(random_rows<weave::bfloat16>(rng, 3, 60, block), q);
  }
  // DeepSeek-V3's hidden size.
  check_quantisation<weave::fp8_e4m3>(random_rows<weave::bfloat16>(rng, 3, 7168, 128), {});
}

TEST_CASE("power-of-two scales make exact FP8 midpoints, which round to the even code") {
  // amax = 448 * 2^-3 gives scale 2^-3 exactly; every other element is a midpoint between two
  // neighbouring E4M3 values, times the scale.
  const fp8_ref::table table(fp8_ref::e4m3);
  weave::host_matrix<float> src(1, 128);
  src.row(0)[0] = 56.0f;
  for (std::size_t j = 1; j < 128; ++j) {
    const std::size_t k = j % (table.entries.size() - 2);
    const double mid = (table.entries[k].first + table.entries[k + 1].first) / 2;
    src.row(0)[j] = static_cast<float>((j % 2 ? -mid : mid) / 8);
  }
  block_quantization q;
  q.rounding = scale_rounding::power_of_two;
  weave::host_matrix<weave::fp8_e4m3> codes(1, 128);
  weave::host_matrix<float> scales(1, 1);
  weave::quantize_rows(src.view(), codes.view(), scales.view(), q);
  CHECK(scales.row(0)[0] == 0.125f);
  for (std::size_t j = 1; j < 128; ++j) {
    const std::uint8_t code = codes.row(0)[j].bits;
    CHECK((code & 1) == 0); // the even neighbour
    CHECK(code == table.round(src.row(0)[j] * 8.0, weave::fp8_overflow::saturate));
  }
  check_quantisation<weave::fp8_e4m3>(src, q);
}

TEST_CASE("an all-zero block gets the floor's scale and zero codes, and -0 keeps its sign") {
  weave::host_matrix<float> src(2, 256); // zero-initialised
  src.row(1)[130] = -0.0f;
  src.row(1)[200] = 1e-6f; // below the floor: amax is 1e-4
  weave::host_matrix<weave::fp8_e4m3> codes(2, 256);
  weave::host_matrix<float> scales(2, 2);
  weave::quantize_rows(src.view(), codes.view(), scales.view());
  for (std::size_t r = 0; r < 2; ++r)
    for (std::size_t b = 0; b < 2; ++b)
      CHECK(scales.row(r)[b] == 1e-4f * (1.0f / 448.0f));
  CHECK(codes.row(0)[7].bits == 0);
  CHECK(codes.row(1)[130].bits == 0x80);
  weave::host_matrix<float> back(2, 256);
  weave::dequantize_rows(codes.view(), scales.view(), back.view());
  CHECK(back.row(0)[7] == 0.0f);
  CHECK(std::signbit(back.row(1)[130]));
  check_quantisation<weave::fp8_e4m3>(src, {});
}

TEST_CASE("a NaN or an infinity poisons its block and is reported with its row and block") {
  for (float bad : {NAN, -INFINITY}) {
    weave::host_matrix<float> src(5, 384);
    for (std::size_t r = 0; r < 5; ++r)
      for (std::size_t c = 0; c < 384; ++c)
        src.row(r)[c] = static_cast<float>(r + 1) * 0.01f * static_cast<float>(c % 17);
    src.row(3)[300] = bad; // row 3, block 2
    src.row(4)[5] = bad;   // a later row: the first one is named
    weave::host_matrix<weave::fp8_e4m3> codes(5, 384);
    weave::host_matrix<float> scales(5, 3);
    try {
      weave::quantize_rows(src.view(), codes.view(), scales.view());
      FAIL("no error");
    } catch (const weave::error& e) {
      CHECK(e.code() == weave::errc::invalid_argument);
      CHECK(e.message().find("row 3 block 2 (columns 256..383)") != std::string::npos);
    }
    // Every row was written; the bad blocks are NaN throughout, the others are exact.
    CHECK(std::isnan(scales.row(3)[2]));
    CHECK(std::isnan(scales.row(4)[0]));
    for (std::size_t c = 256; c < 384; ++c)
      CHECK(codes.row(3)[c].bits == 0x7f);
    weave::host_matrix<float> back(5, 384);
    weave::dequantize_rows(codes.view(), scales.view(), back.view());
    for (std::size_t c = 256; c < 384; ++c)
      CHECK(std::isnan(back.row(3)[c]));
    src.row(3)[300] = 0.0f;
    src.row(4)[5] = 0.0f;
    weave::host_matrix<weave::fp8_e4m3> clean(5, 384);
    weave::host_matrix<float> clean_scales(5, 3);
    weave::quantize_rows(src.view(), clean.view(), clean_scales.view());
    for (std::size_t c = 0; c < 256; ++c)
      CHECK(codes.row(3)[c] == clean.row(3)[c]);
    CHECK(scales.row(2)[1] == clean_scales.row(2)[1]);
  }
}

TEST_CASE("bad shapes and types are typed errors naming the values") {
  weave::host_matrix<float> src(2, 200);
  weave::host_matrix<weave::fp8_e4m3> codes(2, 200);
  weave::host_matrix<float> scales(2, 1);
  using weave_test::code_of;
  // 200 is not a multiple of 128.
  CHECK(code_of([&] { weave::quantize_rows(src.view(), codes.view(), scales.view()); }) ==
        weave::errc::invalid_argument);
  CHECK_THROWS_WITH(
      weave::quantize_rows(src.view(), codes.view(), scales.view()),
      doctest::Contains("rows of 200 elements are not a multiple of the block of 128"));
  block_quantization q;
  q.block = 50;
  weave::host_matrix<float> four(2, 4); // 200 / 50 blocks
  CHECK(code_of([&] { weave::quantize_rows(src.view(), codes.view(), scales.view(), q); }) ==
        weave::errc::size_mismatch);
  weave::host_matrix<float> wrong_rows(3, 4);
  CHECK(code_of([&] { weave::quantize_rows(src.view(), codes.view(), wrong_rows.view(), q); }) ==
        weave::errc::size_mismatch);
  // Destination not FP8, source not a float type, scales not f32.
  weave::host_matrix<float> f32_codes(2, 200);
  CHECK(code_of([&] { weave::quantize_rows(src.view(), f32_codes.view(), four.view(), q); }) ==
        weave::errc::invalid_argument);
  weave::host_matrix<std::int32_t> ints(2, 200);
  CHECK(code_of([&] { weave::quantize_rows(ints.view(), codes.view(), four.view(), q); }) ==
        weave::errc::not_supported);
  weave::host_matrix<double> f64_scales(2, 4);
  CHECK(code_of([&] { weave::quantize_rows(src.view(), codes.view(), f64_scales.view(), q); }) ==
        weave::errc::invalid_argument);
  // A floor of zero would give an all-zero block an infinite multiplier.
  q.min_amax = 0.0f;
  CHECK(code_of([&] { weave::quantize_rows(src.view(), codes.view(), four.view(), q); }) ==
        weave::errc::invalid_argument);
  q.min_amax = 1e-4f;
  weave::host_matrix<float> three_rows(3, 200);
  weave::host_matrix<float> back(3, 200);
  CHECK(code_of([&] { weave::quantize_rows(three_rows.view(), codes.view(), four.view(), q); }) ==
        weave::errc::size_mismatch);
  CHECK(code_of([&] { weave::dequantize_rows(codes.view(), four.view(), back.view(), q); }) ==
        weave::errc::size_mismatch);
  CHECK(code_of([&] { weave::quantized_row_layout::of(200); }) == weave::errc::invalid_argument);
}

TEST_CASE("the packed layout (codes then scales per row) equals separate views") {
  const auto layout = weave::quantized_row_layout::of(7168);
  CHECK(layout.code_bytes == 7168);
  CHECK(layout.scale_bytes == 224);
  CHECK(layout.stride == 7392); // 51.6% of a 14336-byte bf16 row
  std::mt19937 rng(3);
  const auto src = random_rows<weave::bfloat16>(rng, 4, 7168, 128);
  std::vector<std::byte> packed(4 * layout.stride);
  auto [codes, scales] = layout.views(packed.data(), 4, weave::dtype::e4m3);
  weave::quantize_rows(src.view(), codes, scales);
  weave::host_matrix<weave::fp8_e4m3> plain(4, 7168);
  weave::host_matrix<float> plain_scales(4, 56);
  weave::quantize_rows(src.view(), plain.view(), plain_scales.view());
  for (std::size_t r = 0; r < 4; ++r) {
    CHECK(std::memcmp(codes.row(r), plain.row(r).data(), 7168) == 0);
    CHECK(std::memcmp(scales.row(r), plain_scales.row(r).data(), 224) == 0);
  }
  const auto odd = weave::quantized_row_layout::of(384);
  CHECK(odd.stride == 400); // 384 + 12 rounded up to 16
}

// Rows whose length is not a multiple of 4 (or 16): the scales must still start 16-byte aligned
// in every row (a float load needs 4 bytes of alignment on a GPU, a vector 16), and the packed
// round trip must equal the brute-force reference bit for bit.
template <class Fp8, class T>
void check_packed(std::mt19937& rng, std::size_t rows, std::size_t cols, std::size_t block) {
  CAPTURE(cols);
  CAPTURE(block);
  const block_quantization q{block, scale_rounding::exact, 1e-4f};
  const auto layout = weave::quantized_row_layout::of(cols, block);
  CHECK(layout.scale_offset >= cols);
  CHECK(layout.stride % 16 == 0);
  CHECK(layout.stride >= layout.scale_offset + cols / block * sizeof(float));
  const auto src = random_rows<T>(rng, rows, cols, block);
  // Poisoned, so bytes the views do not cover show up nowhere and rows cannot overlap silently.
  std::vector<std::byte> packed(rows * layout.stride + 16, std::byte{0xa5});
  // A 16-byte aligned base: the exchanges' buffers are.
  auto* base = packed.data() + (16 - reinterpret_cast<std::uintptr_t>(packed.data()) % 16) % 16;
  const auto [codes, scales] = layout.views(base, rows, weave::dtype_of_v<Fp8>);
  weave::quantize_rows(src.view(), codes, scales, q);
  weave::host_matrix<T> back(rows, cols);
  weave::dequantize_rows(codes, scales, back.view(), q);
  const fp8_ref::table table(format_of<Fp8>());
  std::vector<float> x(cols);
  for (std::size_t r = 0; r < rows; ++r) {
    CAPTURE(r);
    REQUIRE(reinterpret_cast<std::uintptr_t>(scales.row(r)) % 16 == 0);
    for (std::size_t j = 0; j < cols; ++j)
      x[j] = static_cast<float>(src.row(r)[j]);
    const auto want = fp8_ref::quantize_row(x.data(), cols, q, table);
    const auto* got_codes = reinterpret_cast<const std::uint8_t*>(codes.row(r));
    const auto* got_scales = reinterpret_cast<const float*>(scales.row(r));
    for (std::size_t b = 0; b < cols / block; ++b)
      CHECK(std::bit_cast<std::uint32_t>(got_scales[b]) ==
            std::bit_cast<std::uint32_t>(want.scales[b]));
    for (std::size_t j = 0; j < cols; ++j) {
      CHECK(got_codes[j] == want.codes[j]);
      const T dq(static_cast<float>(fp8_ref::decode(table.f, want.codes[j])) *
                 want.scales[j / block]);
      CHECK(std::memcmp(&back.row(r)[j], &dq, sizeof(T)) == 0);
    }
  }
}

TEST_CASE("packed rows of any length: scales 16-byte aligned, round trip equal to the reference") {
  std::mt19937 rng(13);
  check_packed<weave::fp8_e4m3, float>(rng, 5, 6, 2);
  check_packed<weave::fp8_e4m3, weave::bfloat16>(rng, 5, 6, 3);
  check_packed<weave::fp8_e5m2, float>(rng, 4, 130, 2);
  check_packed<weave::fp8_e4m3, weave::half>(rng, 3, 10, 5);
  check_packed<weave::fp8_e4m3, weave::bfloat16>(rng, 3, 7168, 128);
  // Scales at the next 16-byte boundary, the row padded to 16 bytes.
  CHECK(weave::quantized_row_layout::of(6, 2).scale_offset == 16);
  CHECK(weave::quantized_row_layout::of(6, 2).stride == 32);
  CHECK(weave::quantized_row_layout::of(130, 2).stride == 144 + 260 + 12);
  CHECK(weave::quantized_row_layout::of(7168).scale_offset == 7168);
}

TEST_CASE("quant_moves<host_space>: gather-quantise with padding and counts, status, dequantise") {
  std::mt19937 rng(9);
  const auto src = random_rows<float>(rng, 6, 256, 128);
  auto poisoned = src;
  poisoned.row(4)[3] = NAN;
  poisoned.row(2)[200] = INFINITY;
  const std::vector<std::int64_t> index = {5, -1, 4, 0, 2, 4, 1};
  weave::host_matrix<weave::fp8_e4m3> codes(7, 256);
  weave::host_matrix<float> scales(7, 2);
  std::fill(codes.elements().begin(), codes.elements().end(), weave::fp8_e4m3::from_bits(0x11));
  std::int64_t status = -1, count = 6; // the last index is beyond the count
  weave::host_stream stream;
  weave::quant_moves<weave::host_space>::quantize(stream, poisoned.view(), codes.view(),
                                                  scales.view(), index.data(), &count, {}, &status);
  stream.synchronize();
  CHECK(status == 2); // rows 4 and 2 are non-finite; the smallest source row is named
  for (std::size_t i = 0; i < 7; ++i) {
    if (i == 1 || i == 6) { // padding and past the count: untouched
      CHECK(codes.row(i)[0].bits == 0x11);
      continue;
    }
    weave::host_matrix<float> one(1, 256);
    std::memcpy(one.row(0).data(), poisoned.row(static_cast<std::size_t>(index[i])).data(),
                256 * sizeof(float));
    weave::host_matrix<weave::fp8_e4m3> want(1, 256);
    weave::host_matrix<float> want_scales(1, 2);
    const bool finite = index[i] != 4 && index[i] != 2;
    if (finite)
      weave::quantize_rows(one.view(), want.view(), want_scales.view());
    else
      CHECK_THROWS_AS(weave::quantize_rows(one.view(), want.view(), want_scales.view()),
                      weave::error);
    CHECK(std::memcmp(codes.row(i).data(), want.row(0).data(), 256) == 0);
    CHECK(std::memcmp(scales.row(i).data(), want_scales.row(0).data(), 8) == 0);
  }
  // Dequantise received rows into an expert order through an index, with the same rules.
  const std::vector<std::int64_t> order = {3, -1, 0};
  weave::host_matrix<float> back(3, 256);
  back.row(1)[0] = 42.0f;
  weave::quant_moves<weave::host_space>::dequantize(stream, codes.view(), scales.view(),
                                                    back.view(), order.data(), nullptr, {});
  stream.synchronize();
  weave::host_matrix<float> want(7, 256);
  weave::dequantize_rows(codes.view(), scales.view(), want.view());
  CHECK(std::memcmp(back.row(0).data(), want.row(3).data(), 256 * sizeof(float)) == 0);
  CHECK(back.row(1)[0] == 42.0f);
  CHECK(std::memcmp(back.row(2).data(), want.row(0).data(), 256 * sizeof(float)) == 0);
}

TEST_CASE("example: bf16 activations to FP8 rows with block scales, and back") {
  const std::size_t tokens = 4, hidden = 7168;
  weave::host_matrix<weave::bfloat16> activations(tokens, hidden);
  for (std::size_t i = 0; i < activations.elements().size(); ++i)
    activations.elements()[i] = weave::bfloat16(std::sin(0.001f * static_cast<float>(i)));
  //! [quantize]
  // DeepSeek-V3 / DeepEP: e4m3 codes and one f32 scale per 1 x 128 block of each token.
  weave::block_quantization q; // block 128, exact scales, amax floor 1e-4
  weave::host_matrix<weave::fp8_e4m3> codes(tokens, hidden);
  weave::host_matrix<float> scales(tokens, hidden / q.block);
  weave::quantize_rows(activations.view(), codes.view(), scales.view(), q);

  // ... send codes and scales (51.6% of the bf16 bytes) ...

  weave::host_matrix<weave::bfloat16> restored(tokens, hidden);
  weave::dequantize_rows(codes.view(), scales.view(), restored.view(), q);
  //! [quantize]
  for (std::size_t t = 0; t < tokens; ++t)
    for (std::size_t c = 0; c < hidden; ++c) {
      const float x = static_cast<float>(activations.row(t)[c]);
      const float y = static_cast<float>(restored.row(t)[c]);
      // Half an e4m3 ulp: 2^-4 relative for normal codes, 2^-10 * scale for subnormal ones;
      // then the bf16 rounding of the result.
      const float bound = std::fabs(x) * 0x1p-4f + scales.row(t)[c / 128] * 0x1p-10f;
      CHECK(std::fabs(y - x) <= bound * 1.0001f + std::fabs(y) * 0x1p-8f);
    }
}

// GCC 12 at -O3 sees the gate's scratch resize (never reached: the e4m3 logits are refused
// first) as a memmove of more than PTRDIFF_MAX bytes once this file inlines the gate; a false
// positive of -Wstringop-overflow.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstringop-overflow"
#endif
TEST_CASE("row kernels and the gate reject FP8 rows where they compute, and copy them as bytes") {
  weave::host_matrix<weave::fp8_e4m3> rows(3, 8);
  for (std::size_t i = 0; i < rows.elements().size(); ++i)
    rows.elements()[i] = weave::fp8_e4m3::from_bits(static_cast<std::uint8_t>(i));
  weave::host_matrix<weave::fp8_e4m3> out(2, 8);
  const std::vector<std::int64_t> index = {2, 0};
  weave::gather_rows(rows.view(), out.view(), index); // an unscaled gather moves bytes
  CHECK(out.row(0)[3] == rows.row(2)[3]);
  CHECK(out.row(1)[7] == rows.row(0)[7]);
  const std::vector<float> scale = {1.0f, 2.0f};
  CHECK(weave_test::code_of([&] { weave::gather_rows(rows.view(), out.view(), index, scale); }) ==
        weave::errc::not_supported);
  CHECK(weave_test::code_of([&] { weave::merge_rows(rows.view(), out.view(), index, 1); }) ==
        weave::errc::not_supported);
  std::vector<std::int32_t> ids(3);
  std::vector<float> weights(3);
  weave::gate_options options;
  options.k = 1;
  CHECK_THROWS_WITH_AS(weave::top_k_gate(rows.view(), options, ids, weights),
                       doctest::Contains("gate logits of type e4m3"), weave::error);
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
