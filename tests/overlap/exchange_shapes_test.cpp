// The device exchange (`basic_device_exchange`, the algorithm of `cuda_moe_exchange`) run on host
// streams over a local_world, in `host_space` and in `emulated_gpu_space` (the control flow of
// `cuda_space`: host code at enqueue time, blocking host reads, CUDA's copy and capture rules):
// bitwise equal to `moe_exchange` (itself checked against a dense reference) for dynamic and
// static shapes, every chunking, capacities, dtypes, forward and backward; its statistics; its
// flagged errors and slot overflows; static shapes captured.
#include <doctest/doctest.h>

#include "aligned_buffer.hpp"
#include "moe_test_support.hpp"

#include <weave/comm/local_world.hpp>
#include <weave/exec/emulated_gpu_space.hpp>
#include <weave/exec/host_space.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/overlap/device_exchange.hpp>
#include <weave/overlap/moe_exchange.hpp>
#include <weave/routing/host_quant_moves.hpp>
#include <weave/routing/host_row_moves.hpp>

#include <atomic>
#include <cstring>
#include <future>
#include <limits>
#include <memory>
#include <new>
#include <random>

using weave_test::aligned_buffer;

namespace {

template <class Space>
using device_exchange = weave::basic_device_exchange<Space, weave::local_communicator>;

// The expert work of a callback: in host_space the callback runs as a task of its stream, in
// emulated_gpu_space (as with CUDA) when it is issued, and enqueues its work.
template <class Space, class F>
void on_stream(weave::host_stream& s, F f) {
  if constexpr (Space::runs_later)
    f();
  else
    s.submit(std::move(f));
}

struct setup {
  int ranks = 2, experts = 8, k = 2;
  std::size_t hidden = 8;
  std::vector<std::size_t> tokens; // per rank
  weave::capacity_policy capacity{};
  std::uint32_t seed = 1;
  bool fixed = false;        // static shapes
  std::size_t slot_rows = 0; // static_rows_per_peer
};

template <class T>
struct result {
  std::vector<weave::host_matrix<T>> y, dx;
  std::vector<std::vector<float>> dw;
  std::vector<weave::moe_stats> stats;
};

weave::moe_options options_of(const setup& s, weave::dtype element, int chunks) {
  weave::moe_options o;
  o.k = s.k;
  o.hidden = s.hidden;
  o.element = element;
  o.max_tokens = *std::max_element(s.tokens.begin(), s.tokens.end());
  o.chunks = chunks;
  o.capacity = s.capacity;
  o.save_for_backward = true;
  o.static_shape = s.fixed;
  o.static_rows_per_peer = s.slot_rows;
  return o;
}

// `Space` void: moe_exchange.
template <class T, class Space>
result<T> run(const setup& s, const weave::placement& where, int chunks,
              const std::vector<moe_test::rank_input<T>>& in,
              const moe_test::linear_experts& experts) {
  weave::local_world world(s.ranks, {std::chrono::seconds(20), {}});
  result<T> out;
  const auto n = static_cast<std::size_t>(s.ranks);
  out.y.resize(n);
  out.dx.resize(n);
  out.dw.resize(n);
  out.stats.resize(n);
  world.run([&](weave::local_communicator& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    weave::moe_options o = options_of(s, weave::dtype_of_v<T>, chunks);
    weave::host_stream compute("compute"), comm_stream("comm");
    out.y[r] = weave::host_matrix<T>(in[r].x.rows(), s.hidden);
    out.dx[r] = weave::host_matrix<T>(in[r].x.rows(), s.hidden);
    out.dw[r].assign(in[r].ids.size(), -1.0f);
    if constexpr (!std::is_void_v<Space>) {
      device_exchange<Space> ex(comm, where, o);
      aligned_buffer ws(ex.workspace_size());
      ex.initialize(ws.ptr, ws.size, compute);
      ex.forward(
          in[r].x.view(), in[r].ids, in[r].weights, out.y[r].view(),
          [&](const weave::device_expert_batch<Space>& b) {
            on_stream<Space>(b.stream, [&experts, b] {
              experts.template operator()<T>(
                  {b.chunk, b.device, b.expert_offsets, b.experts, b.input, b.output});
            });
          },
          compute, comm_stream);
      ex.backward(
          in[r].x.view(), out.dx[r].view(), out.dw[r], // dL/dy = x
          [&](const weave::device_expert_grad_batch<Space>& b) {
            on_stream<Space>(b.stream, [&experts, b] {
              experts.template backward<T>({b.chunk, b.device, b.expert_offsets, b.experts,
                                            b.saved_input, b.grad_output, b.grad_input});
            });
          },
          compute, comm_stream);
      compute.synchronize();
      comm_stream.synchronize();
      out.stats[r] = ex.read_stats(compute);
      ex.check_errors(compute);
    } else {
      o.static_shape = false;
      weave::moe_exchange<weave::local_communicator> ex(comm, where, o);
      ex.forward(
          in[r].x.view(), in[r].ids, in[r].weights, out.y[r].view(),
          [&](const weave::expert_batch& b) { experts.template operator()<T>(b); }, compute,
          comm_stream);
      ex.backward(
          in[r].x.view(), out.dx[r].view(), out.dw[r],
          [&](const weave::expert_grad_batch& b) { experts.template backward<T>(b); }, compute,
          comm_stream);
      compute.synchronize();
      comm_stream.synchronize();
      out.stats[r] = ex.stats();
    }
  });
  return out;
}

template <class T>
std::vector<moe_test::rank_input<T>> inputs(const setup& s) {
  std::mt19937 rng(s.seed);
  std::vector<moe_test::rank_input<T>> in;
  for (int r = 0; r < s.ranks; ++r)
    in.push_back(moe_test::random_input<T>(s.tokens[static_cast<std::size_t>(r)], s.hidden,
                                           s.experts, s.k, rng));
  return in;
}

// The device exchange equals moe_exchange bitwise, for every chunking, with equal statistics.
template <class T, class Space>
void check_against_host(const setup& s, const weave::placement& where) {
  const auto in = inputs<T>(s);
  const moe_test::linear_experts experts(s.experts, s.hidden, s.seed + 100);
  const auto want = run<T, void>(s, where, 1, in, experts);
  for (const int chunks : {1, 2, 3}) {
    CAPTURE(chunks);
    const auto got = run<T, Space>(s, where, chunks, in, experts);
    for (std::size_t r = 0; r < static_cast<std::size_t>(s.ranks); ++r) {
      CAPTURE(r);
      REQUIRE(moe_test::bitwise_equal(got.y[r], want.y[r]));
      REQUIRE(moe_test::bitwise_equal(got.dx[r], want.dx[r]));
      REQUIRE(got.dw[r] == want.dw[r]);
      const auto &a = got.stats[r], &b = want.stats[r];
      CHECK(a.tokens == b.tokens);
      CHECK(a.routed_pairs == b.routed_pairs);
      CHECK(a.dropped_pairs == b.dropped_pairs);
      CHECK(a.sent_rows == b.sent_rows);
      CHECK(a.received_rows == b.received_rows);
      CHECK(a.local_rows == b.local_rows);
      CHECK(a.expert_rows == b.expert_rows);
      CHECK(a.row_bytes == b.row_bytes);
    }
  }
}

} // namespace

