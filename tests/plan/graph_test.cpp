#include <doctest/doctest.h>

#include <weave/plan/graph.hpp>
#include <weave/plan/partition_planner.hpp>
#include <weave/plan/schedule.hpp>

#include <limits>
#include <string>

using weave::errc;
using weave::plan::graph;
using weave::plan::op_cost;
using weave::plan::partition_plan;

namespace {

template <class F>
errc code_of(F&& f) {
  try {
    f();
  } catch (const weave::error& e) {
    return e.code();
  }
  return errc::internal; // nothing thrown
}

template <class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const weave::error& e) {
    return e.message();
  }
  return {};
}

} // namespace

TEST_CASE("graph records ops, costs from models, and keeps added order when topological") {
  graph g;
  const auto a = g.add_compute("attn", op_cost::from_kernel({5.0, 0.01}, 1000));
  const auto x = g.add_a2a("dispatch", 1e6, weave::plan::a2a_cost{10.0, 1e-4}, {a});
  const auto w = g.add_weight_grad("dW", {2, 3}, {a});
  REQUIRE(g.size() == 3);
  CHECK(g.at(a).cost.at(1.0) == doctest::Approx(5.0 + 10.0));
  CHECK(g.at(a).cost.at(0.5) == doctest::Approx(5.0 + 5.0));
  CHECK(g.at(x).kind == weave::plan::op_kind::a2a);
  CHECK(g.at(x).cost.at(0.25) == doctest::Approx(10.0 + 1e-4 * 1e6 * 0.25));
  CHECK(g.at(x).bytes == 1e6);
  CHECK_FALSE(g.at(w).partitionable);
  CHECK(g.topological_order() == std::vector<weave::plan::op_id>{0, 1, 2});
  // A dependency added later on an earlier op reorders: 0 must now follow 2.
  g.add_dependency(w, a);
  CHECK(code_of([&] { g.validate(); }) == errc::invalid_argument); // 0 -> 2 -> 0
}

TEST_CASE("topological_order puts a later-added producer first") {
  graph g;
  const auto c = g.add_compute("consumer", {1, 0});
  const auto p = g.add_compute("producer", {1, 0});
  g.add_dependency(p, c);
  CHECK(g.topological_order() == std::vector<weave::plan::op_id>{p, c});
}

TEST_CASE("bad graphs and plans are rejected with the offending value") {
  graph g;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  CHECK(code_of([&] { g.add_compute("neg", {-1, 0}); }) == errc::invalid_argument);
  CHECK(code_of([&] { g.add_compute("neg", {0, -2}); }) == errc::invalid_argument);
  CHECK(code_of([&] { g.add_compute("nan", {nan, 0}); }) == errc::invalid_argument);
  CHECK(code_of([&] { g.add_a2a("bytes", -5, op_cost{1, 1}); }) == errc::invalid_argument);
  CHECK(message_of([&] { g.add_compute("neg", {-1, 0}); }).find("-1") != std::string::npos);
  CHECK(code_of([&] { g.add_compute("dangling", {1, 0}, {7}); }) == errc::out_of_range);
  CHECK(g.empty()); // nothing half-added
  const auto a = g.add_compute("a", {1, 1});
  const auto b = g.add_compute("b", {1, 1}, {a}, /*partitionable=*/false);
  CHECK(code_of([&] { g.add_dependency(a, 9); }) == errc::out_of_range);
  CHECK(code_of([&] { g.add_dependency(9, a); }) == errc::out_of_range);
  CHECK(code_of([&] { (void)g.at(2); }) == errc::out_of_range);

  SUBCASE("plans") {
    auto bad_plan = [&](partition_plan p) {
      return code_of([&] { weave::plan::make_schedule(g, p); });
    };
    partition_plan p = partition_plan::unpartitioned({a, b});
    CHECK_NOTHROW(weave::plan::make_schedule(g, p));
    p.ranges[0].parts = 0; // n < 1
    CHECK(bad_plan(p) == errc::invalid_argument);
    p.ranges[0].parts = 2; // b is not partitionable
    CHECK(bad_plan(p) == errc::invalid_argument);
    CHECK(message_of([&] { weave::plan::make_schedule(g, p); }).find("'b'") != std::string::npos);
    CHECK(bad_plan(partition_plan::unpartitioned({b, a})) ==
          errc::invalid_argument); // not topological
    CHECK(bad_plan(partition_plan::unpartitioned({a, a})) ==
          errc::invalid_argument); // not a permutation
    CHECK(bad_plan(partition_plan::unpartitioned({a, 5})) == errc::out_of_range); // unknown op id
    CHECK(bad_plan(partition_plan::unpartitioned({a})) == errc::size_mismatch);
    partition_plan gap;
    gap.order = {a, b};
    gap.ranges = {{0, 1, 1}};
    CHECK(bad_plan(gap) == errc::invalid_argument); // ranges do not cover b
    gap.ranges = {{0, 1, 1}, {0, 2, 1}};
    CHECK(bad_plan(gap) == errc::invalid_argument); // overlapping ranges
    partition_plan overhead = partition_plan::unpartitioned({a, b});
    overhead.chunk_overhead_us = -1;
    CHECK(bad_plan(overhead) == errc::invalid_argument);
  }
  SUBCASE("planner options and cycles") {
    CHECK(code_of([&] { weave::plan::plan_partitions(g, {.max_parts = 0}); }) ==
          errc::invalid_argument);
    CHECK(code_of([&] { weave::plan::plan_partitions(g, {.chunk_overhead_us = -3}); }) ==
          errc::invalid_argument);
    g.add_dependency(b, a);
    CHECK(code_of([&] { weave::plan::plan_partitions(g); }) == errc::invalid_argument);
    CHECK(message_of([&] { g.validate(); }).find("cycle") != std::string::npos);
  }
  SUBCASE("hand-written schedules") {
    using weave::plan::task;
    task t0, t1, t2, t3;
    t0.op = a;
    t1.op = b;
    t1.deps = {1}; // waits for itself: not an earlier task
    CHECK(code_of([&] {
            weave::plan::schedule::from_tasks({t0, t1}, 2);
          }) == errc::invalid_argument);
    t2.op = b;
    t2.chunk = 2;
    t2.chunks = 2;
    CHECK(code_of([&] {
            weave::plan::schedule::from_tasks({t0, t2}, 2);
          }) == errc::invalid_argument);
    CHECK(code_of([&] { weave::plan::schedule::from_tasks({t0}, 2); }) ==
          errc::invalid_argument); // op b has no task
    t3.op = 4;
    CHECK(code_of([&] { weave::plan::schedule::from_tasks({t0, t3}, 2); }) == errc::out_of_range);
  }
}
