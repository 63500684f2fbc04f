// Every check of non-finite values in the element conversions, block quantisation, the gate,
// capacity, and the dispatch and expert plans (weave's plans, run on host streams in host_space,
// and the host check of top-k choices the exchanges run), fed NaNs, infinities and finite
// extremes: a non-finite value gives the documented typed error, flag or NaN result, a finite
// one never does. The host reference plans of tests/support serve as the reference beside them.
// Built with -ffast-math (test_fast_math) and without (test_fast_math_reference): the same
// expectations hold in both.
#include <doctest/doctest.h>

#include "aligned_buffer.hpp"
#include "host_plans.hpp"
#include "nonfinite_values.hpp"

#include <weave/core/dtype.hpp>
#include <weave/core/fp8.hpp>
#include <weave/core/host_matrix.hpp>
#include <weave/exec/host_space.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/placement/placement.hpp>
#include <weave/routing/capacity.hpp>
#include <weave/routing/device_capacity.hpp>
#include <weave/routing/device_dispatch_plan.hpp>
#include <weave/routing/device_expert_plan.hpp>
#include <weave/routing/device_limit.hpp>
#include <weave/routing/gate.hpp>
#include <weave/routing/host_quant_moves.hpp>
#include <weave/routing/quantize.hpp>
#include <weave/routing/route_entry.hpp>

#include <bit>
#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <vector>

using namespace nonfinite;
using weave::errc;

namespace {

constexpr float one = 1.0f;

// Every value of `specials` and of `extremes` with whether it is finite.
template <class S, std::size_t N, std::size_t M>
std::vector<std::pair<S, bool>> both(const S (&specials)[N], const S (&extremes)[M]) {
  std::vector<std::pair<S, bool>> out;
  for (const S& s : specials)
    out.push_back({s, false});
  for (const S& s : extremes)
    out.push_back({s, true});
  return out;
}

} // namespace

TEST_CASE("non-finite: conversions keep a NaN a NaN and saturate or keep infinities") {
  for (const auto& entry : both(f32_nonfinite, f32_extremes)) {
    const auto& s = entry.first;
    const bool finite = entry.second;
    INFO("value: ", std::string(s.name));
    const float x = value(s);
    const std::uint32_t sign = s.bits & 0x80000000u;
    const bool nan = nan_bits(s.bits);
    // bf16: NaN keeps its sign with a quiet payload; infinities stay infinite.
    const std::uint16_t b = weave::bfloat16(x).bits;
    if (nan)
      CHECK(b == static_cast<std::uint16_t>((s.bits >> 16) | 0x40u));
    else if (!finite)
      CHECK(b == static_cast<std::uint16_t>(s.bits >> 16));
    // half: NaN stays NaN, an infinity or a value past 65504 becomes an infinity of its sign.
    const std::uint16_t h = weave::half(x).bits;
    CHECK(half_finite(h) == (finite && (s.bits & 0x7fffffffu) < 0x477ff000u));
    CHECK(((h & 0x3ffu) != 0 && !half_finite(h)) == nan);
    CHECK((h & 0x8000u) == sign >> 16);
    // OFP8: NaN is 0x7f; saturation clamps infinities to the largest finite code; E5M2 keeps
    // infinities when not saturating.
    const auto e4 = weave::fp8_e4m3(x).bits, e5 = weave::fp8_e5m2(x).bits;
    const auto e5_nosat = weave::fp8_e5m2(x, weave::fp8_overflow::non_saturating).bits;
    const auto e4_nosat = weave::fp8_e4m3(x, weave::fp8_overflow::non_saturating).bits;
    if (nan) {
      CHECK(e4 == 0x7f);
      CHECK(e5 == 0x7f);
      CHECK(e4_nosat == 0x7f);
      CHECK(e5_nosat == 0x7f);
    } else if (!finite) {
      CHECK(e4 == ((sign >> 24) | 0x7eu));
      CHECK(e5 == ((sign >> 24) | 0x7bu));
      CHECK(e4_nosat == ((sign >> 24) | 0x7fu)); // E4M3 has no infinity: NaN, sign kept
      CHECK(e5_nosat == ((sign >> 24) | 0x7cu));
    }
    // Back to float: NaN and infinities survive the round trip through bf16.
    const float back = static_cast<float>(weave::bfloat16::from_bits(b));
    CHECK(nan_bits(bits(back)) == nan);
    CHECK(finite_bits(bits(back)) == finite_bits(static_cast<std::uint32_t>(b) << 16));
  }
  for (const auto& s : half_nonfinite) {
    INFO("value: ", std::string(s.name));
    const float x = static_cast<float>(weave::half::from_bits(s.bits));
    CHECK(!finite_bits(bits(x)));
    CHECK(nan_bits(bits(x)) == ((s.bits & 0x3ffu) != 0));
  }
}

