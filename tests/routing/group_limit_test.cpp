// Group-limited gating (DeepSeek-V3) against brute force: every group scored by sorting all of
// its experts, the kept groups found by trying every set of `top_groups` groups, top-k by a
// full sort; a hand-derived case for the two group-score rules; and the node bound with a
// placement that keeps every group on one node.
#include <doctest/doctest.h>

#include <weave/core/host_matrix.hpp>
#include <weave/placement/replication.hpp>
#include <weave/routing/gate.hpp>
#include <weave/routing/group_limit.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <set>
#include <vector>

namespace {

weave::host_matrix<float> normal_logits(std::size_t T, std::size_t E, std::mt19937& rng) {
  weave::host_matrix<float> m(T, E);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  for (float& x : m.elements())
    x = normal(rng);
  return m;
}

// Every expert's score for each token, as the unrestricted gate computes them (its weights are
// the unbiased scores; the unrestricted gate is checked against brute force in gate_test.cpp).
std::vector<std::vector<float>> all_scores(const weave::host_matrix<float>& logits,
                                           weave::gate_scoring scoring) {
  const std::size_t T = logits.rows(), E = logits.cols();
  weave::gate_options o;
  o.k = static_cast<int>(E);
  o.scoring = scoring;
  std::vector<std::int32_t> ids(T * E);
  std::vector<float> w(T * E);
  weave::top_k_gate(logits.view(), o, ids, w);
  std::vector<std::vector<float>> out(T, std::vector<float>(E));
  for (std::size_t t = 0; t < T; ++t)
    for (std::size_t i = 0; i < E; ++i)
      out[t][static_cast<std::size_t>(ids[t * E + i])] = w[t * E + i];
  return out;
}

// The kept groups by brute force: the set of `top` groups with the largest total group score,
// where a group's score is the sum of its `m` largest selection scores (full sort). Returns an
// empty set when two sets tie (the test then skips the token: tie order is not DeepSeek's).
std::vector<bool> brute_groups(const std::vector<float>& selection, int G, int top, int m) {
  const std::size_t size = selection.size() / static_cast<std::size_t>(G);
  std::vector<float> score(static_cast<std::size_t>(G));
  for (std::size_t g = 0; g < score.size(); ++g) {
    std::vector<float> v(selection.begin() + static_cast<std::ptrdiff_t>(g * size),
                         selection.begin() + static_cast<std::ptrdiff_t>((g + 1) * size));
    std::sort(v.begin(), v.end(), std::greater<>());
    float s = 0.0f;
    for (int i = 0; i < m; ++i)
      s += v[static_cast<std::size_t>(i)];
    score[g] = s;
  }
  std::vector<bool> best;
  double best_sum = -1e300;
  bool tie = false;
  for (unsigned mask = 0; mask < (1u << G); ++mask) {
    if (std::popcount(mask) != top)
      continue;
    double sum = 0;
    for (int g = 0; g < G; ++g)
      if (mask >> g & 1u)
        sum += score[static_cast<std::size_t>(g)];
    if (sum > best_sum) {
      best_sum = sum;
      tie = false;
      best.assign(static_cast<std::size_t>(G), false);
      for (int g = 0; g < G; ++g)
        best[static_cast<std::size_t>(g)] = (mask >> g & 1u) != 0;
    } else if (sum == best_sum) {
      tie = true;
    }
  }
  return tie ? std::vector<bool>{} : best;
}

} // namespace

