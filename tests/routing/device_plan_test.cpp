// weave's plans (`device_dispatch_plan`, `device_expert_plan`, `device_capacity_filter`: one
// algorithm in every space, its steps shared with the CUDA kernels of `cuda_dispatch_plan`), run
// on host streams in `host_space` (the serial forms of the steps: a row's entries in one pass,
// counting sorts) and in `emulated_gpu_space` (the GPU's forms: one index per step call),
// against the sequential host reference plans of tests/support/host_plans.hpp (`dispatch_plan`,
// `expert_plan`, `capacity_filter`) they must equal exactly.
#include <doctest/doctest.h>

#include "aligned_buffer.hpp"
#include "host_plans.hpp"
#include "random_choices.hpp"
#include "routing_reference.hpp"

#include <weave/exec/emulated_gpu_space.hpp>
#include <weave/exec/host_space.hpp>
#include <weave/routing/capacity.hpp>
#include <weave/routing/device_capacity.hpp>
#include <weave/routing/device_dispatch_plan.hpp>
#include <weave/routing/device_expert_plan.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <limits>
#include <memory>
#include <new>
#include <numeric>
#include <random>
#include <vector>

using weave_test::random_choices;
using weave_test::random_keep;
using workspace = weave_test::aligned_buffer;
using host_plan = weave::device_dispatch_plan<weave::host_space>;

namespace {

template <class T>
std::vector<T> vec(std::span<const T> s) {
  return {s.begin(), s.end()};
}

template <class Space>
void expect_equal(const oracle::dispatch_plan& host, const weave::device_dispatch_plan<Space>& dev,
                  weave::host_stream& s) {
  s.synchronize();
  const std::int64_t rows = host.rows();
  REQUIRE(dev.read_rows(s) == rows);
  const auto k = static_cast<std::size_t>(host.k());
  CHECK(vec(dev.send_counts()) == vec(host.send_counts()));
  CHECK(vec(dev.send_offsets()) == vec(host.send_offsets()));
  CHECK(vec(dev.row_token().first(static_cast<std::size_t>(rows))) == vec(host.row_token()));
  CHECK(vec(dev.token_rows()) == vec(host.token_rows()));
  CHECK(vec(dev.row_routes().first(static_cast<std::size_t>(rows) * k)) == vec(host.row_routes()));
  CHECK(vec(dev.kept_experts()) == vec(host.kept_experts()));
  CHECK(vec(dev.slot_loads()) == vec(host.slot_loads()));
  dev.check_errors(s);
}

} // namespace

TEST_CASE_TEMPLATE(
    "device dispatch plan steps equal the reference plan on random placements and choices", Space,
    weave::host_space, weave::emulated_gpu_space) {
  std::mt19937 rng(11);
  weave::host_stream s("plan");
  // `wide`: more choices per token than the steps keep in thread-local arrays (their other path).
  for (const bool wide : {false, true})
    for (const int D : {1, 2, 3, 8, 64, 2, 3, 8})
      for (const int extra : {0, 1, 2}) {
        const int least = wide ? weave::detail::plan_local_choices + 8 : 1;
        const int E = D * static_cast<int>((least + D - 1) / D + rng() % 4);
        const int k = wide ? weave::detail::plan_local_choices + 1 + static_cast<int>(rng() % 8)
                           : std::min(E, static_cast<int>(1 + rng() % 6));
        const std::size_t T = rng() % 300;
        const int source = static_cast<int>(rng() % static_cast<unsigned>(D));
        CAPTURE(wide);
        CAPTURE(D);
        CAPTURE(extra);
        CAPTURE(k);
        const auto p = ref::random_placement(E, D, extra, rng);
        const std::size_t offset = rng() % 1000; // the chunk's first token: replicas depend on it
        std::vector<std::int32_t> ids;
        std::vector<float> w;
        random_choices(rng, T, E, k, ids, w);
        const std::vector<std::uint8_t> keep = random_keep(rng, ids.size());
        oracle::dispatch_plan host(p, k, source);
        host.build(ids, w, keep, offset);

        weave::device_dispatch_plan<Space> dev(p, k, source, T + rng() % 100);
        workspace ws(dev.workspace_size());
        dev.initialize(ws.ptr, ws.size, s);
        dev.build(s, ids, w, keep, offset);
        expect_equal(host, dev, s);
        // A rebuild over poisoned outputs with other choices gives the new reference plan.
        random_choices(rng, T, E, k, ids, w);
        host.build(ids, w);
        std::fill(ws.ptr, ws.ptr + ws.size, std::byte{0xFF});
        dev.initialize(ws.ptr, ws.size, s);
        dev.build(s, ids, w);
        expect_equal(host, dev, s);
      }
}