namespace {

// Rows of `cols` elements of type T from f32 values (bf16 and half by rounding).
template <class T>
weave::host_matrix<T> rows_of(std::size_t rows, std::size_t cols, std::uint32_t seed) {
  weave::host_matrix<T> m(rows, cols);
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 3.0f);
  for (T& v : m.elements())
    v = T(n(rng));
  return m;
}

// quantize_rows of `src` into `Fp8`: the error it raised, its codes and scales.
template <class Fp8, class T>
struct quantized {
  outcome result;
  weave::host_matrix<Fp8> codes;
  weave::host_matrix<float> scales;
};

template <class Fp8, class T>
quantized<Fp8, T> quantize(const weave::host_matrix<T>& src, const weave::block_quantization& q) {
  quantized<Fp8, T> out{{},
                        weave::host_matrix<Fp8>(src.rows(), src.cols()),
                        weave::host_matrix<float>(src.rows(), src.cols() / q.block)};
  out.result =
      outcome_of([&] { weave::quantize_rows(src.view(), out.codes.view(), out.scales.view(), q); });
  return out;
}

// Puts each special of type T (set by `assign`) at row 1, column 130 (block 1) of random rows
// and checks quantize_rows: a non-finite value is a typed error naming row 1 block 1, whose
// scale and codes are NaN while every other block equals the clean quantisation; a finite one
// quantises without error to finite scales.
template <class Fp8, class T, class S, class Assign>
void check_quantize(const std::vector<std::pair<S, bool>>& cases, Assign assign,
                    weave::scale_rounding rounding) {
  const weave::block_quantization q{128, rounding, 1e-4f};
  const auto clean_rows = rows_of<T>(3, 256, 5);
  const auto clean = quantize<Fp8>(clean_rows, q);
  REQUIRE(clean.result.code == errc{});
  for (const auto& entry : cases) {
    const auto& s = entry.first;
    const bool finite = entry.second;
    INFO("value: ", std::string(s.name));
    auto src = clean_rows;
    assign(src(1, 130), s.bits);
    const auto got = quantize<Fp8>(src, q);
    if (finite) {
      CHECK(got.result.code == errc{});
      for (const float scale : got.scales.elements())
        CHECK(finite_bits(bits(scale)));
      continue;
    }
    CHECK(got.result.code == errc::invalid_argument);
    CHECK(got.result.message.find("row 1 block 1") != std::string::npos);
    CHECK(nan_bits(bits(got.scales(1, 1))));
    for (std::size_t c = 128; c < 256; ++c)
      CHECK(got.codes(1, c).bits == 0x7f);
    for (std::size_t r = 0; r < 3; ++r)
      for (std::size_t b = 0; b < 2; ++b) {
        if (r == 1 && b == 1)
          continue;
        CHECK(bits(got.scales(r, b)) == bits(clean.scales(r, b)));
        CHECK(std::memcmp(&got.codes(r, b * 128), &clean.codes(r, b * 128), 128) == 0);
      }
  }
}

} // namespace

