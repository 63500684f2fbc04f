// gather_rows / merge_rows against element-by-element loops, for f32, bf16 and f16 rows, packed
// and strided, directly and in stream order (`row_moves<host_space>` on a host_stream); bitwise
// against the scalar kernels they replaced, special values included; the layout moves
// (`layout_move` in host_space and emulated_gpu_space, `row_moves` merges) and the host
// reference plans' moves (tests/support/host_plans.hpp) against row-by-row copies and the scalar
// kernels, over the reference plans' maps; bad input gets the right error code.
#include <doctest/doctest.h>

#include "host_plans.hpp"
#include "scalar_kernels.hpp"

#include <weave/core/host_matrix.hpp>
#include <weave/exec/emulated_gpu_space.hpp>
#include <weave/exec/host_space.hpp>
#include <weave/routing/host_row_moves.hpp>
#include <weave/routing/kernels_host.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <future>
#include <limits>
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

namespace {

// Normal values mixed with zeros of both signs, infinities, NaNs (quiet and signalling bits),
// subnormals, values at bf16/f16 rounding ties and values that overflow a 16-bit type.
template <class T>
weave::host_matrix<T> special_rows(std::size_t rows, std::size_t cols, std::mt19937& rng) {
  const float inf = std::numeric_limits<float>::infinity();
  const float specials[] = {0.0f,
                            -0.0f,
                            inf,
                            -inf,
                            std::numeric_limits<float>::quiet_NaN(),
                            std::bit_cast<float>(0x7f800001u),
                            std::bit_cast<float>(0xffa00000u),
                            1e-40f,
                            -1e-45f,
                            std::bit_cast<float>(0x3f808000u), // a bf16 tie
                            std::bit_cast<float>(0x3f818000u),
                            65504.0f,
                            70000.0f,
                            3e38f,
                            6e-8f};
  weave::host_matrix<T> m(rows, cols);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  for (auto& v : m.elements())
    v = T(rng() % 5 == 0 ? specials[rng() % std::size(specials)] : normal(rng));
  return m;
}

// Equal bits, or NaN on both sides: IEEE 754 leaves the payload and sign of a NaN result open
// and compilers may swap the operands of an add, so only NaN-ness is part of the contract.
template <class T>
bool same_bits(const weave::host_matrix<T>& a, const weave::host_matrix<T>& b) {
  if (a.elements().size() != b.elements().size())
    return false;
  for (std::size_t i = 0; i < a.elements().size(); ++i) {
    const float x = static_cast<float>(a.elements()[i]), y = static_cast<float>(b.elements()[i]);
    if (std::memcmp(&a.elements()[i], &b.elements()[i], sizeof(T)) != 0 &&
        !(std::isnan(x) && std::isnan(y)))
      return false;
  }
  return true;
}

template <class T>
void check_against_scalar(std::mt19937& rng) {
  const std::size_t widths[] = {1, 3, 8, 17, 255, 256, 1023, 1024, 1025, 2100};
  for (int trial = 0; trial < 40; ++trial) {
    const std::size_t n_src = 1 + rng() % 40, n_dst = rng() % 30;
    const std::size_t cols = widths[rng() % std::size(widths)];
    const int k = 1 + static_cast<int>(rng() % 11);
    const auto kk = static_cast<std::size_t>(k);
    const auto src = special_rows<T>(n_src, cols, rng);
    std::vector<std::int64_t> index(n_dst), merge_index(n_dst * kk);
    std::vector<float> scale(n_dst), weight(merge_index.size());
    const float weights[] = {0.0f, -0.0f, 1.0f, 0.5f, -2.0f, 1e-30f, 1e30f};
    for (std::size_t i = 0; i < n_dst; ++i) {
      index[i] = static_cast<std::int64_t>(rng() % n_src);
      scale[i] = rng() % 3 == 0 ? weights[rng() % std::size(weights)]
                                : std::uniform_real_distribution<float>(-2, 2)(rng);
    }
    for (std::size_t i = 0; i < merge_index.size(); ++i) {
      merge_index[i] = rng() % 4 == 0 ? -1 : static_cast<std::int64_t>(rng() % n_src);
      weight[i] = rng() % 3 == 0 ? weights[rng() % std::size(weights)]
                                 : std::uniform_real_distribution<float>(-1, 1)(rng);
    }
    if (n_dst > 0) // a row with no input at all
      std::fill_n(merge_index.begin(), kk, std::int64_t{-1});

    weave::host_matrix<T> scaled(n_dst, cols), merged(n_dst, cols), summed(n_dst, cols);
    weave::host_matrix<T> want_scaled(n_dst, cols), want_merged(n_dst, cols),
        want_summed(n_dst, cols);
    weave::gather_rows(src.view(), scaled.view(), index, scale);
    weave::merge_rows(src.view(), merged.view(), merge_index, k, weight);
    weave::merge_rows(src.view(), summed.view(), merge_index, k);
    for (std::size_t i = 0; i < n_dst; ++i) {
      scalar::scale_row(src.row(static_cast<std::size_t>(index[i])).data(),
                        want_scaled.row(i).data(), cols, scale[i]);
      std::vector<const T*> rows(kk, nullptr);
      for (std::size_t j = 0; j < kk; ++j)
        if (merge_index[i * kk + j] >= 0)
          rows[j] = src.row(static_cast<std::size_t>(merge_index[i * kk + j])).data();
      scalar::merge_row(rows, want_merged.row(i).data(), cols, weight.data() + i * kk);
      scalar::merge_row(rows, want_summed.row(i).data(), cols, nullptr);
    }
    CAPTURE(cols);
    CAPTURE(k);
    CHECK(same_bits(scaled, want_scaled));
    CHECK(same_bits(merged, want_merged));
    CHECK(same_bits(summed, want_summed));

    // Each instruction set this CPU runs gives the same bits.
    using weave::detail::host_isa;
    for (const auto isa :
         {host_isa::baseline, host_isa::avx2, host_isa::avx512, host_isa::avx512_bf16}) {
      if (isa > weave::detail::detected_host_isa())
        continue;
      weave::host_matrix<T> by_isa(n_dst, cols), merged_isa(n_dst, cols), summed_isa(n_dst, cols);
      weave::detail::gather_rows_host(src.view(), by_isa.view(), index.data(), scale.data(), n_dst,
                                      isa);
      weave::detail::merge_rows_host(src.view(), merged_isa.view(), merge_index.data(), kk,
                                     weight.data(), n_dst, false, isa);
      weave::detail::merge_rows_host(src.view(), summed_isa.view(), merge_index.data(), kk, nullptr,
                                     n_dst, false, isa);
      CAPTURE(static_cast<int>(isa));
      CHECK(same_bits(by_isa, want_scaled));
      CHECK(same_bits(merged_isa, want_merged));
      CHECK(same_bits(summed_isa, want_summed));
    }

    // The host-stream row moves run the same loops.
    weave::host_stream s("kernels");
    weave::host_matrix<T> moved(n_dst, cols), merged_async(n_dst, cols);
    weave::row_moves<weave::host_space>::gather(s, src.view(), moved.view(), index.data(),
                                                scale.data(), nullptr);
    weave::row_moves<weave::host_space>::merge(
        s, src.view(), merged_async.view(), merge_index.data(), k, weight.data(), nullptr, false);
    s.synchronize();
    CHECK(same_bits(moved, want_scaled));
    CHECK(same_bits(merged_async, want_merged));
  }
}

} // namespace

