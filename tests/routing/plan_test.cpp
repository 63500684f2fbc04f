// The host reference plans (tests/support/host_plans.hpp: the oracles the library's device
// plans are checked against) against brute force: the sender plan against a mask-based dispatch
// reference, and the full round trip ORI -> SFD -> (all_to_all_v) -> EPD -> experts -> local
// merge -> (back) -> ORI against a dense per-(token, expert) computation, simulated for D
// devices in one process. Also: statistics from the library's plan's kept experts, and the
// library's host check of top-k choices (`detail::check_routing`) against `check_pair`.
#include <doctest/doctest.h>

#include "aligned_buffer.hpp"
#include "host_plans.hpp"
#include "routing_reference.hpp"

#include <weave/core/host_matrix.hpp>
#include <weave/exec/host_space.hpp>
#include <weave/placement/statistics.hpp>
#include <weave/routing.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace {

struct source_batch {
  std::vector<std::int32_t> ids;
  std::vector<float> weights;
  std::vector<std::uint8_t> keep;
  weave::host_matrix<float> x;
};

// Routes T tokens of device `source` through the real gate and capacity filter.
source_batch route(std::size_t T, int E, int k, std::size_t hidden, double factor, int order,
                   std::mt19937& rng) {
  source_batch b;
  weave::host_matrix<float> logits(T, static_cast<std::size_t>(E));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& v : logits.elements())
    v = normal(rng);
  b.x = weave::host_matrix<float>(T, hidden);
  for (float& v : b.x.elements())
    v = normal(rng);
  weave::gate_options options;
  options.k = k;
  options.renormalize = true;
  b.ids.resize(T * static_cast<std::size_t>(k));
  b.weights.resize(b.ids.size());
  std::vector<float> priority(T); // the top gate score, Tutel's batch priority
  weave::top_k_gate(logits.view(), options, b.ids, b.weights, priority);
  for (std::size_t q = 0; q < b.ids.size(); ++q)
    if (rng() % 23 == 0)
      b.ids[q] = -1; // padding entries are allowed
  oracle::capacity_filter filter(E, k, T, {factor, static_cast<weave::drop_order>(order)});
  b.keep.resize(b.ids.size());
  filter.decide(b.ids, priority, b.keep);
  return b;
}

double factors_pick(std::mt19937& rng) {
  const double factors[] = {0.5, 1.0, 1.5, 0.0, -1.0};
  return factors[rng() % 5];
}

// Expert e is y = (1 + e / 8) * x + e / 16 element-wise: distinct per expert, equal on replicas.
float expert_fn(int e, float x) {
  return (1.0f + static_cast<float>(e) / 8.0f) * x + static_cast<float>(e) / 16.0f;
}

} // namespace

