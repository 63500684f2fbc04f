// Every word a peer sends is checked before it is believed: failure records and statuses
// (`decode_failure`), device flags statuses, configuration fingerprints and announced counts.
// Words no weave rank writes are refused with `errc::protocol` naming their sender, never read as
// "healthy", as another rank, or as a code that is no errc; a rank that finds them aborts its
// communicator, so its peers fail at once instead of waiting for it. Each case injects the bytes
// through a communicator that corrupts what one rank sends.
#include "corrupting_communicator.hpp"

#include <doctest/doctest.h>
#include <weave/comm/agreement.hpp>
#include <weave/comm/device_status_exchange.hpp>
#include <weave/comm/local_world.hpp>
#include <weave/comm/status_exchange.hpp>
#include <weave/core/failure.hpp>
#include <weave/exec/emulated_gpu_space.hpp>
#include <weave/exec/host_space.hpp>

#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

using namespace std::chrono_literals;

namespace {

using words_t = std::array<std::int64_t, weave::failure_words>;

words_t encoded(const weave::failure_record& r) {
  words_t w{};
  weave::encode_failure(&r, w);
  return w;
}

// The error `f` throws (a default one if it returns).
template <class F>
weave::error thrown_by(F&& f) {
  try {
    f();
  } catch (const weave::error& e) {
    return e;
  }
  return weave::error(weave::errc::internal, "nothing thrown");
}

std::int64_t status_of(int rank, weave::errc code) {
  return (std::int64_t{rank} + 1) << 32 | static_cast<std::int64_t>(code);
}

} // namespace

TEST_CASE("decode_failure reads back exactly what encode_failure writes") {
  const weave::failure_record records[] = {
      {0, weave::errc::invalid_argument, true, "k = 9 exceeds 8 experts"},
      {3, weave::errc::protocol, true, ""},
      {1, weave::errc::internal, false, std::string(119, 'y')},
  };
  for (const auto& r : records) {
    const words_t w = encoded(r);
    const auto back = weave::decode_failure(w, 2, 4);
    REQUIRE(back.has_value());
    CHECK(back->rank == r.rank);
    CHECK(back->code == r.code);
    CHECK(back->weave_error == r.weave_error);
    CHECK(back->message == r.message);
    CHECK(encoded(*back) == w); // one wire form per record
  }
  // A message travels up to its first zero byte, and nothing after it is sent.
  const words_t w = encoded({1, weave::errc::timeout, true, std::string("ab\0cd", 5)});
  CHECK(weave::decode_failure(w, 1, 2)->message == "ab");
  CHECK(w[1] == ('a' | 'b' << 8));
}

TEST_CASE("decode_failure refuses every status no encoder writes, naming the sender") {
  const words_t good = encoded({1, weave::errc::out_of_range, true, "expert id 9"});
  struct bad_case {
    const char* what;
    words_t words;
    const char* says;
  };
  std::vector<bad_case> cases;
  const auto with_status = [&](std::int64_t status) {
    words_t w = good;
    w[0] = status;
    return w;
  };
  // The word: a rank field of 0 read as rank -1; bits 17-31 dropped; a code no errc.
  cases.push_back({"rank field 0", with_status(static_cast<std::int64_t>(weave::errc::internal)),
                   "origin rank field 0"});
  cases.push_back({"rank field past the world", with_status(status_of(4, weave::errc::timeout)),
                   "origin rank field 5 outside [1, 4]"});
  cases.push_back({"a negative status word",
                   with_status(std::numeric_limits<std::int64_t>::min() | 1), "origin rank field"});
  cases.push_back({"bit 20", with_status(status_of(1, weave::errc::timeout) | 1 << 20),
                   "unknown bits 0x100000"});
  cases.push_back({"the device flags bit",
                   with_status(status_of(1, weave::errc::timeout) | 1 << 17),
                   "a device's error flags"});
  cases.push_back({"code 0", with_status(status_of(1, weave::errc{})), "code 0, which is no errc"});
  cases.push_back({"code 99", with_status(status_of(1, weave::errc{}) | 99), "code 99"});
  words_t long_message = good;
  std::memset(long_message.data() + 1, 'x', weave::detail::failure_message_bytes);
  cases.push_back({"no zero byte", long_message, "without its terminating zero"});
  words_t tail = good;
  tail[weave::failure_words - 1] = 7;
  cases.push_back({"a byte after the zero", tail, "bytes after"});
  words_t healthy_tail{};
  healthy_tail[3] = 1;
  cases.push_back({"a healthy status with words after it", healthy_tail, "healthy, yet"});
  for (const bad_case& c : cases) {
    CAPTURE(c.what);
    const weave::error e = thrown_by([&] { (void)weave::decode_failure(c.words, 2, 4); });
    CHECK(e.code() == weave::errc::protocol);
    CHECK(e.message().find("rank 2 sent a status no weave rank writes") == 0);
    CHECK(e.message().find(c.says) != std::string::npos);
  }
}

