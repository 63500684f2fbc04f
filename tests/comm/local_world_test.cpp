// local_world against the naive reference (direct copies between the ranks' buffers), over
// random skewed layouts; count exchange feeding an all-to-all on one stream; reductions
// against a serial rank-order reduction; the send/recv fallback; emulated links; bad input.
#include <doctest/doctest.h>

#include "a2a_cases.hpp"

#include <weave/comm.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <future>
#include <random>
#include <span>
#include <vector>

namespace {

using span64 = std::span<const std::int64_t>;

void run_case(weave::local_world& world, const comm_test::a2a_case& c,
              std::vector<std::vector<std::byte>>& recv, int repeats = 1) {
  recv.assign(std::size_t(c.n), {});
  world.run([&](weave::local_communicator& comm) {
    const auto r = std::size_t(comm.rank());
    const comm_test::rank_layout& L = c.ranks[r];
    std::vector<std::vector<std::byte>> outs(
        std::size_t(repeats), std::vector<std::byte>(L.recv_bytes, comm_test::sentinel));
    weave::host_stream s("comm");
    for (auto& out : outs) // several exchanges in flight on one stream
      comm.all_to_all_v(s, L.send.data(), L.send_counts, L.send_displs, out.data(), L.recv_counts,
                        L.recv_displs, c.unit);
    s.synchronize();
    for (std::size_t i = 1; i < outs.size(); ++i)
      REQUIRE(outs[i] == outs[0]);
    recv[r] = std::move(outs[0]);
  });
}

// A communicator that only has grouped send/recv, to exercise the generic fallback.
//! [custom]
struct send_recv_only {
  using stream_type = weave::host_stream;
  weave::local_communicator* inner;
  int rank() const { return inner->rank(); }
  int size() const { return inner->size(); }
  void send_recv(weave::host_stream& s, std::span<const weave::peer_transfer> t) {
    inner->send_recv(s, t);
  }
};
static_assert(weave::communicator<send_recv_only> && weave::has_send_recv<send_recv_only> &&
              !weave::has_all_to_all_v<send_recv_only>);
//! [custom]

template <class F>
weave::errc code_of(F&& f) {
  try {
    f();
  } catch (const weave::error& e) {
    return e.code();
  }
  return weave::errc::internal; // "did not throw"
}

} // namespace

TEST_CASE("local_world all_to_all_v equals the direct-copy reference on random skewed layouts") {
  for (int n : {1, 2, 3, 4, 5}) {
    for (std::size_t unit : {std::size_t{1}, std::size_t{3}, std::size_t{16}}) {
      for (std::uint64_t seed = 1; seed <= 3; ++seed) {
        CAPTURE(n);
        CAPTURE(unit);
        CAPTURE(seed);
        const auto c = comm_test::make_case(n, unit, seed * 7919 + std::uint64_t(n));
        weave::local_world world(n);
        std::vector<std::vector<std::byte>> recv;
        run_case(world, c, recv, 3);
        for (int r = 0; r < n; ++r)
          REQUIRE(recv[std::size_t(r)] == comm_test::expected_recv(c, r));
      }
    }
  }
}

TEST_CASE("a bounded all_to_all_v fills each room with its block alone and reports its length") {
  for (int n : {1, 2, 3, 5}) {
    for (std::size_t unit : {std::size_t{1}, std::size_t{12}}) {
      for (std::uint64_t seed = 1; seed <= 3; ++seed) {
        CAPTURE(n);
        CAPTURE(unit);
        CAPTURE(seed);
        const auto c = comm_test::make_case(n, unit, seed * 104729 + std::uint64_t(n), 300, true,
                                            seed == 3 ? 0 : 9); // seed 3: blocks fill their rooms
        weave::local_world world(n);
        world.run([&](weave::local_communicator& comm) {
          const auto r = std::size_t(comm.rank());
          const comm_test::rank_layout& L = c.ranks[r];
          std::vector<std::byte> out(L.recv_bytes, comm_test::sentinel);
          std::vector<std::int64_t> received(std::size_t(n), -1);
          weave::host_stream s("comm");
          comm.all_to_all_v_bounded(s, L.send.data(), L.send_counts, L.send_displs, out.data(),
                                    L.recv_counts, L.recv_displs, received, c.unit);
          s.synchronize();
          CHECK(out == comm_test::expected_recv(c, int(r)));
          for (std::size_t j = 0; j < std::size_t(n); ++j)
            CHECK(received[j] == c.ranks[j].send_counts[r]);
        });
      }
    }
  }
}