TEST_CASE("reference dispatch_plan equals the mask-based SFD layout over random shapes and "
          "placements") {
  std::mt19937 rng(41);
  for (int trial = 0; trial < 80; ++trial) {
    const int D = 1 + static_cast<int>(rng() % 6);
    const int E = D * (1 + static_cast<int>(rng() % 5));
    const int k = 1 + static_cast<int>(rng() % static_cast<unsigned>(std::min(E, 8)));
    const std::size_t T = rng() % 60, offset = rng() % 1000;
    const int source = static_cast<int>(rng() % static_cast<unsigned>(D));
    const auto p = ref::random_placement(E, D, static_cast<int>(rng() % 3), rng);
    const double factor = factors_pick(rng);
    auto b = route(T, E, k, 1, factor, static_cast<int>(rng() % 4), rng);
    oracle::dispatch_plan plan(p, k, source);
    plan.build(b.ids, b.weights, b.keep, offset);
    const auto expect = ref::naive_dispatch(b.ids, b.weights, b.keep, k, p, source, offset);
    REQUIRE(plan.rows() == expect.offsets.back());
    CHECK(std::vector<long long>(plan.send_counts().begin(), plan.send_counts().end()) ==
          expect.counts);
    CHECK(std::vector<long long>(plan.send_offsets().begin(), plan.send_offsets().end()) ==
          expect.offsets);
    CHECK(std::vector<long long>(plan.row_token().begin(), plan.row_token().end()) ==
          expect.row_token);
    const auto kk = static_cast<std::size_t>(k);
    for (std::size_t t = 0; t < T; ++t) {
      std::vector<long long> rows;
      for (std::size_t j = 0; j < kk; ++j)
        if (plan.token_rows()[t * kk + j] >= 0)
          rows.push_back(plan.token_rows()[t * kk + j]);
        else
          for (std::size_t j2 = j; j2 < kk; ++j2)
            CHECK(plan.token_rows()[t * kk + j2] == -1); // padding only at the end
      CHECK(rows == expect.token_rows[t]);
      CHECK(rows.size() <= static_cast<std::size_t>(std::min(k, D)));
    }
    for (std::size_t r = 0; r < static_cast<std::size_t>(plan.rows()); ++r) {
      std::vector<std::pair<int, float>> entries;
      for (std::size_t i = 0; i < kk; ++i) {
        const auto& e = plan.row_routes()[r * kk + i];
        if (e.local >= 0)
          entries.push_back({e.local, e.weight});
        else
          CHECK(e.weight == 0.0f);
      }
      CHECK(entries == expect.row_routes[r]);
    }
    CHECK(plan.copies_per_token() == doctest::Approx(expect.copies_per_token));
  }
}

TEST_CASE("copies per token of a contiguous placement matches the expected distinct devices") {
  // Uniform random top-k over E experts on g devices: E[CT] = g * (1 - C(E - E/g, k) / C(E, k)).
  std::mt19937 rng(8);
  const int E = 16, g = 4, k = 4;
  const std::size_t T = 20000;
  std::vector<std::int32_t> ids;
  for (std::size_t t = 0; t < T; ++t) {
    std::vector<int> all(E);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    ids.insert(ids.end(), all.begin(), all.begin() + k);
  }
  std::vector<float> w(ids.size(), 0.25f);
  oracle::dispatch_plan plan(weave::placement::contiguous(E, g), k, 0);
  plan.build(ids, w);
  auto choose = [](int n, int r) {
    double c = 1;
    for (int i = 0; i < r; ++i)
      c = c * (n - i) / (i + 1);
    return c;
  };
  const double expected = g * (1.0 - choose(E - E / g, k) / choose(E, k));
  CHECK(plan.copies_per_token() == doctest::Approx(expected).epsilon(0.02));
}

