// Lancet's partitioning of the operators around an MoE layer: a producer that computes each
// chunk's tokens and choices inside the chunk's prepare stage and a consumer that uses each
// chunk's output as soon as it is final. In `host_space` and in `emulated_gpu_space` (each case
// written once, the hooks and the experts enqueuing their work on the compute stream), every
// chunking must give bitwise what the unpartitioned block gives (producer on the whole batch,
// layer, consumer on the whole batch), whose layer output equals the dense reference, and run
// the producer of chunk c + 1 before the experts of chunk c (so dispatch c overlaps it).
#include <doctest/doctest.h>

#include "moe_test_support.hpp"

#include <weave/comm/local_world.hpp>
#include <weave/exec/emulated_gpu_space.hpp>
#include <weave/exec/host_space.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/overlap/moe_exchange.hpp>
#include <weave/routing/host_quant_moves.hpp>
#include <weave/routing/host_row_moves.hpp>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace {

constexpr int ranks = 3, experts = 6, k = 2;
constexpr std::size_t hidden = 8;

// One rank's block: source rows and choices the producer turns into the layer's input.
struct block {
  moe_test::rank_input<float> source; // x = 2 * source + 1, choices copied
  weave::host_matrix<float> x, y, z;  // layer input, layer output, z = y + x
  std::vector<std::int32_t> ids;
  std::vector<float> weights;
  std::vector<std::string> log; // compute-stream order of producer, experts, consumer work
  weave::moe_stats stats;       // the layer call's

  explicit block(moe_test::rank_input<float> in)
      : source(std::move(in))
      , x(source.x.rows(), hidden)
      , y(source.x.rows(), hidden)
      , z(source.x.rows(), hidden)
      , ids(source.ids.size(), -7)
      , weights(source.weights.size(), -7.0f) {}

  void produce(std::size_t first, std::size_t count) {
    log.push_back("P" + std::to_string(first));
    for (std::size_t t = first; t < first + count; ++t) {
      for (std::size_t h = 0; h < hidden; ++h)
        x(t, h) = 2.0f * source.x(t, h) + 1.0f;
      for (std::size_t j = 0; j < k; ++j) {
        ids[t * k + j] = source.ids[t * k + j];
        weights[t * k + j] = source.weights[t * k + j];
      }
    }
  }
  void consume(std::size_t first, std::size_t count) {
    log.push_back("C" + std::to_string(first));
    for (std::size_t t = first; t < first + count; ++t)
      for (std::size_t h = 0; h < hidden; ++h)
        z(t, h) = y(t, h) + x(t, h);
  }
};

std::vector<block> make_blocks() {
  std::mt19937 rng(99);
  std::vector<block> out;
  for (const std::size_t T : {30, 25, 28})
    out.emplace_back(moe_test::random_input<float>(T, hidden, experts, k, rng));
  return out;
}

weave::moe_options options(int chunks, weave::capacity_policy capacity) {
  weave::moe_options o;
  o.k = k;
  o.hidden = hidden;
  o.max_tokens = 30;
  o.chunks = chunks;
  o.capacity = capacity;
  return o;
}

// Runs every rank's block with the layer in `Space`; `hooked` picks the partitioned form,
// `short_hooks` (host_space) hooks written as `(first, count)` that compute directly.
template <class Space>
std::vector<block> run(int chunks, weave::capacity_policy capacity, bool hooked,
                       bool short_hooks = false) {
  REQUIRE((!short_hooks || std::is_same_v<Space, weave::host_space>));
  auto blocks = make_blocks();
  const moe_test::linear_experts linear(experts, hidden, 3);
  const auto where = weave::placement::contiguous(experts, ranks);
  weave::local_world world(ranks, {std::chrono::seconds(20), {}});
  world.run([&](weave::local_communicator& comm) {
    block& b = blocks[static_cast<std::size_t>(comm.rank())];
    weave::host_stream compute("compute"), comm_stream("comm");
    const std::size_t T = b.x.rows();
    // The experts as a step of the compute stream (at once on host streams, whose callback runs
    // in the stream; when the stream gets there where host code runs at enqueue time).
    const auto experts_fn = [&](const weave::basic_expert_batch<Space>& batch) {
      weave::host_space::enqueue(batch.stream, [&b, &linear, batch] {
        b.log.push_back("X" + std::to_string(batch.chunk));
        linear.operator()<float>(batch);
      });
    };
    if (!hooked)
      b.produce(0, T);
    weave::basic_moe_exchange<Space, weave::local_communicator> ex(comm, where,
                                                                   options(chunks, capacity));
    // Both hook objects live until the streams are synchronized (the layer borrows them).
    //! [hooks]
    // The operators around the layer, on the layer's chunks: `produce` writes tokens
    // [first, first + count) of x, ids and weights; `consume` reads the same rows of y. Each
    // enqueues its work on the compute stream it is given (on host streams the hook runs in that
    // stream, so the work runs at once).
    const weave::basic_chunk_hooks<Space> hooks{
        [&](std::size_t first, std::size_t count, weave::host_stream& s) {
          weave::host_space::enqueue(s, [&b, first, count] { b.produce(first, count); });
        },
        [&](std::size_t first, std::size_t count, weave::host_stream& s) {
          weave::host_space::enqueue(s, [&b, first, count] { b.consume(first, count); });
        }};
    //! [hooks]
    // On host streams a hook runs in a task of the compute stream: written as (first, count) it
    // may compute directly (`short_hooks`, host_space only).
    const weave::basic_chunk_hooks<Space> short_form{
        [&](std::size_t first, std::size_t count) { b.produce(first, count); },
        [&](std::size_t first, std::size_t count) { b.consume(first, count); }};
    ex.forward(b.x.view(), b.ids, b.weights, b.y.view(), experts_fn, compute, comm_stream,
               !hooked       ? nullptr
               : short_hooks ? &short_form
                             : &hooks);
    ex.synchronize(compute, comm_stream);
    b.stats = ex.stats(compute);
    if (!hooked)
      b.consume(0, T);
  });
  return blocks;
}