TEST_CASE("a bounded all_to_all_v refuses a block longer than its room") {
  weave::local_world world(2);
  world.run_collect([&](weave::local_communicator& comm) {
    weave::host_stream s;
    std::vector<std::byte> send(16, std::byte{7}), recv(16);
    std::vector<std::int64_t> received(2);
    const std::vector<std::int64_t> room{4, 4}, displs{0, 8};
    std::vector<std::int64_t> counts{4, 4};
    if (comm.rank() == 0)
      counts[1] = 5; // rank 1 has room for 4
    comm.all_to_all_v_bounded(s, send.data(), counts, displs, recv.data(), room, displs, received);
    const auto code = code_of([&] { s.synchronize(); });
    if (comm.rank() == 1)
      CHECK(code == weave::errc::size_mismatch);
    else // it received its own blocks; it may learn of rank 1's failure here
      CHECK((code == weave::errc::internal || code == weave::errc::peer_failure));
  });
}

TEST_CASE("counts exchanged on the stream feed the all_to_all_v enqueued right after them") {
  const int n = 4;
  const auto c = comm_test::make_case(n, 8, 42, 5000, /*gaps=*/false);
  weave::local_world world(n);
  std::vector<std::vector<std::byte>> got(n);
  world.run([&](weave::local_communicator& comm) {
    const auto r = std::size_t(comm.rank());
    const auto& L = c.ranks[r];
    // Two counts per peer: rows, and a tag the receiver checks.
    std::vector<std::int64_t> announce(2 * n), heard(2 * n, -1), recv_counts(n), recv_displs(n);
    for (int j = 0; j < n; ++j) {
      announce[std::size_t(2 * j)] = L.send_counts[std::size_t(j)];
      announce[std::size_t(2 * j + 1)] = 1000 * std::int64_t(r) + j;
    }
    std::vector<std::byte> out(L.recv_bytes, comm_test::sentinel);
    weave::host_stream s;
    comm.exchange_counts(s, announce, heard);
    s.submit([&] { // the receive layout, computed on the stream from the announced counts
      for (int j = 0; j < n; ++j) {
        recv_counts[std::size_t(j)] = heard[std::size_t(2 * j)];
        recv_displs[std::size_t(j)] = L.recv_displs[std::size_t(j)];
      }
    });
    comm.all_to_all_v(s, L.send.data(), L.send_counts, L.send_displs, out.data(), recv_counts,
                      recv_displs, c.unit);
    s.synchronize();
    for (int j = 0; j < n; ++j)
      CHECK(heard[std::size_t(2 * j + 1)] == 1000 * j + std::int64_t(r));
    CHECK(recv_counts == L.recv_counts);
    got[r] = std::move(out);
  });
  for (int r = 0; r < n; ++r)
    CHECK(got[std::size_t(r)] == comm_test::expected_recv(c, r));
}

TEST_CASE("typed rows and the send/recv fallback give the same bytes as all_to_all_v") {
  const int n = 3;
  const std::size_t row = 5; // floats per row
  const auto c = comm_test::make_case(n, row * sizeof(float), 9);
  weave::local_world world(n);
  world.run([&](weave::local_communicator& comm) {
    const auto& L = c.ranks[std::size_t(comm.rank())];
    const auto expected = comm_test::expected_recv(c, comm.rank());
    std::vector<float> rows(L.recv_bytes / sizeof(float));
    std::vector<std::byte> via_p2p(L.recv_bytes, comm_test::sentinel);
    std::memset(rows.data(), 0xAB, L.recv_bytes);
    weave::host_stream s;
    weave::all_to_all_rows(comm, s, reinterpret_cast<const float*>(L.send.data()), L.send_counts,
                           L.send_displs, rows.data(), L.recv_counts, L.recv_displs, row);
    send_recv_only p2p{&comm};
    weave::all_to_all_v(p2p, s, L.send.data(), L.send_counts, L.send_displs, via_p2p.data(),
                        L.recv_counts, L.recv_displs, c.unit);
    s.synchronize();
    CHECK(std::memcmp(rows.data(), expected.data(), L.recv_bytes) == 0);
    CHECK(via_p2p == expected);
  });
}