TEST_CASE("round trip through SFD and EPD equals the dense per-(token, expert) reference") {
  std::mt19937 rng(101);
  for (int trial = 0; trial < 40; ++trial) {
    const int D = 1 + static_cast<int>(rng() % 5);
    const int E = D * (1 + static_cast<int>(rng() % 4));
    const int k = 1 + static_cast<int>(rng() % static_cast<unsigned>(std::min(E, 6)));
    const std::size_t hidden = 1 + rng() % 300;
    const auto p = ref::random_placement(E, D, static_cast<int>(rng() % 2), rng);
    const int L = p.slots_per_device();
    const double factor = factors_pick(rng);
    const int order = static_cast<int>(rng() % 4);
    const bool gate_scaled = trial % 2 == 1; // linear experts: scaling before equals after
    std::vector<source_batch> batches;
    std::vector<oracle::dispatch_plan> plans;
    std::vector<weave::host_matrix<float>> sfd;
    for (int s = 0; s < D; ++s) {
      batches.push_back(route(rng() % 50, E, k, hidden, factor, order, rng));
      plans.emplace_back(p, k, s);
      plans.back().build(batches.back().ids, batches.back().weights, batches.back().keep);
      sfd.emplace_back(static_cast<std::size_t>(plans.back().rows()), hidden);
      oracle::dispatch_gather(plans.back(), batches.back().x.view(), sfd.back().view());
    }
    // all_to_all_v: device d receives, source by source, rows [offsets[d], offsets[d + 1]).
    std::vector<weave::host_matrix<float>> returned(static_cast<std::size_t>(D));
    for (int s = 0; s < D; ++s)
      returned[static_cast<std::size_t>(s)] = weave::host_matrix<float>(
          static_cast<std::size_t>(plans[static_cast<std::size_t>(s)].rows()), hidden);
    for (int d = 0; d < D; ++d) {
      std::vector<std::int64_t> counts;
      std::vector<weave::route_entry> routes;
      std::vector<float> rows;
      for (int s = 0; s < D; ++s) {
        const auto& plan = plans[static_cast<std::size_t>(s)];
        const auto first = plan.send_offsets()[static_cast<std::size_t>(d)];
        const auto n = plan.send_counts()[static_cast<std::size_t>(d)];
        counts.push_back(n);
        const auto r0 = plan.row_routes().begin() + first * k;
        routes.insert(routes.end(), r0, r0 + n * k);
        const auto x0 =
            sfd[static_cast<std::size_t>(s)].elements().begin() + first * static_cast<long>(hidden);
        rows.insert(rows.end(), x0, x0 + n * static_cast<long>(hidden));
      }
      oracle::expert_plan eplan(L, k);
      eplan.build(routes, counts);
      CHECK(std::vector<std::int64_t>(eplan.source_offsets().begin() + 1,
                                      eplan.source_offsets().end())
                .back() == eplan.rows());
      // Receiver reference: every (received row, entry), grouped by local expert in row order.
      for (int l = 0; l < L; ++l) {
        std::vector<std::pair<std::int64_t, float>> expect;
        for (std::int64_t r = 0; r < eplan.rows(); ++r)
          for (int i = 0; i < k; ++i)
            if (routes[static_cast<std::size_t>(r * k + i)].local == l)
              expect.push_back({r, routes[static_cast<std::size_t>(r * k + i)].weight});
        std::vector<std::pair<std::int64_t, float>> got;
        for (auto j = eplan.expert_offsets()[static_cast<std::size_t>(l)];
             j < eplan.expert_offsets()[static_cast<std::size_t>(l) + 1]; ++j)
          got.push_back({eplan.epd_row_source()[static_cast<std::size_t>(j)],
                         eplan.epd_weight()[static_cast<std::size_t>(j)]});
        REQUIRE(got == expect);
      }
      const weave::const_token_view received = weave::make_token_view(std::as_const(rows), hidden);
      weave::host_matrix<float> epd(static_cast<std::size_t>(eplan.epd_rows()), hidden);
      oracle::expert_scatter(eplan, received, epd.view(), gate_scaled);
      for (int l = 0; l < L; ++l) { // the "grouped GEMM": one contiguous range per local expert
        const int e = p.expert_of_slot(d * L + l);
        for (auto j = eplan.expert_offsets()[static_cast<std::size_t>(l)];
             j < eplan.expert_offsets()[static_cast<std::size_t>(l) + 1]; ++j)
          for (float& v : epd.row(static_cast<std::size_t>(j)))
            v = gate_scaled ? (1.0f + static_cast<float>(e) / 8.0f) * v +
                                  eplan.epd_weight()[static_cast<std::size_t>(j)] *
                                      static_cast<float>(e) / 16.0f
                            : expert_fn(e, v);
      }
      weave::host_matrix<float> back(static_cast<std::size_t>(eplan.rows()), hidden);
      oracle::expert_merge(eplan, epd.view(), back.view(), !gate_scaled);
      for (int s = 0; s < D; ++s) { // the return all_to_all_v
        const auto& plan = plans[static_cast<std::size_t>(s)];
        const auto src0 = eplan.source_offsets()[static_cast<std::size_t>(s)];
        for (std::int64_t i = 0; i < plan.send_counts()[static_cast<std::size_t>(d)]; ++i)
          std::copy_n(back.row(static_cast<std::size_t>(src0 + i)).begin(), hidden,
                      returned[static_cast<std::size_t>(s)]
                          .row(static_cast<std::size_t>(
                              plan.send_offsets()[static_cast<std::size_t>(d)] + i))
                          .begin());
      }
    }
    for (int s = 0; s < D; ++s) {
      const auto& b = batches[static_cast<std::size_t>(s)];
      const std::size_t T = b.x.rows();
      weave::host_matrix<float> out(T, hidden, -7.0f);
      oracle::combine_merge(plans[static_cast<std::size_t>(s)],
                            returned[static_cast<std::size_t>(s)].view(), out.view());
      for (std::size_t t = 0; t < T; ++t)
        for (std::size_t c = 0; c < hidden; ++c) {
          double dense = 0; // every kept (token, expert) pair, no layouts at all
          for (int i = 0; i < k; ++i) {
            const std::size_t q = t * static_cast<std::size_t>(k) + static_cast<std::size_t>(i);
            if (b.ids[q] >= 0 && b.keep[q])
              dense += static_cast<double>(b.weights[q]) * expert_fn(b.ids[q], b.x(t, c));
          }
          REQUIRE(out(t, c) == doctest::Approx(dense).epsilon(1e-5).scale(1.0));
        }
    }
  }
}