TEST_CASE("encode_failure never writes a failure that reads as healthy or as no rank") {
  words_t w{};
  // The record (rank -1, code 0) was written as 0: "healthy".
  const weave::failure_record unknown{-1, weave::errc{}, true, "lost"};
  CHECK(thrown_by([&] { weave::encode_failure(&unknown, w); }).code() ==
        weave::errc::invalid_argument);
  const weave::failure_record no_code{2, static_cast<weave::errc>(99), true, "x"};
  CHECK(thrown_by([&] { weave::encode_failure(&no_code, w); }).code() ==
        weave::errc::invalid_argument);
  // record_of makes records that travel: an origin without a rank is this rank's, a code no
  // errc is internal (its number kept in the message).
  const auto from_peer = weave::record_of(
      std::make_exception_ptr(weave::peer_error({-1, weave::errc::timeout, true, "late"}, "x")), 3);
  CHECK(from_peer.rank == 3);
  CHECK(from_peer.code == weave::errc::timeout);
  const auto cast = weave::record_of(
      std::make_exception_ptr(weave::error(static_cast<weave::errc>(99), "odd")), 1);
  CHECK(cast.code == weave::errc::internal);
  CHECK(cast.message == "error code 99: odd");
  CHECK_NOTHROW(weave::encode_failure(&cast, w));
  CHECK(weave::decode_failure(w, 1, 2)->message == "error code 99: odd");
}

namespace {

// How one rank's part of a test ended.
struct ending {
  weave::errc code{};
  int origin = -2; // a peer_error's origin rank
  weave::errc origin_code{};
  std::string message;
};

template <class F>
ending ending_of(F&& f) {
  try {
    f();
  } catch (const weave::peer_error& e) {
    return {e.code(), e.origin().rank, e.origin().code, e.message()};
  } catch (const weave::error& e) {
    return {e.code(), -2, {}, e.message()};
  }
  return {};
}

// Two count exchanges with a status over 2 ranks; rank 1's first one sends `status` (its
// status words to every peer) in place of its own.
std::vector<ending> count_exchange_with(const words_t& status) {
  weave::local_world world(2, {20s, {}});
  std::vector<ending> got(2);
  world.run([&](weave::local_communicator& local) {
    const int r = local.rank();
    weave_test::corrupting_communicator comm(
        local, [&, r](int call, int, std::span<std::int64_t> words) {
          if (r == 1 && call == 0)
            std::copy(status.begin(), status.end(), words.begin() + 1);
        });
    weave::counts_with_status<weave_test::corrupting_communicator> exchange(2, r, 1, "test layer");
    weave::status_block blocks[2] = {exchange.make_block(), exchange.make_block()};
    weave::host_stream s;
    std::vector<std::int64_t> send{10 * r, 10 * r + 1}, recv(2, -1);
    got[std::size_t(r)] = ending_of([&] {
      exchange.exchange(comm, s, blocks[0], send, recv);
      exchange.exchange(comm, s, blocks[1], send, recv);
      s.synchronize();
    });
  });
  return got;
}

} // namespace

