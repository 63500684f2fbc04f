// Buffers sized to need: with dynamic shapes the MoE exchange sizes what each chunk receives
// from the counts of each call, grow-only, through the stream allocator it was given. Where host
// code runs at enqueue time (cuda_space; emulated_gpu_space here) the host sizes a chunk's whole
// receive side once it has the chunk's counts, at the call; in host_space the task that opens a
// chunk sizes its expert rows (the received rows live in the workspace), in the stream. Each case
// written once for both spaces and checked against a naive count of what each rank receives
// (rows: one per (token, device); expert rows: one per (token, expert)): what the allocator hands
// out equals the layer's own sizing of exactly those counts, nothing is allocated by a call that
// receives no more, growth frees the old block in stream order, trim and destruction give
// everything back, and every call equals the dense reference (and bitwise the unchunked call in
// host_space). Static shapes allocate nothing at call time.
#include <doctest/doctest.h>

#include "aligned_buffer.hpp"
#include "moe_test_support.hpp"

#include <weave/comm/local_world.hpp>
#include <weave/exec/emulated_gpu_space.hpp>
#include <weave/exec/host_space.hpp>
#include <weave/exec/stream_allocator.hpp>
#include <weave/overlap/moe_exchange.hpp>
#include <weave/routing/host_quant_moves.hpp>
#include <weave/routing/host_row_moves.hpp>

#include <atomic>
#include <random>
#include <set>
#include <vector>

namespace {

template <class Space>
using exchange = weave::basic_moe_exchange<Space, weave::local_communicator>;

constexpr int ranks = 4, experts = 16, k = 4, chunks = 2;
constexpr std::size_t hidden = 16, tokens = 40;

// What a layer's allocator handed out and took back (in host_space from the compute stream's
// thread, hence atomics).
template <class Space>
struct ledger {
  std::atomic<std::size_t> allocated{0}, freed{0}, allocations{0}, ordered_frees{0};
  weave::stream_allocator<Space> allocator() {
    return {[this](std::size_t bytes, weave::host_stream& s) {
              allocated += bytes;
              ++allocations;
              return Space::allocate_async(bytes, s);
            },
            [this](void* p, std::size_t bytes, weave::host_stream* s) {
              freed += bytes;
              ordered_frees += s != nullptr ? 1 : 0;
              Space::free_async(p, bytes, s);
            }};
  }
};

// What rank `me` receives in chunk `c`: rows (one per token and device) and expert rows (one per
// kept choice), counted naively from every rank's choices (contiguous placement, dropless).
std::pair<std::size_t, std::size_t> received(const std::vector<moe_test::rank_input<float>>& in,
                                             int me, int c) {
  const int spd = experts / ranks;
  std::size_t rows = 0, pairs = 0;
  for (const auto& r : in) {
    const std::size_t T = r.x.rows(), first = T * c / chunks, last = T * (c + 1) / chunks;
    for (std::size_t t = first; t < last; ++t) {
      std::set<int> ids;
      for (int j = 0; j < k; ++j) {
        const int e = r.ids[t * k + static_cast<std::size_t>(j)];
        if (e >= 0 && e / spd == me)
          ids.insert(e);
      }
      rows += ids.empty() ? 0 : 1;
      pairs += ids.size();
    }
  }
  return {rows, pairs};
}

std::vector<moe_test::rank_input<float>> routing(std::uint32_t seed, bool crowd_rank0) {
  std::mt19937 rng(seed);
  std::vector<moe_test::rank_input<float>> in;
  for (int r = 0; r < ranks; ++r) {
    in.push_back(moe_test::random_input<float>(tokens, hidden, experts, k, rng));
    if (crowd_rank0) // every token picks rank 0's experts: it receives every row
      for (std::size_t i = 0; i < in.back().ids.size(); ++i)
        in.back().ids[i] = static_cast<std::int32_t>(i % k);
  }
  return in;
}

weave::moe_options options() {
  weave::moe_options o;
  o.k = k;
  o.hidden = hidden;
  o.max_tokens = tokens;
  o.chunks = chunks;
  o.save_for_backward = true;
  return o;
}

} // namespace