TEST_CASE("chunked plans reproduce the whole batch's combined output bitwise") {
  std::mt19937 rng(77);
  for (int trial = 0; trial < 20; ++trial) {
    const int D = 1 + static_cast<int>(rng() % 4);
    const int E = D * (1 + static_cast<int>(rng() % 4));
    const int k = 1 + static_cast<int>(rng() % static_cast<unsigned>(std::min(E, 4)));
    const std::size_t T = 1 + rng() % 80, hidden = 1 + rng() % 40;
    const auto p = ref::random_placement(E, D, 1, rng);
    const int order = static_cast<int>(rng() % 4);
    auto b = route(T, E, k, hidden, 1.0, order, rng);
    const int source = static_cast<int>(rng() % static_cast<unsigned>(D));
    const int L = p.slots_per_device();
    // One device's view of the round trip, every destination served locally (the exchange is
    // only a permutation of whole rows, which cannot change bits).
    auto run = [&](std::size_t t0, std::size_t t1, weave::host_matrix<float>& out) {
      const auto kk = static_cast<std::size_t>(k);
      oracle::dispatch_plan plan(p, k, source);
      plan.build(std::span(b.ids).subspan(t0 * kk, (t1 - t0) * kk),
                 std::span(b.weights).subspan(t0 * kk, (t1 - t0) * kk),
                 std::span(b.keep).subspan(t0 * kk, (t1 - t0) * kk), t0);
      weave::host_matrix<float> sfd(static_cast<std::size_t>(plan.rows()), hidden);
      oracle::dispatch_gather(plan, b.x.view().subrows(t0, t1 - t0), sfd.view());
      weave::host_matrix<float> back(sfd.rows(), hidden);
      for (int d = 0; d < D; ++d) {
        const auto first = plan.send_offsets()[static_cast<std::size_t>(d)];
        const auto n = plan.send_counts()[static_cast<std::size_t>(d)];
        const std::vector<std::int64_t> counts = {n};
        oracle::expert_plan eplan(L, k);
        eplan.build(plan.row_routes().subspan(static_cast<std::size_t>(first) * kk,
                                              static_cast<std::size_t>(n) * kk),
                    counts);
        weave::host_matrix<float> epd(static_cast<std::size_t>(eplan.epd_rows()), hidden);
        oracle::expert_scatter(
            eplan, sfd.view().subrows(static_cast<std::size_t>(first), static_cast<std::size_t>(n)),
            epd.view());
        for (int l = 0; l < L; ++l)
          for (auto j = eplan.expert_offsets()[static_cast<std::size_t>(l)];
               j < eplan.expert_offsets()[static_cast<std::size_t>(l) + 1]; ++j)
            for (float& v : epd.row(static_cast<std::size_t>(j)))
              v = expert_fn(p.expert_of_slot(d * L + l), v);
        oracle::expert_merge(
            eplan, epd.view(),
            back.view().subrows(static_cast<std::size_t>(first), static_cast<std::size_t>(n)));
      }
      oracle::combine_merge(plan, back.view(), out.view().subrows(t0, t1 - t0));
    };
    weave::host_matrix<float> whole(T, hidden), chunked(T, hidden), again(T, hidden);
    run(0, T, whole);
    run(0, T, again);
    CHECK(whole == again);
    std::size_t t = 0;
    while (t < T) {
      const std::size_t n = std::min(T - t, 1 + rng() % 20);
      run(t, t + n, chunked);
      t += n;
    }
    CHECK(whole == chunked);
  }
}

