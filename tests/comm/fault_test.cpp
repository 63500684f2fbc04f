// Faults in a local_world: a rank that throws, aborts or never arrives, mismatched sizes between
// sender and receiver, mismatched count exchanges, and ranks calling different collectives.
// Every other rank must fail with the documented error code instead of hanging.
#include <doctest/doctest.h>

#include <weave/comm.hpp>
#include <weave/core/failure.hpp>

#include <chrono>
#include <cstdint>
#include <future>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace std::chrono_literals;

weave::errc code_of(const std::exception_ptr& e) {
  if (!e)
    return weave::errc::internal; // "did not fail"
  try {
    std::rethrow_exception(e);
  } catch (const weave::error& err) {
    return err.code();
  } catch (...) {
    return weave::errc::internal;
  }
}

weave::local_world_options quick() {
  weave::local_world_options o;
  o.timeout = 200ms;
  return o;
}

// Every rank but `culprit` runs a few all-to-alls; returns each rank's failure.
template <class Culprit>
std::vector<std::exception_ptr> exchange_with(int n, int culprit, Culprit&& act) {
  weave::local_world world(n, quick());
  return world.run_collect([&](weave::local_communicator& comm) {
    weave::host_stream s;
    std::vector<std::int64_t> counts(std::size_t(n), 4), displs(static_cast<std::size_t>(n));
    for (int j = 0; j < n; ++j)
      displs[std::size_t(j)] = 4 * j;
    std::vector<std::byte> send(std::size_t(4 * n)), recv(send.size());
    if (comm.rank() == culprit)
      act(comm, s, counts, displs, send, recv);
    for (int round = 0; round < 3; ++round)
      comm.all_to_all_v(s, send.data(), counts, displs, recv.data(), counts, displs);
    s.synchronize();
  });
}

} // namespace

TEST_CASE("a rank that throws makes every other rank fail with peer_failure") {
  for (int n : {2, 3, 4}) {
    auto failures = exchange_with(n, n - 1, [](auto&, auto&, auto&, auto&, auto&, auto&) {
      throw std::runtime_error("expert kernel exploded");
    });
    for (int r = 0; r < n - 1; ++r)
      CHECK(code_of(failures[std::size_t(r)]) == weave::errc::peer_failure);
    CHECK(failures[std::size_t(n - 1)]);
  }
}

TEST_CASE("an explicit abort reaches pending and later operations of the others") {
  weave::local_world world(3, quick());
  auto failures = world.run_collect([&](weave::local_communicator& comm) {
    weave::host_stream s;
    if (comm.rank() == 1) {
      std::this_thread::sleep_for(20ms); // the others are already waiting in the barrier
      comm.abort("out of memory");
      return;
    }
    comm.barrier(s);
    try {
      s.synchronize();
    } catch (const weave::error& e) {
      CHECK(e.code() == weave::errc::peer_failure);
      CHECK(std::string(e.what()).find("out of memory") != std::string::npos);
    }
    comm.barrier(s); // later operations fail at once
    s.synchronize();
  });
  CHECK(code_of(failures[0]) == weave::errc::peer_failure);
  CHECK(code_of(failures[2]) == weave::errc::peer_failure);
  CHECK_FALSE(failures[1]);
  CHECK(world.failed_rank() == 1);
}

TEST_CASE("a rank that never arrives makes the others time out, then fail fast") {
  for (int n : {2, 4}) {
    weave::local_world world(n, quick());
    auto failures = world.run_collect([&](weave::local_communicator& comm) {
      if (comm.rank() == 0)
        return; // never calls anything
      weave::host_stream s;
      comm.barrier(s);
      s.synchronize();
    });
    int timeouts = 0;
    for (int r = 1; r < n; ++r) {
      const auto code = code_of(failures[std::size_t(r)]);
      CHECK((code == weave::errc::timeout || code == weave::errc::peer_failure));
      timeouts += code == weave::errc::timeout;
    }
    CHECK(timeouts >= 1);
    CHECK_FALSE(failures[0]);
  }
}

