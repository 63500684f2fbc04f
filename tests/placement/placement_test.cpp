#include <doctest/doctest.h>

#include <weave/placement/placement.hpp>

#include <set>
#include <vector>

TEST_CASE("contiguous placement puts E/D consecutive experts on each device") {
  const auto p = weave::placement::contiguous(8, 4);
  CHECK(p.slots_per_device() == 2);
  CHECK_FALSE(p.replicated());
  for (int e = 0; e < 8; ++e) {
    CHECK(p.device_of(e) == e / 2);
    CHECK(p.slots_of(e).size() == 1);
    CHECK(p.local_of_slot(p.slots_of(e)[0]) == e % 2);
  }
  CHECK_THROWS_AS(weave::placement::contiguous(10, 4), weave::error);
}

TEST_CASE("replicated placement resolves tokens to a local replica, else in turn") {
  // 3 devices x 2 slots; expert 0 replicated on devices 0 and 2.
  const weave::placement p(5, 3, {0, 1, 2, 3, 4, 0});
  CHECK(p.replicated());
  CHECK(std::vector<int>(p.slots_of(0).begin(), p.slots_of(0).end()) == std::vector<int>{0, 5});
  CHECK(p.slot_for(0, 17, 2) == 5); // own device
  CHECK(p.slot_for(0, 17, 0) == 0);
  std::set<int> chosen;
  for (std::size_t t = 0; t < 4; ++t)
    chosen.insert(p.slot_for(0, t, 1)); // no local replica: alternate
  CHECK(chosen == std::set<int>{0, 5});
  CHECK(p.slot_for(3, 99, 0) == 3);
}

TEST_CASE("invalid placements are rejected with the offending value") {
  CHECK_THROWS_AS(weave::placement(4, 2, {0, 1, 2}), weave::error);    // uneven slots
  CHECK_THROWS_AS(weave::placement(4, 2, {0, 1, 2, 2}), weave::error); // expert 3 unplaced
  CHECK_THROWS_AS(weave::placement(4, 2, {0, 1, 2, 7}), weave::error); // id out of range
  CHECK_THROWS_AS(weave::placement(3, 2, {0, 0, 1, 2}), weave::error); // two replicas on device 0
  try {
    weave::placement(4, 2, {0, 1, 2, 9});
  } catch (const weave::error& e) {
    CHECK(e.code() == weave::errc::out_of_range);
    CHECK(e.message().find("expert 9") != std::string::npos);
  }
}

#include <weave/placement/statistics.hpp>

TEST_CASE("expert_statistics counts loads and symmetric co-activation like a naive count") {
  const int E = 6, k = 3;
  const std::vector<std::int32_t> ids = {0, 1, 2, 2, 1, 5, 4, -1, 0, 3, 3, 3};
  weave::expert_statistics s(E);
  s.accumulate(ids, k);
  std::vector<double> load(E, 0), pair(E * E, 0);
  for (std::size_t t = 0; t < ids.size() / k; ++t)
    for (int a = 0; a < k; ++a) {
      const int ea = ids[t * k + a];
      if (ea < 0)
        continue;
      load[ea] += 1;
      for (int b = 0; b < k; ++b) { // every ordered pair of positions
        const int eb = ids[t * k + b];
        if (b != a && eb >= 0 && eb != ea)
          pair[ea * E + eb] += 1;
      }
    }
  for (int e = 0; e < E; ++e)
    CHECK(s.load(e) == load[e]);
  for (int a = 0; a < E; ++a)
    for (int b = 0; b < E; ++b)
      CHECK(s.coactivation(a, b) == pair[a * E + b]);
  CHECK(s.coactivation(1, 2) == 2.0);
  CHECK(s.coactivation(3, 3) == 0.0);

  weave::expert_statistics other(E);
  other.accumulate(ids, k);
  s.merge(other);
  s.decay(0.5);
  CHECK(s.load(3) == 3.0);
  CHECK(s.raw().size() == static_cast<std::size_t>(E + E * E));
  CHECK_THROWS_AS(s.accumulate(std::vector<std::int32_t>{0, 6, 1}, 3), weave::error);
  CHECK_THROWS_AS(s.accumulate(std::vector<std::int32_t>{0, 1}, 3), weave::error);
  CHECK_THROWS_AS(s.merge(weave::expert_statistics(5)), weave::error);
  CHECK_THROWS_AS(s.decay(1.5), weave::error);
}
