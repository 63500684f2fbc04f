// The 2DH all-to-all over nodes x local sub-worlds must equal, byte for byte, both the naive
// reference and the flat local_world all-to-all on the same random skewed layouts.
#include <doctest/doctest.h>

#include "a2a_cases.hpp"

#include <weave/comm.hpp>

#include <cstdint>
#include <exception>
#include <memory>
#include <thread>
#include <vector>

namespace {

using plan = weave::hierarchical_all_to_all<weave::local_communicator, weave::local_communicator>;
static_assert(weave::has_all_to_all_v<plan>);

// Runs the exchange `repeats` times on one stream per global rank; returns each rank's buffer.
std::vector<std::vector<std::byte>> run_2dh(int nodes, int local, const comm_test::a2a_case& c,
                                            int repeats) {
  std::vector<std::unique_ptr<weave::local_world>> intra, inter;
  for (int m = 0; m < nodes; ++m)
    intra.push_back(std::make_unique<weave::local_world>(local));
  for (int l = 0; l < local; ++l)
    inter.push_back(std::make_unique<weave::local_world>(nodes));
  const int n = nodes * local;
  std::vector<std::vector<std::byte>> out(static_cast<std::size_t>(n));
  std::vector<std::exception_ptr> failures(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int g = 0; g < n; ++g)
    threads.emplace_back([&, g] {
      try {
        const int m = g / local, l = g % local;
        plan p(intra[std::size_t(m)]->comm(l), inter[std::size_t(l)]->comm(m), 1 << 20);
        REQUIRE(p.rank() == g);
        REQUIRE(p.size() == n);
        const auto& L = c.ranks[std::size_t(g)];
        std::vector<std::vector<std::byte>> recv(
            std::size_t(repeats), std::vector<std::byte>(L.recv_bytes, comm_test::sentinel));
        weave::host_stream s;
        for (auto& r : recv)
          weave::all_to_all_v(p, s, L.send.data(), L.send_counts, L.send_displs, r.data(),
                              L.recv_counts, L.recv_displs, c.unit);
        s.synchronize();
        for (auto& r : recv)
          REQUIRE(r == recv[0]);
        out[std::size_t(g)] = std::move(recv[0]);
      } catch (...) {
        failures[std::size_t(g)] = std::current_exception();
      }
    });
  for (auto& t : threads)
    t.join();
  for (auto& f : failures)
    if (f)
      std::rethrow_exception(f);
  return out;
}

std::vector<std::vector<std::byte>> run_flat(const comm_test::a2a_case& c) {
  weave::local_world world(c.n);
  std::vector<std::vector<std::byte>> out(std::size_t(c.n));
  world.run([&](weave::local_communicator& comm) {
    const auto& L = c.ranks[std::size_t(comm.rank())];
    std::vector<std::byte> r(L.recv_bytes, comm_test::sentinel);
    weave::host_stream s;
    comm.all_to_all_v(s, L.send.data(), L.send_counts, L.send_displs, r.data(), L.recv_counts,
                      L.recv_displs, c.unit);
    s.synchronize();
    out[std::size_t(comm.rank())] = std::move(r);
  });
  return out;
}

} // namespace

TEST_CASE("2DH all-to-all equals the flat one and the reference") {
  const int shapes[][2] = {{2, 2}, {2, 3}, {4, 2}, {3, 1}, {1, 3}, {3, 2}};
  for (const auto& shape : shapes) {
    for (std::size_t unit : {std::size_t{1}, std::size_t{12}}) {
      for (std::uint64_t seed : {3u, 17u}) {
        const int nodes = shape[0], local = shape[1];
        CAPTURE(nodes);
        CAPTURE(local);
        CAPTURE(unit);
        CAPTURE(seed);
        const auto c = comm_test::make_case(nodes * local, unit, seed * 101 + unit);
        const auto hier = run_2dh(nodes, local, c, 2);
        const auto flat = run_flat(c);
        for (int g = 0; g < c.n; ++g) {
          CHECK(hier[std::size_t(g)] == comm_test::expected_recv(c, g));
          CHECK(hier[std::size_t(g)] == flat[std::size_t(g)]);
        }
      }
    }
  }
}

TEST_CASE("2DH reports a staging buffer that is too small") {
  const auto c = comm_test::make_case(4, 1, 5, 3000);
  weave::local_world intra0(2), intra1(2), inter0(2), inter1(2);
  weave::local_world* intra[] = {&intra0, &intra1};
  weave::local_world* inter[] = {&inter0, &inter1};
  std::vector<weave::errc> codes(4, weave::errc::internal);
  std::vector<std::thread> threads;
  for (int g = 0; g < 4; ++g)
    threads.emplace_back([&, g] {
      plan p(intra[g / 2]->comm(g % 2), inter[g % 2]->comm(g / 2), 64); // far too small
      const auto& L = c.ranks[std::size_t(g)];
      std::vector<std::byte> r(L.recv_bytes);
      weave::host_stream s;
      p.all_to_all_v(s, L.send.data(), L.send_counts, L.send_displs, r.data(), L.recv_counts,
                     L.recv_displs);
      try {
        s.synchronize();
      } catch (const weave::error& e) {
        codes[std::size_t(g)] = e.code();
      }
    });
  for (auto& t : threads)
    t.join();
  for (auto code : codes)
    CHECK((code == weave::errc::size_overflow || code == weave::errc::peer_failure ||
           code == weave::errc::timeout));
}
