#include <doctest/doctest.h>

#include <weave/plan/schedule.hpp>
#include <weave/plan/timeline.hpp>

#include <limits>

using weave::plan::graph;
using weave::plan::make_schedule;
using weave::plan::op_cost;
using weave::plan::partition_plan;

namespace {

// The task of op `id`, chunk `c`.
std::size_t task_of(const weave::plan::schedule& s, weave::plan::op_id id, std::int64_t c = 0) {
  return s.first_task(id) + static_cast<std::size_t>(c);
}

} // namespace

TEST_CASE("an unpartitioned schedule overlaps an a2a with independent compute") {
  graph g;
  const auto a = g.add_compute("A", {3, 0});
  const auto x = g.add_a2a("X", 0.0, op_cost{4, 0}, {a});
  const auto b = g.add_compute("B", {2, 0});
  const auto c = g.add_compute("C", {1, 0}, {x});
  const auto s = make_schedule(g, partition_plan::unpartitioned({a, x, b, c}));
  const auto t = weave::plan::simulate(s);
  // compute: A [0,3], B [3,5], then C waits for X; comm: X [3,7] (after A); C [7,8].
  CHECK(t.at(0, task_of(s, a)).end_us == 3);
  CHECK(t.at(0, task_of(s, x)).begin_us == 3);
  CHECK(t.at(0, task_of(s, x)).end_us == 7);
  CHECK(t.at(0, task_of(s, b)).begin_us == 3);
  CHECK(t.at(0, task_of(s, c)).begin_us == 7);
  CHECK(t.makespan_us() == 8);
  const auto st = weave::plan::analyze(s, t, 0);
  CHECK(st.compute_busy_us == 6); // 3 + 2 + 1
  CHECK(st.comm_busy_us == 4);
  CHECK(st.exposed_comm_us == 2); // X over [3,7], B covers [3,5]
}

TEST_CASE("a chain split in two chunks pipelines the a2a under the other chunk's compute") {
  graph g;
  const auto a = g.add_compute("A", {0, 4});
  const auto x = g.add_a2a("X", 0.0, op_cost{1, 4}, {a}); // 1 us latency per call
  const auto c = g.add_compute("C", {0, 2}, {x});

  SUBCASE("whole: A [0,4], X [4,9], C [9,11]") {
    const auto s = make_schedule(g, partition_plan::unpartitioned({a, x, c}));
    const auto t = weave::plan::simulate(s);
    CHECK(t.makespan_us() == 11);
    CHECK(weave::plan::analyze(s, t, 0).exposed_comm_us == 5);
  }
  SUBCASE("two chunks") {
    partition_plan p;
    p.order = {a, x, c};
    p.ranges = {{0, 3, 2}};
    const auto s = make_schedule(g, p);
    REQUIRE(s.size() == 6);
    const auto t = weave::plan::simulate(s);
    // Chunks: A 2 us, X 1 + 2 = 3 us, C 1 us.
    // compute A0 [0,2] A1 [2,4]; comm X0 [2,5] X1 [5,8]; C0 [5,6] (waits X0); C1 [8,9].
    CHECK(t.at(0, task_of(s, a, 1)).end_us == 4);
    CHECK(t.at(0, task_of(s, x, 0)).begin_us == 2);
    CHECK(t.at(0, task_of(s, x, 1)).begin_us == 5);
    CHECK(t.at(0, task_of(s, c, 0)).begin_us == 5);
    CHECK(t.at(0, task_of(s, c, 1)).begin_us == 8);
    CHECK(t.makespan_us() == 9);
    const auto st = weave::plan::analyze(s, t, 0);
    CHECK(st.comm_busy_us == 6);
    // comm [2,8] against compute [0,4] u [5,6] u [8,9]: hidden 2 + 1 = 3, exposed 3.
    CHECK(st.exposed_comm_us == 3);
    CHECK(st.compute_busy_us == 6);
  }
  SUBCASE("chunk overhead is paid by every chunk of a partitioned range") {
    partition_plan p;
    p.order = {a, x, c};
    p.ranges = {{0, 3, 2}};
    p.chunk_overhead_us = 0.5;
    const auto s = make_schedule(g, p);
    // A0 [0,2.5] A1 [2.5,5]; X0 [2.5,6] X1 [6,9.5]; C0 [6,7.5]; C1 [9.5,11].
    CHECK(weave::plan::simulate(s).makespan_us() == 11);
  }
}