TEST_CASE("statistics accumulated from a plan's kept experts count kept choices only") {
  std::mt19937 rng(13);
  const int E = 12, D = 3, k = 3;
  const auto p = ref::random_placement(E, D, 1, rng);
  auto b = route(300, E, k, 1, 0.5, 0, rng);
  weave::host_stream s("plan");
  weave::device_dispatch_plan<weave::host_space> plan(p, k, 2, 300);
  weave_test::aligned_buffer ws(plan.workspace_size());
  plan.initialize(ws.ptr, ws.size, s);
  plan.build(s, b.ids, b.weights, b.keep);
  s.synchronize();
  weave::expert_statistics stats(E);
  stats.accumulate(plan.kept_experts(), k);
  std::vector<double> load(E, 0), pair(E * E, 0);
  for (std::size_t t = 0; t < 300; ++t)
    for (int a = 0; a < k; ++a) {
      const std::size_t qa = t * k + static_cast<std::size_t>(a);
      if (b.ids[qa] < 0 || !b.keep[qa])
        continue;
      load[static_cast<std::size_t>(b.ids[qa])] += 1;
      for (int c = 0; c < k; ++c) {
        const std::size_t qc = t * k + static_cast<std::size_t>(c);
        if (c != a && b.ids[qc] >= 0 && b.keep[qc])
          pair[static_cast<std::size_t>(b.ids[qa] * E + b.ids[qc])] += 1;
      }
    }
  for (int e = 0; e < E; ++e)
    CHECK(stats.load(e) == load[static_cast<std::size_t>(e)]);
  for (int a = 0; a < E; ++a)
    for (int c = 0; c < E; ++c)
      CHECK(stats.coactivation(a, c) == pair[static_cast<std::size_t>(a * E + c)]);
}

TEST_CASE("reference plans reject bad input with the right error code") {
  auto code = [](auto&& f) {
    try {
      f();
    } catch (const weave::error& e) {
      return e.code();
    }
    return weave::errc::internal;
  };
  const auto p = weave::placement::contiguous(4, 2);
  CHECK(code([&] { oracle::dispatch_plan(p, 5, 0); }) == weave::errc::invalid_argument);
  CHECK(code([&] { oracle::dispatch_plan(p, 0, 0); }) == weave::errc::invalid_argument);
  CHECK(code([&] { oracle::dispatch_plan(p, 2, 2); }) == weave::errc::out_of_range);
  oracle::dispatch_plan plan(p, 2, 0);
  std::vector<std::int32_t> ids = {0, 1, 3, 2};
  std::vector<float> w = {0.5f, 0.5f, 0.5f, 0.5f};
  CHECK(code([&] { plan.build(ids, w); }) == weave::errc::internal);
  ids[1] = 4;
  CHECK(code([&] { plan.build(ids, w); }) == weave::errc::out_of_range);
  ids[1] = -2;
  CHECK(code([&] { plan.build(ids, w); }) == weave::errc::out_of_range);
  ids[1] = 0;
  CHECK(code([&] { plan.build(ids, w); }) == weave::errc::invalid_argument); // expert twice
  ids[1] = 1;
  w[2] = std::numeric_limits<float>::quiet_NaN();
  CHECK(code([&] { plan.build(ids, w); }) == weave::errc::invalid_argument);
  w[2] = 0.5f;
  CHECK(code([&] { plan.build(ids, std::span(w).first(3)); }) == weave::errc::size_mismatch);
  CHECK(code([&] { plan.build(std::span(ids).first(3), std::span(w).first(3)); }) ==
        weave::errc::size_mismatch);
  std::vector<std::uint8_t> keep(3, 1);
  CHECK(code([&] { plan.build(ids, w, keep); }) == weave::errc::size_mismatch);

  oracle::expert_plan eplan(2, 2);
  std::vector<weave::route_entry> routes = {{0, 0.5f}, {1, 0.5f}, {1, 1.0f}, {-1, 0.0f}};
  std::vector<std::int64_t> counts = {1, 1};
  CHECK(code([&] { eplan.build(routes, counts); }) == weave::errc::internal);
  counts = {1, 2};
  CHECK(code([&] { eplan.build(routes, counts); }) == weave::errc::size_mismatch);
  counts = {-1, 3};
  CHECK(code([&] { eplan.build(routes, counts); }) == weave::errc::invalid_argument);
  counts = {1, 1};
  routes[2].local = 2;
  CHECK(code([&] { eplan.build(routes, counts); }) == weave::errc::out_of_range);
  routes[2] = {-1, 0.0f};
  CHECK(code([&] { eplan.build(routes, counts); }) == weave::errc::invalid_argument); // empty row
  routes[2] = {0, 1.0f};
  routes[3] = {0, 1.0f};
  CHECK(code([&] { eplan.build(routes, counts); }) == weave::errc::invalid_argument); // twice
  CHECK(code([&] { oracle::expert_plan(0, 2); }) == weave::errc::invalid_argument);
}

