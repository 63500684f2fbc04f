// The MoE exchange (`basic_moe_exchange`) on a local_world, each case written once and run in
// `host_space` and in `emulated_gpu_space` (the control flow of `cuda_space`: host code at
// enqueue time, blocking host reads, CUDA's copy and capture rules), for dynamic and static
// shapes: equal to a dense reference for every chunking, capacity, dtype and placement, forward
// and backward, with statistics equal to a naive count (and bitwise equal to the unchunked
// dynamic-shape call in host_space, whatever the space, shape or chunking); its flagged errors
// and slot overflows; bad arguments; static shapes captured.
#include <doctest/doctest.h>

#include "aligned_buffer.hpp"
#include "moe_test_support.hpp"

#include <weave/comm/local_world.hpp>
#include <weave/exec/emulated_gpu_space.hpp>
#include <weave/exec/host_space.hpp>
#include <weave/exec/host_stream.hpp>
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
using exchange = weave::basic_moe_exchange<Space, weave::local_communicator>;

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

// A forward and its backward (dL/dy = x) on every rank, in `Space`.
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
    const weave::moe_options o = options_of(s, weave::dtype_of_v<T>, chunks);
    weave::host_stream compute("compute"), comm_stream("comm");
    out.y[r] = weave::host_matrix<T>(in[r].x.rows(), s.hidden);
    out.dx[r] = weave::host_matrix<T>(in[r].x.rows(), s.hidden);
    out.dw[r].assign(in[r].ids.size(), -1.0f);
    exchange<Space> ex(comm, where, o);
    // A workspace poisoned with 0xFF bytes: nothing may read what it did not write.
    aligned_buffer ws(ex.workspace_size());
    ex.initialize(ws.ptr, ws.size, compute);
    ex.forward(
        in[r].x.view(), in[r].ids, in[r].weights, out.y[r].view(),
        [&](const weave::basic_expert_batch<Space>& b) { moe_test::run_experts<T>(experts, b); },
        compute, comm_stream);
    ex.backward(
        in[r].x.view(), out.dx[r].view(), out.dw[r], // dL/dy = x
        [&](const weave::basic_expert_grad_batch<Space>& b) {
          moe_test::run_experts<T>(experts, b);
        },
        compute, comm_stream);
    ex.synchronize(compute, comm_stream);
    out.stats[r] = ex.stats(compute);
    ex.check_errors(compute);
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

// What each rank's statistics must say beyond what `check_rank_against_dense` counts, from every
// rank's choices: rows received (one per peer token with a kept pair here), rows that stay local,
// expert rows (one per kept pair served here).
struct wire_counts {
  std::vector<std::int64_t> received, local, expert_rows;
};

template <class T>
wire_counts count_rows(const setup& s, const weave::placement& where,
                       const std::vector<moe_test::rank_input<T>>& in) {
  const auto n = static_cast<std::size_t>(s.ranks);
  const auto k = static_cast<std::size_t>(s.k);
  wire_counts w{std::vector<std::int64_t>(n, 0), std::vector<std::int64_t>(n, 0),
                std::vector<std::int64_t>(n, 0)};
  for (int src = 0; src < s.ranks; ++src) {
    const auto& r = in[static_cast<std::size_t>(src)];
    const auto keep = moe_test::naive_keep(r.ids, r.weights, s.k, s.experts, s.capacity);
    for (std::size_t t = 0; t < r.x.rows(); ++t) {
      std::vector<bool> to(n, false);
      for (std::size_t j = 0; j < k; ++j) {
        const std::int32_t e = r.ids[t * k + j];
        if (e < 0 || !keep[t * k + j])
          continue;
        const auto d = static_cast<std::size_t>(where.device_of_slot(where.slot_for(e, t, src)));
        to[d] = true;
        ++w.expert_rows[d];
      }
      for (std::size_t d = 0; d < n; ++d)
        if (to[d]) {
          ++w.received[d];
          w.local[d] += d == static_cast<std::size_t>(src) ? 1 : 0;
        }
    }
  }
  return w;
}

