#include <doctest/doctest.h>

#include <weave/placement/profiling.hpp>
#include <weave/placement/trace.hpp>

#include <cstdint>
#include <span>
#include <vector>

TEST_CASE("all-reducing statistics through a callable equals merging every rank by hand") {
  const int E = 16, k = 4, ranks = 4;
  std::vector<weave::coactivation_profiler> prof;
  std::vector<weave::synthetic_trace> traces;
  for (int r = 0; r < ranks; ++r) {
    prof.emplace_back(E, 0.5);
    weave::trace_options o;
    o.num_experts = E;
    o.k = k;
    o.tokens = 300;
    o.seed = static_cast<std::uint64_t>(r + 1);
    traces.push_back(weave::generate_trace(o));
  }
  // Two steps per rank: the first half of its trace, then the second half.
  for (int r = 0; r < ranks; ++r) {
    const std::span<const std::int32_t> ids(traces[static_cast<std::size_t>(r)].ids);
    prof[static_cast<std::size_t>(r)].record(ids.first(ids.size() / 2), k);
    prof[static_cast<std::size_t>(r)].end_step();
    prof[static_cast<std::size_t>(r)].record(ids.subspan(ids.size() / 2), k);
  }
  // Reference: decay by hand, then merge.
  weave::expert_statistics expected(E);
  for (int r = 0; r < ranks; ++r) {
    const std::span<const std::int32_t> ids(traces[static_cast<std::size_t>(r)].ids);
    weave::expert_statistics s(E);
    s.accumulate(ids.first(ids.size() / 2), k, 0.5);
    s.accumulate(ids.subspan(ids.size() / 2), k);
    expected.merge(s);
  }
  // A fake communicator: every rank's buffer is summed; rank r sees the total in place.
  std::vector<std::vector<double>> buffers;
  for (int r = 0; r < ranks; ++r) {
    const auto raw = prof[static_cast<std::size_t>(r)].local().raw();
    buffers.emplace_back(raw.begin(), raw.end());
  }
  std::vector<double> total(buffers[0].size(), 0.0);
  for (const auto& b : buffers)
    for (std::size_t i = 0; i < b.size(); ++i)
      total[i] += b[i];
  int calls = 0;
  for (int r = 0; r < ranks; ++r) {
    const auto global = prof[static_cast<std::size_t>(r)].synchronize([&](std::span<double> buf) {
      REQUIRE(buf.size() == total.size());
      for (std::size_t i = 0; i < buf.size(); ++i)
        buf[i] = total[i];
      ++calls;
    });
    for (int a = 0; a < E; ++a) {
      CHECK(global.load(a) == doctest::Approx(expected.load(a)));
      for (int b = 0; b < E; ++b)
        CHECK(global.coactivation(a, b) == doctest::Approx(expected.coactivation(a, b)));
    }
  }
  CHECK(calls == ranks);
  CHECK(prof[0].steps() == 1);
  // Local counts are untouched by synchronize.
  CHECK(prof[0].local().raw()[0] == buffers[0][0]);
  // The free function works on any statistics.
  weave::expert_statistics s(E);
  s.raw()[3] = 1;
  weave::all_reduce_statistics(s, [](std::span<double> b) {
    for (auto& x : b)
      x *= ranks; // every rank held the same counts
  });
  CHECK(s.load(3) == ranks);
  CHECK_THROWS_AS(weave::coactivation_profiler(E, 1.5), weave::error);
  CHECK_THROWS_AS(weave::coactivation_profiler(0, 0.5), weave::error);
}