bool same(const weave::host_matrix<float>& a, const weave::host_matrix<float>& b) {
  return a.rows() == b.rows() &&
         std::memcmp(a.data(), b.data(), a.rows() * a.cols() * sizeof(float)) == 0;
}

// The unpartitioned block: its layer output equals the dense reference for its input and
// choices, and z = y + x.
void check_block_against_dense(const std::vector<block>& blocks, weave::capacity_policy capacity) {
  const moe_test::linear_experts linear(experts, hidden, 3);
  const auto where = weave::placement::contiguous(experts, ranks);
  for (std::size_t r = 0; r < blocks.size(); ++r) {
    CAPTURE(r);
    const block& b = blocks[r];
    const moe_test::rank_input<float> in{b.x, b.ids, b.weights};
    moe_test::check_rank_against_dense<float>(static_cast<int>(r), where, k, experts, capacity, in,
                                              linear, b.y, nullptr, nullptr, b.stats, 1e-4);
    for (std::size_t t = 0; t < b.x.rows(); ++t)
      for (std::size_t h = 0; h < hidden; ++h)
        REQUIRE(b.z(t, h) == b.y(t, h) + b.x(t, h));
  }
}

template <class Space>
void check_partitioned(weave::capacity_policy capacity) {
  const auto want = run<Space>(1, capacity, false);
  check_block_against_dense(want, capacity);
  if constexpr (!std::is_same_v<Space, weave::host_space>) { // the same bits in every space
    const auto host = run<weave::host_space>(1, capacity, false);
    for (std::size_t r = 0; r < want.size(); ++r)
      CHECK(same(want[r].z, host[r].z));
  }
  for (const int chunks : {1, 2, 3, 5}) {
    CAPTURE(chunks);
    const auto got = run<Space>(chunks, capacity, true);
    for (std::size_t r = 0; r < got.size(); ++r) {
      CAPTURE(r);
      CHECK(same(got[r].y, want[r].y));
      CHECK(same(got[r].z, want[r].z));
      // Queue order of the compute stream: P0 P1 X0 P2 X1 C0 P3 X2 C1 ... (producer c + 1
      // before experts c; consumer c after experts c + 1).
      const auto& log = got[r].log;
      const auto at = [&](const std::string& what) {
        return std::find(log.begin(), log.end(), what) - log.begin();
      };
      const std::size_t T = got[r].x.rows();
      for (int c = 0; c + 1 < chunks; ++c) {
        const auto first = [&](int i) { return std::to_string(T * i / chunks); };
        CHECK(at("P" + first(c + 1)) < at("X" + std::to_string(c)));
        CHECK(at("C" + first(c)) > at("X" + std::to_string(c + 1)));
        if (c + 2 < chunks) // ... and before experts c + 2: under chunk c + 1's combine
          CHECK(at("C" + first(c)) < at("X" + std::to_string(c + 2)));
      }
    }
  }
}

} // namespace

TEST_CASE_TEMPLATE("chunk hooks give the unpartitioned block's result for every chunking", Space,
                   weave::host_space, weave::emulated_gpu_space) {
  for (const auto capacity :
       {weave::capacity_policy{}, weave::capacity_policy{1.0, weave::drop_order::position},
        weave::capacity_policy{0.5, weave::drop_order::position}}) {
    CAPTURE(capacity.factor);
    check_partitioned<Space>(capacity);
  }
}

TEST_CASE("on host streams, hooks taking (first, count) compute in the stream") {
  // The short form of a hook (no stream): in host_space it runs in a task of the compute stream,
  // so it may compute directly, with the same results and order as the hooks that enqueue.
  for (const int chunks : {1, 3}) {
    CAPTURE(chunks);
    const weave::capacity_policy capacity{1.0, weave::drop_order::position};
    const auto want = run<weave::host_space>(chunks, capacity, true);
    const auto got = run<weave::host_space>(chunks, capacity, true, /*short_hooks=*/true);
    for (std::size_t r = 0; r < got.size(); ++r) {
      CAPTURE(r);
      CHECK(same(got[r].z, want[r].z));
      CHECK(got[r].log == want[r].log);
    }
  }
}

TEST_CASE_TEMPLATE("a chunk producer needs dropless or position-order capacity", Space,
                   weave::host_space, weave::emulated_gpu_space) {
  weave::local_world world(1);
  world.run([&](weave::local_communicator& comm) {
    weave::moe_options o = options(2, {1.0, weave::drop_order::batch_prioritized});
    weave::basic_moe_exchange<Space, weave::local_communicator> ex(
        comm, weave::placement::contiguous(6, 1), o);
    weave::host_matrix<float> x(4, hidden), y(4, hidden);
    std::vector<std::int32_t> ids(8, 0);
    std::vector<float> w(8, 1.0f);
    weave::host_stream a("a"), b("b");
    const weave::basic_chunk_hooks<Space> hooks{[](std::size_t, std::size_t) {}, {}};
    try {
      ex.forward(
          x.view(), ids, w, y.view(), [](const weave::basic_expert_batch<Space>&) {}, a, b, &hooks);
      FAIL("a producer with batch-prioritized capacity was accepted");
    } catch (const weave::error& e) {
      CHECK(e.code() == weave::errc::invalid_argument);
    }
  });
}
