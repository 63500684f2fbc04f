// top_k_gate and device-limited routing against brute force: scores recomputed per token,
// a full sort of every expert for top-k, every device scored by sorting all its experts.
#include <doctest/doctest.h>

#include "routing_reference.hpp"

#include <weave/core/host_matrix.hpp>
#include <weave/routing/gate.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <vector>

namespace {

// Scores of one row, computed as the documented formula (fp32, same steps).
std::vector<float> reference_scores(std::span<const float> logits, weave::gate_scoring scoring) {
  std::vector<float> s(logits.begin(), logits.end());
  if (scoring == weave::gate_scoring::softmax) {
    const float top = *std::max_element(s.begin(), s.end());
    float sum = 0;
    for (float& x : s) {
      x = std::exp(x - top);
      sum += x;
    }
    for (float& x : s)
      x /= sum;
  } else {
    for (float& x : s)
      x = 1.0f / (1.0f + std::exp(-x));
  }
  return s;
}

// Full sort by (selection desc, id asc) over the allowed experts.
std::vector<int> brute_top_k(const std::vector<float>& selection, int k,
                             const std::vector<bool>& allowed) {
  std::vector<int> order;
  for (int e = 0; e < static_cast<int>(selection.size()); ++e)
    if (allowed.empty() || allowed[static_cast<std::size_t>(e)])
      order.push_back(e);
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    const float sa = selection[static_cast<std::size_t>(a)],
                sb = selection[static_cast<std::size_t>(b)];
    return sa != sb ? sa > sb : a < b;
  });
  order.resize(static_cast<std::size_t>(k));
  return order;
}

weave::host_matrix<float> random_logits(std::size_t T, std::size_t E, std::mt19937& rng,
                                        bool ties) {
  weave::host_matrix<float> m(T, E);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::uniform_int_distribution<int> small(-3, 3);
  for (float& x : m.elements())
    x = ties ? static_cast<float>(small(rng)) : normal(rng);
  return m;
}

} // namespace

TEST_CASE("top_k_gate equals brute-force top-k with ties to the lower id, softmax and sigmoid") {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 60; ++trial) {
    const std::size_t T = 1 + rng() % 40;
    const int E = 1 + static_cast<int>(rng() % 40);
    const int k = 1 + static_cast<int>(rng() % static_cast<unsigned>(E));
    const bool ties = trial % 2 == 0;
    const auto logits = random_logits(T, static_cast<std::size_t>(E), rng, ties);
    weave::gate_options options;
    options.k = k;
    options.scoring = trial % 3 == 0 ? weave::gate_scoring::sigmoid : weave::gate_scoring::softmax;
    options.renormalize = trial % 4 == 1;
    std::vector<float> bias;
    if (trial % 5 == 2) {
      for (int e = 0; e < E; ++e)
        bias.push_back(static_cast<float>(static_cast<int>(rng() % 5)) * 0.125f);
      options.bias = bias;
    }
    std::vector<std::int32_t> ids(T * static_cast<std::size_t>(k));
    std::vector<float> weights(ids.size());
    const auto summary = weave::top_k_gate(logits.view(), options, ids, weights);
    CHECK(summary.tokens == T);

    std::vector<double> mean_prob(static_cast<std::size_t>(E), 0),
        first(static_cast<std::size_t>(E), 0);
    for (std::size_t t = 0; t < T; ++t) {
      const auto scores = reference_scores(logits.row(t), options.scoring);
      std::vector<float> selection = scores;
      for (std::size_t e = 0; e < bias.size(); ++e)
        selection[e] += bias[e];
      const auto expect = brute_top_k(selection, k, {});
      float chosen = 0;
      for (int i = 0; i < k; ++i)
        chosen += scores[static_cast<std::size_t>(expect[static_cast<std::size_t>(i)])];
      for (int i = 0; i < k; ++i) {
        const std::size_t q = t * static_cast<std::size_t>(k) + static_cast<std::size_t>(i);
        REQUIRE(ids[q] == expect[static_cast<std::size_t>(i)]);
        float w = scores[static_cast<std::size_t>(expect[static_cast<std::size_t>(i)])];
        if (options.renormalize)
          w /= chosen;
        CHECK(weights[q] == doctest::Approx(w).epsilon(1e-6));
      }
      double sum = 0;
      for (float s : scores)
        sum += s;
      for (int e = 0; e < E; ++e)
        mean_prob[static_cast<std::size_t>(e)] += scores[static_cast<std::size_t>(e)] / sum;
      first[static_cast<std::size_t>(expect[0])] += 1; // one-hot mask of the first choice
    }
    double aux = 0;
    for (int e = 0; e < E; ++e)
      aux += mean_prob[static_cast<std::size_t>(e)] / static_cast<double>(T) *
             first[static_cast<std::size_t>(e)] / static_cast<double>(T);
    CHECK(summary.aux_loss == doctest::Approx(aux * E).epsilon(1e-5));
  }
}