TEST_CASE("all_reduce equals a serial rank-order reduction, in place and out of place") {
  for (int n : {1, 2, 3, 5}) {
    CAPTURE(n);
    std::mt19937_64 rng(static_cast<std::uint64_t>(n));
    const std::size_t count = 37;
    std::vector<std::vector<double>> in_d(static_cast<std::size_t>(n), std::vector<double>(count));
    std::vector<std::vector<float>> in_f(static_cast<std::size_t>(n), std::vector<float>(count));
    std::vector<std::vector<std::int64_t>> in_i(static_cast<std::size_t>(n),
                                                std::vector<std::int64_t>(count));
    std::uniform_real_distribution<double> u(-1e3, 1e3);
    for (int r = 0; r < n; ++r)
      for (std::size_t e = 0; e < count; ++e) {
        in_d[std::size_t(r)][e] = u(rng);
        in_f[std::size_t(r)][e] = static_cast<float>(u(rng));
        in_i[std::size_t(r)][e] = static_cast<std::int64_t>(rng() % 100000) - 50000;
      }
    auto serial = [&](const auto& in, weave::reduce_op op) {
      auto out = in[0];
      for (std::size_t r = 1; r < in.size(); ++r)
        for (std::size_t e = 0; e < count; ++e)
          out[e] = op == weave::reduce_op::sum ? out[e] + in[r][e] : std::max(out[e], in[r][e]);
      return out;
    };
    weave::local_world world(n);
    world.run([&](weave::local_communicator& comm) {
      const auto r = std::size_t(comm.rank());
      weave::host_stream s;
      for (auto op : {weave::reduce_op::sum, weave::reduce_op::max}) {
        std::vector<double> od(count);
        std::vector<float> inplace = in_f[r];
        std::vector<std::int64_t> oi(count);
        comm.all_reduce(s, std::span<const double>(in_d[r]), std::span<double>(od), op);
        comm.all_reduce(s, std::span<const float>(inplace), std::span<float>(inplace), op);
        comm.all_reduce(s, std::span<const std::int64_t>(in_i[r]), std::span<std::int64_t>(oi), op);
        s.synchronize();
        CHECK(od == serial(in_d, op));
        CHECK(inplace == serial(in_f, op));
        CHECK(oi == serial(in_i, op));
      }
    });
  }
}

TEST_CASE("barrier completes on no rank before every rank reached it") {
  const int n = 4;
  for (int round = 0; round < 20; ++round) {
    std::atomic<int> arrived{0};
    std::vector<int> seen(n, -1);
    weave::local_world world(n);
    world.run([&](weave::local_communicator& comm) {
      weave::host_stream s;
      if (comm.rank() == round % n)
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      arrived.fetch_add(1);
      comm.barrier(s);
      s.synchronize();
      seen[std::size_t(comm.rank())] = arrived.load();
    });
    for (int v : seen)
      CHECK(v == n);
  }
}

TEST_CASE("an emulated link delays completion by at least latency + bytes / bandwidth") {
  const int n = 2;
  const std::int64_t bytes = 1 << 20;
  weave::local_world_options options;
  options.link = weave::emulated_link::gbps(0.5, std::chrono::milliseconds(3));
  const auto modeled = options.link.transfer_time(bytes);
  CHECK(modeled == std::chrono::milliseconds(3) + std::chrono::nanoseconds(2097152));
  weave::local_world world(n, options);
  std::vector<std::chrono::nanoseconds> took(n);
  world.run([&](weave::local_communicator& comm) {
    std::vector<std::byte> send(std::size_t(2 * bytes), std::byte{7}), recv(send.size());
    const std::vector<std::int64_t> counts{bytes, bytes}, displs{0, bytes};
    weave::host_stream s;
    comm.barrier(s);
    s.synchronize();
    const auto start = std::chrono::steady_clock::now();
    comm.all_to_all_v(s, send.data(), counts, displs, recv.data(), counts, displs);
    s.synchronize();
    took[std::size_t(comm.rank())] = std::chrono::steady_clock::now() - start;
    CHECK(recv == send);
  });
  for (auto t : took)
    CHECK(t >= modeled); // a lower bound the model guarantees, not a performance assertion
}

TEST_CASE("local_world rejects bad layouts with a typed error") {
  weave::local_world world(2);
  world.run_collect([&](weave::local_communicator& comm) {
    weave::host_stream s;
    std::vector<std::byte> buf(64);
    const std::vector<std::int64_t> two{1, 1}, three{1, 1, 1}, negative{-1, 1}, displs{0, 1};
    if (comm.rank() == 0) {
      comm.all_to_all_v(s, buf.data(), three, three, buf.data(), two, displs);
      CHECK(code_of([&] { s.synchronize(); }) == weave::errc::size_mismatch);
    } else {
      comm.all_to_all_v(s, buf.data(), negative, displs, buf.data(), two, displs);
      const auto code = code_of([&] { s.synchronize(); });
      CHECK((code == weave::errc::invalid_argument || code == weave::errc::peer_failure));
    }
  });
  CHECK(code_of([] { weave::local_world bad(0); }) == weave::errc::invalid_argument);
  weave::local_world w(2);
  CHECK(code_of([&] { (void)w.comm(2); }) == weave::errc::out_of_range);
  CHECK(code_of([] {
          const std::vector<std::int64_t> c{1}, d{0};
          weave::detail::check_layout(1, c, d, 0, "send");
        }) == weave::errc::invalid_argument);
}