TEST_CASE("device dispatch plan flags bad choices and rejects bad arguments") {
  weave::host_stream s("plan");
  const auto p = weave::placement::contiguous(8, 4);
  host_plan dev(p, 2, 0, 4);
  workspace ws(dev.workspace_size());
  CHECK_THROWS_AS(dev.build(s, std::vector<std::int32_t>(2, 0), std::vector<float>(2, 1.0f)),
                  weave::error); // before initialize
  dev.initialize(ws.ptr, ws.size, s);
  const auto code = [&](std::vector<std::int32_t> ids, std::vector<float> w) {
    try {
      dev.build(s, ids, w);
      dev.check_errors(s);
    } catch (const weave::error& e) {
      return e.code();
    }
    return weave::errc{};
  };
  CHECK(code({0, 1, 2, 3}, {1, 1, 1, 1}) == weave::errc{});
  CHECK(code({0, 8, 2, 3}, {1, 1, 1, 1}) == weave::errc::out_of_range);
  CHECK(code({0, -2, 2, 3}, {1, 1, 1, 1}) == weave::errc::out_of_range);
  CHECK(code({0, 0, 2, 3}, {1, 1, 1, 1}) == weave::errc::invalid_argument);
  CHECK(code({0, 1, 2, 3}, {1, std::numeric_limits<float>::quiet_NaN(), 1, 1}) ==
        weave::errc::invalid_argument);
  // A flagged id is treated as -1: the plan still routes the rest, and the flag is cleared.
  CHECK(code({0, 1, 2, 3}, {1, 1, 1, 1}) == weave::errc{});
  CHECK(code({0, 1, 2}, {1, 1, 1}) == weave::errc::size_mismatch);
  CHECK(code({0, 1, 2, 3}, {1, 1, 1}) == weave::errc::size_mismatch);
  CHECK(code(std::vector<std::int32_t>(10, -1), std::vector<float>(10, 0.0f)) ==
        weave::errc::size_mismatch); // 5 tokens in a plan for 4
  CHECK_THROWS_AS(host_plan(p, 9, 0, 4), weave::error);
  CHECK_THROWS_AS(host_plan(p, 2, 4, 4), weave::error);
  workspace small(dev.workspace_size() / 2);
  CHECK_THROWS_AS(dev.initialize(small.ptr, small.size, s), weave::error);
}

namespace {

// Random received rows: per source a count, each row 1..k distinct local experts (route
// entries packed from the front, as senders pack them).
std::vector<weave::route_entry> random_routes(std::mt19937& rng, int L, int k,
                                              const std::vector<std::int64_t>& counts) {
  std::vector<weave::route_entry> routes;
  std::vector<std::int32_t> locals(static_cast<std::size_t>(L));
  for (const std::int64_t c : counts)
    for (std::int64_t r = 0; r < c; ++r) {
      std::iota(locals.begin(), locals.end(), 0);
      std::shuffle(locals.begin(), locals.end(), rng);
      const int entries = 1 + static_cast<int>(rng() % static_cast<unsigned>(std::min(k, L)));
      for (int i = 0; i < k; ++i)
        routes.push_back(i < entries ? weave::route_entry{locals[static_cast<std::size_t>(i)],
                                                          static_cast<float>(rng() % 100) / 7.0f}
                                     : weave::route_entry{});
    }
  return routes;
}

} // namespace

