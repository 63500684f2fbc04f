// weave's capacities (`expert_capacity`) against hand-derived values, and the host reference
// capacity filter (tests/support/host_plans.hpp, the oracle the library's
// `device_capacity_filter` is checked against) against a Tutel-style mask + cumsum reference,
// hand-derived keep masks for Tutel's semantics, and Lancet's rule: chunk plans built with the
// capacity used by earlier chunks drop exactly what the whole batch drops, in every order.
#include <doctest/doctest.h>

#include "host_plans.hpp"
#include "routing_reference.hpp"

#include <weave/core/host_matrix.hpp>
#include <weave/routing/capacity.hpp>
#include <weave/routing/gate.hpp>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace {

struct random_batch {
  std::vector<std::int32_t> ids;
  std::vector<float> weights, priority;
};

// Distinct experts per token (a few -1 "no expert" entries), skewed towards low ids so experts
// overflow; priorities with ties so stability matters.
random_batch make_batch(std::size_t T, int E, int k, std::mt19937& rng) {
  random_batch b;
  std::geometric_distribution<int> skew(0.15);
  for (std::size_t t = 0; t < T; ++t) {
    std::vector<int> chosen;
    while (static_cast<int>(chosen.size()) < k) {
      const int e = skew(rng) % E;
      if (std::find(chosen.begin(), chosen.end(), e) == chosen.end())
        chosen.push_back(e);
    }
    for (int e : chosen) {
      b.ids.push_back(rng() % 17 == 0 ? -1 : e);
      b.weights.push_back(static_cast<float>(rng() % 8) / 8.0f);
    }
    b.priority.push_back(static_cast<float>(rng() % 5));
  }
  return b;
}

const double factors[] = {0.25, 0.5, 1.0, 1.25, 2.0, 0.0, -0.5, -1.0};
constexpr int orders = 4;
const weave::capacity_rounding roundings[] = {weave::capacity_rounding::ceil,
                                              weave::capacity_rounding::tutel};

std::vector<std::uint8_t> decide(int E, int k, const std::vector<std::int32_t>& ids,
                                 const std::vector<float>& priority, weave::capacity_policy policy,
                                 std::int64_t* dropped = nullptr) {
  oracle::capacity_filter filter(E, k, ids.size() / static_cast<std::size_t>(k), policy);
  std::vector<std::uint8_t> keep(ids.size());
  const std::int64_t d = filter.decide(ids, priority, keep);
  if (dropped != nullptr)
    *dropped = d;
  return keep;
}

} // namespace

TEST_CASE("expert_capacity, ceil rounding: ceil(k * T / E * |factor|), -1 when dropless") {
  CHECK(weave::expert_capacity(1.25, 10, 2, 4) == 7); // 6.25 -> 7
  CHECK(weave::expert_capacity(-1.25, 10, 2, 4) == 7);
  CHECK(weave::expert_capacity(1.0, 16, 2, 8) == 4);
  CHECK(weave::expert_capacity(0.0, 16, 2, 8) == -1);
  CHECK(weave::expert_capacity(1.0, 6, 2, 4) == 3);   // 12 / 4 = 3
  CHECK(weave::expert_capacity(1.1, 16, 1, 8) == 3);  // 2.2 -> 3
  CHECK(weave::expert_capacity(1.1, 16, 2, 8) == 5);  // 4.4 -> 5
  CHECK(weave::expert_capacity(0.5, 16, 2, 64) == 1); // 0.25 -> 1: never 0 for T > 0
  // Megatron-Core's evaluation order, (k * T / E) * f: (30 / 3) * 0.1 is exactly 1.0, where
  // 0.1 * 30 / 3 would round to 1.0000000000000002 and ceil to 2.
  CHECK(weave::expert_capacity(0.1, 10, 3, 3) == 1);
  for (long long T = 1; T < 50; ++T)
    for (int k = 1; k < 4; ++k) // factor 0.75 = 3/4: exact integer ceiling
      CHECK(weave::expert_capacity(0.75, static_cast<std::size_t>(T), k, 6) ==
            (3 * k * T + 4 * 6 - 1) / (4 * 6));
}

