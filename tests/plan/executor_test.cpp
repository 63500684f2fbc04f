#include <doctest/doctest.h>

#include <weave/exec/host_stream.hpp>
#include <weave/plan/executor.hpp>
#include <weave/plan/partition_planner.hpp>

#include <atomic>
#include <barrier>
#include <chrono>
#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <tuple>
#include <vector>

using namespace weave::plan;

namespace {

graph moe_layer() {
  graph g;
  const auto a = g.add_compute("attn", {20, 400});
  const auto gate = g.add_compute("gate", {10, 50}, {a});
  const auto d = g.add_a2a("dispatch", 1e6, op_cost{50, 300}, {gate});
  const auto e = g.add_compute("experts", {20, 500}, {d});
  const auto side = g.add_compute("shared_expert", {20, 200}, {gate}); // independent of the a2a
  g.add_a2a("combine", 1e6, op_cost{50, 300}, {e});
  (void)side;
  return g;
}

void sleep_us(double us) {
  std::this_thread::sleep_for(std::chrono::duration<double, std::micro>(us));
}

struct ranked_streams {
  std::vector<std::unique_ptr<weave::host_stream>> owned;
  std::vector<rank_streams<weave::host_stream>> view;
  explicit ranked_streams(std::size_t ranks) {
    for (std::size_t r = 0; r < ranks; ++r) {
      owned.push_back(std::make_unique<weave::host_stream>("compute"));
      owned.push_back(std::make_unique<weave::host_stream>("comm"));
      view.push_back({owned[2 * r].get(), owned[2 * r + 1].get()});
    }
  }
};

} // namespace

TEST_CASE("the executor runs every task once, in an order that respects the schedule") {
  const graph g = moe_layer();
  const partition_plan p = plan_partitions(g, {.max_parts = 3});
  const schedule s = make_schedule(g, p);
  constexpr std::size_t ranks = 2;
  ranked_streams streams(ranks);
  schedule_executor<weave::host_stream> ex(g, s, streams.view);

  std::mutex m;
  std::map<std::tuple<std::size_t, op_id, std::int64_t>, int> ran;
  std::barrier<> rendezvous(ranks); // stand-in collective: every rank enters each a2a together
  auto note = [&](std::size_t rank, const task& t) {
    std::lock_guard lock(m);
    ++ran[{rank, t.op, t.chunk}];
  };
  auto compute = [&](std::size_t rank, const op& o, const task& t) {
    CHECK(o.kind != op_kind::a2a);
    note(rank, t);
    sleep_us(t.predicted_us / 10);
  };
  auto comm = [&](std::size_t rank, const op& o, const task& t) {
    CHECK(o.kind == op_kind::a2a);
    note(rank, t);
    rendezvous.arrive_and_wait();
    sleep_us(t.predicted_us / 10);
  };
  for (int repeat = 0; repeat < 2; ++repeat) {
    ran.clear();
    const weave::plan::timeline& t = ex.run(compute, comm);
    REQUIRE(t.ranks() == ranks);
    REQUIRE(t.tasks() == s.size());
    CHECK(ran.size() == ranks * s.size());
    for (const auto& [key, count] : ran)
      CHECK(count == 1);
    for (std::size_t r = 0; r < ranks; ++r) {
      double stream_end[2] = {0, 0};
      for (std::size_t i = 0; i < s.size(); ++i) {
        const auto& iv = t.at(r, i);
        CHECK(iv.end_us >= iv.begin_us);
        CHECK(iv.begin_us >= 0);
        // Stream order: a task starts after the previous one on its stream ended.
        auto& prev = stream_end[static_cast<std::size_t>(s[i].stream)];
        CHECK(iv.begin_us >= prev);
        prev = iv.end_us;
        // Dependencies on the same rank ended first.
        for (std::size_t d : s[i].deps)
          CHECK(iv.begin_us >= t.at(r, d).end_us);
        // A collective ends after every rank's inputs were ready.
        if (s[i].stream == stream_kind::comm)
          for (std::size_t q = 0; q < ranks; ++q)
            for (std::size_t d : s[i].deps)
              CHECK(iv.end_us >= t.at(q, d).end_us);
      }
    }
  }
}