TEST_CASE_TEMPLATE("device exchange on host streams equals moe_exchange: dynamic and static shapes",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  for (const bool fixed : {false, true}) {
    CAPTURE(fixed);
    setup s;
    s.fixed = fixed;
    s.tokens = {37, 29};
    check_against_host<float, Space>(s, weave::placement::contiguous(8, 2));
    s.ranks = 4;
    s.experts = 16;
    s.k = 4;
    s.hidden = 12;
    s.tokens = {40, 0, 17, 33};
    s.seed = 5;
    std::vector<std::int32_t> slots(16);
    for (int i = 0; i < 16; ++i)
      slots[static_cast<std::size_t>(i)] = (i * 7) % 16;
    check_against_host<float, Space>(s, weave::placement(16, 4, slots));
    s.ranks = 3;
    s.experts = 6;
    s.k = 3;
    s.tokens = {25, 25, 24};
    s.seed = 9;
    check_against_host<weave::bfloat16, Space>(s, weave::placement::contiguous(6, 3));
    // Replicas: experts 0 and 3 twice, 5 three times; chosen per token as moe_exchange does.
    check_against_host<float, Space>(s, weave::placement(6, 3, {0, 1, 5, 2, 3, 0, 4, 5, 3}));
    // Empty slots: device 0 holds two experts, device 2 one; expert 1 twice.
    check_against_host<float, Space>(s, weave::placement(6, 3, {0, 1, -1, 2, 3, 4, 5, -1, -1}));
    s.ranks = 2;
    s.experts = 5;
    s.k = 2;
    s.tokens = {21, 34};
    s.seed = 13;
    check_against_host<float, Space>(s, weave::placement(5, 2, {0, 1, 2, 3, 4, -1, -1, 1}));
    s.ranks = 1;
    s.experts = 4;
    s.k = 2;
    s.tokens = {19};
    check_against_host<weave::half, Space>(s, weave::placement::contiguous(4, 1));
  }
}

