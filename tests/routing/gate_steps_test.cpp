// The gate's DeepSeek-V3 options on the host, and the CUDA gate's per-token steps run on the host:
// - the CUDA gate's group-limit steps (`group_score`, `group_kept`, gate_steps.hpp), run lane by
//   lane as its warps run them, then a top-k by full sort, choose what the host gate chooses,
//   on random shapes with many exact ties (equal scores, equal group scores);
// - `gate_precision::bf16` equals a scalar model of DeepSeek-V3's reference gate in a bf16
//   model (torch's rounding to bf16 at each step, done with weave::bfloat16), ids and weights
//   bit for bit, with and without bias and group limit;
// - `route_scale` multiplies the finished weights, and bad values are typed errors;
// - the documented edge cases: one expert per group with a bias, k above the kept experts.
#include <doctest/doctest.h>

#include <weave/core/dtype.hpp>
#include <weave/core/host_matrix.hpp>
#include <weave/routing/gate.hpp>
#include <weave/routing/gate_steps.hpp>
#include <weave/routing/group_limit.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

namespace {

using weave::gate_precision;
using weave::gate_scoring;

// Indices of the k largest keys, higher key first, ties to the lower index; NaN keys excluded.
std::vector<int> sorted_top_k(const std::vector<float>& key, int k) {
  std::vector<int> order;
  for (int e = 0; e < static_cast<int>(key.size()); ++e)
    if (!std::isnan(key[static_cast<std::size_t>(e)]))
      order.push_back(e);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return key[static_cast<std::size_t>(a)] > key[static_cast<std::size_t>(b)];
  });
  order.resize(static_cast<std::size_t>(k));
  return order;
}

// Logits that are bf16 values (so gate_precision::bf16 does not round them) with many exact
// ties (`ties`: multiples of 1/4 in [-3, 3]) or few (normal).
weave::host_matrix<float> bf16_logits(std::size_t T, std::size_t E, std::mt19937& rng, bool ties) {
  weave::host_matrix<float> m(T, E);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::uniform_int_distribution<int> quarter(-12, 12);
  for (float& x : m.elements())
    x = ties ? static_cast<float>(quarter(rng)) / 4
             : static_cast<float>(weave::bfloat16(normal(rng)));
  return m;
}

// Every expert's score per token under `precision`, from the unrestricted f32 gate with k = E
// (whose weights are its scores: no renormalization, scale 1). The logits are bf16 values, so
// the bf16 gate's scores are these with sigmoid scores rounded to bf16.
std::vector<std::vector<float>> scores_of(const weave::host_matrix<float>& logits,
                                          gate_scoring scoring, gate_precision precision) {
  const std::size_t T = logits.rows(), E = logits.cols();
  weave::gate_options o;
  o.k = static_cast<int>(E);
  o.scoring = scoring;
  std::vector<std::int32_t> ids(T * E);
  std::vector<float> w(T * E);
  weave::top_k_gate(logits.view(), o, ids, w);
  std::vector<std::vector<float>> out(T, std::vector<float>(E));
  for (std::size_t t = 0; t < T; ++t)
    for (std::size_t i = 0; i < E; ++i) {
      float s = w[t * E + i];
      if (precision == gate_precision::bf16 && scoring == gate_scoring::sigmoid)
        s = static_cast<float>(weave::bfloat16(s));
      out[t][static_cast<std::size_t>(ids[t * E + i])] = s;
    }
  return out;
}

} // namespace