TEST_CASE("group-limited gating equals brute force: kept groups, then top-k inside them") {
  std::mt19937 rng(41);
  int checked = 0;
  for (int trial = 0; trial < 80; ++trial) {
    const int G = 1 + static_cast<int>(rng() % 6);
    const int size = 1 + static_cast<int>(rng() % 5);
    const int E = G * size;
    weave::group_limit limit;
    limit.groups = G;
    limit.top_groups = 1 + static_cast<int>(rng() % static_cast<unsigned>(G));
    limit.scores_per_group = static_cast<int>(rng() % static_cast<unsigned>(std::min(size, 3) + 1));
    const int k = 1 + static_cast<int>(rng() % static_cast<unsigned>(limit.top_groups * size));
    const std::size_t T = 1 + rng() % 30;
    const auto logits = normal_logits(T, static_cast<std::size_t>(E), rng);
    weave::gate_options o;
    o.k = k;
    o.scoring = trial % 2 ? weave::gate_scoring::sigmoid : weave::gate_scoring::softmax;
    o.renormalize = trial % 3 == 0;
    o.groups = &limit;
    std::vector<float> bias;
    if (trial % 4 < 2) {
      std::uniform_real_distribution<float> b(-0.2f, 0.2f);
      for (int e = 0; e < E; ++e)
        bias.push_back(b(rng));
      o.bias = bias;
    }
    std::vector<std::int32_t> ids(T * static_cast<std::size_t>(k));
    std::vector<float> weights(ids.size());
    const auto summary = weave::top_k_gate(logits.view(), o, ids, weights);
    const auto scores = all_scores(logits, o.scoring);
    // DeepSeek-V3's rule: the best two with a bias, the best one without.
    const int m =
        limit.scores_per_group > 0 ? limit.scores_per_group : (!bias.empty() && size >= 2 ? 2 : 1);
    std::int64_t changed = 0;
    bool skipped = false;
    for (std::size_t t = 0; t < T; ++t) {
      std::vector<float> selection = scores[t];
      for (std::size_t e = 0; e < bias.size(); ++e)
        selection[e] += bias[e];
      const auto kept = brute_groups(selection, G, limit.top_groups, m);
      if (kept.empty()) {
        skipped = true;
        continue;
      }
      auto top_k = [&](bool limited) {
        std::vector<int> order;
        for (int e = 0; e < E; ++e)
          if (!limited || kept[static_cast<std::size_t>(e / size)])
            order.push_back(e);
        std::sort(order.begin(), order.end(), [&](int a, int b) {
          const float sa = selection[static_cast<std::size_t>(a)];
          const float sb = selection[static_cast<std::size_t>(b)];
          return sa != sb ? sa > sb : a < b;
        });
        order.resize(static_cast<std::size_t>(k));
        return order;
      };
      const auto expect = top_k(true);
      changed += expect != top_k(false);
      float chosen = 0.0f;
      for (const int e : expect)
        chosen += scores[t][static_cast<std::size_t>(e)];
      for (int i = 0; i < k; ++i) {
        const std::size_t q = t * static_cast<std::size_t>(k) + static_cast<std::size_t>(i);
        const int e = expect[static_cast<std::size_t>(i)];
        REQUIRE(ids[q] == e);
        const float w = scores[t][static_cast<std::size_t>(e)] / (o.renormalize ? chosen : 1.0f);
        CHECK(weights[q] == doctest::Approx(w).epsilon(1e-6));
      }
      ++checked;
    }
    if (!skipped) // tokens whose top-k the group limit changed
      CHECK(summary.limited == changed);
  }
  CHECK(checked > 1000);
}

TEST_CASE("DeepSeek-V3's group score: the top-2 sum with a bias, the maximum without") {
  // Sigmoid scores p chosen by their logits log(p / (1 - p)); groups of two experts:
  //   group 0: 0.90 0.10 (max 0.90, top-2 sum 1.00)
  //   group 1: 0.60 0.60 (max 0.60, top-2 sum 1.20)
  //   group 2: 0.70 0.55 (max 0.70, top-2 sum 1.25)
  //   group 3: 0.20 0.20
  const std::vector<float> p = {0.90f, 0.10f, 0.60f, 0.60f, 0.70f, 0.55f, 0.20f, 0.20f};
  weave::host_matrix<float> logits(1, 8);
  for (std::size_t e = 0; e < 8; ++e)
    logits(0, e) = std::log(p[e] / (1.0f - p[e]));
  weave::group_limit limit{4, 2, 0};
  weave::gate_options o;
  o.k = 2;
  o.scoring = weave::gate_scoring::sigmoid;
  o.groups = &limit;
  std::vector<std::int32_t> ids(2);
  std::vector<float> w(2);
  // No bias: groups 0 and 2 by their maxima; top-2 inside them: experts 0 (0.9) and 4 (0.7).
  auto summary = weave::top_k_gate(logits.view(), o, ids, w);
  CHECK(ids == std::vector<std::int32_t>{0, 4});
  CHECK(summary.limited == 0);
  // A zero bias: groups 2 and 1 by their top-2 sums; experts 4 (0.7), then 2 (0.6, lower id).
  const std::vector<float> zero(8, 0.0f);
  o.bias = zero;
  summary = weave::top_k_gate(logits.view(), o, ids, w);
  CHECK(ids == std::vector<std::int32_t>{4, 2});
  CHECK(summary.limited == 1); // unrestricted: experts 0 and 4
  // The rule can be forced either way.
  limit.scores_per_group = 1;
  weave::top_k_gate(logits.view(), o, ids, w);
  CHECK(ids == std::vector<std::int32_t>{0, 4});
  limit.scores_per_group = 2;
  o.bias = {};
  weave::top_k_gate(logits.view(), o, ids, w);
  CHECK(ids == std::vector<std::int32_t>{4, 2});
}

