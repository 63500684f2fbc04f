// Configuration agreement and the status-carrying count exchange on local_world: every rank
// reaches the same verdict, the messages name the first differing field and each rank's value
// (checked against hand-written text), a rank whose own configuration is invalid fails alone
// with its error and its peers with a peer_error naming it, and a count exchange carries a
// rank's failure to every peer while moving the counts exactly when all are healthy. The 2DH
// all-to-all refuses an inconsistent grid on every rank.
#include <doctest/doctest.h>

#include <weave/comm.hpp>
#include <weave/comm/agreement.hpp>
#include <weave/comm/status_exchange.hpp>
#include <weave/core/failure.hpp>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

using namespace std::chrono_literals;

// Runs `f(comm)` on every rank of a world of `n`; returns each rank's error message ("" if none)
// and code.
struct ending {
  std::string message;
  weave::errc code{};
  int origin = -1;
};

template <class F>
std::vector<ending> endings(int n, F&& f) {
  weave::local_world world(n, {10s, {}});
  std::vector<ending> out(static_cast<std::size_t>(n));
  world.run([&](weave::local_communicator& comm) {
    auto& mine = out[static_cast<std::size_t>(comm.rank())];
    try {
      f(comm);
    } catch (const weave::peer_error& e) {
      mine = {e.message(), e.code(), e.origin().rank};
    } catch (const weave::error& e) {
      mine = {e.message(), e.code(), -1};
    }
  });
  return out;
}

const char* dtype_name(std::int64_t v) {
  constexpr const char* names[] = {"f32", "f16", "bf16"};
  return v >= 0 && v < 3 ? names[v] : nullptr;
}

weave::config_fingerprint fingerprint(int rank) {
  weave::config_fingerprint f("layer");
  f.add("experts", 8)
      .add("hidden", rank == 1 ? 32 : 64)
      .add_label("element type", rank == 3 ? 2 : 0, dtype_name)
      .add_real("capacity factor", 1.25)
      .add_flag("static_shape", false);
  return f;
}

} // namespace

TEST_CASE("agreement names the first field that differs and every rank's value, on every rank") {
  const auto got = endings(4, [](weave::local_communicator& comm) {
    weave::agree_on_config(comm, fingerprint(comm.rank()));
  });
  for (const ending& e : got) {
    CHECK(e.code == weave::errc::config_mismatch);
    CHECK(e.message == "layer: ranks disagree on hidden: 64 on ranks 0, 2-3; 32 on rank 1 (every "
                       "rank must build it with the same configuration)");
  }
}

TEST_CASE("agreement formats labels, hashes and real numbers, and passes when all agree") {
  const auto label = endings(3, [](weave::local_communicator& comm) {
    weave::config_fingerprint f("layer");
    f.add_label("element type", comm.rank() == 2 ? 2 : 0, dtype_name);
    weave::agree_on_config(comm, f);
  });
  for (const ending& e : label)
    CHECK(e.message.find("element type: f32 on ranks 0-1; bf16 on rank 2") != std::string::npos);
  const auto hash = endings(2, [](weave::local_communicator& comm) {
    const std::vector<std::int32_t> table = {0, 1, comm.rank()};
    weave::config_fingerprint f("layer");
    f.add_hash("table", std::span<const std::int32_t>(table)).add_real("factor", 0.5 * comm.rank());
    weave::agree_on_config(comm, f);
  });
  // FNV-1a of the 12 bytes 00000000 01000000 00000000 / ... 01000000, computed by hand below.
  auto fnv = [](std::vector<unsigned char> bytes) {
    std::uint64_t h = 0xcbf29ce484222325ull;
    for (unsigned char b : bytes)
      h = (h ^ b) * 0x100000001b3ull;
    return h;
  };
  char expected[160];
  std::snprintf(expected, sizeof(expected), "table: 0x%016llx on rank 0; 0x%016llx on rank 1",
                static_cast<unsigned long long>(fnv({0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0})),
                static_cast<unsigned long long>(fnv({0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0})));
  for (const ending& e : hash)
    CHECK(e.message.find(expected) != std::string::npos);
  const auto same = endings(
      3, [](weave::local_communicator& comm) { weave::agree_on_config(comm, fingerprint(0)); });
  for (const ending& e : same)
    CHECK(e.message.empty());
}

TEST_CASE(
    "a rank whose configuration is invalid fails with its error, its peers with a peer_error") {
  const auto got = endings(3, [](weave::local_communicator& comm) {
    weave::agree_on_config(comm, fingerprint(0), [&] {
      WEAVE_EXPECT(comm.rank() != 1, weave::errc::invalid_argument, "k = 9 exceeds 8 experts");
    });
  });
  CHECK(got[1].code == weave::errc::invalid_argument);
  CHECK(got[1].message == "k = 9 exceeds 8 experts");
  for (const int r : {0, 2}) {
    CHECK(got[std::size_t(r)].code == weave::errc::peer_failure);
    CHECK(got[std::size_t(r)].origin == 1);
    CHECK(got[std::size_t(r)].message.find("k = 9 exceeds 8 experts") != std::string::npos);
  }
  const auto kinds = endings(2, [](weave::local_communicator& comm) {
    weave::config_fingerprint f("layer");
    f.add("a", 1);
    if (comm.rank() == 1)
      f.add("b", 2);
    weave::agree_on_config(comm, f);
  });
  for (const ending& e : kinds)
    CHECK(e.message.find("different kinds of object (field counts 1 on rank 0; 2 on rank 1)") !=
          std::string::npos);
}