TEST_CASE_TEMPLATE("dynamic shapes size what a chunk receives from the counts, grow-only, "
                   "stream-ordered",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  // At call time (CUDA's control flow) a chunk's receive side is sized for its rows and expert
  // rows, at least one of each; in the stream (host_space) its expert rows only, when it has any.
  constexpr bool at_call = !Space::runs_later;
  const auto where = weave::placement::contiguous(experts, ranks);
  const moe_test::linear_experts f(experts, hidden, 11);
  const std::vector<std::vector<moe_test::rank_input<float>>> calls = {
      routing(1, false), routing(1, false), routing(2, true), routing(3, false)};
  // The unchunked call's outputs in host_space: every chunking and space gives the same bits.
  std::vector<std::vector<weave::host_matrix<float>>> want(
      calls.size(), std::vector<weave::host_matrix<float>>(ranks));
  {
    weave::local_world world(ranks);
    world.run([&](weave::local_communicator& comm) {
      const auto r = static_cast<std::size_t>(comm.rank());
      weave::moe_options o = options();
      o.chunks = 1;
      exchange<weave::host_space> ex(comm, where, o);
      weave::host_stream compute("compute"), comm_stream("comm");
      for (std::size_t i = 0; i < calls.size(); ++i) {
        weave::host_matrix<float> y(tokens, hidden);
        ex.forward(
            calls[i][r].x.view(), calls[i][r].ids, calls[i][r].weights, y.view(),
            [&](const weave::expert_batch& b) { moe_test::run_experts<float>(f, b); }, compute,
            comm_stream);
        ex.synchronize(compute, comm_stream);
        want[i][r] = std::move(y);
      }
    });
  }
  std::vector<ledger<Space>> ledgers(ranks);
  weave::local_world world(ranks);
  world.run([&](weave::local_communicator& comm) {
    const int me = comm.rank();
    const auto r = static_cast<std::size_t>(me);
    ledger<Space>& led = ledgers[r];
    {
      exchange<Space> ex(comm, where, options());
      weave_test::aligned_buffer ws(ex.workspace_size());
      weave::host_stream compute("compute"), comm_stream("comm");
      ex.initialize(ws.ptr, ws.size, compute, led.allocator());
      CHECK(ex.memory().held == 0);
      CHECK(ex.memory().workspace == ex.workspace_size());
      std::vector<std::size_t> cap_rows(chunks, 0), cap_epd(chunks, 0);
      std::size_t expect_held = 0;
      for (std::size_t i = 0; i < calls.size(); ++i) {
        CAPTURE(i);
        const std::size_t before = led.allocations;
        // The sizes this call should hold: every chunk's counts, grown when they outgrow.
        std::size_t grows = 0;
        for (int c = 0; c < chunks; ++c) {
          auto [rows, pairs] = received(calls[i], me, c);
          if (at_call) {
            rows = std::max<std::size_t>(rows, 1);
            pairs = std::max<std::size_t>(pairs, 1);
          }
          const auto cc = static_cast<std::size_t>(c);
          if ((at_call && rows > cap_rows[cc]) || pairs > cap_epd[cc]) {
            ++grows;
            expect_held -= cap_epd[cc] == 0 ? 0 : ex.receive_bytes_for(cap_rows[cc], cap_epd[cc]);
            if (at_call)
              cap_rows[cc] = rows > cap_rows[cc] ? exchange<Space>::grown(rows) : cap_rows[cc];
            cap_epd[cc] = pairs > cap_epd[cc] ? exchange<Space>::grown(pairs) : cap_epd[cc];
            expect_held += ex.receive_bytes_for(cap_rows[cc], cap_epd[cc]);
          }
        }
        weave::host_matrix<float> y(tokens, hidden), dx(tokens, hidden);
        std::vector<float> dw(tokens * k);
        const auto& in = calls[i][r];
        ex.forward(
            in.x.view(), in.ids, in.weights, y.view(),
            [&](const weave::basic_expert_batch<Space>& b) { moe_test::run_experts<float>(f, b); },
            compute, comm_stream);
        if constexpr (at_call) // the host sized every chunk before the forward returned
          CHECK(led.allocations - before == grows);
        ex.synchronize(compute, comm_stream); // in host_space the tasks sized them
        const std::size_t forward_allocations = led.allocations - before;
        CHECK(forward_allocations == grows);
        ex.backward(
            in.x.view(), dx.view(), dw,
            [&](const weave::basic_expert_grad_batch<Space>& b) {
              moe_test::run_experts<float>(f, b);
            },
            compute, comm_stream);
        ex.synchronize(compute, comm_stream);
        const auto stats = ex.stats(compute);
        moe_test::check_rank_against_dense(me, where, k, experts, {}, in, f, y, &dx, &dw, stats,
                                           1e-4);
        CHECK(moe_test::bitwise_equal(y, want[i][r]));
        const auto m = ex.memory();
        std::size_t grads = 0, most_epd = 0;
        for (int c = 0; c < chunks; ++c)
          most_epd = std::max(most_epd, received(calls[i], me, c).second);
        grads = m.held - expect_held; // the backward's buffers: at least this call's EPD rows
        CHECK(grads >= ex.backward_bytes_for(most_epd));
        CHECK(m.held >= expect_held);
        CHECK(static_cast<std::size_t>(stats.received_rows) ==
              received(calls[i], me, 0).first + received(calls[i], me, 1).first);
        CHECK(static_cast<std::size_t>(stats.expert_rows) ==
              received(calls[i], me, 0).second + received(calls[i], me, 1).second);
      }
      if (me == 0) // the crowded call outgrew rank 0's buffers: the old ones freed in order
        CHECK(led.ordered_frees > 0);
      // trim gives everything back in stream order; the next call sizes again and is right.
      ex.trim(compute);
      CHECK(ex.memory().held == 0);
      compute.synchronize();
      CHECK(led.allocated == led.freed);
      weave::host_matrix<float> y(tokens, hidden), dx(tokens, hidden);
      std::vector<float> dw(tokens * k);
      ex.forward(
          calls[0][r].x.view(), calls[0][r].ids, calls[0][r].weights, y.view(),
          [&](const weave::basic_expert_batch<Space>& b) { moe_test::run_experts<float>(f, b); },
          compute, comm_stream);
      ex.synchronize(compute, comm_stream);
      moe_test::check_rank_against_dense<float>(me, where, k, experts, {}, calls[0][r], f, y,
                                                nullptr, nullptr, ex.stats(compute), 1e-4);
      CHECK(moe_test::bitwise_equal(y, want[0][r]));
      CHECK(ex.memory().held > 0);
    }
    CHECK(led.allocated == led.freed); // destruction frees the rest
  });
}

TEST_CASE_TEMPLATE("static shapes allocate nothing at call time", Space, weave::host_space,
                   weave::emulated_gpu_space) {
  const auto where = weave::placement::contiguous(experts, ranks);
  weave::local_world world(ranks);
  world.run([&](weave::local_communicator& comm) {
    ledger<Space> led;
    weave::moe_options o = options();
    o.static_shape = true;
    exchange<Space> ex(comm, where, o);
    weave_test::aligned_buffer ws(ex.workspace_size());
    weave::host_stream compute("compute"), comm_stream("comm");
    ex.initialize(ws.ptr, ws.size, compute, led.allocator());
    std::mt19937 rng(static_cast<unsigned>(comm.rank()) + 5);
    const auto in = moe_test::random_input<float>(tokens, hidden, experts, k, rng);
    weave::host_matrix<float> y(tokens, hidden);
    ex.forward(
        in.x.view(), in.ids, in.weights, y.view(), [](const weave::basic_expert_batch<Space>&) {},
        compute, comm_stream);
    ex.synchronize(compute, comm_stream);
    CHECK(led.allocations == 0);
    CHECK(ex.memory().held == 0);
    CHECK(ex.memory().next_call_max == 0);
  });
}