TEST_CASE_TEMPLATE("device exchange decides capacity like moe_exchange, for every order", Space,
                   weave::host_space, weave::emulated_gpu_space) {
  for (const bool fixed : {false, true})
    for (const auto order :
         {weave::drop_order::position, weave::drop_order::rank_major,
          weave::drop_order::batch_prioritized, weave::drop_order::priority_token_major})
      for (const double factor : {0.5, 1.0, 1.25}) {
        // Tutel's rounding above factor 0.5: at factor 1, 26 tokens over 6 experts with k = 2
        // get 2 * ceil(26 / 6) = 10 rows per expert against ceil(52 / 6) = 9, so the static
        // slot bound must follow the rounding.
        const auto rounding =
            factor > 0.5 ? weave::capacity_rounding::tutel : weave::capacity_rounding::ceil;
        CAPTURE(fixed);
        CAPTURE(static_cast<int>(order));
        CAPTURE(factor);
        setup s;
        s.ranks = 3;
        s.experts = 6;
        s.k = 2;
        s.tokens = {30, 21, 26};
        s.capacity = {factor, order, rounding};
        s.fixed = fixed;
        s.seed = 77;
        check_against_host<float, Space>(s, weave::placement::contiguous(6, 3));
      }
}

TEST_CASE_TEMPLATE("device exchange flags bad ids, bad weights and overflowing static slots", Space,
                   weave::host_space, weave::emulated_gpu_space) {
  // Rank 0 passes a bad id, a duplicate or a NaN weight: flagged ids are treated as absent, so
  // every shape stays consistent and nobody hangs; the flags travel with the count exchange, so
  // rank 0 reports the kind and rank 1 a peer_failure naming rank 0 and that kind: with dynamic
  // shapes both streams fail at that exchange, with static shapes check_errors reports it.
  const auto where = weave::placement::contiguous(4, 2);
  struct outcome {
    weave::errc code{};
    int origin = -1; // rank named by a peer_error
    weave::errc origin_code{};
  };
  const auto outcomes = [&](auto&& poison, bool fixed, std::size_t slot_rows,
                            bool idle_peer = false) {
    weave::local_world world(2, {std::chrono::seconds(20), {}});
    std::vector<outcome> out(2);
    world.run([&](weave::local_communicator& comm) {
      const auto r = static_cast<std::size_t>(comm.rank());
      setup s;
      s.experts = 4;
      s.tokens = {12, 12};
      s.fixed = fixed;
      s.slot_rows = slot_rows;
      std::mt19937 rng(3 + static_cast<unsigned>(r));
      auto in = moe_test::random_input<float>(12, s.hidden, 4, 2, rng);
      if (r == 0)
        poison(in);
      if (r == 1 && idle_peer) // every choice "no expert": sends nothing, so cannot overflow
        std::fill(in.ids.begin(), in.ids.end(), -1);
      weave::host_matrix<float> y(12, s.hidden);
      device_exchange<Space> ex(comm, where, options_of(s, weave::dtype::f32, 2));
      aligned_buffer ws(ex.workspace_size());
      weave::host_stream compute("compute"), comm_stream("comm");
      ex.initialize(ws.ptr, ws.size, compute);
      try {
        ex.forward(
            in.x.view(), in.ids, in.weights, y.view(),
            [](const weave::device_expert_batch<Space>& b) {
              on_stream<Space>(b.stream, [b] {
                moe_test::linear_experts(4, 8, 1).operator()<float>(
                    {b.chunk, b.device, b.expert_offsets, b.experts, b.input, b.output});
              });
            },
            compute, comm_stream);
        ex.synchronize(compute, comm_stream);
      } catch (const weave::peer_error& e) {
        out[r] = {e.code(), e.origin().rank, e.origin().code};
      } catch (const weave::error& e) {
        out[r].code = e.code();
      }
      CHECK(ex.usable()); // the ranks failed together: the layer can be called again
    });
    return out;
  };
  const auto expect = [](const std::vector<outcome>& got, weave::errc code) {
    CHECK(got[0].code == code);
    CHECK(got[1].code == weave::errc::peer_failure);
    CHECK(got[1].origin == 0);
    CHECK(got[1].origin_code == code);
  };
  const auto none = [](moe_test::rank_input<float>&) {};
  for (const bool fixed : {false, true}) {
    CAPTURE(fixed);
    const auto clean = outcomes(none, fixed, 0);
    CHECK(clean[0].code == weave::errc{});
    CHECK(clean[1].code == weave::errc{});
    const auto bad_id = [](moe_test::rank_input<float>& in) { in.ids[5] = 4; };
    expect(outcomes(bad_id, fixed, 0), weave::errc::out_of_range);
    const auto negative = [](moe_test::rank_input<float>& in) { in.ids[3] = -7; };
    expect(outcomes(negative, fixed, 0), weave::errc::out_of_range);
    const auto twice = [](moe_test::rank_input<float>& in) { in.ids[7] = in.ids[6] = 1; };
    expect(outcomes(twice, fixed, 0), weave::errc::invalid_argument);
    const auto nan = [](moe_test::rank_input<float>& in) {
      in.weights[2] = std::numeric_limits<float>::quiet_NaN();
    };
    expect(outcomes(nan, fixed, 0), weave::errc::invalid_argument);
  }
  // Slots of 2 rows cannot hold a chunk of 6 tokens sent mostly to one peer.
  const auto crowd = [](moe_test::rank_input<float>& in) {
    for (std::size_t i = 0; i < in.ids.size(); i += 2) {
      in.ids[i] = 0;
      in.ids[i + 1] = 1;
    }
  };
  expect(outcomes(crowd, true, 2, true), weave::errc::size_overflow);
  const auto roomy = outcomes(crowd, true, 6);
  CHECK(roomy[0].code == weave::errc{});
  CHECK(roomy[1].code == weave::errc{});
}