TEST_CASE("operations return at once and complete in stream order while the caller computes") {
  weave::local_world world(2); // by default every operation runs on the stream's worker
  std::promise<void> gate;
  auto opened = gate.get_future().share();
  world.run([&](weave::local_communicator& comm) {
    weave::host_stream s;
    std::vector<std::int64_t> v{1, 2}, out(2);
    if (comm.rank() == 1)
      opened.wait(); // rank 1 joins only after rank 0 has checked
    comm.all_reduce(s, std::span<const std::int64_t>(v), std::span<std::int64_t>(out),
                    weave::reduce_op::sum);
    weave::host_event done = s.record();
    if (comm.rank() == 0) {
      std::int64_t work = 0;
      for (int i = 0; i < 1000; ++i) // the caller's thread is free while the exchange waits
        work += i;
      CHECK(work == 499500);
      CHECK_FALSE(done.query());
      gate.set_value();
    }
    done.synchronize();
    CHECK(out == std::vector<std::int64_t>{2, 4});
  });
}

TEST_CASE("a small operation on an idle stream runs on the caller, a large or queued one does "
          "not") {
  for (const std::size_t limit : {std::size_t{0}, std::size_t{64}, std::size_t{1} << 22}) {
    CAPTURE(limit);
    weave::local_world_options options;
    options.inline_max_bytes = limit;
    weave::local_world world(2, options);
    world.run([&](weave::local_communicator& comm) {
      weave::host_stream s;
      const int peer = 1 - comm.rank();
      // Counts filled by an exchange queued behind a gate: the all-to-all enqueued after it
      // must read them only once the exchange ran (it is queued too, not inline).
      std::promise<void> gate;
      auto opened = gate.get_future().share();
      s.submit([opened] { opened.wait(); });
      std::vector<std::int64_t> send_counts{0, 0}, recv_counts(2, -7);
      send_counts[static_cast<std::size_t>(peer)] = 24;
      send_counts[static_cast<std::size_t>(comm.rank())] = 8;
      comm.exchange_counts(s, send_counts, recv_counts);
      const std::vector<std::int64_t> displs{0, 32};
      std::vector<std::byte> send(64), recv(64);
      for (std::size_t i = 0; i < send.size(); ++i)
        send[i] = std::byte(comm.rank() * 100 + static_cast<int>(i));
      std::vector<std::int64_t> send_displs{0, 32};
      comm.all_to_all_v(s, send.data(), send_counts, send_displs, recv.data(), recv_counts, displs);
      weave::host_event queued = s.record();
      CHECK_FALSE(queued.query());
      gate.set_value();
      s.synchronize();
      CHECK(recv_counts[static_cast<std::size_t>(peer)] == 24);
      const auto me = static_cast<std::size_t>(comm.rank());
      const auto from = static_cast<std::size_t>(peer);
      for (std::int64_t i = 0; i < 24; ++i) // the peer's bytes at its displacement for this rank
        CHECK(recv[static_cast<std::size_t>(displs[from] + i)] ==
              std::byte(peer * 100 + static_cast<int>(displs[me] + i)));

      // Idle stream: a small all-reduce runs here (complete when the call returns); a large
      // one (above the limit) is queued.
      std::vector<std::int64_t> v{comm.rank() + 1, 10}, out(2);
      comm.all_reduce(s, std::span<const std::int64_t>(v), std::span<std::int64_t>(out),
                      weave::reduce_op::sum);
      const bool small = limit > 0 && 2 * v.size() * sizeof(std::int64_t) <= limit;
      if (small)
        CHECK(out == std::vector<std::int64_t>{3, 20});
      s.synchronize();
      CHECK(out == std::vector<std::int64_t>{3, 20});
    });
  }
}

TEST_CASE("an operation above the inline limit returns before its peers arrive") {
  weave::local_world_options options;
  options.inline_max_bytes = 64;
  options.timeout = std::chrono::seconds(5); // were it run inline, rank 0 would time out
  weave::local_world world(2, options);
  std::promise<void> gate;
  auto opened = gate.get_future().share();
  world.run([&](weave::local_communicator& comm) {
    weave::host_stream s;
    std::vector<std::int64_t> v(16, comm.rank() + 1), out(16); // 256 bytes moved
    if (comm.rank() == 1)
      opened.wait();
    comm.all_reduce(s, std::span<const std::int64_t>(v), std::span<std::int64_t>(out),
                    weave::reduce_op::sum);
    weave::host_event done = s.record();
    if (comm.rank() == 0) {
      CHECK_FALSE(done.query());
      gate.set_value();
    }
    done.synchronize();
    CHECK(out == std::vector<std::int64_t>(16, 3));
  });
}