TEST_CASE("top_k_gate's top_score is the largest unbiased score, other outputs are unchanged") {
  std::mt19937 rng(13);
  for (int trial = 0; trial < 40; ++trial) {
    const std::size_t T = 1 + rng() % 30;
    const int E = 1 + static_cast<int>(rng() % 24);
    const int k = 1 + static_cast<int>(rng() % static_cast<unsigned>(E));
    const auto logits = random_logits(T, static_cast<std::size_t>(E), rng, trial % 2 == 0);
    weave::gate_options options;
    options.k = k;
    options.scoring = trial % 3 == 0 ? weave::gate_scoring::sigmoid : weave::gate_scoring::softmax;
    options.renormalize = trial % 2 == 1;
    std::vector<float> bias;
    if (trial % 4 == 3) { // a bias that moves the choices away from the best score
      for (int e = 0; e < E; ++e)
        bias.push_back(static_cast<float>(E - e) * 0.25f);
      options.bias = bias;
    }
    std::vector<std::int32_t> ids(T * static_cast<std::size_t>(k)), ids2(ids.size());
    std::vector<float> weights(ids.size()), weights2(ids.size()), top(T, -1.0f);
    const auto plain = weave::top_k_gate(logits.view(), options, ids, weights);
    const auto with_top = weave::top_k_gate(logits.view(), options, ids2, weights2, top);
    CHECK(ids2 == ids);
    CHECK(std::memcmp(weights2.data(), weights.data(), weights.size() * sizeof(float)) == 0);
    CHECK(with_top.aux_loss == plain.aux_loss);
    for (std::size_t t = 0; t < T; ++t) {
      const auto scores = reference_scores(logits.row(t), options.scoring);
      CHECK(top[t] == doctest::Approx(*std::max_element(scores.begin(), scores.end())));
    }
  }
  weave::host_matrix<float> logits(3, 4);
  std::vector<std::int32_t> ids(3);
  std::vector<float> weights(3), top(2);
  weave::gate_options options;
  CHECK_THROWS_AS(weave::top_k_gate(logits.view(), options, ids, weights, top), weave::error);
}

TEST_CASE("top_k_gate reads bf16 and f16 logits as their fp32 values") {
  std::mt19937 rng(11);
  const std::size_t T = 33, E = 16;
  const int k = 3;
  const auto f32 = random_logits(T, E, rng, false);
  weave::host_matrix<weave::bfloat16> bf(T, E);
  weave::host_matrix<weave::half> hf(T, E);
  weave::host_matrix<float> bf_as_f32(T, E), hf_as_f32(T, E);
  for (std::size_t i = 0; i < T * E; ++i) {
    bf.elements()[i] = weave::bfloat16(f32.elements()[i]);
    hf.elements()[i] = weave::half(f32.elements()[i]);
    bf_as_f32.elements()[i] = static_cast<float>(bf.elements()[i]);
    hf_as_f32.elements()[i] = static_cast<float>(hf.elements()[i]);
  }
  weave::gate_options options;
  options.k = k;
  auto gate = [&](weave::const_token_view v) {
    std::vector<std::int32_t> ids(T * k);
    std::vector<float> w(T * k);
    weave::top_k_gate(v, options, ids, w);
    return std::pair(ids, w);
  };
  CHECK(gate(bf.view()) == gate(bf_as_f32.view()));
  CHECK(gate(hf.view()) == gate(hf_as_f32.view()));
}