TEST_CASE("device exchange rejects bad arguments") {
  weave::local_world world(2);
  world.run([&](weave::local_communicator& comm) {
    weave::moe_options o;
    o.k = 2;
    o.hidden = 4;
    o.max_tokens = 8;
    const auto where = weave::placement::contiguous(4, 2);
    CHECK(moe_test::error_code_of([&] {
            device_exchange<weave::host_space>(comm, weave::placement::contiguous(4, 4), o);
          }) == weave::errc::invalid_argument);
    weave::moe_options fixed = o;
    fixed.static_shape = true;
    CHECK(moe_test::error_code_of([&] {
            weave::moe_exchange<weave::local_communicator>(comm, where, fixed);
          }) == weave::errc::not_supported);
    device_exchange<weave::host_space> ex(comm, where, o);
    aligned_buffer ws(ex.workspace_size()); // outlives the streams: rejected calls still take
                                            // their turn on them, which uses the workspace
    weave::host_matrix<float> x(8, 4), y(8, 4), wide(8, 5), many(9, 4);
    std::vector<std::int32_t> ids(16, 0);
    std::vector<float> w(16, 1.0f);
    weave::host_stream a("a"), b("b");
    const auto noop = [](const weave::device_expert_batch<weave::host_space>&) {};
    CHECK(moe_test::error_code_of([&] { ex.forward(x.view(), ids, w, y.view(), noop, a, b); }) ==
          weave::errc::invalid_state); // not initialised
    CHECK(moe_test::error_code_of([&] { ex.initialize(ws.ptr, ws.size / 2, a); }) ==
          weave::errc::size_mismatch);
    ex.initialize(ws.ptr, ws.size, a);
    CHECK(moe_test::error_code_of([&] { ex.forward(wide.view(), ids, w, y.view(), noop, a, b); }) ==
          weave::errc::size_mismatch);
    CHECK(moe_test::error_code_of([&] {
            ex.forward(many.view(), ids, w, many.view(), noop, a, b);
          }) == weave::errc::invalid_argument);
    CHECK(moe_test::error_code_of([&] {
            ex.forward(x.view(), std::span(ids).first(15), w, y.view(), noop, a, b);
          }) == weave::errc::size_mismatch);
    std::vector<float> dw(16);
    CHECK(moe_test::error_code_of([&] {
            ex.backward(
                x.view(), y.view(), dw,
                [](const weave::device_expert_grad_batch<weave::host_space>&) {}, a, b);
          }) == weave::errc::invalid_state); // no save_for_backward
  });
}