TEST_CASE("a failing op surfaces from run and leaves the executor usable") {
  const graph g = moe_layer();
  const schedule s = make_schedule(g, partition_plan::unpartitioned(g.topological_order()));
  ranked_streams streams(1);
  schedule_executor<weave::host_stream> ex(g, s, streams.view);
  std::mutex m;
  std::vector<std::string> ran;
  auto compute = [&](std::size_t, const op& o, const task&) {
    {
      std::lock_guard lock(m);
      ran.push_back(o.name);
    }
    if (o.name == "gate")
      throw std::runtime_error("gate failed");
  };
  auto comm = [&](std::size_t, const op& o, const task&) {
    std::lock_guard lock(m);
    ran.push_back(o.name);
  };
  CHECK_THROWS_WITH_AS(ex.run(compute, comm), "gate failed", std::runtime_error);
  // Nothing after the failure ran: every other op depends on gate (or on attn before it).
  CHECK(ran == std::vector<std::string>{"attn", "gate"});
  ran.clear();
  auto fine = [&](std::size_t, const op& o, const task&) {
    std::lock_guard lock(m);
    ran.push_back(o.name);
  };
  ex.run(fine, fine);
  CHECK(ran.size() == g.size());
}

TEST_CASE("the executor rejects missing streams and a schedule of another graph") {
  const graph g = moe_layer();
  const schedule s = make_schedule(g, partition_plan::unpartitioned(g.topological_order()));
  graph other;
  other.add_compute("only", {1, 0});
  ranked_streams streams(1);
  auto code_of = [](auto&& f) {
    try {
      f();
    } catch (const weave::error& e) {
      return e.code();
    }
    return weave::errc::internal;
  };
  using ex_t = schedule_executor<weave::host_stream>;
  CHECK(code_of([&] { ex_t(g, s, {}); }) == weave::errc::invalid_argument);
  CHECK(code_of([&] {
          ex_t(g, s, {{streams.view[0].compute, nullptr}});
        }) == weave::errc::invalid_argument);
  CHECK(code_of([&] { ex_t(other, s, streams.view); }) == weave::errc::size_mismatch);
}

#include <weave/plan/timeline_trace.hpp>

TEST_CASE("docs example: describe, plan, simulate, trace, execute") {
  //! [plan]
  const auto link = weave::plan::a2a_cost::from_bandwidth(/*alpha_us=*/30, /*GB/s=*/12.5);
  graph g; // one MoE layer; costs in us at full batch: {per chunk, scaled by the fraction}
  const op_id attn = g.add_compute("attention", {20, 1200});
  const op_id gate = g.add_compute("gate", {15, 60}, {attn});
  const op_id disp = g.add_a2a("dispatch", 11e6, link, {gate}); // 11 MB per rank
  const op_id experts = g.add_compute("experts", {30, 1500}, {disp});
  g.add_a2a("combine", 11e6, link, {experts});

  const partition_plan p = plan_partitions(g, {.max_parts = 8, .chunk_overhead_us = 5});
  const schedule s = make_schedule(g, p);
  const weave::plan::timeline predicted = weave::plan::simulate(s, /*ranks=*/2);
  const weave::plan::rank_stats st = weave::plan::analyze_worst(s, predicted);

  weave::trace_writer trace; // open the JSON in chrome://tracing or ui.perfetto.dev
  append_timeline(trace, g, s, predicted, "predicted");

  weave::host_stream compute0("compute0"), comm0("comm0"), compute1("compute1"), comm1("comm1");
  schedule_executor<weave::host_stream> run(g, s, {{&compute0, &comm0}, {&compute1, &comm1}});
  std::atomic<int> calls{0};
  const weave::plan::timeline& measured = run.run(
      [&](std::size_t /*rank*/, const op& /*o*/, const task& /*t*/) {
        ++calls; // run o on t.fraction of the rows
      },
      [&](std::size_t /*rank*/, const op& /*o*/, const task& /*t*/) {
        ++calls; // all-to-all of o.bytes * t.fraction
      });
  append_timeline(trace, g, s, measured, "measured", /*pid_base=*/100);
  //! [plan]

  CHECK(st.makespan_us <= p.predicted_us);
  const double serial =
      weave::plan::simulate(make_schedule(g, partition_plan::unpartitioned({0, 1, 2, 3, 4})))
          .makespan_us();
  CHECK(st.makespan_us < serial);
  CHECK(trace.size() == 4 * s.size());
  CHECK(calls == static_cast<int>(2 * s.size()));
  CHECK(measured.tasks() == s.size());
}