TEST_CASE("non-finite: block quantisation reports every NaN or infinite block") {
  const auto set_f32 = [](float& x, std::uint32_t b) { x = std::bit_cast<float>(b); };
  const auto set_bf16 = [](weave::bfloat16& x, std::uint16_t b) { x.bits = b; };
  const auto set_half = [](weave::half& x, std::uint16_t b) { x.bits = b; };
  for (const auto rounding : {weave::scale_rounding::exact, weave::scale_rounding::power_of_two}) {
    CAPTURE(static_cast<int>(rounding));
    check_quantize<weave::fp8_e4m3, float>(both(f32_nonfinite, f32_extremes), set_f32, rounding);
    check_quantize<weave::fp8_e5m2, float>(both(f32_nonfinite, f32_extremes), set_f32, rounding);
    check_quantize<weave::fp8_e4m3, weave::bfloat16>(both(bf16_nonfinite, bf16_extremes), set_bf16,
                                                     rounding);
    check_quantize<weave::fp8_e5m2, weave::half>(both(half_nonfinite, half_extremes), set_half,
                                                 rounding);
  }
  // The dispatch form (a plan's SFD rows quantised from their tokens, on a host stream) names
  // the token in its status word; min_amax must be finite.
  const auto where = weave::placement::contiguous(4, 2);
  weave::host_stream stream("quantize");
  weave::device_dispatch_plan<weave::host_space> plan(where, 2, 0, 3);
  weave_test::aligned_buffer ws(plan.workspace_size());
  plan.initialize(ws.ptr, ws.size, stream);
  const std::vector<std::int32_t> ids = {0, 2, 1, 3, 3, -1};
  const std::vector<float> weights(6, 0.5f);
  plan.build(stream, ids, weights);
  const auto rows = static_cast<std::size_t>(plan.read_rows(stream));
  REQUIRE(rows == 5);
  using moves = weave::quant_moves<weave::host_space>;
  for (const auto& s : f32_nonfinite) {
    INFO("value: ", std::string(s.name));
    auto ori = rows_of<float>(3, 128, 9);
    ori(2, 7) = value(s);
    weave::host_matrix<weave::fp8_e4m3> codes(rows, 128);
    weave::host_matrix<float> scales(rows, 1);
    std::int64_t status = -1;
    moves::quantize(stream, ori.view(), codes.view(), scales.view(), plan.row_token().data(),
                    nullptr, {}, &status);
    stream.synchronize();
    CHECK(status == 2);
    weave::block_quantization q;
    q.min_amax = value(s);
    CHECK(outcome_of([&] {
            moves::quantize(stream, ori.view(), codes.view(), scales.view(),
                            plan.row_token().data(), nullptr, q, &status);
          }).code == errc::invalid_argument);
  }
}

namespace {

// top_k_gate over `logits` with `options`: the error, the ids and weights.
struct gated {
  outcome result;
  std::vector<std::int32_t> ids;
  std::vector<float> weights;
};

gated gate(weave::const_token_view logits, const weave::gate_options& options) {
  gated g;
  g.ids.assign(logits.rows() * static_cast<std::size_t>(options.k), -1);
  g.weights.assign(g.ids.size(), 0.0f);
  g.result = outcome_of([&] { weave::top_k_gate(logits, options, g.ids, g.weights); });
  return g;
}

// Logits of 3 tokens over 8 experts: token t's expert e has 0.5 * e - t (every row distinct).
template <class T>
weave::host_matrix<T> logits_of() {
  weave::host_matrix<T> m(3, 8);
  for (std::size_t t = 0; t < 3; ++t)
    for (std::size_t e = 0; e < 8; ++e)
      m(t, e) = T(0.5f * static_cast<float>(e) - static_cast<float>(t));
  return m;
}

bool chooses(const gated& g, std::size_t token, int k, std::int32_t expert) {
  for (int j = 0; j < k; ++j)
    if (g.ids[token * static_cast<std::size_t>(k) + static_cast<std::size_t>(j)] == expert)
      return true;
  return false;
}

} // namespace