TEST_CASE("vectorised gathers and merges equal the scalar kernels bitwise, special values too") {
  std::mt19937 rng(6);
  check_against_scalar<float>(rng);
  check_against_scalar<weave::bfloat16>(rng);
  check_against_scalar<weave::half>(rng);
}

namespace {

// A random dispatch of T tokens (k of E experts over D devices) and the receiving side of all
// its rows, planned by the host reference plans (tests/support/host_plans.hpp): their maps
// drive both the reference moves and the library's `layout_move` / `row_moves`.
struct routed_layouts {
  oracle::dispatch_plan plan;
  oracle::expert_plan experts;
};

routed_layouts route(std::size_t T, int E, int D, int k, std::mt19937& rng) {
  std::vector<std::int32_t> ids(T * static_cast<std::size_t>(k));
  std::vector<float> weights(ids.size());
  for (std::size_t t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) {
      std::int32_t e = 0;
      bool fresh = false;
      while (!fresh) {
        e = static_cast<std::int32_t>(rng() % static_cast<unsigned>(E));
        fresh = std::find(ids.begin() + static_cast<long>(t * k),
                          ids.begin() + static_cast<long>(t * k + j),
                          e) == ids.begin() + static_cast<long>(t * k + j);
      }
      ids[t * k + j] = rng() % 9 == 0 ? -1 : e;
      weights[t * k + j] = std::uniform_real_distribution<float>(-1, 1)(rng);
    }
  const auto where = weave::placement::contiguous(E, D);
  routed_layouts r{oracle::dispatch_plan(where, k, 0),
                   oracle::expert_plan(where.slots_per_device(), k)};
  r.plan.build(ids, weights);
  r.experts.build(r.plan.row_routes(), r.plan.send_counts());
  return r;
}

// `layout_move` in `Space` from `src` into rows [0, n) of `dst` (n + 3 rows, filled with 7s
// first): host_space scatters through the inverse map `by_src` (counted over the source rows),
// the emulated GPU gathers through `by_dst` (counted over the destination rows). Returns `dst`;
// the rows past the count must stay 7s.
template <class Space, class T>
weave::host_matrix<T> moved(const weave::host_matrix<T>& src, std::size_t n,
                            std::span<const std::int64_t> by_dst, const float* scale_by_dst,
                            std::span<const std::int64_t> by_src, int k,
                            const float* scale_by_src) {
  weave::host_matrix<T> dst(n + 3, src.cols());
  for (auto& v : dst.elements())
    v = T(7.0f);
  const auto src_count = static_cast<std::int64_t>(src.rows());
  const auto dst_count = static_cast<std::int64_t>(n);
  weave::host_stream st("layout_move");
  weave::layout_move<Space>(st, src.view(), dst.view(), by_dst.data(), scale_by_dst, &dst_count,
                            by_src.data(), k, scale_by_src, &src_count);
  st.synchronize();
  return dst;
}

// Rows [0, n) of `got` equal `want` bitwise; the 3 rows after them are untouched 7s.
template <class T>
void expect_moved(const weave::host_matrix<T>& got, const weave::host_matrix<T>& want) {
  const std::size_t n = want.rows(), cols = want.cols();
  REQUIRE(got.rows() == n + 3);
  for (std::size_t i = 0; i < n; ++i)
    REQUIRE(std::memcmp(got.row(i).data(), want.row(i).data(), cols * sizeof(T)) == 0);
  for (std::size_t i = n; i < n + 3; ++i)
    REQUIRE(static_cast<float>(got(i, 0)) == 7.0f);
}

template <class T>
void check_layout_moves(std::size_t tokens, std::size_t cols, std::mt19937& rng) {
  const int k = 1 + static_cast<int>(rng() % 4);
  const auto kk = static_cast<std::size_t>(k);
  const auto r = route(tokens, 8, 4, k, rng);
  const auto ori = special_rows<T>(tokens, cols, rng);
  const auto rows = static_cast<std::size_t>(r.plan.rows());
  const auto epd_rows = static_cast<std::size_t>(r.experts.epd_rows());
  // ORI -> SFD: the reference move against a row-by-row copy, and the library's move (a scatter
  // over token_rows on the host, a gather over row_token on the emulated GPU) against both.
  weave::host_matrix<T> sfd(rows, cols), want_sfd(rows, cols);
  oracle::dispatch_gather(r.plan, ori.view(), sfd.view());
  for (std::size_t i = 0; i < rows; ++i)
    std::memcpy(want_sfd.row(i).data(),
                ori.row(static_cast<std::size_t>(r.plan.row_token()[i])).data(), cols * sizeof(T));
  CHECK(same_bits(sfd, want_sfd));
  expect_moved(moved<weave::host_space>(ori, rows, r.plan.row_token(), nullptr, r.plan.token_rows(),
                                        k, nullptr),
               want_sfd);
  expect_moved(moved<weave::emulated_gpu_space>(ori, rows, r.plan.row_token(), nullptr,
                                                r.plan.token_rows(), k, nullptr),
               want_sfd);
  // SFD -> EPD, plain and gate-scaled: the reference move against the scalar scaling, and the
  // library's move (a scatter over row_epd x row_weight, or a gather) against both.
  for (const bool scaled : {false, true}) {
    weave::host_matrix<T> epd(epd_rows, cols), want_epd(epd_rows, cols);
    oracle::expert_scatter(r.experts, sfd.view(), epd.view(), scaled);
    for (std::size_t j = 0; j < epd_rows; ++j) {
      const T* from = sfd.row(static_cast<std::size_t>(r.experts.epd_row_source()[j])).data();
      if (scaled)
        scalar::scale_row(from, want_epd.row(j).data(), cols, r.experts.epd_weight()[j]);
      else
        std::memcpy(want_epd.row(j).data(), from, cols * sizeof(T));
    }
    CAPTURE(scaled);
    CHECK(same_bits(epd, want_epd));
    const float* by_dst = scaled ? r.experts.epd_weight().data() : nullptr;
    const float* by_src = scaled ? r.experts.row_weight().data() : nullptr;
    expect_moved(moved<weave::host_space>(sfd, epd_rows, r.experts.epd_row_source(), by_dst,
                                          r.experts.row_epd(), k, by_src),
                 epd);
    expect_moved(moved<weave::emulated_gpu_space>(sfd, epd_rows, r.experts.epd_row_source(), by_dst,
                                                  r.experts.row_epd(), k, by_src),
                 epd);
  }
  // The merges back: the reference moves and the library's (row_moves) against the scalar
  // kernels.
  const auto epd_out = special_rows<T>(epd_rows, cols, rng);
  weave::host_matrix<T> back(rows, cols), want_back(rows, cols), out(tokens, cols),
      want_out(tokens, cols), lib_back(rows, cols), lib_out(tokens, cols);
  oracle::expert_merge(r.experts, epd_out.view(), back.view());
  oracle::combine_merge(r.plan, back.view(), out.view());
  const auto inputs = [&](const weave::host_matrix<T>& src, std::span<const std::int64_t> index,
                          std::size_t i) {
    std::vector<const T*> in(kk, nullptr);
    for (std::size_t j = 0; j < kk; ++j)
      if (index[i * kk + j] >= 0)
        in[j] = src.row(static_cast<std::size_t>(index[i * kk + j])).data();
    return in;
  };
  for (std::size_t i = 0; i < rows; ++i)
    scalar::merge_row(inputs(epd_out, r.experts.row_epd(), i), want_back.row(i).data(), cols,
                      r.experts.row_weight().data() + i * kk);
  for (std::size_t t = 0; t < tokens; ++t)
    scalar::merge_row(inputs(back, r.plan.token_rows(), t), want_out.row(t).data(), cols, nullptr);
  CHECK(same_bits(back, want_back));
  CHECK(same_bits(out, want_out));
  weave::host_stream st("merges");
  weave::row_moves<weave::host_space>::merge(st, epd_out.view(), lib_back.view(),
                                             r.experts.row_epd().data(), k,
                                             r.experts.row_weight().data(), nullptr, false);
  weave::row_moves<weave::host_space>::merge(
      st, back.view(), lib_out.view(), r.plan.token_rows().data(), k, nullptr, nullptr, false);
  st.synchronize();
  CHECK(same_bits(lib_back, want_back));
  CHECK(same_bits(lib_out, want_out));
}

} // namespace

