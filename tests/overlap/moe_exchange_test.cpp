// The MoE exchange on a local_world against a dense single-process reference, forward and
// backward, for every chunk count (bitwise identical to unchunked), capacities, placements
// (including replicated ones), dtypes, and bad input; each case written once and run in every
// execution space CI has (host streams, and the CUDA path's control flow emulated on them).
#include <doctest/doctest.h>

#include "moe_test_support.hpp"

#include <weave/comm/local_world.hpp>
#include <weave/exec/emulated_gpu_space.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/overlap/moe_exchange.hpp>

#include <cstring>
#include <memory>
#include <random>

namespace {

using exchange = weave::moe_exchange<weave::local_communicator>;
template <class Space>
using exchange_in = weave::basic_moe_exchange<Space, weave::local_communicator>;

template <class T>
struct case_result {
  std::vector<weave::host_matrix<T>> y, dx;
  std::vector<std::vector<float>> dw;
  std::vector<weave::moe_stats> stats;
};

struct case_setup {
  int ranks = 2;
  int experts = 8;
  int k = 2;
  std::size_t hidden = 8;
  std::vector<std::size_t> tokens; // per rank
  weave::capacity_policy capacity{};
  std::uint32_t seed = 1;
};

template <class T>
std::vector<moe_test::rank_input<T>> make_inputs(const case_setup& s) {
  std::mt19937 rng(s.seed);
  std::vector<moe_test::rank_input<T>> in;
  for (int r = 0; r < s.ranks; ++r)
    in.push_back(moe_test::random_input<T>(s.tokens[static_cast<std::size_t>(r)], s.hidden,
                                           s.experts, s.k, rng));
  return in;
}

template <class T, class Space>
case_result<T> run_case(const case_setup& s, const weave::placement& where, int chunks,
                        const std::vector<moe_test::rank_input<T>>& in,
                        const moe_test::linear_experts& experts, bool with_backward) {
  weave::local_world world(s.ranks, {std::chrono::seconds(20), {}});
  case_result<T> out;
  out.y.resize(static_cast<std::size_t>(s.ranks));
  out.dx.resize(static_cast<std::size_t>(s.ranks));
  out.dw.resize(static_cast<std::size_t>(s.ranks));
  out.stats.resize(static_cast<std::size_t>(s.ranks));
  const std::size_t max_tokens = *std::max_element(s.tokens.begin(), s.tokens.end());
  world.run([&](weave::local_communicator& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    weave::moe_options o;
    o.k = s.k;
    o.hidden = s.hidden;
    o.element = weave::dtype_of_v<T>;
    o.max_tokens = max_tokens;
    o.chunks = chunks;
    o.capacity = s.capacity;
    o.save_for_backward = with_backward;
    exchange_in<Space> ex(comm, where, o);
    weave::host_stream compute("compute"), comm_stream("comm");
    out.y[r] = weave::host_matrix<T>(in[r].x.rows(), s.hidden);
    ex.forward(
        in[r].x.view(), in[r].ids, in[r].weights, out.y[r].view(),
        [&](const weave::basic_expert_batch<Space>& b) { moe_test::run_experts<T>(experts, b); },
        compute, comm_stream);
    if (with_backward) {
      out.dx[r] = weave::host_matrix<T>(in[r].x.rows(), s.hidden);
      out.dw[r].assign(in[r].ids.size(), -1.0f);
      // dL/dy = x: an arbitrary, rank-specific upstream gradient.
      ex.backward(
          in[r].x.view(), out.dx[r].view(), out.dw[r],
          [&](const weave::basic_expert_grad_batch<Space>& b) {
            moe_test::run_experts<T>(experts, b);
          },
          compute, comm_stream);
    }
    ex.synchronize(compute, comm_stream);
    out.stats[r] = ex.stats(compute);
  });
  return out;
}

template <class T, class Space>
void check_all_chunkings(const case_setup& s, const weave::placement& where, double tolerance) {
  const auto in = make_inputs<T>(s);
  const moe_test::linear_experts experts(s.experts, s.hidden, s.seed + 100);
  const auto base = run_case<T, Space>(s, where, 1, in, experts, true);
  for (int r = 0; r < s.ranks; ++r) {
    const auto i = static_cast<std::size_t>(r);
    moe_test::check_rank_against_dense(r, where, s.k, s.experts, s.capacity, in[i], experts,
                                       base.y[i], &base.dx[i], &base.dw[i], base.stats[i],
                                       tolerance);
  }
  for (int chunks : {2, 3, 5}) {
    CAPTURE(chunks);
    const auto got = run_case<T, Space>(s, where, chunks, in, experts, true);
    for (int r = 0; r < s.ranks; ++r) {
      const auto i = static_cast<std::size_t>(r);
      REQUIRE(moe_test::bitwise_equal(got.y[i], base.y[i]));
      REQUIRE(moe_test::bitwise_equal(got.dx[i], base.dx[i]));
      REQUIRE(got.dw[i] == base.dw[i]); // bitwise: no NaNs are produced
      CHECK(got.stats[i].dropped_pairs == base.stats[i].dropped_pairs);
    }
  }
}

} // namespace