TEST_CASE_TEMPLATE("device expert plan steps equal the reference expert plan, compact and with "
                   "padded slots",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  std::mt19937 rng(23);
  weave::host_stream s("expert plan");
  for (int trial = 0; trial < 12; ++trial) {
    const int L = 1 + static_cast<int>(rng() % 6), k = 1 + static_cast<int>(rng() % 5);
    const int D = 1 + static_cast<int>(rng() % 5);
    std::vector<std::int64_t> counts(static_cast<std::size_t>(D));
    for (auto& c : counts)
      c = rng() % 3 == 0 ? 0 : static_cast<std::int64_t>(rng() % 40);
    const auto routes = random_routes(rng, L, k, counts);
    oracle::expert_plan host(L, k);
    host.build(routes, counts);
    const auto kk = static_cast<std::size_t>(k);
    const auto rows = static_cast<std::size_t>(host.rows());

    for (const bool padded : {false, true}) {
      // Compact: source s at the scan of the counts. Padded: fixed slots of S rows.
      const std::int64_t S = padded ? 45 : 0;
      std::vector<std::int64_t> displs(static_cast<std::size_t>(D));
      std::vector<std::int64_t> where(rows); // buffer row of each compact row
      std::size_t r = 0;
      for (int src = 0; src < D; ++src) {
        const auto i = static_cast<std::size_t>(src);
        displs[i] = padded ? src * S : host.source_offsets()[i];
        for (std::int64_t j = 0; j < counts[i]; ++j)
          where[r++] = displs[i] + j;
      }
      const std::size_t max_rows = padded ? static_cast<std::size_t>(D * S) : rows + rng() % 7;
      std::vector<weave::route_entry> buffer(max_rows * kk, weave::route_entry{77, 1.0f});
      for (std::size_t x = 0; x < rows; ++x)
        std::copy_n(routes.begin() + static_cast<std::ptrdiff_t>(x * kk), kk,
                    buffer.begin() +
                        static_cast<std::ptrdiff_t>(where[x]) * static_cast<std::ptrdiff_t>(kk));
      weave::device_expert_plan<Space> dev(L, k, D, max_rows);
      workspace ws(dev.workspace_size());
      dev.initialize(ws.ptr, ws.size, s);
      dev.build(s, buffer, counts.data(), displs.data());
      s.synchronize();
      dev.check_errors(s);

      CHECK(vec(dev.expert_offsets()) == vec(host.expert_offsets()));
      const auto epd = static_cast<std::size_t>(host.epd_rows());
      REQUIRE(dev.max_epd_rows() >= epd);
      for (std::size_t j = 0; j < epd; ++j) {
        CHECK(dev.epd_row_source()[j] == where[static_cast<std::size_t>(host.epd_row_source()[j])]);
        CHECK(dev.epd_weight()[j] == host.epd_weight()[j]);
      }
      std::vector<std::int64_t> want_epd(max_rows * kk, -1);
      std::vector<float> want_w(max_rows * kk, 0.0f);
      for (std::size_t x = 0; x < rows; ++x)
        for (std::size_t e = 0; e < kk; ++e) {
          want_epd[static_cast<std::size_t>(where[x]) * kk + e] = host.row_epd()[x * kk + e];
          want_w[static_cast<std::size_t>(where[x]) * kk + e] = host.row_weight()[x * kk + e];
        }
      CHECK(vec(dev.row_epd()) == want_epd);
      CHECK(vec(dev.row_weight()) == want_w);
    }
  }
}

TEST_CASE("device expert plan flags bad entries") {
  weave::host_stream s("expert plan");
  weave::device_expert_plan<weave::host_space> dev(3, 2, 1, 2);
  workspace ws(dev.workspace_size());
  dev.initialize(ws.ptr, ws.size, s);
  const std::vector<std::int64_t> counts = {2}, displs = {0};
  const auto code = [&](std::vector<weave::route_entry> routes) {
    try {
      dev.build(s, routes, counts.data(), displs.data());
      dev.check_errors(s);
    } catch (const weave::error& e) {
      return e.code();
    }
    return weave::errc{};
  };
  const float nan = std::numeric_limits<float>::quiet_NaN();
  CHECK(code({{0, 1}, {2, 1}, {1, 1}, {-1, 0}}) == weave::errc{});
  CHECK(code({{0, 1}, {3, 1}, {1, 1}, {-1, 0}}) == weave::errc::out_of_range);
  CHECK(code({{0, 1}, {0, 1}, {1, 1}, {-1, 0}}) == weave::errc::invalid_argument);
  CHECK(code({{0, 1}, {2, nan}, {1, 1}, {-1, 0}}) == weave::errc::invalid_argument);
  CHECK(code({{0, 1}, {2, 1}, {-1, 0}, {-1, 0}}) == weave::errc::invalid_argument);
  CHECK(code({{0, 1}, {2, 1}, {1, 1}}) == weave::errc::size_mismatch);
  CHECK_THROWS_AS(weave::device_expert_plan<weave::host_space>(0, 2, 1, 2), weave::error);
}