TEST_CASE("check_routing fails exactly where the pair-by-pair check does, with its error") {
  // The branch-free token check against check_pair pair by pair (the reference plan's): random
  // tokens with a few faults each (ids out of range, below -1, repeated, weights inf or NaN).
  std::mt19937 rng(5);
  int failures = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const std::size_t k = 1 + rng() % 8, tokens = 1 + rng() % 4;
    const int E = static_cast<int>(k) + static_cast<int>(rng() % 12);
    CAPTURE(trial);
    std::vector<std::int32_t> ids(tokens * k);
    std::vector<float> weights(ids.size());
    for (std::size_t t = 0; t < tokens; ++t) {
      std::vector<std::int32_t> experts(static_cast<std::size_t>(E));
      for (int e = 0; e < E; ++e)
        experts[static_cast<std::size_t>(e)] = e;
      std::shuffle(experts.begin(), experts.end(), rng);
      for (std::size_t j = 0; j < k; ++j) {
        ids[t * k + j] = rng() % 6 == 0 ? -1 : experts[j];
        weights[t * k + j] = static_cast<float>(rng() % 100) / 50.0f - 1.0f;
      }
    }
    if (rng() % 2 == 0) { // one fault, somewhere
      const std::size_t p = rng() % ids.size();
      switch (rng() % 6) {
      case 0:
        ids[p] = E + static_cast<int>(rng() % 3);
        break;
      case 1:
        ids[p] = -2 - static_cast<int>(rng() % 3);
        break;
      case 2:
        ids[p] = ids[p / k * k + rng() % k];
        break; // may be itself or a -1: no fault
      case 3:
        weights[p] = std::numeric_limits<float>::infinity();
        break;
      case 4:
        weights[p] = std::numeric_limits<float>::quiet_NaN();
        break;
      default:
        ids[p] = -1;
        weights[p] = std::numeric_limits<float>::quiet_NaN();
        break; // fine
      }
    }
    std::string expected, got;
    try {
      for (std::size_t p = 0; p < ids.size(); ++p)
        if (ids[p] != -1)
          weave::detail::check_pair(ids, weights, p, k, E, 0);
    } catch (const weave::error& e) {
      expected = std::to_string(static_cast<int>(e.code())) + e.message();
    }
    try {
      weave::detail::check_routing(ids, weights, k, E);
    } catch (const weave::error& e) {
      got = std::to_string(static_cast<int>(e.code())) + e.message();
    }
    CHECK(got == expected);
    failures += expected.empty() ? 0 : 1;
  }
  CHECK(failures > 500); // the faults were caught often enough to mean something
}