// A static-shape call issues nothing a CUDA graph capture refuses (host_capture.hpp): no wait for
// an event recorded outside the capture, no query of a captured event, no host wait or pageable
// copy (emulated_gpu_space), and the comm stream is joined back. Captured forwards and backwards
// (host streams run them as they are captured) and the eager calls around them give moe_exchange's
// results; a dynamic-shape call is refused before it issues anything.
TEST_CASE_TEMPLATE("static-shape calls pass the CUDA capture rules; dynamic ones are refused",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  for (const int in_flight : {1, 2})
    for (const int chunks : {1, 3}) {
      CAPTURE(in_flight);
      CAPTURE(chunks);
      setup s;
      s.ranks = 2;
      s.experts = 4;
      s.k = 2;
      s.tokens = {13, 9};
      s.fixed = true;
      const auto where = weave::placement::contiguous(4, 2);
      const auto in = inputs<float>(s);
      const moe_test::linear_experts experts(s.experts, s.hidden, 7);
      const auto want = run<float, void>(s, where, 1, in, experts);
      weave::local_world world(2, {std::chrono::seconds(20), {}});
      world.run([&](weave::local_communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        weave::moe_options o = options_of(s, weave::dtype::f32, chunks);
        o.max_in_flight = in_flight;
        device_exchange<Space> ex(comm, where, o);
        aligned_buffer ws(ex.workspace_size());
        weave::host_stream compute("compute"), comm_stream("comm");
        ex.initialize(ws.ptr, ws.size, compute);
        const auto forward_experts = [&](const weave::device_expert_batch<Space>& b) {
          on_stream<Space>(b.stream, [&experts, b] {
            experts.operator()<float>(
                {b.chunk, b.device, b.expert_offsets, b.experts, b.input, b.output});
          });
        };
        const auto backward_experts = [&](const weave::device_expert_grad_batch<Space>& b) {
          on_stream<Space>(b.stream, [&experts, b] {
            experts.backward<float>({b.chunk, b.device, b.expert_offsets, b.experts, b.saved_input,
                                     b.grad_output, b.grad_input});
          });
        };
        // eager, captured, eager: each call's outputs checked against moe_exchange's
        for (const bool captured : {false, true, false}) {
          CAPTURE(captured);
          weave::host_matrix<float> y(in[r].x.rows(), s.hidden), dx(in[r].x.rows(), s.hidden);
          std::vector<float> dw(in[r].ids.size(), -1.0f);
          if (captured)
            compute.begin_capture();
          ex.forward(in[r].x.view(), in[r].ids, in[r].weights, y.view(), forward_experts, compute,
                     comm_stream);
          ex.backward(in[r].x.view(), dx.view(), dw, backward_experts, compute, comm_stream);
          if (captured)
            compute.end_capture(); // throws for a violation, or a comm stream not joined back
          ex.synchronize(compute, comm_stream);
          CHECK(moe_test::bitwise_equal(y, want.y[r]));
          CHECK(moe_test::bitwise_equal(dx, want.dx[r]));
          CHECK(dw == want.dw[r]);
        }
        // Two handles in flight in one capture (DualPipe-style), when the slots allow.
        if (in_flight == 2) {
          weave::host_matrix<float> y1(in[r].x.rows(), s.hidden), y2(in[r].x.rows(), s.hidden);
          compute.begin_capture();
          auto a = ex.dispatch(in[r].x.view(), in[r].ids, in[r].weights, compute, comm_stream);
          auto b = ex.dispatch(in[r].x.view(), in[r].ids, in[r].weights, compute, comm_stream);
          for (auto* h : {&a, &b}) // handles: the caller enqueues its experts in either space
            for (auto chunk : ex.chunks(*h))
              compute.submit([&experts, batch = chunk.experts()] {
                experts.operator()<float>({batch.chunk, batch.device, batch.expert_offsets,
                                           batch.experts, batch.input, batch.output});
              });
          ex.combine(a, y1.view(), compute, comm_stream);
          ex.combine(b, y2.view(), compute, comm_stream);
          compute.end_capture();
          ex.synchronize(compute, comm_stream);
          CHECK(moe_test::bitwise_equal(y1, want.y[r]));
          CHECK(moe_test::bitwise_equal(y2, want.y[r]));
        }
      });
    }
  // Dynamic shapes wait for counts on the host: refused in a capture, before anything is issued.
  setup s;
  s.tokens = {6, 6};
  const auto where = weave::placement::contiguous(8, 2);
  weave::local_world world(2, {std::chrono::seconds(20), {}});
  world.run([&](weave::local_communicator& comm) {
    device_exchange<Space> ex(comm, where, options_of(s, weave::dtype::f32, 2));
    aligned_buffer ws(ex.workspace_size());
    weave::host_stream compute("compute"), comm_stream("comm");
    ex.initialize(ws.ptr, ws.size, compute);
    std::mt19937 rng(1);
    const auto in = moe_test::random_input<float>(6, s.hidden, 8, 2, rng);
    compute.begin_capture();
    CHECK(moe_test::error_code_of([&] {
            (void)ex.dispatch(in.x.view(), in.ids, in.weights, compute, comm_stream);
          }) == weave::errc::invalid_state);
    compute.end_capture(); // nothing was issued in it
    CHECK(ex.usable());
  });
}