TEST_CASE("expert_capacity, Tutel rounding: k * floor(|factor| * ceil(T / E))") {
  const auto tutel = weave::capacity_rounding::tutel;
  CHECK(weave::expert_capacity(1.0, 6, 2, 4, tutel) == 4);  // ceil(6/4) = 2 -> 2 * 2
  CHECK(weave::expert_capacity(1.1, 16, 1, 8, tutel) == 2); // floor(1.1 * 2) = 2 per choice
  CHECK(weave::expert_capacity(1.1, 16, 2, 8, tutel) == 4);
  CHECK(weave::expert_capacity(1.25, 10, 2, 4, tutel) == 6); // floor(1.25 * 3) = 3
  CHECK(weave::expert_capacity(0.5, 16, 2, 64, tutel) == 0); // floor(0.5 * 1) = 0: drop all
  CHECK(weave::expert_capacity(-0.5, 16, 2, 64, tutel) == 0);
  CHECK(weave::expert_capacity(-1.1, 16, 2, 8, tutel) == 4); // capped dropless: same bound
  CHECK(weave::expert_capacity(0.0, 16, 2, 8, tutel) == -1);
  CHECK(weave::expert_capacity(2.0, 0, 3, 8, tutel) == 0);
  const weave::capacity_policy policy{1.0, weave::drop_order::batch_prioritized, tutel};
  CHECK(weave::expert_capacity(policy, 6, 2, 4) == 4);
  for (long long T = 1; T < 50; ++T)
    for (int k = 1; k < 4; ++k) // factor 1.5 = 3/2: floor exact in integers
      CHECK(weave::expert_capacity(1.5, static_cast<std::size_t>(T), k, 6, tutel) ==
            k * ((3 * ((T + 5) / 6)) / 2));
}

// The example of Tutel's batch-prioritized routing: logits [[2,0],[1.5,0],[0,1],[0,0.5]],
// k = 2, factor 0.5. Softmax top scores 0.88, 0.82, 0.73, 0.62 rank the tokens 0, 1, 2, 3;
// capacity 2 * floor(0.5 * ceil(4 / 2)) = 2 (the ceil rule gives ceil(8 / 2 * 0.5) = 2 too).
// Tutel's pass over first choices fills both experts (tokens 0, 1 -> expert 0; 2, 3 -> expert
// 1), so every second choice is dropped.
TEST_CASE("batch_prioritized is Tutel's order: the four-token example keeps every first choice") {
  weave::host_matrix<float> logits(4, 2);
  const float values[] = {2.0f, 0.0f, 1.5f, 0.0f, 0.0f, 1.0f, 0.0f, 0.5f};
  std::copy(std::begin(values), std::end(values), logits.elements().begin());
  weave::gate_options gate;
  gate.k = 2;
  gate.renormalize = true; // Tutel normalizes the gates after taking the priority
  std::vector<std::int32_t> ids(8);
  std::vector<float> weights(8), top(4);
  weave::top_k_gate(logits.view(), gate, ids, weights, top);
  REQUIRE(ids == std::vector<std::int32_t>{0, 1, 0, 1, 1, 0, 1, 0});
  CHECK(top[0] > top[1]);
  CHECK(top[1] > top[2]);
  CHECK(top[2] > top[3]);
  for (const auto rounding : roundings) {
    std::int64_t dropped = -1;
    const auto tutel =
        decide(2, 2, ids, top, {0.5, weave::drop_order::batch_prioritized, rounding}, &dropped);
    CHECK(tutel == std::vector<std::uint8_t>{1, 0, 1, 0, 1, 0, 1, 0});
    CHECK(dropped == 4);
    // Token-major over the same priorities: the two most confident tokens keep both choices.
    const auto whole =
        decide(2, 2, ids, top, {0.5, weave::drop_order::priority_token_major, rounding}, &dropped);
    CHECK(whole == std::vector<std::uint8_t>{1, 1, 1, 1, 0, 0, 0, 0});
    CHECK(dropped == 4);
  }
}

