#include <doctest/doctest.h>

#include <weave/plan/partition_planner.hpp>
#include <weave/plan/timeline.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

using weave::plan::graph;
using weave::plan::op_cost;
using weave::plan::op_id;
using weave::plan::op_range;
using weave::plan::partition_plan;

namespace {

// A random DAG over ops added in order: each op depends on each earlier op with probability
// `p_dep`; about a third are a2a; some are not partitionable; costs have fixed and scaled parts.
graph random_graph(std::mt19937_64& rng, std::size_t n, double p_dep = 0.4) {
  std::uniform_real_distribution<double> u(0.0, 1.0), cost(0.0, 10.0);
  graph g;
  for (std::size_t i = 0; i < n; ++i) {
    std::vector<op_id> deps;
    for (op_id d = 0; d < i; ++d)
      if (u(rng) < p_dep)
        deps.push_back(d);
    const op_cost c{cost(rng) * 0.3, cost(rng)};
    const bool part = u(rng) < 0.85;
    const bool is_a2a = u(rng) < 0.35;
    std::string name(1, is_a2a ? 'x' : 'c'); // (literal + string trips GCC 12's -Wrestrict)
    name += std::to_string(i);
    if (is_a2a)
      g.add_a2a(name, 1000.0, c, deps, part);
    else
      g.add_compute(name, c, deps, part);
  }
  return g;
}

// Independent reference: every way to cut the order into ranges (of at most `max_len` ops),
// every chunk count in [1, max_parts] per range (1 only where an op is not partitionable), each
// whole plan priced by the general simulator on its barriered schedule. Returns the minimum.
double brute_force(const graph& g, const std::vector<op_id>& order, std::int64_t max_parts,
                   std::size_t max_len, double overhead) {
  const std::size_t n = order.size();
  double best = std::numeric_limits<double>::infinity();
  partition_plan p;
  p.order = order;
  p.chunk_overhead_us = overhead;
  std::function<void(std::size_t)> rec = [&](std::size_t start) {
    if (start == n) {
      const auto s = weave::plan::make_schedule(g, p, {.range_barriers = true});
      best = std::min(best, weave::plan::simulate(s).makespan_us());
      return;
    }
    for (std::size_t end = start + 1; end <= n && end - start <= max_len; ++end) {
      bool partitionable = true;
      for (std::size_t i = start; i < end; ++i)
        partitionable = partitionable && g.at(order[i]).partitionable;
      for (std::int64_t parts = 1; parts <= (partitionable ? max_parts : 1); ++parts) {
        p.ranges.push_back({start, end, parts});
        rec(end);
        p.ranges.pop_back();
      }
    }
  };
  rec(0);
  return best;
}

} // namespace

TEST_CASE("the DP equals brute force over all partitionings on random small graphs") {
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> overhead_d(0.0, 1.0);
  for (int trial = 0; trial < 60; ++trial) {
    const std::size_t n = 1 + static_cast<std::size_t>(trial % 7);
    const graph g = random_graph(rng, n, trial % 2 ? 0.3 : 0.6);
    const std::int64_t max_parts = 1 + trial % 4;
    const std::size_t max_len = trial % 3 == 0 ? 0 : 1 + static_cast<std::size_t>(trial % 4);
    const double overhead = trial % 5 == 0 ? 0.0 : overhead_d(rng);
    CAPTURE(trial);
    const partition_plan p = weave::plan::plan_partitions(
        g, {.max_parts = max_parts, .max_range_ops = max_len, .chunk_overhead_us = overhead});
    const double reference =
        brute_force(g, g.topological_order(), max_parts, max_len == 0 ? n : max_len, overhead);
    CHECK(p.predicted_us == doctest::Approx(reference).epsilon(1e-9));
    // The plan is what it claims: its barriered schedule takes exactly F(N), and without
    // barriers it is never slower.
    const auto barriered = weave::plan::make_schedule(g, p, {.range_barriers = true});
    CHECK(weave::plan::simulate(barriered).makespan_us() ==
          doctest::Approx(p.predicted_us).epsilon(1e-9));
    const auto free_running = weave::plan::make_schedule(g, p);
    CHECK(weave::plan::simulate(free_running).makespan_us() <= p.predicted_us + 1e-9);
    for (const op_range& r : p.ranges) {
      CHECK(r.parts <= max_parts);
      if (max_len != 0)
        CHECK(r.end - r.begin <= max_len);
    }
  }
}