TEST_CASE("a sender/receiver size mismatch is detected and named") {
  weave::local_world world(2, quick());
  auto failures = world.run_collect([&](weave::local_communicator& comm) {
    weave::host_stream s;
    std::vector<std::byte> send(16), recv(16);
    const std::vector<std::int64_t> displs{0, 8};
    // rank 0 sends 5 bytes to rank 1, which expects 4
    const std::vector<std::int64_t> send_counts =
        comm.rank() == 0 ? std::vector<std::int64_t>{4, 5} : std::vector<std::int64_t>{4, 4};
    const std::vector<std::int64_t> recv_counts{4, 4};
    comm.all_to_all_v(s, send.data(), send_counts, displs, recv.data(), recv_counts, displs);
    s.synchronize();
  });
  REQUIRE(failures[1]);
  CHECK(code_of(failures[1]) == weave::errc::size_mismatch);
  try {
    std::rethrow_exception(failures[1]);
  } catch (const weave::error& e) {
    CHECK(e.message().find("rank 0 sends 5 bytes to rank 1") != std::string::npos);
  }
  const auto other = code_of(failures[0]);
  CHECK(other == weave::errc::peer_failure);
}

TEST_CASE("mismatched count exchanges are detected") {
  SUBCASE("ranks disagree on the counts per peer") {
    weave::local_world world(2, quick());
    auto failures = world.run_collect([&](weave::local_communicator& comm) {
      weave::host_stream s;
      const std::size_t k = comm.rank() == 0 ? 1 : 2;
      std::vector<std::int64_t> send(2 * k, 1), recv(2 * k);
      comm.exchange_counts(s, send, recv);
      s.synchronize();
    });
    // Whoever checks first reports the mismatch; the other may see it as the peer's failure.
    const auto a = code_of(failures[0]), b = code_of(failures[1]);
    CHECK((a == weave::errc::size_mismatch || b == weave::errc::size_mismatch));
    CHECK((a == weave::errc::size_mismatch || a == weave::errc::peer_failure));
    CHECK((b == weave::errc::size_mismatch || b == weave::errc::peer_failure));
  }
  SUBCASE("a received count differs from what the receiver expected") {
    weave::local_world world(3, quick());
    auto failures = world.run_collect([&](weave::local_communicator& comm) {
      weave::host_stream s;
      std::vector<std::int64_t> send(3, 10), recv(3), expected(3, 10);
      if (comm.rank() == 2)
        send[1] = 11; // rank 2 announces 11 to rank 1, which expects 10
      comm.exchange_counts(s, send, recv);
      weave::expect_counts(s, recv, expected, 1);
      s.synchronize();
    });
    CHECK_FALSE(failures[0]);
    CHECK_FALSE(failures[2]);
    REQUIRE(failures[1]);
    CHECK(code_of(failures[1]) == weave::errc::size_mismatch);
    try {
      std::rethrow_exception(failures[1]);
    } catch (const weave::error& e) {
      CHECK(e.message().find("rank 2 announced 11") != std::string::npos);
    }
  }
}

TEST_CASE("ranks calling different collectives fail with invalid_state or size_mismatch") {
  {
    weave::local_world world(2, quick());
    auto failures = world.run_collect([&](weave::local_communicator& comm) {
      weave::host_stream s;
      std::vector<double> v(4, 1.0);
      if (comm.rank() == 0)
        comm.barrier(s);
      else
        comm.all_reduce(s, std::span<const double>(v), std::span<double>(v), weave::reduce_op::sum);
      s.synchronize();
    });
    for (const auto& f : failures) {
      const auto code = code_of(f);
      CHECK((code == weave::errc::invalid_state || code == weave::errc::peer_failure));
    }
  }
  {
    weave::local_world world(2, quick());
    auto failures = world.run_collect([&](weave::local_communicator& comm) {
      weave::host_stream s;
      std::vector<double> v(comm.rank() == 0 ? 4 : 5, 1.0);
      comm.all_reduce(s, std::span<const double>(v), std::span<double>(v), weave::reduce_op::max);
      s.synchronize();
    });
    for (const auto& f : failures) {
      const auto code = code_of(f);
      CHECK((code == weave::errc::size_mismatch || code == weave::errc::peer_failure));
    }
  }
}