// Hand-derived masks for one expert shared by every token (k = 1, E = 2, capacity by Tutel's
// rule with T = 4: floor(f * 2)).
TEST_CASE("Tutel's semantics: priority ties, capacity 0 and negative factors") {
  const auto tutel = weave::capacity_rounding::tutel;
  const auto prioritized = weave::drop_order::batch_prioritized;
  const std::vector<std::int32_t> ids = {0, 0, 0, 0};
  // Tokens 1 and 2 tie at the top: the earlier token wins; token 3 beats token 0.
  const std::vector<float> priority = {0.25f, 0.75f, 0.75f, 0.5f};
  CHECK(decide(2, 1, ids, priority, {0.5, prioritized, tutel}) ==
        std::vector<std::uint8_t>{0, 1, 0, 0}); // capacity 1
  CHECK(decide(2, 1, ids, priority, {1.0, prioritized, tutel}) ==
        std::vector<std::uint8_t>{0, 1, 1, 0}); // capacity 2
  CHECK(decide(2, 1, ids, priority, {1.5, prioritized, tutel}) ==
        std::vector<std::uint8_t>{0, 1, 1, 1}); // capacity 3
  // -0 and +0 tie as well.
  CHECK(decide(2, 1, ids, {-0.0f, 0.0f, -0.0f, 0.0f}, {0.5, prioritized, tutel}) ==
        std::vector<std::uint8_t>{1, 0, 0, 0});
  // Capacity 0 (floor(0.25 * 2) = 0) drops every pair; a negative factor bounds the same way.
  std::int64_t dropped = 0;
  CHECK(decide(2, 1, ids, priority, {0.25, prioritized, tutel}, &dropped) ==
        std::vector<std::uint8_t>{0, 0, 0, 0});
  CHECK(dropped == 4);
  CHECK(decide(2, 1, ids, priority, {-0.25, prioritized, tutel}, &dropped) ==
        std::vector<std::uint8_t>{0, 0, 0, 0});
  CHECK(decide(2, 1, ids, priority, {-1.0, prioritized, tutel}) ==
        std::vector<std::uint8_t>{0, 1, 1, 0});
  // A capped-dropless bound above every load drops nothing.
  CHECK(decide(2, 1, ids, priority, {-2.0, prioritized, tutel}, &dropped) ==
        std::vector<std::uint8_t>{1, 1, 1, 1});
  CHECK(dropped == 0);
}

// Tutel's dropless batch-prioritized capacity is one plus the largest location in the last
// token's row of the sorted-then-unsorted locations, not the largest expert load. Here (k = 1)
// the last token ranks first on expert 1, so Tutel's capacity is 1 and it drops tokens 1 and 2
// of expert 0. weave's dropless keeps every pair in every order.
TEST_CASE("dropless batch-prioritized keeps every pair (where Tutel drops)") {
  const std::vector<std::int32_t> ids = {0, 0, 0, 1};
  const std::vector<float> priority = {0.9f, 0.8f, 0.7f, 0.6f};
  for (int order = 0; order < orders; ++order) {
    std::int64_t dropped = -1;
    CHECK(decide(2, 1, ids, priority, {0.0, static_cast<weave::drop_order>(order)}, &dropped) ==
          std::vector<std::uint8_t>{1, 1, 1, 1});
    CHECK(dropped == 0);
  }
}

TEST_CASE("reference capacity_filter keeps what the mask-based reference keeps, in every order") {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 60; ++trial) {
    const int E = 1 + static_cast<int>(rng() % 12);
    const int k = 1 + static_cast<int>(rng() % static_cast<unsigned>(std::min(E, 4)));
    const std::size_t T = rng() % 70;
    const auto b = make_batch(T, E, k, rng);
    for (const double factor : factors)
      for (int order = 0; order < orders; ++order) {
        const weave::capacity_policy policy{factor, static_cast<weave::drop_order>(order),
                                            roundings[trial % 2]};
        oracle::capacity_filter filter(E, k, T, policy);
        std::vector<std::uint8_t> keep(b.ids.size());
        const auto dropped = filter.decide(b.ids, b.priority, keep);
        const auto expect = ref::mask_keep(b.ids, k, E, filter.capacity(), order, b.priority);
        REQUIRE(keep == expect);
        std::int64_t expect_dropped = 0;
        for (std::size_t q = 0; q < keep.size(); ++q)
          expect_dropped += b.ids[q] >= 0 && !keep[q] ? 1 : 0;
        CHECK(dropped == expect_dropped);
        if (factor == 0.0)
          CHECK(dropped == 0);
      }
  }
}