TEST_CASE("a count exchange carries a rank's failure to every peer, and the counts otherwise") {
  constexpr int n = 3;
  weave::local_world world(n, {10s, {}});
  std::vector<std::string> second(n);
  world.run([&](weave::local_communicator& comm) {
    const int r = comm.rank();
    weave::counts_with_status<weave::local_communicator> status(n, r, 2, "test layer");
    weave::status_block blocks[2] = {status.make_block(), status.make_block()};
    weave::host_stream s;
    std::vector<std::int64_t> send(2 * n), recv(2 * n, -1);
    for (int j = 0; j < n; ++j) { // rank r sends (10 r + j, 100 r + j) to rank j
      send[std::size_t(2 * j)] = 10 * r + j;
      send[std::size_t(2 * j + 1)] = 100 * r + j;
    }
    status.exchange(comm, s, blocks[0], send, recv);
    s.synchronize();
    for (int j = 0; j < n; ++j) {
      CHECK(recv[std::size_t(2 * j)] == 10 * j + r);
      CHECK(recv[std::size_t(2 * j + 1)] == 100 * j + r);
    }
    // Rank 2's stream fails before the next exchange: every rank fails there; a later
    // exchange of the same call moves nothing and hangs nobody.
    if (r == 2)
      s.submit([] { WEAVE_THROW(weave::errc::out_of_range, "expert id 9 outside [-1, 8)"); });
    status.exchange(comm, s, blocks[1], send, recv);
    status.exchange(comm, s, blocks[0], send, recv);
    try {
      s.synchronize();
      FAIL("rank ", r, " did not fail");
    } catch (const weave::peer_error& e) {
      CHECK(r != 2);
      CHECK(e.origin().rank == 2);
      CHECK(e.origin().code == weave::errc::out_of_range);
      CHECK(e.origin().message == "expert id 9 outside [-1, 8)");
      second[std::size_t(r)] = e.message();
    } catch (const weave::error& e) {
      CHECK(r == 2);
      CHECK(e.code() == weave::errc::out_of_range);
    }
    // Everyone recovered together: the next exchange works.
    std::fill(recv.begin(), recv.end(), -1);
    status.exchange(comm, s, blocks[1], send, recv);
    s.synchronize();
    CHECK(recv[1] == 0 * 100 + r);
  });
  CHECK(second[0].find("test layer count exchange: rank 2 failed with out_of_range") == 0);
}

TEST_CASE("a long message is cut to the wire form's room, a short one travels whole") {
  weave::failure_record r{3, weave::errc::invalid_argument, true, std::string(500, 'x')};
  std::int64_t words[weave::failure_words];
  weave::encode_failure(&r, words);
  const auto back = weave::decode_failure(words, 3, 4);
  REQUIRE(back.has_value());
  CHECK(back->rank == 3);
  CHECK(back->code == weave::errc::invalid_argument);
  CHECK(back->message == std::string((weave::failure_words - 1) * 8 - 1, 'x'));
  r = {0, weave::errc::internal, false, "boom"};
  weave::encode_failure(&r, words);
  CHECK(weave::decode_failure(words, 1, 2)->weave_error == false);
  CHECK(weave::decode_failure(words, 1, 2)->message == "boom");
  weave::encode_failure(nullptr, words);
  CHECK_FALSE(weave::decode_failure(words, 1, 2).has_value());
}

TEST_CASE("the 2DH all-to-all refuses an inconsistent grid on every rank") {
  using plan = weave::hierarchical_all_to_all<weave::local_communicator, weave::local_communicator>;
  using place = std::pair<int, int>; // (world, rank in it)
  // 2 nodes x 2 local ranks; global rank g joins intra world intra_of(g) and inter world
  // inter_of(g).
  const auto build = [](auto intra_of, auto inter_of, auto staging_of) {
    constexpr int n = 4;
    const weave::local_world_options o{10s, {}};
    std::vector<std::unique_ptr<weave::local_world>> intra, inter;
    for (int w = 0; w < 2; ++w) {
      intra.push_back(std::make_unique<weave::local_world>(2, o));
      inter.push_back(std::make_unique<weave::local_world>(2, o));
    }
    std::vector<ending> out(n);
    std::vector<std::thread> threads;
    for (int g = 0; g < n; ++g)
      threads.emplace_back([&, g] {
        const place a = intra_of(g), b = inter_of(g);
        try {
          plan p(intra[std::size_t(a.first)]->comm(a.second),
                 inter[std::size_t(b.first)]->comm(b.second), staging_of(g));
        } catch (const weave::error& e) {
          out[std::size_t(g)] = {e.message(), e.code(), -1};
        }
      });
    for (auto& t : threads)
      t.join();
    return out;
  };
  const auto node_major = [](int g) { return place{g / 2, g % 2}; };
  const auto by_local = [](int g) { return place{g % 2, g / 2}; };
  const auto same_staging = [](int) { return std::size_t{1024}; };
  for (const ending& e : build(node_major, by_local, same_staging))
    CHECK(e.message.empty());
  const auto staging =
      build(node_major, by_local, [](int g) { return std::size_t(g == 3 ? 2048 : 1024); });
  for (const ending& e : staging) {
    CHECK(e.code == weave::errc::config_mismatch);
    CHECK(e.message.find("staging bytes") != std::string::npos);
  }
  // Node 1's ranks join the inter worlds crosswise: inter world 1 then holds global rank 1
  // (local rank 1) and global rank 2 (local rank 0), which do not share a local rank.
  const auto crosswise = [](int g) { return g < 2 ? place{g % 2, 0} : place{1 - g % 2, 1}; };
  for (const ending& e : build(node_major, crosswise, same_staging)) {
    CHECK(e.code == weave::errc::config_mismatch);
    CHECK(e.message.find("local rank (intra-node rank)") != std::string::npos);
  }
}