TEST_CASE("non-finite: the gate rejects NaN and +inf logits, and masks -inf ones") {
  for (const auto scoring : {weave::gate_scoring::softmax, weave::gate_scoring::sigmoid})
    for (const auto precision : {weave::gate_precision::f32, weave::gate_precision::bf16}) {
      CAPTURE(static_cast<int>(scoring));
      CAPTURE(static_cast<int>(precision));
      weave::gate_options o;
      o.k = 2;
      o.scoring = scoring;
      o.precision = precision;
      for (const auto& entry : both(f32_nonfinite, f32_extremes)) {
        const auto& s = entry.first;
        INFO("value: ", std::string(s.name));
        auto logits = logits_of<float>();
        logits(1, 6) = value(s);
        const auto g = gate(logits.view(), o);
        // bf16 precision rounds FLT_MAX up to +inf, which is refused as +inf.
        const bool rounds_to_inf =
            precision == weave::gate_precision::bf16 && s.bits == 0x7f7fffffu;
        if (nan_bits(s.bits) || positive_inf_bits(s.bits) || rounds_to_inf) {
          CHECK(g.result.code == errc::invalid_argument);
          CHECK(g.result.message.find("logit[1, 6]") != std::string::npos);
          continue;
        }
        REQUIRE(g.result.code == errc{});
        // -inf and -FLT_MAX are never among the best two of a row of finite logits; FLT_MAX
        // always is; the other rows keep their own best two (experts 7 and 6).
        if (s.bits == 0xff800000u || s.bits == 0xff7fffffu)
          CHECK(!chooses(g, 1, 2, 6));
        if (s.bits == 0x7f7fffffu)
          CHECK(g.ids[2] == 6);
        for (const std::size_t t : {std::size_t{0}, std::size_t{2}}) {
          CHECK(g.ids[2 * t] == 7);
          CHECK(g.ids[2 * t + 1] == 6);
        }
        for (const float w : g.weights)
          CHECK(finite_bits(bits(w)));
      }
      // A softmax row of only -inf logits has no distribution; sigmoid scores it 0 everywhere.
      auto logits = logits_of<float>();
      for (std::size_t e = 0; e < 8; ++e)
        logits(2, e) = value(f32_nonfinite[5]);
      const auto g = gate(logits.view(), o);
      if (scoring == weave::gate_scoring::softmax) {
        CHECK(g.result.code == errc::invalid_argument);
        CHECK(g.result.message.find("only -inf") != std::string::npos);
      } else {
        CHECK(g.result.code == errc{});
        CHECK(g.ids[4] == 0); // ties to the lower id
        CHECK(bits(g.weights[4]) == 0u);
      }
    }
}

TEST_CASE("non-finite: the gate checks f64, bf16 and f16 logits, the bias and route_scale") {
  weave::gate_options o;
  o.k = 2;
  for (const auto& s : f64_nonfinite) {
    INFO("value: ", std::string(s.name));
    auto logits = logits_of<double>();
    logits(0, 3) = value(s);
    const bool refused = nan_bits64(s.bits) || s.bits == 0x7ff0000000000000u;
    CHECK(gate(logits.view(), o).result.code == (refused ? errc::invalid_argument : errc{}));
  }
  for (const double big : {1e39, -1e39}) { // narrowed to f32: +-inf
    auto logits = logits_of<double>();
    logits(0, 3) = big;
    CHECK(gate(logits.view(), o).result.code == (big > 0 ? errc::invalid_argument : errc{}));
  }
  for (const auto& entry : both(bf16_nonfinite, bf16_extremes)) {
    const auto& s = entry.first;
    const bool finite = entry.second;
    INFO("value: ", std::string(s.name));
    auto logits = logits_of<weave::bfloat16>();
    logits(2, 0).bits = s.bits;
    const bool refused = !finite && s.bits != 0xff80u;
    CHECK(gate(logits.view(), o).result.code == (refused ? errc::invalid_argument : errc{}));
  }
  for (const auto& entry : both(half_nonfinite, half_extremes)) {
    const auto& s = entry.first;
    const bool finite = entry.second;
    INFO("value: ", std::string(s.name));
    auto logits = logits_of<weave::half>();
    logits(2, 0).bits = s.bits;
    const bool refused = !finite && s.bits != 0xfc00u;
    CHECK(gate(logits.view(), o).result.code == (refused ? errc::invalid_argument : errc{}));
  }
  const auto logits = logits_of<float>();
  for (const auto& entry : both(f32_nonfinite, f32_extremes)) {
    const auto& s = entry.first;
    const bool finite = entry.second;
    INFO("value: ", std::string(s.name));
    std::vector<float> bias(8, 0.25f);
    bias[5] = value(s);
    weave::gate_options b = o;
    b.bias = bias;
    const auto g = gate(logits.view(), b);
    CHECK(g.result.code == (finite ? errc{} : errc::invalid_argument));
    if (!finite)
      CHECK(g.result.message.find("bias[5]") != std::string::npos);
    // route_scale: finite and above 0 (the subnormals are left out: a consumer's flush-to-zero
    // mode may read them as 0).
    if ((s.bits & 0x7f800000u) == 0 && (s.bits & 0x007fffffu) != 0)
      continue;
    weave::gate_options r = o;
    r.route_scale = value(s);
    const bool usable = finite && (s.bits >> 31) == 0 && s.bits != 0;
    CHECK(gate(logits.view(), r).result.code == (usable ? errc{} : errc::invalid_argument));
  }
}