TEST_CASE("an a2a starts on every rank once the slowest rank is ready") {
  graph g;
  const auto a = g.add_compute("A", {2, 0});
  const auto x = g.add_a2a("X", 0.0, op_cost{3, 0}, {a});
  const auto c = g.add_compute("C", {1, 0}, {x});
  const auto s = make_schedule(g, partition_plan::unpartitioned({a, x, c}));
  // Rank 1 computes twice as slowly: A ends at 2 on rank 0 and 4 on rank 1; X runs [4,7] on
  // both; C [7,8] on rank 0 and [7,9] on rank 1.
  const auto t = weave::plan::simulate(s, 2, [&](std::size_t r, std::size_t i) {
    return s[i].stream == weave::plan::stream_kind::comm ? s[i].predicted_us
                                                         : s[i].predicted_us * (1.0 + r);
  });
  CHECK(t.at(0, task_of(s, x)).begin_us == 4);
  CHECK(t.at(1, task_of(s, x)).begin_us == 4);
  CHECK(t.at(0, task_of(s, c)).end_us == 8);
  CHECK(t.at(1, task_of(s, c)).end_us == 9);
  CHECK(t.makespan_us() == 9);
  CHECK(weave::plan::analyze(s, t, 0).exposed_comm_us == 3); // rank 0 idles through X
  const auto worst = weave::plan::analyze_worst(s, t);
  CHECK(worst.makespan_us == 9);
  CHECK(worst.compute_busy_us == 6); // rank 1: 4 + 2
}

TEST_CASE("range barriers make each range wait for everything before it") {
  graph g;
  const auto a = g.add_compute("A", {2, 0});
  const auto x = g.add_a2a("X", 0.0, op_cost{5, 0}, {a});
  const auto b = g.add_compute("B", {3, 0});
  partition_plan p;
  p.order = {a, x, b};
  p.ranges = {{0, 2, 1}, {2, 3, 1}};
  // Without barriers B runs under X: A [0,2], X [2,7], B [2,5] -> 7.
  CHECK(weave::plan::simulate(make_schedule(g, p)).makespan_us() == 7);
  // With them B waits for X: B [7,10] -> 10.
  CHECK(weave::plan::simulate(make_schedule(g, p, {.range_barriers = true})).makespan_us() == 10);
}

TEST_CASE("the simulator rejects bad durations and mismatched timelines") {
  graph g;
  g.add_compute("A", {1, 0});
  const auto s = make_schedule(g, partition_plan::unpartitioned({0}));
  auto code_of = [](auto&& f) {
    try {
      f();
    } catch (const weave::error& e) {
      return e.code();
    }
    return weave::errc::internal;
  };
  CHECK(code_of([&] {
          weave::plan::simulate(s, 1, [](std::size_t, std::size_t) { return -1.0; });
        }) == weave::errc::invalid_argument);
  CHECK(code_of([&] {
          weave::plan::simulate(s, 1, [](std::size_t, std::size_t) {
            return std::numeric_limits<double>::quiet_NaN();
          });
        }) == weave::errc::invalid_argument);
  CHECK(code_of([&] { weave::plan::simulate(s, 0); }) == weave::errc::invalid_argument);
  const weave::plan::timeline wrong(1, 3);
  CHECK(code_of([&] { weave::plan::analyze(s, wrong, 0); }) == weave::errc::size_mismatch);
  CHECK(code_of([&] { weave::plan::analyze(s, weave::plan::simulate(s), 1); }) ==
        weave::errc::out_of_range);
}