// Every rank's outputs and statistics against the dense reference and the naive counts.
template <class T>
void check_dense(const setup& s, const weave::placement& where,
                 const std::vector<moe_test::rank_input<T>>& in,
                 const moe_test::linear_experts& experts, const result<T>& got, double tolerance) {
  const wire_counts want = count_rows(s, where, in);
  for (std::size_t r = 0; r < static_cast<std::size_t>(s.ranks); ++r) {
    CAPTURE(r);
    moe_test::check_rank_against_dense(static_cast<int>(r), where, s.k, s.experts, s.capacity,
                                       in[r], experts, got.y[r], &got.dx[r], &got.dw[r],
                                       got.stats[r], tolerance);
    const weave::moe_stats& a = got.stats[r];
    CHECK(a.received_rows == want.received[r]);
    CHECK(a.local_rows == want.local[r]);
    CHECK(a.expert_rows == want.expert_rows[r]);
    CHECK(a.row_bytes == s.hidden * sizeof(T));
  }
}

// The exchange in `Space` (with the setup's shapes) equals the dense reference for every
// chunking; and it is bitwise equal, with equal statistics, to the unchunked dynamic-shape call
// in host_space (results do not depend on the space, the shapes or the chunking).
template <class T, class Space>
void check_against_dense(const setup& s, const weave::placement& where) {
  const double tolerance = sizeof(T) == 4 ? 1e-4 : 3e-2;
  const auto in = inputs<T>(s);
  const moe_test::linear_experts experts(s.experts, s.hidden, s.seed + 100);
  setup dynamic = s;
  dynamic.fixed = false;
  dynamic.slot_rows = 0;
  const auto want = run<T, weave::host_space>(dynamic, where, 1, in, experts);
  check_dense(dynamic, where, in, experts, want, tolerance);
  for (const int chunks : {1, 2, 3}) {
    CAPTURE(chunks);
    const auto got = run<T, Space>(s, where, chunks, in, experts);
    check_dense(s, where, in, experts, got, tolerance);
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

TEST_CASE_TEMPLATE("the exchange equals the dense reference: dynamic and static shapes", Space,
                   weave::host_space, weave::emulated_gpu_space) {
  for (const bool fixed : {false, true}) {
    CAPTURE(fixed);
    setup s;
    s.fixed = fixed;
    s.tokens = {37, 29};
    check_against_dense<float, Space>(s, weave::placement::contiguous(8, 2));
    s.ranks = 4;
    s.experts = 16;
    s.k = 4;
    s.hidden = 12;
    s.tokens = {40, 0, 17, 33};
    s.seed = 5;
    std::vector<std::int32_t> slots(16);
    for (int i = 0; i < 16; ++i)
      slots[static_cast<std::size_t>(i)] = (i * 7) % 16;
    check_against_dense<float, Space>(s, weave::placement(16, 4, slots));
    s.ranks = 3;
    s.experts = 6;
    s.k = 3;
    s.tokens = {25, 25, 24};
    s.seed = 9;
    check_against_dense<weave::bfloat16, Space>(s, weave::placement::contiguous(6, 3));
    // Replicas: experts 0 and 3 twice, 5 three times; chosen per token by `placement::slot_for`.
    check_against_dense<float, Space>(s, weave::placement(6, 3, {0, 1, 5, 2, 3, 0, 4, 5, 3}));
    // Empty slots: device 0 holds two experts, device 2 one; expert 1 twice.
    check_against_dense<float, Space>(s, weave::placement(6, 3, {0, 1, -1, 2, 3, 4, 5, -1, -1}));
    s.ranks = 2;
    s.experts = 5;
    s.k = 2;
    s.tokens = {21, 34};
    s.seed = 13;
    check_against_dense<float, Space>(s, weave::placement(5, 2, {0, 1, 2, 3, 4, -1, -1, 1}));
    s.ranks = 1;
    s.experts = 4;
    s.k = 2;
    s.tokens = {19};
    check_against_dense<weave::half, Space>(s, weave::placement::contiguous(4, 1));
  }
}

TEST_CASE_TEMPLATE("the exchange decides capacity like the naive count, for every order and shape",
                   Space, weave::host_space, weave::emulated_gpu_space) {
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
        check_against_dense<float, Space>(s, weave::placement::contiguous(6, 3));
      }
}

TEST_CASE_TEMPLATE("the exchange flags bad ids, bad weights and overflowing static slots", Space,
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
      const moe_test::linear_experts experts(4, 8, 1);
      exchange<Space> ex(comm, where, options_of(s, weave::dtype::f32, 2));
      weave::host_stream compute("compute"), comm_stream("comm");
      try {
        ex.forward(
            in.x.view(), in.ids, in.weights, y.view(),
            [&](const weave::basic_expert_batch<Space>& b) {
              moe_test::run_experts<float>(experts, b);
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

TEST_CASE_TEMPLATE("the exchange rejects bad arguments; static shapes are valid", Space,
                   weave::host_space, weave::emulated_gpu_space) {
  weave::local_world world(2);
  world.run([&](weave::local_communicator& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    weave::moe_options o;
    o.k = 2;
    o.hidden = 4;
    o.max_tokens = 8;
    const auto where = weave::placement::contiguous(4, 2);
    CHECK(moe_test::error_code_of([&] {
            exchange<Space>(comm, weave::placement::contiguous(4, 4), o);
          }) == weave::errc::invalid_argument);
    // Static shapes work in every space (the former host-only layer refused them): a forward and
    // its backward against the dense reference.
    {
      weave::moe_options fixed = o;
      fixed.static_shape = true;
      fixed.save_for_backward = true;
      exchange<Space> ex(comm, where, fixed);
      CHECK(ex.static_shape());
      CHECK(ex.slot_rows() > 0);
      std::mt19937 rng(21 + static_cast<unsigned>(r));
      const auto in = moe_test::random_input<float>(8, 4, 4, 2, rng);
      const moe_test::linear_experts experts(4, 4, 5);
      weave::host_matrix<float> y(8, 4), dx(8, 4);
      std::vector<float> dw(16, -1.0f);
      weave::host_stream a("a"), b("b");
      ex.forward(
          in.x.view(), in.ids, in.weights, y.view(),
          [&](const weave::basic_expert_batch<Space>& batch) {
            moe_test::run_experts<float>(experts, batch);
          },
          a, b);
      ex.backward(
          in.x.view(), dx.view(), dw,
          [&](const weave::basic_expert_grad_batch<Space>& batch) {
            moe_test::run_experts<float>(experts, batch);
          },
          a, b);
      ex.synchronize(a, b);
      moe_test::check_rank_against_dense(comm.rank(), where, 2, 4, {}, in, experts, y, &dx, &dw,
                                         ex.stats(a), 1e-4);
    }
    exchange<Space> ex(comm, where, o);
    aligned_buffer ws(ex.workspace_size()); // outlives the streams: rejected calls still take
                                            // their turn on them, which uses the workspace
    weave::host_matrix<float> x(8, 4), y(8, 4), wide(8, 5), many(9, 4);
    std::vector<std::int32_t> ids(16, 0), good_ids(16);
    for (std::size_t i = 0; i < good_ids.size(); ++i)
      good_ids[i] = static_cast<std::int32_t>(i % 4); // distinct choices per token
    std::vector<float> w(16, 1.0f);
    weave::host_stream a("a"), b("b");
    const auto noop = [](const weave::basic_expert_batch<Space>&) {};
    CHECK(moe_test::error_code_of([&] { ex.initialize(ws.ptr, ws.size / 2, a); }) ==
          weave::errc::size_mismatch);
    // Without `initialize` the first call takes its workspace from the layer's allocator.
    CHECK(moe_test::error_code_of([&] {
            ex.forward(x.view(), good_ids, w, y.view(), noop, a, b);
            ex.synchronize(a, b);
          }) == weave::errc{});
    CHECK(ex.memory().workspace == ex.workspace_size());
    ex.initialize(ws.ptr, ws.size, a); // the caller's workspace replaces it
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
                x.view(), y.view(), dw, [](const weave::basic_expert_grad_batch<Space>&) {}, a, b);
          }) == weave::errc::invalid_state); // no save_for_backward
  });
}

// A static-shape call issues nothing a CUDA graph capture refuses (host_capture.hpp): no wait for
// an event recorded outside the capture, no query of a captured event, no host wait or pageable
// copy (emulated_gpu_space), and the comm stream is joined back. Captured forwards and backwards
// (host streams run them as they are captured) and the eager calls around them equal the dense
// reference (and bitwise the dynamic-shape call in host_space); a dynamic-shape call is refused
// before it issues anything.
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
      const auto where = weave::placement::contiguous(4, 2);
      const auto in = inputs<float>(s);
      const moe_test::linear_experts experts(s.experts, s.hidden, 7);
      const auto want = run<float, weave::host_space>(s, where, 1, in, experts);
      check_dense(s, where, in, experts, want, 1e-4);
      s.fixed = true;
      weave::local_world world(2, {std::chrono::seconds(20), {}});
      world.run([&](weave::local_communicator& comm) {
        const auto r = static_cast<std::size_t>(comm.rank());
        weave::moe_options o = options_of(s, weave::dtype::f32, chunks);
        o.max_in_flight = in_flight;
        exchange<Space> ex(comm, where, o);
        aligned_buffer ws(ex.workspace_size());
        weave::host_stream compute("compute"), comm_stream("comm");
        ex.initialize(ws.ptr, ws.size, compute);
        const auto forward_experts = [&](const weave::basic_expert_batch<Space>& b) {
          moe_test::run_experts<float>(experts, b);
        };
        const auto backward_experts = [&](const weave::basic_expert_grad_batch<Space>& b) {
          moe_test::run_experts<float>(experts, b);
        };
        // eager, captured, eager: each call's outputs checked against the dense reference
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
          moe_test::check_rank_against_dense(comm.rank(), where, s.k, s.experts, s.capacity, in[r],
                                             experts, y, &dx, &dw, ex.stats(compute), 1e-4);
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
          // Handles: the caller enqueues its experts, which read the chunk in a task of the
          // compute stream (where host_space's views hold the chunk's rows once it is open).
          for (auto* h : {&a, &b})
            for (auto chunk : ex.chunks(*h))
              compute.submit([&experts, chunk] { experts.operator()<float>(chunk.experts()); });
          ex.combine(a, y1.view(), compute, comm_stream);
          ex.combine(b, y2.view(), compute, comm_stream);
          compute.end_capture();
          ex.synchronize(compute, comm_stream);
          for (auto* h : {&a, &b})
            moe_test::check_rank_against_dense<float>(
                comm.rank(), where, s.k, s.experts, s.capacity, in[r], experts, h == &a ? y1 : y2,
                nullptr, nullptr, ex.stats(*h, compute), 1e-4);
          CHECK(moe_test::bitwise_equal(y1, want.y[r]));
          CHECK(moe_test::bitwise_equal(y2, want.y[r]));
        }
      });
    }
  // Dynamic shapes wait for counts on the host where host code runs at enqueue time (and a
  // capture must not depend on the space): refused in a capture, before anything is issued.
  setup s;
  s.tokens = {6, 6};
  const auto where = weave::placement::contiguous(8, 2);
  weave::local_world world(2, {std::chrono::seconds(20), {}});
  world.run([&](weave::local_communicator& comm) {
    exchange<Space> ex(comm, where, options_of(s, weave::dtype::f32, 2));
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

// With dynamic shapes where host code runs at enqueue time (cuda_space; emulated_gpu_space here)
// the host reads each chunk's counts, but not before the next chunk's experts are issued: chunk
// c's expert work (a task here) cannot finish until chunk c + 1's experts have been issued, which
// the issue order allows only if the host does not wait for chunk c's combine (which waits for
// chunk c's experts) before issuing chunk c + 1's. A host that waits there would find the gate
// closed until it times out. (In host_space the callbacks run in the compute stream's tasks and
// no host code waits for counts, so there is no such wait to check.)
TEST_CASE("dynamic shapes on the CUDA path issue chunk c + 1's experts before chunk c's finish") {
  using space = weave::emulated_gpu_space;
  setup s;
  s.ranks = 2;
  s.tokens = {24, 24};
  const int C = 4;
  const auto where = weave::placement::contiguous(8, 2);
  const auto in = inputs<float>(s);
  const moe_test::linear_experts experts(s.experts, s.hidden, 3);
  const auto want = run<float, weave::host_space>(s, where, 1, in, experts);
  weave::local_world world(2, {std::chrono::seconds(20), {}});
  world.run([&](weave::local_communicator& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    weave::moe_options o = options_of(s, weave::dtype::f32, C);
    o.save_for_backward = false;
    exchange<space> ex(comm, where, o);
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
        [&](const weave::basic_expert_batch<space>& b) {
          issued[static_cast<std::size_t>(b.chunk)].set_value();
          compute.submit([&, b] {
            if (b.chunk + 1 < C && gates[static_cast<std::size_t>(b.chunk + 1)].wait_for(
                                       std::chrono::seconds(2)) != std::future_status::ready)
              ++timed_out;
            experts.operator()<float>(b);
          });
        },
        compute, comm_stream);
    ex.synchronize(compute, comm_stream);
    CHECK(timed_out == 0);
    moe_test::check_rank_against_dense<float>(comm.rank(), where, s.k, s.experts, s.capacity, in[r],
                                              experts, y, nullptr, nullptr, ex.stats(compute),
                                              1e-4);
    CHECK(moe_test::bitwise_equal(y, want.y[r]));
  });
}
