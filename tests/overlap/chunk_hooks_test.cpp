// Lancet's partitioning of the operators around an MoE layer: a producer that computes each
// chunk's tokens and choices inside the chunk's prepare stage and a consumer that uses each
// chunk's output as soon as it is final. Both exchanges (moe_exchange and the device exchange on
// host streams) must give, for every chunking, bitwise what the unpartitioned block gives
// (producer on the whole batch, layer, consumer on the whole batch), and run the producer of
// chunk c + 1 before the experts of chunk c (so dispatch c overlaps it).
#include <doctest/doctest.h>

#include "aligned_buffer.hpp"
#include "moe_test_support.hpp"

#include <weave/comm/local_world.hpp>
#include <weave/exec/host_space.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/overlap/device_exchange.hpp>
#include <weave/overlap/moe_exchange.hpp>
#include <weave/routing/host_quant_moves.hpp>
#include <weave/routing/host_row_moves.hpp>

#include <cstring>
#include <random>
#include <string>
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
  std::vector<std::string> log; // compute-thread order of producer, experts, consumer calls

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

// Runs every rank's block; `Device` picks the exchange, `hooked` the partitioned form.
template <bool Device>
std::vector<block> run(int chunks, weave::capacity_policy capacity, bool hooked) {
  auto blocks = make_blocks();
  const moe_test::linear_experts linear(experts, hidden, 3);
  const auto where = weave::placement::contiguous(experts, ranks);
  weave::local_world world(ranks, {std::chrono::seconds(20), {}});
  world.run([&](weave::local_communicator& comm) {
    block& b = blocks[static_cast<std::size_t>(comm.rank())];
    weave::host_stream compute("compute"), comm_stream("comm");
    const std::size_t T = b.x.rows();
    const auto experts_fn = [&](const weave::expert_batch& batch) {
      b.log.push_back("X" + std::to_string(batch.chunk));
      linear.operator()<float>(batch);
    };
    if (!hooked)
      b.produce(0, T);
    if constexpr (Device) {
      weave::basic_device_exchange<weave::host_space, weave::local_communicator> ex(
          comm, where, options(chunks, capacity));
      weave_test::aligned_buffer ws(ex.workspace_size());
      ex.initialize(ws.ptr, ws.size, compute);
      const weave::device_chunk_hooks<weave::host_space> hooks{
          [&](std::size_t first, std::size_t count, weave::host_stream&) {
            b.produce(first, count);
          },
          [&](std::size_t first, std::size_t count, weave::host_stream&) {
            b.consume(first, count);
          }};
      ex.forward(
          b.x.view(), b.ids, b.weights, b.y.view(),
          [&](const weave::device_expert_batch<weave::host_space>& d) {
            experts_fn({d.chunk, d.device, d.expert_offsets, d.experts, d.input, d.output});
          },
          compute, comm_stream, hooked ? &hooks : nullptr);
      compute.synchronize();
      comm_stream.synchronize();
      ex.check_errors(compute);
    } else {
      weave::moe_exchange<weave::local_communicator> ex(comm, where, options(chunks, capacity));
      //! [hooks]
      // The operators around the layer, on the layer's chunks: `produce` writes tokens
      // [first, first + count) of x, ids and weights; `consume` reads the same rows of y.
      const weave::moe_chunk_hooks hooks{
          [&](std::size_t first, std::size_t count) { b.produce(first, count); },
          [&](std::size_t first, std::size_t count) { b.consume(first, count); }};
      ex.forward(b.x.view(), b.ids, b.weights, b.y.view(), experts_fn, compute, comm_stream,
                 hooked ? &hooks : nullptr);
      //! [hooks]
      compute.synchronize();
      comm_stream.synchronize();
    }
    if (!hooked)
      b.consume(0, T);
  });
  return blocks;
}

bool same(const weave::host_matrix<float>& a, const weave::host_matrix<float>& b) {
  return a.rows() == b.rows() &&
         std::memcmp(a.data(), b.data(), a.rows() * a.cols() * sizeof(float)) == 0;
}

template <bool Device>
void check_partitioned(weave::capacity_policy capacity) {
  const auto want = run<false>(1, capacity, false);
  for (const int chunks : {1, 2, 3, 5}) {
    CAPTURE(chunks);
    const auto got = run<Device>(chunks, capacity, true);
    for (std::size_t r = 0; r < got.size(); ++r) {
      CAPTURE(r);
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

TEST_CASE("chunk hooks give the unpartitioned block's result for every chunking") {
  for (const auto capacity :
       {weave::capacity_policy{}, weave::capacity_policy{1.0, weave::drop_order::position},
        weave::capacity_policy{0.5, weave::drop_order::position}}) {
    CAPTURE(capacity.factor);
    check_partitioned<false>(capacity);
    check_partitioned<true>(capacity);
  }
}

TEST_CASE("a chunk producer needs dropless or position-order capacity") {
  weave::local_world world(1);
  world.run([&](weave::local_communicator& comm) {
    weave::moe_options o = options(2, {1.0, weave::drop_order::batch_prioritized});
    weave::moe_exchange<weave::local_communicator> ex(comm, weave::placement::contiguous(6, 1), o);
    weave::host_matrix<float> x(4, hidden), y(4, hidden);
    std::vector<std::int32_t> ids(8, 0);
    std::vector<float> w(8, 1.0f);
    weave::host_stream a("a"), b("b");
    const weave::moe_chunk_hooks hooks{[](std::size_t, std::size_t) {}, {}};
    try {
      ex.forward(
          x.view(), ids, w, y.view(), [](const weave::expert_batch&) {}, a, b, &hooks);
      FAIL("a producer with batch-prioritized capacity was accepted");
    } catch (const weave::error& e) {
      CHECK(e.code() == weave::errc::invalid_argument);
    }
  });
}