TEST_CASE("layout moves done as scatters equal the gathers they replace, cached and streaming") {
  std::mt19937 rng(8);
  for (int trial = 0; trial < 10; ++trial) {
    check_layout_moves<float>(1 + rng() % 300, 1 + rng() % 700, rng);
    check_layout_moves<weave::bfloat16>(1 + rng() % 300, 1 + rng() % 700, rng);
    check_layout_moves<weave::half>(1 + rng() % 300, 1 + rng() % 700, rng);
  }
  // Outputs past streaming_store_bytes take the non-temporal stores (rows of 2101 elements:
  // destinations not 16-byte aligned).
  const std::size_t cols = 2101;
  const std::size_t tokens = weave::detail::streaming_store_bytes / (cols * sizeof(float)) + 7;
  check_layout_moves<float>(tokens, cols, rng);
  check_layout_moves<weave::bfloat16>(2 * tokens, cols, rng);
}

TEST_CASE("the branch-free bf16 rounding equals bfloat16(float) on every 2^-8-spaced pattern") {
  // Every sign, exponent and top mantissa byte, with low bits that hit ties, NaN payloads and
  // the carry into the exponent.
  const std::uint32_t lows[] = {0x0000u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu, 0x4000u, 0xc000u};
  for (std::uint32_t high = 0; high < (1u << 16); ++high)
    for (const std::uint32_t low : lows) {
      const float f = std::bit_cast<float>(high << 16 | low);
      weave::bfloat16 got;
      weave::detail::store_f32(&got, f);
      REQUIRE(got.bits == weave::bfloat16(f).bits);
    }
}