TEST_CASE("the CUDA gate's group steps, run lane by lane, choose what the host gate chooses") {
  std::mt19937 rng(61);
  int tokens = 0, tied_groups = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const int G = 1 + static_cast<int>(rng() % 9);
    const int size = 1 + static_cast<int>(rng() % 6);
    const int E = G * size;
    weave::group_limit limit;
    limit.groups = G;
    limit.top_groups = 1 + static_cast<int>(rng() % static_cast<unsigned>(G));
    limit.scores_per_group = rng() % 3 == 0 ? 1 + static_cast<int>(rng() % size) : 0;
    const int k = 1 + static_cast<int>(rng() % static_cast<unsigned>(limit.top_groups * size));
    const std::size_t T = 1 + rng() % 40;
    const bool ties = trial % 3 != 0;
    const auto logits = bf16_logits(T, static_cast<std::size_t>(E), rng, ties);
    weave::gate_options o;
    o.k = k;
    o.scoring = trial % 2 ? gate_scoring::sigmoid : gate_scoring::softmax;
    o.precision = trial % 4 < 2 ? gate_precision::bf16 : gate_precision::f32;
    o.groups = &limit;
    std::vector<float> bias;
    if (trial % 5 < 3) // quantized biases keep keys tied; the others break ties
      for (int e = 0; e < E; ++e)
        bias.push_back(ties ? 0.25f * static_cast<float>(rng() % 3)
                            : std::uniform_real_distribution<float>(-0.1f, 0.1f)(rng));
    o.bias = bias;
    std::vector<std::int32_t> ids(T * static_cast<std::size_t>(k));
    std::vector<float> w(ids.size());
    weave::top_k_gate(logits.view(), o, ids, w);
    const auto scores = scores_of(logits, o.scoring, o.precision);
    const int m = weave::detail::group_score_count(limit.scores_per_group, size, !bias.empty());
    for (std::size_t t = 0; t < T; ++t) {
      std::vector<float> key = scores[t];
      for (std::size_t e = 0; e < bias.size(); ++e)
        key[e] += bias[e];
      // As the kernel's warp does: phase 1, a lane per group scores it; phase 2, a lane per
      // group drops its experts unless the group is kept (reading every group score).
      std::vector<float> group_scores(static_cast<std::size_t>(G));
      for (int lane = 0; lane < 32; ++lane)
        for (int g = lane; g < G; g += 32)
          group_scores[static_cast<std::size_t>(g)] = weave::detail::group_score(
              key.data() + static_cast<std::ptrdiff_t>(g * size), size, m);
      for (int lane = 0; lane < 32; ++lane)
        for (int g = lane; g < G; g += 32)
          if (!weave::detail::group_kept(group_scores.data(), G, limit.top_groups, g))
            for (int e = g * size; e < (g + 1) * size; ++e)
              key[static_cast<std::size_t>(e)] = std::numeric_limits<float>::quiet_NaN();
      const auto want = sorted_top_k(key, k);
      for (int i = 0; i < k; ++i)
        REQUIRE(ids[t * static_cast<std::size_t>(k) + static_cast<std::size_t>(i)] ==
                want[static_cast<std::size_t>(i)]);
      std::vector<float> sorted = group_scores;
      std::sort(sorted.begin(), sorted.end());
      tied_groups += std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end() ? 1 : 0;
      ++tokens;
    }
  }
  MESSAGE(tokens, " tokens, ", tied_groups, " with two equal group scores");
  CHECK(tied_groups > tokens / 10); // the tie rules are exercised
}

namespace {

// DeepSeek-V3's reference gate (`Gate.forward`, inference/model.py) in a bf16 model, as torch
// evaluates it, one scalar at a time: bf16 logits; sigmoid in f32 rounded to bf16, or an f32
// softmax; the f32 bias added in f32; the group score amax (no bias) or top-2 sum (bias) of the
// selection scores; top-k of the masked selection scores; weights gathered from the unbiased
// scores; for sigmoid, divided in bf16 by their bf16 sum (accumulated in f32); multiplied by
// route_scale (in bf16 for sigmoid, f32 for softmax); returned as bf16. Ties: lower index.
struct bf16_reference {
  gate_scoring scoring = gate_scoring::sigmoid;
  std::vector<float> bias; // empty: none
  int groups = 1, top_groups = 1, k = 1;
  float route_scale = 1.0f;