// With dynamic shapes the host reads each chunk's counts, but not before the next chunk's experts
// are issued: chunk c's expert work (a task here) cannot finish until chunk c + 1's experts have
// been issued, which the issue order allows only if the host does not wait for chunk c's combine
// (which waits for chunk c's experts) before issuing chunk c + 1's. A host that waits there
// would find the gate closed until it times out.
TEST_CASE("dynamic shapes on the CUDA path issue chunk c + 1's experts before chunk c's finish") {
  using space = weave::emulated_gpu_space;
  setup s;
  s.ranks = 2;
  s.tokens = {24, 24};
  const int C = 4;
  const auto where = weave::placement::contiguous(8, 2);
  const auto in = inputs<float>(s);
  const moe_test::linear_experts experts(s.experts, s.hidden, 3);
  const auto want = run<float, void>(s, where, 1, in, experts);
  weave::local_world world(2, {std::chrono::seconds(20), {}});
  world.run([&](weave::local_communicator& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    weave::moe_options o = options_of(s, weave::dtype::f32, C);
    o.save_for_backward = false;
    device_exchange<space> ex(comm, where, o);
    aligned_buffer ws(ex.workspace_size());
    weave::host_stream compute("compute"), comm_stream("comm");
    ex.initialize(ws.ptr, ws.size, compute);
    std::vector<std::promise<void>> issued(C);
    std::vector<std::shared_future<void>> gates;
    for (auto& p : issued)
      gates.push_back(p.get_future().share());
    std::atomic<int> timed_out{0};
    weave::host_matrix<float> y(in[r].x.rows(), s.hidden);
    ex.forward(
        in[r].x.view(), in[r].ids, in[r].weights, y.view(),
        [&](const weave::device_expert_batch<space>& b) {
          issued[static_cast<std::size_t>(b.chunk)].set_value();
          compute.submit([&, b] {
            if (b.chunk + 1 < C && gates[static_cast<std::size_t>(b.chunk + 1)].wait_for(
                                       std::chrono::seconds(2)) != std::future_status::ready)
              ++timed_out;
            experts.operator()<float>(
                {b.chunk, b.device, b.expert_offsets, b.experts, b.input, b.output});
          });
        },
        compute, comm_stream);
    ex.synchronize(compute, comm_stream);
    CHECK(timed_out == 0);
    CHECK(moe_test::bitwise_equal(y, want.y[r]));
  });
}