TEST_CASE("a count exchange refuses a status no rank writes, and both ranks fail at once") {
  const auto started = std::chrono::steady_clock::now();
  const words_t failure = encoded({1, weave::errc::out_of_range, true, "expert id 9"});
  words_t rank_zero = failure, high_bits = failure, no_code = failure, healthy_tail{};
  rank_zero[0] = static_cast<std::int64_t>(weave::errc::out_of_range); // rank field 0
  high_bits[0] |= std::int64_t{1} << 24;
  no_code[0] = status_of(1, weave::errc{}) | 77;
  healthy_tail[5] = 0x41;
  for (const words_t* w : {&rank_zero, &high_bits, &no_code, &healthy_tail}) {
    const auto got = count_exchange_with(*w);
    // Rank 0 names rank 1 and what it sent; rank 1, which saw nothing wrong, learns it from the
    // abort rather than waiting for rank 0 in its second exchange.
    CHECK(got[0].code == weave::errc::protocol);
    CHECK(got[0].message.find("test layer count exchange: rank 1 sent a status no weave rank "
                              "writes") == 0);
    CHECK(got[1].code == weave::errc::peer_failure);
    CHECK(got[1].origin == 0);
    CHECK(got[1].origin_code == weave::errc::protocol);
  }
  CHECK(std::chrono::steady_clock::now() - started < 10s); // nobody waited for a timeout
  // A healthy status still is one, and a real failure is reported as before.
  const auto healthy = count_exchange_with(words_t{});
  CHECK(healthy[0].code == weave::errc{});
  CHECK(healthy[1].code == weave::errc{});
  const auto real = count_exchange_with(failure);
  CHECK(real[0].code == weave::errc::peer_failure);
  CHECK(real[0].origin == 1);
  CHECK(real[0].message.find("expert id 9") != std::string::npos);
}

TEST_CASE("the construction's agreement refuses a fingerprint or a status no rank writes") {
  // Rank 1 sends its fingerprint with a word set past its fields (word `at`), or a status
  // without a rank (`status`): every rank sees the same words and fails alike.
  const auto agree = [](std::size_t at, std::int64_t value) {
    weave::local_world world(2, {20s, {}});
    std::vector<ending> got(2);
    world.run([&](weave::local_communicator& local) {
      const int r = local.rank();
      weave_test::corrupting_communicator comm(local, [&, r](int, int, std::span<std::int64_t> w) {
        if (r == 1)
          w[at] = value;
      });
      weave::config_fingerprint f("test layer");
      f.add("a", 1).add("b", 2);
      got[std::size_t(r)] = ending_of([&] { weave::agree_on_config(comm, f); });
    });
    return got;
  };
  const auto padding = agree(7, 5);
  for (const ending& e : padding) {
    CHECK(e.code == weave::errc::protocol);
    CHECK(e.message.find("test layer: rank 1 sent a configuration fingerprint no weave rank "
                         "writes") == 0);
  }
  const auto too_many = agree(1, 1000);
  for (const ending& e : too_many)
    CHECK(e.code == weave::errc::protocol);
  const auto no_rank =
      agree(weave::fingerprint_words + 1, status_of(-1, weave::errc::invalid_argument));
  CHECK(no_rank[0].code == weave::errc::protocol);
  CHECK(no_rank[0].message.find("test layer construction: rank 1 sent a status") == 0);
}