TEST_CASE("non-finite: capacity rejects non-finite factors and NaN priorities") {
  for (const auto& s : f64_nonfinite) {
    INFO("value: ", std::string(s.name));
    CHECK(outcome_of([&] { (void)weave::expert_capacity(value(s), 64, 2, 8); }).code ==
          errc::invalid_argument);
    weave::capacity_policy p;
    p.factor = value(s);
    CHECK(outcome_of([&] {
            weave::device_capacity_filter<weave::host_space> filter(8, 2, 64, p);
          }).code == errc::invalid_argument);
  }
  CHECK(weave::expert_capacity(-0.0, 64, 2, 8) == -1); // dropless, like +0
  // Priorities of 8 tokens, each choosing expert 0 (k = 1, E = 1): with capacity c the first c
  // tokens of the descending order are kept, ties to the earlier token, -0 equal to +0.
  const std::uint32_t priority_bits[] = {
      0x3f800000u, // 1
      0xff800000u, // -inf (a NaN in the second run: ranks last)
      0x80000000u, // -0
      0x7f800000u, // +inf
      0x00000000u, // +0
      0xff800000u, // -inf
      0x7f7fffffu, // FLT_MAX
      0xff7fffffu, // -FLT_MAX
  };
  const std::size_t order_of[] = {3, 6, 0, 2, 4, 7, 1, 5};
  const std::size_t nan_order_of[] = {3, 6, 0, 2, 4, 7, 5, 1};
  std::vector<float> priority(8);
  for (std::size_t t = 0; t < 8; ++t)
    priority[t] = std::bit_cast<float>(priority_bits[t]);
  const std::vector<std::int32_t> ids(8, 0);
  weave::host_stream stream("capacity");
  for (const auto order :
       {weave::drop_order::batch_prioritized, weave::drop_order::priority_token_major})
    for (int c = 1; c <= 8; ++c) {
      CAPTURE(c);
      const weave::capacity_policy p{c / 8.0, order, weave::capacity_rounding::ceil};
      weave::device_capacity_filter<weave::host_space> dev(1, 1, 8, p);
      weave_test::aligned_buffer ws(dev.workspace_size());
      dev.initialize(ws.ptr, ws.size, stream);
      std::vector<std::uint8_t> keep(8, 9);
      dev.decide(stream, ids, std::vector<float>(8, one), keep, priority);
      stream.synchronize();
      CHECK(dev.capacity() == c);
      CHECK(*dev.dropped_count() == 8 - c);
      for (std::size_t i = 0; i < 8; ++i)
        CHECK(keep[order_of[i]] == (static_cast<int>(i) < c ? 1 : 0));
      // The reference filter (tests/support) keeps the same pairs.
      oracle::capacity_filter reference(1, 1, 8, p);
      std::vector<std::uint8_t> want(8, 9);
      CHECK(reference.decide(ids, priority, want) == 8 - c);
      CHECK(keep == want);
      // A NaN priority ranks last.
      auto with_nan = priority;
      with_nan[1] = value(f32_nonfinite[c % 4]);
      dev.decide(stream, ids, std::vector<float>(8, one), keep, with_nan);
      stream.synchronize();
      for (std::size_t i = 0; i < 8; ++i)
        CHECK(keep[nan_order_of[i]] == (static_cast<int>(i) < c ? 1 : 0));
    }
}