TEST_CASE("group-limited routing on a group-on-node placement reaches at most topk_group nodes") {
  std::mt19937 rng(43);
  // DeepSeek-V3's proportions, smaller: 64 experts in 8 groups on 4 nodes x 2 GPUs, one spare
  // slot per GPU, each token in its 2 best groups, top-6.
  const int E = 64, G = 8, top_groups = 2, k = 6;
  const auto topo = weave::topology::grid(4, 2);
  std::vector<double> loads(E);
  std::lognormal_distribution<double> dist(0.0, 1.0);
  for (auto& l : loads)
    l = dist(rng);
  weave::replication_options ro;
  ro.redundant_slots = 8;
  ro.groups.groups = G;
  const auto p = weave::place_replicated(loads, topo, ro);
  const std::size_t T = 2000;
  const auto logits = normal_logits(T, E, rng);
  std::vector<float> bias(E);
  std::uniform_real_distribution<float> b(-0.1f, 0.1f);
  for (auto& x : bias)
    x = b(rng);
  weave::group_limit limit{G, top_groups, 0};
  weave::gate_options o;
  o.k = k;
  o.scoring = weave::gate_scoring::sigmoid;
  o.bias = bias;
  o.groups = &limit;
  std::vector<std::int32_t> ids(T * k);
  std::vector<float> w(ids.size());
  weave::top_k_gate(logits.view(), o, ids, w);
  std::size_t most = 0, unlimited_most = 0;
  for (std::size_t t = 0; t < T; ++t) {
    std::set<int> nodes;
    // Every replica of every chosen expert, so any replica choice stays within the bound.
    for (int i = 0; i < k; ++i)
      for (const auto s : p.slots_of(ids[t * k + static_cast<std::size_t>(i)]))
        nodes.insert(topo.node_of(p.device_of_slot(s)));
    CHECK(nodes.size() <= static_cast<std::size_t>(top_groups));
    most = std::max(most, nodes.size());
  }
  // Without the limit the same tokens spread wider.
  o.groups = nullptr;
  weave::top_k_gate(logits.view(), o, ids, w);
  for (std::size_t t = 0; t < T; ++t) {
    std::set<int> nodes;
    for (int i = 0; i < k; ++i)
      nodes.insert(topo.node_of(p.device_of_slot(p.slots_of(ids[t * k + std::size_t(i)])[0])));
    unlimited_most = std::max(unlimited_most, nodes.size());
  }
  MESSAGE("nodes per token: at most ", most, " group-limited, ", unlimited_most, " without");
  CHECK(unlimited_most > static_cast<std::size_t>(top_groups));
}

TEST_CASE("group and device limits together: kept groups first, then at most M devices") {
  std::mt19937 rng(44);
  const int E = 32, G = 4, size = 8;
  const auto p = weave::placement::contiguous(E, 8); // 4 experts per device, 2 per group
  weave::group_limit groups{G, 2, 0};
  weave::device_limit devices{&p, 2, 0, 0, 0};
  weave::gate_options o;
  o.k = 4;
  o.groups = &groups;
  o.limit = &devices;
  const std::size_t T = 300;
  const auto logits = normal_logits(T, E, rng);
  std::vector<std::int32_t> ids(T * 4);
  std::vector<float> w(ids.size());
  weave::top_k_gate(logits.view(), o, ids, w);
  const auto scores = all_scores(logits, o.scoring);
  for (std::size_t t = 0; t < T; ++t) {
    const auto kept = brute_groups(scores[t], G, 2, 1);
    if (kept.empty())
      continue;
    std::set<int> used;
    for (int i = 0; i < 4; ++i) {
      const int e = ids[t * 4 + static_cast<std::size_t>(i)];
      CHECK(kept[static_cast<std::size_t>(e / size)]);
      used.insert(p.device_of(e));
    }
    CHECK(used.size() <= 2);
  }
}

TEST_CASE("group limits reject what cannot hold") {
  weave::host_matrix<float> logits(2, 12);
  std::vector<std::int32_t> ids(4);
  std::vector<float> w(4);
  weave::gate_options o;
  o.k = 2;
  weave::group_limit limit;
  o.groups = &limit;
  auto fails = [&] {
    try {
      weave::top_k_gate(logits.view(), o, ids, w);
    } catch (const weave::error& e) {
      CHECK(e.code() == weave::errc::invalid_argument);
      return;
    }
    FAIL("no error");
  };
  limit = {5, 1, 0}; // 12 experts do not split into 5 groups
  fails();
  limit = {0, 1, 0};
  fails();
  limit = {4, 0, 0}; // top_groups outside 1..4
  fails();
  limit = {4, 5, 0};
  fails();
  limit = {4, 1, 4}; // 4 scores of a group of 3
  fails();
  limit = {4, 1, -1};
  fails();
  limit = {6, 1, 0}; // k = 2 fits one group of 2
  CHECK_NOTHROW(weave::top_k_gate(logits.view(), o, ids, w));
  limit = {12, 1, 0}; // k = 2 does not fit one group of 1
  fails();
}