TEST_CASE("device-limited gating by score equals brute-force device choice, also with replicas") {
  std::mt19937 rng(21);
  for (int trial = 0; trial < 40; ++trial) {
    const int D = 2 + static_cast<int>(rng() % 5);
    const int E = D * (1 + static_cast<int>(rng() % 4));
    const int extra = trial % 3 == 0 ? 1 : 0;
    const auto p = ref::random_placement(E, D, extra, rng);
    const int M = 1 + static_cast<int>(rng() % static_cast<unsigned>(D));
    const int k = 1 + static_cast<int>(rng() % static_cast<unsigned>(std::min(E, M * (E / D))));
    const int source = static_cast<int>(rng() % static_cast<unsigned>(D));
    const std::size_t T = 1 + rng() % 30, offset = rng() % 100;
    const auto logits = random_logits(T, static_cast<std::size_t>(E), rng, trial % 2 == 0);
    weave::device_limit limit{&p, M, source, offset, 0};
    weave::gate_options options;
    options.k = k;
    options.limit = &limit;
    std::vector<std::int32_t> ids(T * static_cast<std::size_t>(k));
    std::vector<float> weights(ids.size());
    bool unreachable = false;
    try {
      weave::top_k_gate(logits.view(), options, ids, weights);
    } catch (const weave::error& e) {
      // Only replicated placements can leave the M best devices with fewer than k experts.
      CHECK(e.code() == weave::errc::invalid_argument);
      CHECK(extra > 0);
      unreachable = true;
    }
    if (unreachable)
      continue;
    const int g = (k + M - 1) / M;
    for (std::size_t t = 0; t < T; ++t) {
      const auto scores = reference_scores(logits.row(t), options.scoring);
      std::vector<std::vector<float>> per_device(static_cast<std::size_t>(D));
      std::vector<int> dev(static_cast<std::size_t>(E));
      for (int e = 0; e < E; ++e) {
        dev[static_cast<std::size_t>(e)] = p.device_of_slot(p.slot_for(e, offset + t, source));
        per_device[static_cast<std::size_t>(dev[static_cast<std::size_t>(e)])].push_back(
            scores[static_cast<std::size_t>(e)]);
      }
      std::vector<std::pair<double, int>> device_scores;
      for (int d = 0; d < D; ++d) {
        auto& v = per_device[static_cast<std::size_t>(d)];
        if (v.empty())
          continue;
        std::sort(v.begin(), v.end(), std::greater<>());
        double sum = 0;
        for (int i = 0; i < g && i < static_cast<int>(v.size()); ++i)
          sum += v[static_cast<std::size_t>(i)];
        device_scores.push_back({sum, d});
      }
      std::stable_sort(device_scores.begin(), device_scores.end(),
                       [](auto& a, auto& b) { return a.first > b.first; });
      std::vector<bool> allowed(static_cast<std::size_t>(E), false);
      std::set<int> chosen_devices;
      for (int i = 0; i < M && i < static_cast<int>(device_scores.size()); ++i)
        chosen_devices.insert(device_scores[static_cast<std::size_t>(i)].second);
      for (int e = 0; e < E; ++e)
        allowed[static_cast<std::size_t>(e)] =
            chosen_devices.count(dev[static_cast<std::size_t>(e)]) > 0;
      const auto expect = brute_top_k(scores, k, allowed);
      std::set<int> used;
      for (int i = 0; i < k; ++i) {
        REQUIRE(ids[t * static_cast<std::size_t>(k) + static_cast<std::size_t>(i)] ==
                expect[static_cast<std::size_t>(i)]);
        used.insert(dev[static_cast<std::size_t>(expect[static_cast<std::size_t>(i)])]);
      }
      CHECK(static_cast<int>(used.size()) <= M);
    }
  }
}