TEST_CASE_TEMPLATE("moe_exchange equals the dense reference and is bitwise identical for every "
                   "chunking",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  SUBCASE("2 ranks, 8 experts, k = 2, dropless, f32") {
    case_setup s{2, 8, 2, 8, {37, 20}, {}, 1};
    check_all_chunkings<float, Space>(s, weave::placement::contiguous(8, 2), 1e-4);
  }
  SUBCASE("4 ranks, 16 experts, k = 4, uneven tokens (one rank empty), f32") {
    case_setup s{4, 16, 4, 6, {50, 0, 13, 31}, {}, 2};
    check_all_chunkings<float, Space>(s, weave::placement::contiguous(16, 4), 1e-4);
  }
  SUBCASE("4 ranks, scattered placement with replicas, k = 3, bf16") {
    // 4 devices x 3 slots for 10 experts: experts 0 and 5 replicated.
    const weave::placement where(10, 4, {0, 7, 2, 5, 1, 9, 3, 0, 8, 6, 4, 5});
    case_setup s{4, 10, 3, 8, {25, 25, 40, 9}, {}, 3};
    check_all_chunkings<weave::bfloat16, Space>(s, where, 3e-2);
  }
  SUBCASE("3 ranks, empty slots (devices of 2, 3 and 3 experts) and a replica, k = 2, f32") {
    const weave::placement where(7, 3, {0, 4, -1, 1, 5, 2, 3, 6, 0});
    case_setup s{3, 7, 2, 8, {31, 18, 26}, {}, 4};
    check_all_chunkings<float, Space>(s, where, 1e-4);
  }
  SUBCASE("2 ranks, one device with two empty slots, k = 2, f32") {
    const weave::placement where(4, 2, {0, 1, 2, 3, -1, -1});
    case_setup s{2, 4, 2, 8, {23, 30}, {}, 6};
    check_all_chunkings<float, Space>(s, where, 1e-4);
  }
}

TEST_CASE_TEMPLATE("capacity drops equal the naive count for every order and chunking", Space,
                   weave::host_space, weave::emulated_gpu_space) {
  for (auto order :
       {weave::drop_order::position, weave::drop_order::rank_major,
        weave::drop_order::batch_prioritized, weave::drop_order::priority_token_major}) {
    for (double factor : {0.5, 1.0, -0.75}) {
      for (auto rounding : {weave::capacity_rounding::ceil, weave::capacity_rounding::tutel}) {
        CAPTURE(static_cast<int>(order));
        CAPTURE(factor);
        CAPTURE(static_cast<int>(rounding));
        case_setup s{2, 8, 2, 4, {40, 33}, {factor, order, rounding}, 7};
        check_all_chunkings<float, Space>(s, weave::placement::contiguous(8, 2), 1e-4);
      }
    }
  }
}

TEST_CASE("moe_exchange reports bad input as typed errors") {
  weave::local_world world(2, {std::chrono::seconds(10), {}});
  world.run([&](weave::local_communicator& comm) {
    weave::moe_options o;
    o.k = 2;
    o.hidden = 4;
    o.max_tokens = 8;
    const auto where = weave::placement::contiguous(4, 2);
    CHECK_THROWS_AS(exchange(comm, weave::placement::contiguous(4, 4), o), weave::error);
    weave::moe_options big_k = o;
    big_k.k = 5;
    CHECK_THROWS_AS(exchange(comm, where, big_k), weave::error);
    weave::moe_options bad_dtype = o;
    bad_dtype.element = weave::dtype::i32;
    CHECK_THROWS_AS(exchange(comm, where, bad_dtype), weave::error);
    exchange ex(comm, where, o);
    weave::host_stream compute, comm_stream;
    weave::host_matrix<float> x(9, 4), y(9, 4);
    std::vector<std::int32_t> ids(18, 0);
    std::vector<float> w(18, 1.0f);
    auto noop = [](const weave::expert_batch&) {};
    try {
      ex.forward(x.view(), ids, w, y.view(), noop, compute, comm_stream);
      FAIL("9 tokens > max_tokens accepted");
    } catch (const weave::error& e) {
      CHECK(e.code() == weave::errc::invalid_argument);
    }
    weave::host_matrix<float> wide(4, 5);
    CHECK_THROWS_AS(ex.forward(wide.view(), std::span(ids).first(8), std::span(w).first(8),
                               wide.view(), noop, compute, comm_stream),
                    weave::error);
    weave::host_matrix<float> dy(4, 4), dx(4, 4);
    std::vector<float> dw(8);
    CHECK_THROWS_AS(ex.backward(dy.view(), dx.view(), dw, {}, compute, comm_stream),
                    weave::error); // save_for_backward is off
  });
}

TEST_CASE("an out-of-range expert id on one rank fails every rank instead of hanging") {
  weave::local_world world(2, {std::chrono::seconds(20), {}});
  const auto failures = world.run_collect([&](weave::local_communicator& comm) {
    weave::moe_options o;
    o.k = 1;
    o.hidden = 4;
    o.max_tokens = 4;
    exchange ex(comm, weave::placement::contiguous(4, 2), o);
    weave::host_stream compute, comm_stream;
    weave::host_matrix<float> x(4, 4), y(4, 4);
    std::vector<std::int32_t> ids = {0, 1, 2, comm.rank() == 1 ? 4 : 3};
    std::vector<float> w(4, 1.0f);
    ex.forward(
        x.view(), ids, w, y.view(), [](const weave::expert_batch&) {}, compute, comm_stream);
    std::exception_ptr first;
    for (weave::host_stream* s : {&compute, &comm_stream}) {
      try {
        s->synchronize();
      } catch (...) {
        first = first ? first : std::current_exception();
      }
    }
    if (first)
      std::rethrow_exception(first);
  });
  REQUIRE(failures[1]);
  try {
    std::rethrow_exception(failures[1]);
  } catch (const weave::error& e) {
    CHECK(e.code() == weave::errc::out_of_range);
    CHECK(e.message().find("expert id 4") != std::string::npos);
  }
  REQUIRE(failures[0]); // the healthy rank learns of it
  try {
    std::rethrow_exception(failures[0]);
  } catch (const weave::error& e) {
    CHECK((e.code() == weave::errc::peer_failure || e.code() == weave::errc::timeout));
  }
}