TEST_CASE("partitioning pays off for a2a-heavy chains and stops when chunks get too small") {
  // attention -> dispatch -> experts -> combine: unpartitioned, nothing overlaps.
  graph g;
  const auto a = g.add_compute("attn", {0, 8});
  const auto d = g.add_a2a("dispatch", 1e6, op_cost{0.1, 6});
  g.add_dependency(a, d);
  const auto e = g.add_compute("experts", {0, 8}, {d});
  g.add_a2a("combine", 1e6, op_cost{0.1, 6}, {e});
  const partition_plan whole = partition_plan::unpartitioned(g.topological_order());
  const double serial = weave::plan::simulate(weave::plan::make_schedule(g, whole)).makespan_us();
  CHECK(serial == doctest::Approx(8 + 6.1 + 8 + 6.1));
  const partition_plan p = weave::plan::plan_partitions(g, {.max_parts = 8});
  CHECK(p.predicted_us < serial * 0.75);
  REQUIRE(p.ranges.size() == 1);
  CHECK(p.ranges[0].parts > 1);
  // With a large per-chunk overhead, splitting costs more than it hides.
  const partition_plan q =
      weave::plan::plan_partitions(g, {.max_parts = 8, .chunk_overhead_us = 50});
  for (const op_range& r : q.ranges)
    CHECK(r.parts == 1);
  CHECK(q.predicted_us == doctest::Approx(serial));
}

TEST_CASE("plan_partitions handles an empty graph and a caller-given order") {
  graph empty;
  const partition_plan p = weave::plan::plan_partitions(empty);
  CHECK(p.ranges.empty());
  CHECK(p.predicted_us == 0.0);
  CHECK(weave::plan::make_schedule(empty, p).size() == 0);

  graph g;
  g.add_compute("a", {1, 1});
  g.add_compute("b", {1, 1});
  const partition_plan q = weave::plan::plan_partitions_in_order(g, {1, 0});
  CHECK(q.order == std::vector<op_id>{1, 0});
  CHECK_THROWS_AS(weave::plan::plan_partitions_in_order(g, {0}), weave::error);
}

TEST_CASE("the DP is never worse than expert-only pipelining, a plan it can choose") {
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<double> cost(50.0, 1500.0), alpha(5.0, 60.0);
  for (int trial = 0; trial < 20; ++trial) {
    graph g;
    std::vector<std::pair<std::size_t, std::size_t>> expert_ranges; // [dispatch, combine]
    op_id prev = g.add_compute("embed", {5, cost(rng)});
    const std::size_t layers = 1 + static_cast<std::size_t>(trial % 5);
    for (std::size_t l = 0; l < layers; ++l) {
      const op_id attn = g.add_compute("attention", {10, cost(rng)}, {prev});
      const op_id gate = g.add_compute("gate", {10, cost(rng) / 10}, {attn});
      const op_id d = g.add_a2a("dispatch", 1e6, op_cost{alpha(rng), cost(rng)}, {gate});
      const op_id e = g.add_compute("experts", {10, cost(rng)}, {d});
      const op_id c = g.add_a2a("combine", 1e6, op_cost{alpha(rng), cost(rng)}, {e});
      expert_ranges.emplace_back(d, c);
      prev = g.add_compute("residual", {5, cost(rng) / 10}, {c, attn});
    }
    const double overhead = 5.0;
    const partition_plan ours = weave::plan::plan_partitions(g, {.chunk_overhead_us = overhead});
    // Ops were added in topological order, so positions equal ids.
    REQUIRE(g.topological_order() == ours.order);
    for (std::int64_t degree : {1, 2, 4, 8}) {
      partition_plan tutel;
      tutel.order = ours.order;
      tutel.chunk_overhead_us = overhead;
      std::size_t next = 0;
      for (const auto& [d, c] : expert_ranges) {
        for (; next < d; ++next)
          tutel.ranges.push_back({next, next + 1, 1});
        tutel.ranges.push_back({d, c + 1, degree});
        next = c + 1;
      }
      for (; next < g.size(); ++next)
        tutel.ranges.push_back({next, next + 1, 1});
      const auto s = weave::plan::make_schedule(g, tutel, {.range_barriers = true});
      CHECK(ours.predicted_us <= weave::plan::simulate(s).makespan_us() + 1e-9);
    }
  }
}