#if WEAVE_SIMD_BF16_NATIVE
namespace {

// The CPU's conversion of the same patterns, sixteen at a time (even lanes from `f`, odd ones
// from its negation, so both signs meet in one vector); false where it declined (a subnormal).
__attribute__((target("avx2,avx512f,avx512vl,avx512bw,avx512dq"))) bool
native_bf16(const float* even, const float* odd, std::uint16_t* out) {
  weave::detail::simd::f32x8 e, o;
  weave::detail::simd::load(e, even);
  weave::detail::simd::load(o, odd);
  return weave::detail::simd::bf16_pairs_native(out, e, o);
}

} // namespace

TEST_CASE("the CPU's bf16 conversion equals bfloat16(float) on every 2^-8-spaced pattern") {
  if (weave::detail::detected_host_isa() < weave::detail::host_isa::avx512_bf16) {
    MESSAGE("skipped: this CPU has no AVX-512 BF16");
    return;
  }
  const std::uint32_t lows[] = {0x0000u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu, 0x4000u, 0xc000u};
  std::size_t declined = 0;
  for (const std::uint32_t low : lows)
    for (std::uint32_t high = 0; high < (1u << 16); high += 8) {
      float even[8], odd[8];
      for (std::uint32_t i = 0; i < 8; ++i) {
        even[i] = std::bit_cast<float>((high + i) << 16 | low);
        odd[i] = std::bit_cast<float>(((high + i) << 16 | low) ^ 0x80000000u);
      }
      std::uint16_t got[16];
      if (!native_bf16(even, odd, got)) { // a subnormal in the vector: the kernels round it
        bool subnormal = false;
        for (const float f : even)
          subnormal = subnormal || std::fpclassify(f) == FP_SUBNORMAL;
        REQUIRE(subnormal);
        ++declined;
        continue;
      }
      for (std::size_t i = 0; i < 8; ++i) {
        REQUIRE(got[2 * i] == weave::bfloat16(even[i]).bits);
        REQUIRE(got[2 * i + 1] == weave::bfloat16(odd[i]).bits);
      }
    }
  // Exponent 0: 16 vectors of each sign per low bits (a zero among them); a subnormal that went
  // through would have failed the comparison above.
  CHECK(declined == 32 * std::size(lows));
}
#endif