TEST_CASE("Lancet's rule: chunked capacity decisions equal the whole batch's") {
  std::mt19937 rng(17);
  for (int trial = 0; trial < 40; ++trial) {
    const int D = 1 + static_cast<int>(rng() % 4);
    const int E = D * (1 + static_cast<int>(rng() % 4));
    const int k = 1 + static_cast<int>(rng() % static_cast<unsigned>(std::min(E, 3)));
    const std::size_t T = 1 + rng() % 90;
    const auto p = ref::random_placement(E, D, trial % 2, rng);
    const auto b = make_batch(T, E, k, rng);
    const auto kk = static_cast<std::size_t>(k);
    std::vector<std::size_t> cuts = {0, T};
    for (int c = 0; c < 3; ++c)
      cuts.push_back(rng() % (T + 1));
    std::sort(cuts.begin(), cuts.end());
    for (const double factor : factors)
      for (int order = 0; order < orders; ++order) {
        const weave::capacity_policy policy{factor, static_cast<weave::drop_order>(order),
                                            roundings[trial % 2]};
        oracle::capacity_filter whole(E, k, T, policy);
        std::vector<std::uint8_t> keep(b.ids.size());
        whole.decide(b.ids, b.priority, keep);
        oracle::dispatch_plan whole_plan(p, k, 0);
        whole_plan.build(b.ids, b.weights, keep);

        // Chunk plans: position order decides each chunk from the used capacity so far;
        // the other orders read their slice of the once-per-batch mask.
        oracle::capacity_filter chunked(E, k, T, policy);
        std::vector<std::uint8_t> chunk_keep(b.ids.size());
        std::vector<oracle::dropped_route> dropped;
        std::vector<std::int64_t> loads(static_cast<std::size_t>(p.num_slots()), 0);
        std::vector<std::int32_t> kept;
        for (std::size_t c = 0; c + 1 < cuts.size(); ++c) {
          const std::size_t t0 = cuts[c], n = cuts[c + 1] - cuts[c];
          const auto ids = std::span(b.ids).subspan(t0 * kk, n * kk);
          auto mask = std::span(chunk_keep).subspan(t0 * kk, n * kk);
          if (policy.order == weave::drop_order::position)
            chunked.admit(ids, mask);
          else
            std::copy_n(keep.begin() + static_cast<long>(t0 * kk), n * kk, mask.begin());
          oracle::dispatch_plan plan(p, k, 0);
          plan.build(ids, std::span(b.weights).subspan(t0 * kk, n * kk), mask, t0);
          dropped.insert(dropped.end(), plan.dropped().begin(), plan.dropped().end());
          kept.insert(kept.end(), plan.kept_experts().begin(), plan.kept_experts().end());
          for (std::size_t s = 0; s < loads.size(); ++s)
            loads[s] += plan.slot_loads()[s];
        }
        CHECK(chunk_keep == keep);
        CHECK(std::vector(whole_plan.dropped().begin(), whole_plan.dropped().end()) == dropped);
        CHECK(std::vector(whole_plan.kept_experts().begin(), whole_plan.kept_experts().end()) ==
              kept);
        CHECK(std::vector(whole_plan.slot_loads().begin(), whole_plan.slot_loads().end()) == loads);
        if (policy.order == weave::drop_order::position)
          CHECK(std::vector(chunked.used().begin(), chunked.used().end()) ==
                std::vector(whole.used().begin(), whole.used().end()));
      }
  }
}