  void choose(const float* logits, int E, std::vector<int>& ids, std::vector<float>& w) const {
    using bf16 = weave::bfloat16;
    std::vector<float> original(static_cast<std::size_t>(E));
    std::vector<float> x(static_cast<std::size_t>(E));
    for (int e = 0; e < E; ++e)
      x[static_cast<std::size_t>(e)] = static_cast<float>(bf16(logits[e]));
    if (scoring == gate_scoring::sigmoid) {
      for (std::size_t e = 0; e < x.size(); ++e)
        original[e] = static_cast<float>(bf16(1.0f / (1.0f + std::exp(-x[e]))));
    } else {
      const float top = *std::max_element(x.begin(), x.end());
      float sum = 0.0f;
      for (std::size_t e = 0; e < x.size(); ++e) {
        original[e] = std::exp(x[e] - top);
        sum += original[e];
      }
      for (float& s : original)
        s /= sum;
    }
    std::vector<float> selection = original;
    for (std::size_t e = 0; e < bias.size(); ++e)
      selection[e] = original[e] + bias[e];
    if (groups > 1) {
      const std::size_t size = x.size() / static_cast<std::size_t>(groups);
      std::vector<float> group_score(static_cast<std::size_t>(groups));
      for (std::size_t g = 0; g < group_score.size(); ++g) {
        std::vector<float> v(selection.begin() + static_cast<std::ptrdiff_t>(g * size),
                             selection.begin() + static_cast<std::ptrdiff_t>((g + 1) * size));
        std::sort(v.begin(), v.end(), std::greater<>());
        group_score[g] = bias.empty() ? v[0] : v[0] + v[1];
      }
      std::vector<int> order(static_cast<std::size_t>(groups));
      for (int g = 0; g < groups; ++g)
        order[static_cast<std::size_t>(g)] = g;
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
        return group_score[static_cast<std::size_t>(a)] > group_score[static_cast<std::size_t>(b)];
      });
      for (std::size_t r = static_cast<std::size_t>(top_groups); r < order.size(); ++r)
        for (std::size_t e = 0; e < size; ++e)
          selection[static_cast<std::size_t>(order[r]) * size + e] =
              -std::numeric_limits<float>::infinity();
    }
    std::vector<int> order(x.size());
    for (int e = 0; e < E; ++e)
      order[static_cast<std::size_t>(e)] = e;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      return selection[static_cast<std::size_t>(a)] > selection[static_cast<std::size_t>(b)];
    });
    ids.assign(order.begin(), order.begin() + k);
    w.clear();
    if (scoring == gate_scoring::sigmoid) {
      std::vector<bf16> g;
      float sum = 0.0f;
      for (const int e : ids) {
        g.push_back(bf16(original[static_cast<std::size_t>(e)])); // exact: already bf16
        sum += static_cast<float>(g.back());
      }
      const bf16 total(sum);
      for (bf16& v : g) {
        v = bf16(static_cast<float>(v) / static_cast<float>(total));
        v = bf16(static_cast<float>(v) * route_scale);
        w.push_back(static_cast<float>(v));
      }
    } else {
      for (const int e : ids)
        w.push_back(static_cast<float>(bf16(original[static_cast<std::size_t>(e)] * route_scale)));
    }
  }
};

} // namespace

TEST_CASE("gate_precision::bf16 equals DeepSeek-V3's reference gate in bf16, bit for bit") {
  std::mt19937 rng(67);
  std::size_t tokens = 0, differ_from_f32 = 0;
  for (int trial = 0; trial < 120; ++trial) {
    // DeepSeek-V3's shape (256 experts, 8 groups, 4 kept, k = 8, sigmoid, bias, scale 2.5)
    // among smaller ones; softmax without renormalization as the reference's other branch.
    const bool v3 = trial % 4 == 0;
    const int G = v3 ? 8 : 1 + static_cast<int>(rng() % 6);
    const int size = v3 ? 32 : 2 + static_cast<int>(rng() % 6);
    const int E = G * size;
    bf16_reference ref;
    ref.scoring = trial % 3 == 2 ? gate_scoring::softmax : gate_scoring::sigmoid;
    ref.groups = G;
    ref.top_groups = v3 ? 4 : 1 + static_cast<int>(rng() % static_cast<unsigned>(G));
    ref.k = v3 ? 8 : 1 + static_cast<int>(rng() % static_cast<unsigned>(ref.top_groups * size));
    ref.route_scale = v3 ? 2.5f : std::uniform_real_distribution<float>(0.5f, 3.0f)(rng);
    if (v3 || trial % 2 == 0) {
      std::normal_distribution<float> b(0.0f, 0.05f);
      for (int e = 0; e < E; ++e)
        ref.bias.push_back(b(rng));
    }
    const std::size_t T = 1 + rng() % 64;
    // f32 logits of a bf16 model's scale: the gate rounds them to bf16 first.
    weave::host_matrix<float> logits(T, static_cast<std::size_t>(E));
    std::normal_distribution<float> normal(0.0f, 1.5f);
    for (float& x : logits.elements())
      x = normal(rng);
    const weave::group_limit limit{G, ref.top_groups, 0};
    weave::gate_options o;
    o.k = ref.k;
    o.scoring = ref.scoring;
    o.renormalize = ref.scoring == gate_scoring::sigmoid;
    o.bias = ref.bias;
    o.groups = G > 1 ? &limit : nullptr;
    o.route_scale = ref.route_scale;
    o.precision = gate_precision::bf16;
    const auto kk = static_cast<std::size_t>(ref.k);
    std::vector<std::int32_t> ids(T * kk), f32_ids(T * kk);
    std::vector<float> w(T * kk), f32_w(T * kk);
    weave::top_k_gate(logits.view(), o, ids, w);
    o.precision = gate_precision::f32;
    weave::top_k_gate(logits.view(), o, f32_ids, f32_w);
    std::vector<int> want_ids;
    std::vector<float> want_w;
    for (std::size_t t = 0; t < T; ++t) {
      ref.choose(logits.row(t).data(), E, want_ids, want_w);
      for (std::size_t i = 0; i < kk; ++i) {
        REQUIRE(ids[t * kk + i] == want_ids[i]);
        CHECK(std::bit_cast<std::uint32_t>(w[t * kk + i]) ==
              std::bit_cast<std::uint32_t>(want_w[i]));
      }
      bool same = true;
      for (std::size_t i = 0; i < kk; ++i)
        same = same && ids[t * kk + i] == f32_ids[t * kk + i];
      differ_from_f32 += same ? 0 : 1;
      ++tokens;
    }
  }
  MESSAGE(differ_from_f32, " of ", tokens, " tokens choose other experts or another order in f32");
  CHECK(differ_from_f32 > 0); // the option changes choices, as the reference's rounding does
}

