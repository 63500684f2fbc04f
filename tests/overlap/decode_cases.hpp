// The decode exchange's test cases, written once for any communicator (the local_world test
// runs them on threads, the MPI test on processes). Each function is one rank's side and
// checks with doctest; every rank builds the same global problem from the seed.
#pragma once

#include "decode_test_support.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <future>
#include <limits>
#include <random>
#include <thread>

namespace decode_test {

constexpr int experts = 8, k = 3;
constexpr std::size_t hidden = 16, max_tokens = 8;

inline weave::decode_options options() {
  weave::decode_options o;
  o.k = k;
  o.hidden = hidden;
  o.max_tokens_per_rank = max_tokens;
  return o;
}

// Tokens of `rank` in call `call`: zero, full slots (exactly max_tokens) and sizes between.
inline std::size_t tokens_of(int rank, int call) {
  constexpr std::size_t table[] = {0, max_tokens, 3, 1, max_tokens, 0, 5, 2};
  return table[static_cast<std::size_t>(rank + 3 * call) % 8];
}

// Several calls on one exchange, each equal bitwise to the naive reference (with
// `partial_sums`, its per-device form), with per-slot counts equal to the pairs each source
// routed to the slot's expert (unreplicated placement).
template <class T, class Comm>
void check_against_reference(Comm& comm, const weave::placement& where, bool partial_sums = false,
                             bool gathered_inputs = false) {
  const int num_experts = where.num_experts(); // the routing's, the placement's count
  const int rank = comm.rank(), D = comm.size();
  const moe_test::linear_experts f(num_experts, hidden, 11);
  weave::decode_options o = options();
  o.partial_sums = partial_sums;
  o.gathered_inputs = gathered_inputs;
  weave::decode_exchange<Comm, T> ex(comm, where, o);
  typename Comm::stream_type s("decode");
  for (int call = 0; call < 4; ++call) {
    std::vector<moe_test::rank_input<T>> inputs;
    for (int r = 0; r < D; ++r) {
      std::mt19937 rng(static_cast<std::uint32_t>(100 * call + r));
      inputs.push_back(moe_test::random_input<T>(tokens_of(r, call), hidden, num_experts, k, rng));
    }
    std::vector<std::int64_t> rows;
    const auto y = decode_call(ex, inputs[static_cast<std::size_t>(rank)], f, s, &rows);
    const auto& in = inputs[static_cast<std::size_t>(rank)];
    CHECK(bitwise_equal(y, expected(in, o, f, where, rank)));
    std::int64_t total = 0, expected_total = 0;
    for (int l = 0; l < where.slots_per_device(); ++l) {
      const int e = where.expert_of_slot(rank * where.slots_per_device() + l);
      for (int src = 0; src < D; ++src) {
        const std::int64_t got = rows[static_cast<std::size_t>(l * D + src)];
        total += got;
        if (!where.replicated())
          CHECK(got == pairs_for(inputs[static_cast<std::size_t>(src)].ids, e));
      }
    }
    for (int src = 0; src < D; ++src)
      for (int l = 0; l < where.slots_per_device(); ++l)
        expected_total +=
            where.replicated()
                ? 0
                : pairs_for(inputs[static_cast<std::size_t>(src)].ids,
                            where.expert_of_slot(rank * where.slots_per_device() + l));
    if (!where.replicated())
      CHECK(total == expected_total);
  }
}

// Three calls enqueued back to back on one stream, the experts as tasks reading the view, and
// one synchronize at the end: each output equals its reference (a call's queued work never
// sees the next call's state).
template <class Comm>
void check_queued_calls(Comm& comm) {
  const moe_test::linear_experts f(experts, hidden, 9);
  const auto where = weave::placement::contiguous(experts, comm.size());
  weave::decode_exchange<Comm, float> ex(comm, where, options());
  typename Comm::stream_type s("decode");
  std::vector<moe_test::rank_input<float>> inputs;
  std::vector<std::vector<float>> ys;
  for (int call = 0; call < 3; ++call) {
    std::mt19937 rng(static_cast<std::uint32_t>(10 * comm.rank() + call));
    inputs.push_back(
        moe_test::random_input<float>(tokens_of(comm.rank(), call), hidden, experts, k, rng));
    ys.emplace_back(inputs.back().x.rows() * hidden);
  }
  for (int call = 0; call < 3; ++call) {
    const auto& in = inputs[static_cast<std::size_t>(call)];
    auto h = ex.dispatch(in.x.elements(), in.ids, in.weights, s);
    s.submit([&f, xs = h.experts()] {
      for (int l = 0; l < xs.local_experts(); ++l)
        for (std::int64_t r = 0; r < xs.rows(l); ++r)
          f.apply(xs.expert(l), xs.input(l).data() + r * static_cast<std::int64_t>(hidden),
                  xs.output(l).data() + r * static_cast<std::int64_t>(hidden));
    });
    ex.combine(h, std::span<float>(ys[static_cast<std::size_t>(call)]), s);
  }
  s.synchronize();
  for (int call = 0; call < 3; ++call)
    CHECK(bitwise_equal(
        ys[static_cast<std::size_t>(call)],
        expected(inputs[static_cast<std::size_t>(call)], options(), f, where, comm.rank())));
}

// A layer destroyed while its last call is still queued (behind a gated task) waits for that
// call: the combine's output is complete when the destructor returns. A call that ran on the
// calling thread first leaves nothing queued, so the layer records no event for it; the queued
// call's must still be recorded.
template <class Comm>
void check_destroyed_while_queued(Comm& comm) {
  const moe_test::linear_experts f(experts, hidden, 3);
  const auto where = weave::placement::contiguous(experts, comm.size());
  typename Comm::stream_type s("decode"); // outlives the layer
  std::vector<moe_test::rank_input<float>> inputs;
  for (int call = 0; call < 2; ++call) {
    std::mt19937 rng(static_cast<std::uint32_t>(20 * comm.rank() + call));
    inputs.push_back(
        moe_test::random_input<float>(tokens_of(comm.rank(), call), hidden, experts, k, rng));
  }
  std::vector<float> queued_y(inputs[1].x.rows() * hidden, -7.0f);
  std::promise<void> gate;
  std::thread opener;
  {
    weave::decode_exchange<Comm, float> ex(comm, where, options());
    CHECK(bitwise_equal(decode_call(ex, inputs[0], f, s),
                        expected(inputs[0], options(), f, where, comm.rank())));
    s.submit([opened = gate.get_future().share()] { opened.wait(); });
    auto h = ex.dispatch(inputs[1].x.elements(), inputs[1].ids, inputs[1].weights, s);
    s.submit([&f, xs = h.experts()] {
      for (int l = 0; l < xs.local_experts(); ++l)
        for (std::int64_t r = 0; r < xs.rows(l); ++r)
          f.apply(xs.expert(l), xs.input(l).data() + r * static_cast<std::int64_t>(hidden),
                  xs.output(l).data() + r * static_cast<std::int64_t>(hidden));
    });
    ex.combine(h, std::span<float>(queued_y), s);
    CHECK_FALSE(s.query()); // still queued behind the gate
    opener = std::thread([&gate] {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      gate.set_value();
    });
  } // waits for the queued call
  CHECK(bitwise_equal(queued_y, expected(inputs[1], options(), f, where, comm.rank())));
  opener.join();
  s.synchronize();
}

// Layers called inside the caller's own claim of the stream (`claim_if_idle`, held across a
// whole layer) join it: every step, the all-to-alls (small, on a communicator that runs them
// inline) and the experts run on the calling thread, so the output is complete before the
// claim ends. A step sent to the worker would not run until then (the worker starts nothing
// while the stream is held).
template <class Comm>
void check_inside_a_claim(Comm& comm) {
  const moe_test::linear_experts f(experts, hidden, 9);
  const auto where = weave::placement::contiguous(experts, comm.size());
  weave::decode_exchange<Comm, float> ex(comm, where, options());
  typename Comm::stream_type s("decode");
  for (int call = 0; call < 3; ++call) {
    std::mt19937 rng(static_cast<std::uint32_t>(40 * comm.rank() + call));
    const auto in =
        moe_test::random_input<float>(tokens_of(comm.rank(), call), hidden, experts, k, rng);
    std::vector<float> y(in.x.rows() * hidden, -7.0f);
    {
      const auto claim = s.claim_if_idle();
      REQUIRE(static_cast<bool>(claim));
      auto h = ex.dispatch(in.x.elements(), in.ids, in.weights, s);
      weave::run_inline_or_submit(s, [&f, xs = h.experts()] {
        for (int l = 0; l < xs.local_experts(); ++l)
          for (std::int64_t r = 0; r < xs.rows(l); ++r)
            f.apply(xs.expert(l), xs.input(l).data() + r * static_cast<std::int64_t>(hidden),
                    xs.output(l).data() + r * static_cast<std::int64_t>(hidden));
      });
      ex.combine(h, std::span<float>(y), s);
      CHECK(claim.all_ran_here());
      CHECK(bitwise_equal(y, expected(in, options(), f, where, comm.rank()))); // done here
    }
    s.synchronize();
  }
}

// How `bad` corrupts one rank's call.
enum class fault { none, too_many_tokens, bad_id, nan_weight, duplicate_expert, wrong_output };

// Rank `rank`'s input of a fail-stop case (4 tokens), with the fault `bad` put in it.
inline moe_test::rank_input<float> input_of(int rank, fault bad) {
  std::mt19937 rng(static_cast<std::uint32_t>(rank + 7));
  auto in = moe_test::random_input<float>(bad == fault::too_many_tokens ? max_tokens + 1 : 4,
                                          hidden, experts, k, rng);
  if (bad == fault::bad_id)
    in.ids[5] = experts;
  if (bad == fault::nan_weight) {
    in.ids[4] = 2;
    in.weights[4] = std::numeric_limits<float>::quiet_NaN();
  }
  if (bad == fault::duplicate_expert) {
    in.ids[3] = 1;
    in.ids[4] = 1;
  }
  return in;
}

// Rank `culprit` makes `bad` in its call; it must fail with `own`, every other rank with
// peer_failure naming it; then a good call succeeds on every rank (nobody hangs, nothing is
// left half done).
template <class Comm>
void check_fail_stop(Comm& comm, int culprit, fault bad, weave::errc own, const char* cause) {
  using T = float;
  const int rank = comm.rank();
  const moe_test::linear_experts f(experts, hidden, 5);
  const auto where = weave::placement::contiguous(experts, comm.size());
  weave::decode_exchange<Comm, T> ex(comm, where, options());
  typename Comm::stream_type s("decode");
  const bool me = rank == culprit;
  const auto in = input_of(rank, me ? bad : fault::none);
  const outcome got = outcome_of([&] {
    const std::size_t H = hidden;
    std::vector<T> y(in.x.rows() * H + (me && bad == fault::wrong_output ? H : 0));
    auto h = ex.dispatch(in.x.elements(), in.ids, in.weights, s);
    s.synchronize();
    const auto xs = h.experts();
    for (int l = 0; l < xs.local_experts(); ++l)
      for (std::int64_t r = 0; r < xs.rows(l); ++r)
        f.apply(xs.expert(l), xs.input(l).data() + r * static_cast<std::int64_t>(H),
                xs.output(l).data() + r * static_cast<std::int64_t>(H));
    ex.combine(h, std::span<T>(y), s);
    s.synchronize();
  });
  INFO("rank ", rank, ": ", got.message);
  if (me) {
    CHECK(got.code == own);
  } else {
    CHECK(got.code == weave::errc::peer_failure);
    CHECK(got.message.find("rank " + std::to_string(culprit)) != std::string::npos);
  }
  CHECK(got.message.find(cause) != std::string::npos);
  // The exchange and the communicator still work.
  std::mt19937 again(static_cast<std::uint32_t>(rank + 70));
  const auto good = moe_test::random_input<T>(3, hidden, experts, k, again);
  CHECK(bitwise_equal(decode_call(ex, good, f, s), expected(good, options(), f, where, rank)));
}

template <class Comm>
void check_every_fault(Comm& comm) {
  const int culprit = comm.size() - 1;
  using weave::errc;
  check_fail_stop(comm, culprit, fault::too_many_tokens, errc::invalid_argument,
                  "exceeds max_tokens_per_rank");
  check_fail_stop(comm, culprit, fault::bad_id, errc::out_of_range, "expert id 8");
  check_fail_stop(comm, culprit, fault::nan_weight, errc::invalid_argument, "weight nan");
  check_fail_stop(comm, culprit, fault::duplicate_expert, errc::invalid_argument, "twice");
  check_fail_stop(comm, 0, fault::wrong_output, errc::size_mismatch, "an output of");
}

} // namespace decode_test