TEST_CASE("one communicator's operations running out of order are rejected") {
  weave::local_world world(2, quick());
  auto failures = world.run_collect([&](weave::local_communicator& comm) {
    weave::host_stream first("first"), second("second");
    if (comm.rank() == 0) {
      std::promise<void> gate;
      auto opened = gate.get_future().share();
      first.submit([opened] { opened.wait(); }); // holds operation #1 back
      comm.barrier(first);                       // #1
      comm.barrier(second);                      // #2 runs first
      try {
        second.synchronize();
      } catch (...) {
        gate.set_value();
        try { // observe the first stream's failure too
          first.synchronize();
        } catch (...) {
        }
        throw;
      }
      gate.set_value();
      first.synchronize();
    } else {
      comm.barrier(first);
      comm.barrier(first);
      first.synchronize();
    }
  });
  CHECK(code_of(failures[0]) == weave::errc::invalid_state);
  CHECK(code_of(failures[1]) == weave::errc::peer_failure);
}

TEST_CASE("ranks match operations in the order they run: a skipped one matches nothing") {
  // Rank 0's stream fails before its first barrier, which is skipped; once it recovered, its
  // all-to-all must meet rank 1's all-to-all (not rank 1's barrier-free history), as in MPI.
  weave::local_world world(2, quick());
  std::vector<std::vector<std::int32_t>> got(2);
  world.run([&](weave::local_communicator& comm) {
    weave::host_stream s;
    const int r = comm.rank();
    if (r == 0) {
      s.submit([] { throw std::runtime_error("local failure"); });
      comm.barrier(s); // skipped: the stream failed
      CHECK_THROWS_AS(s.synchronize(), std::runtime_error);
    }
    std::vector<std::int32_t> send = {10 * r, 10 * r + 1}, recv(2, -1);
    const std::vector<std::int64_t> counts{4, 4}, displs{0, 4};
    comm.all_to_all_v(s, send.data(), counts, displs, recv.data(), counts, displs);
    s.synchronize();
    got[std::size_t(r)] = recv;
  });
  CHECK(got[0] == std::vector<std::int32_t>{0, 10});
  CHECK(got[1] == std::vector<std::int32_t>{1, 11});
}

TEST_CASE("a peer_error names the rank where the failure started, its code and its message") {
  weave::local_world world(3, quick());
  auto failures = world.run_collect([&](weave::local_communicator& comm) {
    weave::host_stream s;
    if (comm.rank() == 2) {
      comm.abort(weave::failure_record{2, weave::errc::out_of_range, true, "expert 9 of 8"});
      return;
    }
    comm.barrier(s);
    s.synchronize();
  });
  for (int r = 0; r < 2; ++r) {
    REQUIRE(failures[std::size_t(r)]);
    try {
      std::rethrow_exception(failures[std::size_t(r)]);
    } catch (const weave::peer_error& e) {
      CHECK(e.code() == weave::errc::peer_failure);
      CHECK(e.origin().rank == 2);
      CHECK(e.origin().code == weave::errc::out_of_range);
      CHECK(e.origin().message == "expert 9 of 8");
      CHECK(e.message().find("rank 2 failed with out_of_range: expert 9 of 8") !=
            std::string::npos);
    }
  }
  CHECK_FALSE(failures[2]);
}

TEST_CASE("local_world::run reports the root cause first, then every rank's error") {
  weave::local_world world(3, quick());
  try {
    world.run([&](weave::local_communicator& comm) {
      weave::host_stream s;
      if (comm.rank() == 1) {
        std::this_thread::sleep_for(20ms); // the others wait in the barrier already
        WEAVE_THROW(weave::errc::invalid_argument, "bad input on rank one");
      }
      comm.barrier(s);
      s.synchronize();
    });
    FAIL("run did not throw");
  } catch (const weave::peer_error&) {
    FAIL("run reported a consequence, not the root cause");
  } catch (const weave::error& e) {
    CHECK(e.code() == weave::errc::invalid_argument);
    const std::string m = e.message();
    CHECK(m.rfind("bad input on rank one", 0) == 0); // the root cause first
    const auto r0 = m.find("[rank 0] weave peer_failure"),
               r2 = m.find("[rank 2] weave peer_failure");
    CHECK(r0 != std::string::npos);
    CHECK(r2 != std::string::npos);
    CHECK(r0 < r2);
  }
}