TEST_CASE_TEMPLATE("device capacity filter equals the reference filter for every order, factor "
                   "and rounding",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  std::mt19937 rng(31);
  weave::host_stream s("capacity");
  for (int trial = 0; trial < 60; ++trial) {
    const int E = 1 + static_cast<int>(rng() % 12);
    const int k = 1 + static_cast<int>(rng() % std::min(E, 4));
    const std::size_t T = rng() % 200;
    std::vector<std::int32_t> ids;
    std::vector<float> w;
    random_choices(rng, T, E, k, ids, w);
    for (std::size_t i = 0; i < w.size(); i += 5)
      w[i] = w[(i * 7) % w.size()]; // ties between tokens
    const double factor = std::array{0.0, 0.5, 1.0, 1.25, -1.0, 3.0}[rng() % 6];
    const auto order = static_cast<weave::drop_order>(trial % 4);
    const auto rounding = static_cast<weave::capacity_rounding>((trial / 4) % 2);
    const weave::capacity_policy policy{factor, order, rounding};
    const bool given = trial % 3 != 0; // an explicit priority, or the weights' best

    // The weights' best over valid choices (what moe_exchange uses), or a given priority with
    // ties (whole multiples of 1/4, signed zeros).
    std::vector<float> priority(T, -std::numeric_limits<float>::infinity());
    for (std::size_t t = 0; t < T; ++t) {
      if (given) {
        priority[t] = static_cast<float>(static_cast<int>(rng() % 5) - 2) / 4.0f;
        if (priority[t] == 0.0f && rng() % 2 == 0)
          priority[t] = -0.0f;
        continue;
      }
      for (int j = 0; j < k; ++j)
        if (ids[t * k + j] >= 0)
          priority[t] = std::max(priority[t], w[t * k + j]);
    }
    oracle::capacity_filter host(E, k, T, policy);
    std::vector<std::uint8_t> want(ids.size());
    const std::int64_t want_dropped = host.decide(ids, priority, want);

    weave::device_capacity_filter<Space> dev(E, k, T + rng() % 10, policy);
    workspace ws(dev.workspace_size());
    dev.initialize(ws.ptr, ws.size, s);
    std::vector<std::uint8_t> got(ids.size(), 0xEE);
    dev.decide(s, ids, w, got, given ? std::span<const float>(priority) : std::span<const float>());
    s.synchronize();
    INFO("E = ", E, ", k = ", k, ", T = ", T, ", factor = ", factor,
         ", order = ", static_cast<int>(order), ", rounding = ", static_cast<int>(rounding),
         ", given priority = ", given);
    CHECK(got == want);
    CHECK(*dev.dropped_count() == want_dropped);
    CHECK(dev.capacity() == host.capacity());
  }
  weave::device_capacity_filter<weave::host_space> dev(4, 1, 8,
                                                       {1.0, weave::drop_order::batch_prioritized});
  workspace ws(dev.workspace_size());
  dev.initialize(ws.ptr, ws.size, s);
  std::vector<std::int32_t> ids(4, 0);
  std::vector<float> w(4, 1.0f), priority(3, 1.0f);
  std::vector<std::uint8_t> keep(4);
  CHECK_THROWS_AS(dev.decide(s, ids, w, keep, priority), weave::error);
  CHECK_THROWS_AS(weave::device_capacity_filter<weave::host_space>(
                      4, 1, 8, {1.0, static_cast<weave::drop_order>(5)}),
                  weave::error);
}

TEST_CASE_TEMPLATE("device capacity filter admits chunk by chunk what it decides for the whole "
                   "batch",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  std::mt19937 rng(41);
  weave::host_stream s("capacity");
  for (int trial = 0; trial < 20; ++trial) {
    const int E = 2 + static_cast<int>(rng() % 10);
    const int k = 1 + static_cast<int>(rng() % std::min(E, 4));
    const std::size_t T = 1 + rng() % 150;
    std::vector<std::int32_t> ids;
    std::vector<float> w;
    random_choices(rng, T, E, k, ids, w);
    const weave::capacity_policy policy{std::array{0.0, 0.5, 1.0, 1.5}[rng() % 4],
                                        weave::drop_order::position};
    weave::device_capacity_filter<Space> dev(E, k, T, policy);
    workspace ws(dev.workspace_size());
    dev.initialize(ws.ptr, ws.size, s);
    std::vector<std::uint8_t> whole(ids.size()), chunked(ids.size(), 0xEE);
    dev.decide(s, ids, w, whole);
    s.synchronize();
    const std::int64_t dropped = *dev.dropped_count();
    dev.reset(s, T);
    const std::size_t chunks = 1 + rng() % 5;
    const auto kk = static_cast<std::size_t>(k);
    for (std::size_t c = 0; c < chunks; ++c) {
      const std::size_t first = T * c / chunks, last = T * (c + 1) / chunks;
      dev.admit(s, std::span(ids).subspan(first * kk, (last - first) * kk),
                std::span(chunked).subspan(first * kk, (last - first) * kk));
    }
    s.synchronize();
    CAPTURE(trial);
    CHECK(chunked == whole);
    CHECK(*dev.dropped_count() == dropped);
  }
  weave::device_capacity_filter<weave::host_space> ranked(4, 1, 8,
                                                          {1.0, weave::drop_order::rank_major});
  workspace ws(ranked.workspace_size());
  ranked.initialize(ws.ptr, ws.size, s);
  CHECK_THROWS_AS(ranked.reset(s, 8), weave::error);
}