namespace {

// A device status block (host memory in these spaces) holding what 3 ranks sent rank 0; rank
// `from` sent `status`, the others were healthy.
template <class Space>
std::exception_ptr device_status_with(const words_t& status, int from, bool own) {
  weave::device_counts_with_status<Space> exchange(
      3, 0, true, "test layer",
      [](int rank, std::uint32_t flags) {
        return weave::failure_record{rank, weave::errc::out_of_range, true,
                                     "flags " + std::to_string(flags)};
      },
      1, 0x3u);
  weave::device_status_block<Space> b;
  exchange.size_block(b);
  std::fill(b.host.begin(), b.host.end(), 0);
  std::copy(status.begin(), status.end(),
            b.host.begin() +
                static_cast<std::ptrdiff_t>(from * weave::detail::status_block_stride(1) + 2));
  return own ? exchange.failure(b) : exchange.peer_failure(b);
}

ending ending_of_ptr(const std::exception_ptr& p) {
  return ending_of([&] {
    if (p)
      std::rethrow_exception(p);
  });
}

} // namespace

TEST_CASE_TEMPLATE("a device flags status is checked like a failure record", Space,
                   weave::host_space, weave::emulated_gpu_space) {
  const bool own = !Space::runs_later; // emulated_gpu_space: the exchange's own decision
  const auto flags_of = [](int rank, std::int64_t flags) {
    words_t w{};
    w[0] = (std::int64_t{rank} + 1) << 32 | weave::detail::device_flags_status;
    w[1] = flags;
    return w;
  };
  // Rank 2's flags, as it writes them.
  const ending good = ending_of_ptr(device_status_with<Space>(flags_of(2, 2), 2, own));
  CHECK(good.code == weave::errc::peer_failure);
  CHECK(good.origin == 2);
  CHECK(good.message.find("flags 2") != std::string::npos);
  // Flags the owner never sets, no flags, another rank's tag, a word set past the flags.
  words_t tail = flags_of(2, 1);
  tail[4] = 9;
  for (const words_t& w :
       {flags_of(2, 4), flags_of(2, 0), flags_of(2, std::int64_t{1} << 40), flags_of(1, 1), tail}) {
    const ending e = ending_of_ptr(device_status_with<Space>(w, 2, own));
    CHECK(e.code == weave::errc::protocol);
    CHECK(e.message.find("test layer count exchange: rank 2 sent a device flags status no weave "
                         "rank writes") == 0);
  }
  // A status without a rank: refused, not read as rank -1 (nor as rank 2).
  words_t rank_zero = encoded({2, weave::errc::timeout, true, "slow"});
  rank_zero[0] = static_cast<std::int64_t>(weave::errc::timeout);
  const ending e = ending_of_ptr(device_status_with<Space>(rank_zero, 2, own));
  CHECK(e.code == weave::errc::protocol);
}

TEST_CASE("announced counts are checked one by one before they are summed") {
  std::vector<std::int64_t> displs(3);
  CHECK(weave::detail::receive_displacements(std::vector<std::int64_t>{4, 0, 3}, displs, 7,
                                             "test") == 7);
  CHECK(displs == std::vector<std::int64_t>{0, 4, 4});
  constexpr std::int64_t big = std::numeric_limits<std::int64_t>::max();
  const std::vector<std::int64_t> bad[] = {
      {big, 1, 0},   // INT64_MAX rows: the sum overflowed
      {big, big, 2}, // wraps to 0, which passed the bound
      {5, -5, 0},    // a negative count brought the total back under the bound
      {3, 3, 2},     // past the bound
      {0, std::numeric_limits<std::int64_t>::min(), 0},
  };
  for (const auto& counts : bad) {
    const weave::error e = thrown_by(
        [&] { (void)weave::detail::receive_displacements(counts, displs, 7, "test receive"); });
    CHECK(e.code() == weave::errc::size_mismatch);
    CHECK(e.message().find("test receive: rank ") == 0);
  }
  const weave::error e = thrown_by([&] {
    (void)weave::detail::receive_displacements(std::vector<std::int64_t>{5, -5, 0}, displs, 7,
                                               "test receive");
  });
  CHECK(e.message().find("rank 1 announced -5 rows") != std::string::npos);
}
