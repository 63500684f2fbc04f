// The counts a peer announces are checked one by one before the receive is laid out from them
// (the MoE exchange in host_space and in emulated_gpu_space), and a status no rank writes is
// refused: a negative count or INT64_MAX rows fail the call with a typed error naming the sender
// (no signed overflow, no wrapped sum passing the bound), and the peer, which saw nothing wrong,
// fails at once instead of waiting. With static shapes a step checks each count against the
// static slot before it is read. Rank 1 of a 2-rank local_world sends its first chunk's count
// exchange altered through a corrupting communicator.
#include <doctest/doctest.h>

#include "corrupting_communicator.hpp"
#include "moe_test_support.hpp"

#include <weave/comm/local_world.hpp>
#include <weave/exec/emulated_gpu_space.hpp>
#include <weave/exec/host_space.hpp>
#include <weave/overlap/moe_exchange.hpp>
#include <weave/routing/host_quant_moves.hpp>
#include <weave/routing/host_row_moves.hpp>

#include <chrono>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

using namespace std::chrono_literals;
using weave_test::corrupting_communicator;

namespace {

struct ending {
  weave::errc code{};
  int origin = -2;
  std::string message;
};

template <class F>
ending ending_of(F&& f) {
  try {
    f();
  } catch (const weave::peer_error& e) {
    return {e.code(), e.origin().rank, e.message()};
  } catch (const weave::error& e) {
    return {e.code(), -2, e.message()};
  }
  return {};
}

// One forward per rank of the exchange in `Space` on 2 ranks; rank 1's first chunk count
// exchange to rank 0 has `word` (0: the count; then a second count, the call's tag or the status)
// set to `value`.
template <class Space>
std::vector<ending> forward_with(std::size_t word, std::int64_t value, bool fixed = false) {
  weave::local_world world(2, {20s, {}});
  std::vector<ending> got(2);
  world.run([&](weave::local_communicator& local) {
    const int r = local.rank();
    // Count exchange 0 is the construction's agreement; 1 is the first chunk's.
    corrupting_communicator comm(local, [&, r](int call, int dest, std::span<std::int64_t> w) {
      if (r == 1 && call == 1 && dest == 0)
        w[word] = value;
    });
    weave::moe_options o;
    o.k = 2;
    o.hidden = 8;
    o.max_tokens = 6;
    o.static_shape = fixed;
    o.static_rows_per_peer = fixed ? 8 : 0;
    std::mt19937 rng(static_cast<std::uint32_t>(r + 5));
    const auto in = moe_test::random_input<float>(6, o.hidden, 8, o.k, rng);
    const moe_test::linear_experts experts(8, o.hidden, 4);
    weave::host_matrix<float> y(6, o.hidden);
    weave::host_stream compute("compute"), comm_stream("comm");
    const auto where = weave::placement::contiguous(8, 2);
    got[static_cast<std::size_t>(r)] = ending_of([&] {
      weave::basic_moe_exchange<Space, corrupting_communicator> ex(comm, where, o);
      try {
        ex.forward(
            in.x.view(), in.ids, in.weights, y.view(),
            [&](const weave::basic_expert_batch<Space>& b) {
              moe_test::run_experts<float>(experts, b);
            },
            compute, comm_stream);
      } catch (...) { // where the host reads the counts, the call itself fails: let it drain
        try {
          ex.synchronize(compute, comm_stream);
        } catch (...) {
        }
        throw;
      }
      ex.synchronize(compute, comm_stream);
    });
  });
  return got;
}

template <class Space>
void check_bad_counts() {
  const auto started = std::chrono::steady_clock::now();
  constexpr std::int64_t big = std::numeric_limits<std::int64_t>::max();
  for (const std::int64_t count :
       {std::int64_t{-1}, big, std::numeric_limits<std::int64_t>::min(), std::int64_t{1000}}) {
    CAPTURE(count);
    const auto got = forward_with<Space>(0, count);
    CHECK(got[0].code == weave::errc::size_mismatch);
    CHECK(got[0].message.find("chunk receive: rank 1 announced " + std::to_string(count) +
                              " rows") != std::string::npos);
    CHECK(got[1].code == weave::errc::peer_failure); // rank 0 aborted: nobody waits
    CHECK(got[1].origin == 0);
  }
  // A status word without a rank: refused, naming rank 1, and rank 1 learns it at once. (Each
  // block carries the call's tag after the counts; where host code runs at enqueue time the
  // receive is sized at the call, with CUDA's control flow: two counts per peer.)
  const std::size_t status_word = Space::runs_later ? 2 : 3;
  const auto got =
      forward_with<Space>(status_word, static_cast<std::int64_t>(weave::errc::out_of_range));
  CHECK(got[0].code == weave::errc::protocol);
  CHECK(got[0].message.find("count exchange: rank 1 sent a status no weave rank writes") !=
        std::string::npos);
  CHECK(got[1].code == weave::errc::peer_failure);
  CHECK(got[1].origin == 0);
  CHECK(std::chrono::steady_clock::now() - started < 15s);
}

} // namespace

TEST_CASE_TEMPLATE("the exchange checks each announced count before summing, and refuses bad "
                   "statuses",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  check_bad_counts<Space>();
}

TEST_CASE_TEMPLATE("the exchange with static shapes checks each announced count in memory of the "
                   "space before it is read",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  // No host reads the counts with static shapes: a step checks them against the static slot
  // (12 rows here: max_tokens x k), and check_errors reports one outside it.
  for (const std::int64_t count :
       {std::int64_t{-1}, std::int64_t{13}, std::numeric_limits<std::int64_t>::max()}) {
    CAPTURE(count);
    const auto got = forward_with<Space>(0, count, true);
    CHECK(got[0].code == weave::errc::size_mismatch);
    CHECK(got[0].message.find("a peer announced a row count outside the static slot of 8 rows") !=
          std::string::npos);
  }
}