TEST_CASE("prune_by_similarity keeps at most M devices and picks the most similar replacement") {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 40; ++trial) {
    const int D = 2 + static_cast<int>(rng() % 4);
    const int E = D * (2 + static_cast<int>(rng() % 3));
    const auto p = ref::random_placement(E, D, 0, rng);
    const int M = 1 + static_cast<int>(rng() % static_cast<unsigned>(D));
    const int k = 1 + static_cast<int>(rng() % static_cast<unsigned>(std::min(E, M * (E / D))));
    const std::size_t T = 1 + rng() % 20;
    const auto logits = random_logits(T, static_cast<std::size_t>(E), rng, false);
    std::vector<float> sim(static_cast<std::size_t>(E * E));
    for (float& s : sim)
      s = std::uniform_real_distribution<float>(0, 1)(rng);
    weave::gate_options options;
    options.k = k;
    std::vector<std::int32_t> ids(T * static_cast<std::size_t>(k));
    std::vector<float> weights(ids.size());
    weave::top_k_gate(logits.view(), options, ids, weights);
    const auto before = ids;
    weave::device_limit limit{&p, M, 0, 0, 0};
    const auto replaced = weave::prune_by_similarity(ids, k, limit, sim);
    std::int64_t changed = 0;
    for (std::size_t t = 0; t < T; ++t) {
      std::vector<int> kept_devices; // first M distinct devices of the original choices
      for (int i = 0; i < k; ++i) {
        const int d =
            p.device_of(before[t * static_cast<std::size_t>(k) + static_cast<std::size_t>(i)]);
        if (std::find(kept_devices.begin(), kept_devices.end(), d) == kept_devices.end() &&
            static_cast<int>(kept_devices.size()) < M)
          kept_devices.push_back(d);
      }
      auto kept = [&](int e) {
        return std::find(kept_devices.begin(), kept_devices.end(), p.device_of(e)) !=
               kept_devices.end();
      };
      std::set<int> final_set, original(before.begin() + static_cast<long>(t) * k,
                                        before.begin() + static_cast<long>(t + 1) * k);
      std::set<int> taken = original;
      for (int i = 0; i < k; ++i) {
        const std::size_t q = t * static_cast<std::size_t>(k) + static_cast<std::size_t>(i);
        final_set.insert(ids[q]);
        CHECK(kept(ids[q]));
        if (kept(before[q])) {
          CHECK(ids[q] == before[q]);
          continue;
        }
        ++changed;
        // Brute force: the best unselected expert on a kept device, given earlier replacements.
        int best = -1;
        for (int c = 0; c < E; ++c)
          if (!taken.count(c) && kept(c) &&
              (best < 0 || sim[static_cast<std::size_t>(before[q] * E + c)] >
                               sim[static_cast<std::size_t>(before[q] * E + best)]))
            best = c;
        CHECK(ids[q] == best);
        taken.insert(best);
      }
      CHECK(final_set.size() == static_cast<std::size_t>(k)); // no expert twice
    }
    CHECK(replaced == changed);
  }
}

TEST_CASE("top_k_gate rejects bad input with the right error code") {
  weave::host_matrix<float> logits(4, 8, 0.5f);
  std::vector<std::int32_t> ids(8);
  std::vector<float> w(8);
  auto code = [&](weave::gate_options o, weave::const_token_view v, std::size_t out = 8) {
    ids.assign(out, 0);
    w.assign(out, 0);
    try {
      weave::top_k_gate(v, o, ids, w);
    } catch (const weave::error& e) {
      return e.code();
    }
    return weave::errc::internal;
  };
  weave::gate_options o;
  o.k = 2;
  CHECK(code(o, logits.view()) == weave::errc::internal); // valid: no throw
  auto nan = logits;
  nan(2, 5) = std::numeric_limits<float>::quiet_NaN();
  CHECK(code(o, nan.view()) == weave::errc::invalid_argument);
  auto inf = logits;
  inf(1, 0) = std::numeric_limits<float>::infinity();
  CHECK(code(o, inf.view()) == weave::errc::invalid_argument);
  o.k = 9;
  CHECK(code(o, logits.view(), 36) == weave::errc::invalid_argument);
  o.k = 0;
  CHECK(code(o, logits.view(), 0) == weave::errc::invalid_argument);
  o.k = 2;
  CHECK(code(o, logits.view(), 7) == weave::errc::size_mismatch);
  std::vector<float> bias(7, 0.0f);
  o.bias = bias;
  CHECK(code(o, logits.view()) == weave::errc::size_mismatch);
  o.bias = {};
  std::vector<std::int32_t> ints(32);
  const weave::const_token_view int_logits = weave::make_token_view(ints, 8);
  CHECK(code(o, int_logits) == weave::errc::invalid_argument);
  const auto p = weave::placement::contiguous(8, 4);
  weave::device_limit limit{&p, 0, 0, 0, 0};
  o.limit = &limit;
  CHECK(code(o, logits.view()) == weave::errc::invalid_argument); // M = 0
  limit.max_devices = 1;
  o.k = 3; // 3 experts do not fit on one device of 2
  CHECK(code(o, logits.view(), 12) == weave::errc::invalid_argument);
}