TEST_CASE("non-finite: the device capacity filter ranks tokens by their best finite weight") {
  // No priorities given: a token's priority is the best weight of its valid choices, where a
  // NaN weight never wins (the plan flags it). Tokens choose experts 0 and 1 (k = 2, E = 2)
  // with the weights below: priorities 0.25, 0.9, 0.5, 0.2; at a capacity of one row per expert
  // only token 1 keeps its pairs.
  weave::host_stream stream("capacity");
  const weave::capacity_policy p{1 / 4.0, weave::drop_order::priority_token_major,
                                 weave::capacity_rounding::ceil};
  const std::vector<std::int32_t> ids = {0, 1, 0, 1, 0, 1, 0, 1};
  for (const auto& s : f32_nonfinite) {
    if (!nan_bits(s.bits))
      continue;
    INFO("value: ", std::string(s.name));
    const std::vector<float> weights = {0.25f, 0.1f, value(s), 0.9f, 0.5f, 0.3f, 0.125f, 0.2f};
    weave::device_capacity_filter<weave::host_space> dev(2, 2, 4, p);
    weave_test::aligned_buffer ws(dev.workspace_size());
    dev.initialize(ws.ptr, ws.size, stream);
    std::vector<std::uint8_t> keep(8, 9);
    dev.decide(stream, ids, weights, keep);
    stream.synchronize();
    CHECK(keep == std::vector<std::uint8_t>{0, 0, 1, 1, 0, 0, 0, 0});
  }
}

TEST_CASE("non-finite: dispatch and expert plans reject non-finite gate weights") {
  const auto where = weave::placement::contiguous(8, 4);
  weave::host_stream stream("plan");
  weave::device_dispatch_plan<weave::host_space> dev(where, 2, 0, 4);
  weave_test::aligned_buffer ws(dev.workspace_size());
  dev.initialize(ws.ptr, ws.size, stream);
  weave::device_expert_plan<weave::host_space> dev_experts(3, 2, 1, 2);
  weave_test::aligned_buffer ws2(dev_experts.workspace_size());
  dev_experts.initialize(ws2.ptr, ws2.size, stream);
  oracle::dispatch_plan reference(where, 2, 0);
  oracle::expert_plan reference_experts(3, 2);
  const std::vector<std::int32_t> ids = {0, 5, 2, 7, 1, 3, 6, 4};
  const std::vector<std::int64_t> counts = {2}, displs = {0};
  for (const auto& entry : both(f32_nonfinite, f32_extremes)) {
    const auto& s = entry.first;
    const bool finite = entry.second;
    INFO("value: ", std::string(s.name));
    std::vector<float> weights(8, 0.5f);
    weights[5] = value(s);
    const auto want = finite ? errc{} : errc::invalid_argument;
    // The host check the exchanges run on the choices names the pair.
    const auto checked = outcome_of([&] { weave::detail::check_routing(ids, weights, 2, 8); });
    CHECK(checked.code == want);
    if (!finite)
      CHECK(checked.message.find("of token 2 for expert 3") != std::string::npos);
    CHECK(outcome_of([&] {
            dev.build(stream, ids, weights);
            dev.check_errors(stream);
          }).code == want);
    // Dropped by capacity still counts: the weight is checked before the keep mask.
    std::vector<std::uint8_t> keep(8, 1);
    keep[5] = 0;
    CHECK(outcome_of([&] {
            dev.build(stream, ids, weights, keep);
            dev.check_errors(stream);
          }).code == want);
    CHECK(outcome_of([&] { reference.build(ids, weights, keep); }).code == want);
    // Received rows: the receiver checks what peers send.
    const std::vector<weave::route_entry> routes = {{0, 1}, {2, value(s)}, {1, 1}, {-1, 0}};
    CHECK(outcome_of([&] {
            dev_experts.build(stream, routes, counts.data(), displs.data());
            dev_experts.check_errors(stream);
          }).code == want);
    CHECK(outcome_of([&] { reference_experts.build(routes, counts); }).code == want);
  }
}

TEST_CASE("non-finite: similarity pruning rejects a NaN similarity") {
  const auto where = weave::placement::contiguous(4, 2);
  weave::device_limit limit;
  limit.where = &where;
  limit.max_devices = 1;
  for (const auto& entry : both(f32_nonfinite, f32_extremes)) {
    const auto& s = entry.first;
    INFO("value: ", std::string(s.name));
    std::vector<float> similarity(16, 0.5f);
    similarity[2 * 4 + 1] = value(s); // expert 2 (device 1) -> candidate 1 (device 0)
    std::vector<std::int32_t> ids = {0, 2};
    const auto got = outcome_of([&] { weave::prune_by_similarity(ids, 2, limit, similarity); });
    CHECK(got.code == (nan_bits(s.bits) ? errc::invalid_argument : errc{}));
    if (!nan_bits(s.bits))
      CHECK(ids[1] == 1);
  }
}
