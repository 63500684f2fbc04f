// local_communicator::shrink: the survivors of a failure agree on who is left and go on in a
// smaller world. Checked: who is left after a rank threw, stopped (never arrives) or is excluded,
// that the new world's collectives deliver what an independent reference says, that ranks inside
// an operation are let out at once, disagreement and late arrival are typed errors on every rank
// concerned, and shrinking twice.
#include <doctest/doctest.h>

#include <weave/comm/local_world.hpp>
#include <weave/comm/shrink.hpp>
#include <weave/exec/host_stream.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

namespace {

using namespace std::chrono_literals;

// Every rank sends (100 * old rank + old destination) to each peer; returns what arrived.
std::vector<std::int64_t> exchange_identities(weave::local_communicator& c,
                                              const std::vector<int>& old_of) {
  weave::host_stream s("shrink-test");
  const auto n = static_cast<std::size_t>(c.size());
  std::vector<std::int64_t> send(n), recv(n, -1);
  for (std::size_t j = 0; j < n; ++j)
    send[j] = 100 * old_of[static_cast<std::size_t>(c.rank())] + old_of[j];
  c.exchange_counts(s, send, recv);
  s.synchronize();
  return recv;
}

// The reference: what exchange_identities must return on the rank whose old rank is `me`.
std::vector<std::int64_t> expected_identities(int me, const std::vector<int>& old_of) {
  std::vector<std::int64_t> out;
  for (const int from : old_of)
    out.push_back(100 * from + me);
  return out;
}

weave::errc code_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const weave::error& x) {
    return x.code();
  }
}

} // namespace

TEST_CASE("shrink: a rank that threw is left out, the survivors' world exchanges correctly") {
  for (const int lost : {0, 2, 3}) {
    CAPTURE(lost);
    weave::local_world world(4, {.timeout = 5s});
    std::mutex m;
    std::vector<std::vector<int>> survivors_seen;
    const auto failures = world.run_collect([&](weave::local_communicator& c) {
      weave::host_stream s("step");
      std::vector<std::int64_t> send(4, 1), recv(4);
      if (c.rank() == lost)
        throw std::runtime_error("device lost");
      try {
        c.exchange_counts(s, send, recv);
        s.synchronize();
      } catch (const weave::peer_error& e) {
        CHECK(e.origin().rank == lost);
      }
      auto next = weave::shrink(c);
      {
        std::lock_guard lock(m);
        survivors_seen.push_back(next.survivors);
      }
      CHECK(next.comm->size() == 3);
      CHECK(next.lost == std::vector<int>{lost});
      CHECK(next.old_rank() == c.rank());
      CHECK(exchange_identities(*next.comm, next.survivors) ==
            expected_identities(c.rank(), next.survivors));
    });
    for (int r = 0; r < 4; ++r)
      CHECK(static_cast<bool>(failures[static_cast<std::size_t>(r)]) == (r == lost));
    REQUIRE(survivors_seen.size() == 3);
    for (const auto& v : survivors_seen)
      CHECK(v == survivors_seen.front());
  }
}

TEST_CASE("shrink: a rank that never arrives is left out after the timeout, and refused later") {
  weave::local_world world(4, {.timeout = 300ms});
  std::atomic<bool> survivors_done{false};
  std::exception_ptr late;
  const auto failures = world.run_collect([&](weave::local_communicator& c) {
    if (c.rank() == 1) { // stopped: it neither works nor leaves until the others are done
      while (!survivors_done.load())
        std::this_thread::sleep_for(1ms);
      try {
        (void)c.shrink();
      } catch (...) {
        late = std::current_exception();
      }
      return;
    }
    weave::host_stream s("step");
    std::vector<std::int64_t> send(4, 1), recv(4);
    c.exchange_counts(s, send, recv);
    CHECK_THROWS_AS(s.synchronize(), weave::error); // the timeout, or a peer's report of it
    auto next = c.shrink();
    CHECK(next.survivors == std::vector<int>{0, 2, 3});
    CHECK(exchange_identities(*next.comm, next.survivors) ==
          expected_identities(c.rank(), next.survivors));
    next.comm->barrier(s);
    s.synchronize();
    if (next.comm->rank() == 0)
      survivors_done = true;
  });
  for (const auto& f : failures)
    CHECK_FALSE(f);
  REQUIRE(late);
  CHECK(code_of(late) == weave::errc::invalid_state);
}