TEST_CASE("every routed pair is kept or reported dropped") {
  std::mt19937 rng(29);
  const int E = 8, k = 2;
  const std::size_t T = 200;
  const auto b = make_batch(T, E, k, rng);
  const auto p = weave::placement::contiguous(E, 4);
  oracle::capacity_filter filter(E, k, T, {0.5, weave::drop_order::batch_prioritized});
  std::vector<std::uint8_t> keep(b.ids.size());
  const auto dropped = filter.decide(b.ids, b.priority, keep);
  oracle::dispatch_plan plan(p, k, 1);
  plan.build(b.ids, b.weights, keep);
  std::int64_t routed = 0, kept = 0;
  for (std::size_t q = 0; q < b.ids.size(); ++q) {
    routed += b.ids[q] >= 0;
    kept += plan.kept_experts()[q] >= 0;
  }
  CHECK(dropped > 0);
  CHECK(static_cast<std::int64_t>(plan.dropped().size()) == dropped);
  CHECK(kept + dropped == routed);
  for (const auto& d : plan.dropped())
    CHECK(b.ids[static_cast<std::size_t>(d.token) * k + static_cast<std::size_t>(d.rank)] ==
          d.expert);
}

TEST_CASE("capacity rejects bad input with the right error code") {
  auto code = [](auto&& f) {
    try {
      f();
    } catch (const weave::error& e) {
      return e.code();
    }
    return weave::errc::internal;
  };
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  CHECK(code([&] { weave::expert_capacity(nan, 4, 1, 2); }) == weave::errc::invalid_argument);
  CHECK(code([&] { weave::expert_capacity(inf, 4, 1, 2); }) == weave::errc::invalid_argument);
  CHECK(code([&] { weave::expert_capacity(1.0, 4, 0, 2); }) == weave::errc::invalid_argument);
  CHECK(code([&] { weave::expert_capacity(1e30, 1u << 30, 8, 1); }) == weave::errc::size_overflow);
  CHECK(code([&] {
          weave::expert_capacity(1e30, 1u << 30, 8, 1, weave::capacity_rounding::tutel);
        }) == weave::errc::size_overflow);
  CHECK(code([&] {
          weave::expert_capacity(1.0, 4, 1, 2, static_cast<weave::capacity_rounding>(7));
        }) == weave::errc::invalid_argument);
  CHECK(code([&] {
          oracle::capacity_filter(2, 1, 4, {1.0, static_cast<weave::drop_order>(9)});
        }) == weave::errc::invalid_argument);
  std::vector<std::int32_t> ids = {0, 1, 2, 4};
  std::vector<std::uint8_t> keep(4);
  std::vector<float> priority = {1.0f, 2.0f};
  oracle::capacity_filter position(4, 2, 2, {1.0, weave::drop_order::position});
  CHECK(code([&] { position.admit(ids, keep); }) == weave::errc::out_of_range); // id 4 >= E
  ids[3] = -2;
  CHECK(code([&] { position.admit(ids, keep); }) == weave::errc::out_of_range); // id < -1
  ids[3] = 3;
  CHECK(code([&] { position.admit(ids, std::span(keep).first(3)); }) == weave::errc::size_mismatch);
  for (const auto order :
       {weave::drop_order::batch_prioritized, weave::drop_order::priority_token_major}) {
    priority[1] = 2.0f;
    oracle::capacity_filter prioritized(4, 2, 2, {1.0, order});
    CHECK(code([&] { prioritized.admit(ids, keep); }) == weave::errc::invalid_state);
    CHECK(code([&] { prioritized.decide(ids, std::span(priority).first(1), keep); }) ==
          weave::errc::size_mismatch);
    priority[1] = std::numeric_limits<float>::quiet_NaN();
    CHECK(code([&] { prioritized.decide(ids, priority, keep); }) == weave::errc::invalid_argument);
  }
  CHECK(code([&] {
          position.decide(std::span(ids).first(2), priority, std::span(keep).first(2));
        }) == weave::errc::size_mismatch); // not the batch size
}