TEST_CASE("row moves read and write strided views and run in order on a host_stream") {
  std::mt19937 rng(4);
  auto wide = random_rows<float>(10, 12, rng);
  // Columns 2..9 of each row, as a strided view.
  const weave::const_token_view src(reinterpret_cast<const std::byte*>(wide.data() + 2), 10, 8,
                                    weave::dtype::f32, weave::memory_space::host, -1,
                                    12 * sizeof(float));
  // Columns 4..11 of each destination row, as strided views: one gathered into, one scattered.
  weave::host_matrix<float> dst_wide(4, 16, 9.0f), scattered_wide(4, 16, 9.0f);
  const weave::token_view dst(reinterpret_cast<std::byte*>(dst_wide.data() + 4), 4, 8,
                              weave::dtype::f32, weave::memory_space::host, -1, 16 * sizeof(float));
  const weave::token_view scattered(reinterpret_cast<std::byte*>(scattered_wide.data() + 4), 4, 8,
                                    weave::dtype::f32, weave::memory_space::host, -1,
                                    16 * sizeof(float));
  const std::vector<std::int64_t> index = {9, 0, 3, 3};
  // The same move by its inverse map: the destinations of each source row (k = 2, -1 none).
  std::vector<std::int64_t> by_src(10 * 2, -1);
  by_src[9 * 2] = 0;
  by_src[0 * 2] = 1;
  by_src[3 * 2] = 2;
  by_src[3 * 2 + 1] = 3;
  weave::host_matrix<float> merged(2, 8);
  const std::vector<std::int64_t> pairs = {0, 2, -1, 1};
  {
    using moves = weave::row_moves<weave::host_space>;
    weave::host_stream stream;
    std::promise<void> open;
    stream.submit([gate = open.get_future().share()] { gate.wait(); });
    moves::gather(stream, src, dst, index.data(), nullptr, nullptr);
    // The merge reads the gather's output.
    moves::merge(stream, dst, merged.view(), pairs.data(), 2, nullptr, nullptr, false);
    moves::scatter(stream, src, scattered, by_src.data(), 2, nullptr, nullptr);
    // Enqueued behind the held task, not run by the caller.
    for (const float v : dst_wide.elements())
      CHECK(v == 9.0f);
    for (const float v : scattered_wide.elements())
      CHECK(v == 9.0f);
    open.set_value();
    stream.synchronize();
  }
  for (std::size_t i = 0; i < 4; ++i)
    for (std::size_t c = 0; c < 16; ++c) {
      CHECK(dst_wide(i, c) ==
            (c >= 4 && c < 12 ? wide(static_cast<std::size_t>(index[i]), c - 2) : 9.0f));
      CHECK(scattered_wide(i, c) == dst_wide(i, c));
    }
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