TEST_CASE("route_scale multiplies the finished weights, not the top score") {
  std::mt19937 rng(71);
  const std::size_t T = 50;
  const int E = 16, k = 4;
  const auto logits = bf16_logits(T, E, rng, false);
  for (const bool renormalize : {false, true})
    for (const auto scoring : {gate_scoring::softmax, gate_scoring::sigmoid}) {
      weave::gate_options o;
      o.k = k;
      o.scoring = scoring;
      o.renormalize = renormalize;
      std::vector<std::int32_t> ids(T * k), scaled_ids(T * k);
      std::vector<float> w(T * k), scaled(T * k), top(T), scaled_top(T);
      weave::top_k_gate(logits.view(), o, ids, w, top);
      o.route_scale = 2.5f;
      weave::top_k_gate(logits.view(), o, scaled_ids, scaled, scaled_top);
      CHECK(scaled_ids == ids);
      CHECK(scaled_top == top);
      for (std::size_t i = 0; i < w.size(); ++i)
        CHECK(scaled[i] == w[i] * 2.5f); // one f32 product after the renormalization
    }
  weave::gate_options o;
  o.k = k;
  std::vector<std::int32_t> ids(T * k);
  std::vector<float> w(T * k);
  for (const float bad : {0.0f, -1.0f, std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN()}) {
    o.route_scale = bad;
    try {
      weave::top_k_gate(logits.view(), o, ids, w);
      FAIL("route_scale = ", bad, " was accepted");
    } catch (const weave::error& e) {
      CHECK(e.code() == weave::errc::invalid_argument);
    }
  }
}

TEST_CASE("a logit that rounds to +inf in bf16 is rejected under gate_precision::bf16") {
  weave::host_matrix<float> logits(1, 4);
  logits(0, 2) = std::numeric_limits<float>::max(); // finite in f32, +inf in bf16
  weave::gate_options o;
  std::vector<std::int32_t> ids(1);
  std::vector<float> w(1);
  CHECK_NOTHROW(weave::top_k_gate(logits.view(), o, ids, w));
  o.precision = gate_precision::bf16;
  CHECK_THROWS_AS(weave::top_k_gate(logits.view(), o, ids, w), weave::error);
}

TEST_CASE("group limit edge cases: one expert per group with a bias, k above the kept experts") {
  std::mt19937 rng(73);
  const std::size_t T = 200;
  const int E = 12, k = 3;
  const auto logits = bf16_logits(T, E, rng, true);
  std::vector<float> bias(E);
  for (float& b : bias)
    b = 0.25f * static_cast<float>(rng() % 3);
  weave::gate_options o;
  o.k = k;
  o.scoring = gate_scoring::sigmoid;
  o.bias = bias;
  std::vector<std::int32_t> free_ids(T * k), ids(T * k);
  std::vector<float> free_w(T * k), w(T * k);
  weave::top_k_gate(logits.view(), o, free_ids, free_w);
  // One expert per group: a group's score is its one selection score (the reference's top-2
  // sum has no second score), so keeping top_groups >= k groups keeps the k best experts: the
  // limit changes nothing, ties included.
  weave::group_limit one{E, k, 0};
  o.groups = &one;
  const auto summary = weave::top_k_gate(logits.view(), o, ids, w);
  CHECK(ids == free_ids);
  CHECK(w == free_w);
  CHECK(summary.limited == 0);
  // k above the experts of the kept groups: refused before any token is gated.
  weave::group_limit narrow{4, 1, 0}; // one group of 3 experts kept
  o.groups = &narrow;
  o.k = 4;
  std::vector<std::int32_t> ids4(T * 4);
  std::vector<float> w4(T * 4);
  try {
    weave::top_k_gate(logits.view(), o, ids4, w4);
    FAIL("k = 4 with 3 kept experts was accepted");
  } catch (const weave::error& e) {
    CHECK(e.code() == weave::errc::invalid_argument);
  }
}