TEST_CASE("shrink revokes: a rank inside an operation is let out at once and may survive") {
  weave::local_world world(3, {.timeout = 30s});
  const auto start = std::chrono::steady_clock::now();
  world.run([&](weave::local_communicator& c) {
    weave::host_stream s("step");
    if (c.rank() != 2) { // ranks 0 and 1 wait in an exchange rank 2 never joins
      std::vector<std::int64_t> send(3, 1), recv(3);
      c.exchange_counts(s, send, recv);
      CHECK_THROWS_AS(s.synchronize(), weave::peer_error);
    }
    auto next = c.shrink(); // nobody excluded: all three go on
    CHECK(next.survivors == std::vector<int>{0, 1, 2});
    CHECK(next.lost.empty());
    CHECK(exchange_identities(*next.comm, next.survivors) ==
          expected_identities(c.rank(), next.survivors));
  });
  CHECK(std::chrono::steady_clock::now() - start < 10s); // not the 30 s timeout
}

TEST_CASE("shrink: survivors that disagree about who is left all fail, none forms a group") {
  weave::local_world world(4, {.timeout = 5s});
  const auto failures = world.run_collect([&](weave::local_communicator& c) {
    const std::vector<int> mine = c.rank() == 0 ? std::vector<int>{3} : std::vector<int>{};
    (void)c.shrink(mine);
  });
  for (const auto& f : failures) {
    REQUIRE(f);
    CHECK(code_of(f) == weave::errc::config_mismatch);
  }
}

TEST_CASE("shrink: excluded ranks are left out even when alive, and learn it") {
  weave::local_world world(4, {.timeout = 5s});
  const std::vector<int> excluded{1, 3};
  const auto failures = world.run_collect([&](weave::local_communicator& c) {
    auto next = c.shrink(excluded);
    CHECK(next.survivors == std::vector<int>{0, 2});
    CHECK(exchange_identities(*next.comm, next.survivors) ==
          expected_identities(c.rank(), next.survivors));
  });
  for (int r = 0; r < 4; ++r) {
    const auto& f = failures[static_cast<std::size_t>(r)];
    CHECK(static_cast<bool>(f) == (r == 1 || r == 3));
    if (f)
      CHECK(code_of(f) == weave::errc::invalid_state);
  }
  weave::local_world small(2);
  const auto bad = small.run_collect([&](weave::local_communicator& c) {
    const std::vector<int> outside{2};
    (void)c.shrink(outside);
  });
  CHECK(code_of(bad[0]) == weave::errc::out_of_range);
}

TEST_CASE("shrink twice: 4 -> 3 -> 2, each world exchanging correctly") {
  weave::local_world world(4, {.timeout = 5s});
  world.run_collect([&](weave::local_communicator& c) {
    if (c.rank() == 1)
      throw std::runtime_error("first loss");
    auto a = c.shrink();
    REQUIRE(a.survivors == std::vector<int>{0, 2, 3});
    if (a.comm->rank() == 0) { // old rank 0: lost second; its handle goes with it
      a.comm.reset();
      return;
    }
    auto b = a.comm->shrink();
    CHECK(b.survivors == std::vector<int>{1, 2}); // ranks of the 3-rank world
    const std::vector<int> old_of{a.survivors[1], a.survivors[2]};
    CHECK(exchange_identities(*b.comm, old_of) == expected_identities(c.rank(), old_of));
    CHECK_THROWS_AS((void)a.comm->shrink(), weave::error); // once per world
  });
}
