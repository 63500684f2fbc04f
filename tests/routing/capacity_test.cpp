// capacity_filter against a Tutel-style mask + cumsum reference, and Lancet's rule: chunk plans
// built with the capacity used by earlier chunks drop exactly what the whole batch drops.
#include <doctest/doctest.h>

#include "routing_reference.hpp"

#include <weave/routing/capacity.hpp>
#include <weave/routing/dispatch_plan.hpp>

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

} // namespace

TEST_CASE("expert_capacity is ceil(|factor| * k * T / E), -1 when dropless") {
  CHECK(weave::expert_capacity(1.25, 10, 2, 4) == 7); // 6.25 -> 7
  CHECK(weave::expert_capacity(-1.25, 10, 2, 4) == 7);
  CHECK(weave::expert_capacity(1.0, 16, 2, 8) == 4);
  CHECK(weave::expert_capacity(0.0, 16, 2, 8) == -1);
  for (long long T = 1; T < 50; ++T)
    for (int k = 1; k < 4; ++k) // factor 0.75 = 3/4: exact integer ceiling
      CHECK(weave::expert_capacity(0.75, static_cast<std::size_t>(T), k, 6) ==
            (3 * k * T + 4 * 6 - 1) / (4 * 6));
}

TEST_CASE("capacity_filter keeps what the mask-based reference keeps, in every order") {
  std::mt19937 rng(3);
  for (int trial = 0; trial < 60; ++trial) {
    const int E = 1 + static_cast<int>(rng() % 12);
    const int k = 1 + static_cast<int>(rng() % static_cast<unsigned>(std::min(E, 4)));
    const std::size_t T = rng() % 70;
    const auto b = make_batch(T, E, k, rng);
    for (const double factor : factors)
      for (int order = 0; order < 3; ++order) {
        const weave::capacity_policy policy{factor, static_cast<weave::drop_order>(order)};
        weave::capacity_filter filter(E, k, T, policy);
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
      for (int order = 0; order < 3; ++order) {
        const weave::capacity_policy policy{factor, static_cast<weave::drop_order>(order)};
        weave::capacity_filter whole(E, k, T, policy);
        std::vector<std::uint8_t> keep(b.ids.size());
        whole.decide(b.ids, b.priority, keep);
        weave::dispatch_plan whole_plan(p, k, 0);
        whole_plan.build(b.ids, b.weights, keep);

        // Chunk plans: position order decides each chunk from the used capacity so far;
        // the other orders read their slice of the once-per-batch mask.
        weave::capacity_filter chunked(E, k, T, policy);
        std::vector<std::uint8_t> chunk_keep(b.ids.size());
        std::vector<weave::dropped_route> dropped;
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
          weave::dispatch_plan plan(p, k, 0);
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
  weave::capacity_filter filter(E, k, T, {0.5, weave::drop_order::batch_prioritized});
  std::vector<std::uint8_t> keep(b.ids.size());
  const auto dropped = filter.decide(b.ids, b.priority, keep);
  weave::dispatch_plan plan(p, k, 1);
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
  std::vector<std::int32_t> ids = {0, 1, 2, 4};
  std::vector<std::uint8_t> keep(4);
  std::vector<float> priority = {1.0f, 2.0f};
  weave::capacity_filter position(4, 2, 2, {1.0, weave::drop_order::position});
  CHECK(code([&] { position.admit(ids, keep); }) == weave::errc::out_of_range); // id 4 >= E
  ids[3] = -2;
  CHECK(code([&] { position.admit(ids, keep); }) == weave::errc::out_of_range); // id < -1
  ids[3] = 3;
  CHECK(code([&] { position.admit(ids, std::span(keep).first(3)); }) == weave::errc::size_mismatch);
  weave::capacity_filter prioritized(4, 2, 2, {1.0, weave::drop_order::batch_prioritized});
  CHECK(code([&] { prioritized.admit(ids, keep); }) == weave::errc::invalid_state);
  CHECK(code([&] { prioritized.decide(ids, std::span(priority).first(1), keep); }) ==
        weave::errc::size_mismatch);
  priority[1] = std::numeric_limits<float>::quiet_NaN();
  CHECK(code([&] { prioritized.decide(ids, priority, keep); }) == weave::errc::invalid_argument);
  CHECK(code([&] {
          position.decide(std::span(ids).first(2), priority, std::span(keep).first(2));
        }) == weave::errc::size_mismatch); // not the batch size
}
