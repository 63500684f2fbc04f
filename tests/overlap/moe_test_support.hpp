// Shared pieces of the MoE exchange tests: random problems, linear experts, and a dense
// single-process reference (every kept (token, expert) pair computed directly, in double).
#pragma once

#include <weave/core/dtype.hpp>
#include <weave/core/error.hpp>
#include <weave/core/host_matrix.hpp>
#include <weave/exec/host_space.hpp>
#include <weave/overlap/moe_options.hpp>
#include <weave/placement/placement.hpp>
#include <weave/routing/capacity.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

namespace moe_test {

// One rank's tokens and routing.
template <class T>
struct rank_input {
  weave::host_matrix<T> x;
  std::vector<std::int32_t> ids;
  std::vector<float> weights;
};

// Expert e is y = W_e x (H x H, fp32 math, each row independent of its batch).
struct linear_experts {
  int experts = 0;
  std::size_t hidden = 0;
  std::vector<float> w; // [E][H][H]

  linear_experts(int e, std::size_t h, std::uint32_t seed)
      : experts(e)
      , hidden(h)
      , w(e * h * h) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> n(0.0f, 1.0f / std::sqrt(static_cast<float>(h)));
    for (float& v : w)
      v = n(rng);
  }
  float at(int e, std::size_t o, std::size_t i) const {
    return w[(static_cast<std::size_t>(e) * hidden + o) * hidden + i];
  }

  template <class T>
  void apply(int e, const T* in, T* out, bool transpose = false) const {
    for (std::size_t o = 0; o < hidden; ++o) {
      float acc = 0.0f;
      for (std::size_t i = 0; i < hidden; ++i)
        acc += (transpose ? at(e, i, o) : at(e, o, i)) * static_cast<float>(in[i]);
      out[o] = T(acc);
    }
  }

  // The callback weave runs on each chunk's EPD rows (any space's batch, read when the rows are
  // there: see `run_experts`).
  template <class T, class Batch>
  void operator()(const Batch& b) const {
    for (std::size_t l = 0; l + 1 < b.expert_offsets.size(); ++l)
      for (auto r = b.expert_offsets[l]; r < b.expert_offsets[l + 1]; ++r)
        apply(b.experts[l], b.input.template row_as<T>(static_cast<std::size_t>(r)).data(),
              b.output.template row_as<T>(static_cast<std::size_t>(r)).data());
  }

  template <class T, class Batch>
  void backward(const Batch& b) const {
    for (std::size_t l = 0; l + 1 < b.expert_offsets.size(); ++l)
      for (auto r = b.expert_offsets[l]; r < b.expert_offsets[l + 1]; ++r)
        apply(b.experts[l], b.grad_output.template row_as<T>(static_cast<std::size_t>(r)).data(),
              b.grad_input.template row_as<T>(static_cast<std::size_t>(r)).data(),
              /*transpose=*/true);
  }
};

// An expert callback of any space: the linear experts on the batch's rows, as a step of its
// stream (on host streams the callback runs in the stream, so the step runs at once; where host
// code runs at enqueue time, it runs once the stream gets there). Forward or backward by the
// batch's type.
template <class T, class Batch>
void run_experts(const linear_experts& lin, const Batch& b) {
  weave::host_space::enqueue(b.stream, [&lin, b] {
    if constexpr (requires { b.grad_output; })
      lin.backward<T>(b);
    else
      lin.operator()<T>(b);
  });
}

// Random distinct top-k ids (a few -1 holes) and softmax-like positive weights.
template <class T>
rank_input<T> random_input(std::size_t tokens, std::size_t hidden, int experts, int k,
                           std::mt19937& rng) {
  rank_input<T> in{weave::host_matrix<T>(tokens, hidden), {}, {}};
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (T& v : in.x.elements())
    v = T(n(rng));
  std::vector<std::int32_t> all(static_cast<std::size_t>(experts));
  std::iota(all.begin(), all.end(), 0);
  std::uniform_real_distribution<float> u(0.05f, 1.0f);
  for (std::size_t t = 0; t < tokens; ++t) {
    std::shuffle(all.begin(), all.end(), rng);
    for (int j = 0; j < k; ++j) {
      const bool hole = rng() % 23 == 0;
      in.ids.push_back(hole ? -1 : all[static_cast<std::size_t>(j)]);
      in.weights.push_back(u(rng));
    }
  }
  return in;
}

// The two matrices hold the same bits.
template <class T>
bool bitwise_equal(const weave::host_matrix<T>& a, const weave::host_matrix<T>& b) {
  return a.rows() == b.rows() &&
         (a.rows() == 0 || std::memcmp(a.data(), b.data(), a.rows() * a.cols() * sizeof(T)) == 0);
}

// The code of the weave::error `f()` throws, or errc{} when it throws none.
template <class F>
weave::errc error_code_of(F&& f) {
  try {
    f();
  } catch (const weave::error& e) {
    return e.code();
  }
  return weave::errc{};
}

// Which (token, rank) pairs a naive capacity count keeps, for one rank's batch.
inline std::vector<bool> naive_keep(const std::vector<std::int32_t>& ids,
                                    const std::vector<float>& weights, int k, int experts,
                                    const weave::capacity_policy& policy) {
  const std::size_t tokens = ids.size() / static_cast<std::size_t>(k);
  std::vector<bool> keep(ids.size(), false);
  if (policy.factor == 0.0) {
    for (std::size_t i = 0; i < ids.size(); ++i)
      keep[i] = ids[i] >= 0;
    return keep;
  }
  const double f = std::fabs(policy.factor);
  const auto cap = static_cast<std::int64_t>(
      policy.rounding == weave::capacity_rounding::tutel
          ? k * std::floor(f * static_cast<double>((tokens + experts - 1) / experts))
          : std::ceil(static_cast<double>(k * tokens) / experts * f));
  std::vector<std::size_t> order(tokens);
  std::iota(order.begin(), order.end(), 0);
  const bool prioritized = policy.order == weave::drop_order::batch_prioritized ||
                           policy.order == weave::drop_order::priority_token_major;
  if (prioritized) { // the exchange's priority: the best weight of the token's valid choices
    auto best = [&](std::size_t t) {
      float b = -INFINITY;
      for (int j = 0; j < k; ++j)
        if (ids[t * k + j] >= 0)
          b = std::max(b, weights[t * k + j]);
      return b;
    };
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t a, std::size_t b) { return best(a) > best(b); });
  }
  std::vector<std::int64_t> used(static_cast<std::size_t>(experts), 0);
  auto visit = [&](std::size_t t, int j) {
    const std::int32_t e = ids[t * k + j];
    if (e >= 0 && used[static_cast<std::size_t>(e)] < cap) {
      ++used[static_cast<std::size_t>(e)];
      keep[t * k + j] = true;
    }
  };
  if (policy.order == weave::drop_order::rank_major ||
      policy.order == weave::drop_order::batch_prioritized) {
    for (int j = 0; j < k; ++j) // choice by choice (Tutel)
      for (std::size_t t : order)
        visit(t, j);
  } else {
    for (std::size_t t : order)
      for (int j = 0; j < k; ++j)
        visit(t, j);
  }
  return keep;
}

// Checks one rank's forward output (and backward gradients, if given) against a dense
// per-(token, expert) computation in double, and its statistics against a naive count.
template <class T>
void check_rank_against_dense(int rank, const weave::placement& where, int k, int experts_count,
                              const weave::capacity_policy& capacity, const rank_input<T>& in,
                              const linear_experts& experts, const weave::host_matrix<T>& y,
                              const weave::host_matrix<T>* dx, const std::vector<float>* dw,
                              const weave::moe_stats& stats, double tolerance) {
  const auto kk = static_cast<std::size_t>(k);
  const std::size_t hidden = in.x.cols();
  const auto keep = naive_keep(in.ids, in.weights, k, experts_count, capacity);
  std::int64_t dropped = 0, kept_pairs = 0, copies = 0;
  for (std::size_t t = 0; t < in.x.rows(); ++t) {
    std::vector<double> yr(hidden, 0.0), dxr(hidden, 0.0);
    std::vector<int> devices;
    for (std::size_t j = 0; j < kk; ++j) {
      const std::int32_t e = in.ids[t * kk + j];
      if (e < 0 || !keep[t * kk + j]) {
        dropped += e >= 0 ? 1 : 0;
        if (dw)
          CHECK((*dw)[t * kk + j] == 0.0f);
        continue;
      }
      ++kept_pairs;
      const int device = where.device_of_slot(where.slot_for(e, t, rank));
      if (std::find(devices.begin(), devices.end(), device) == devices.end())
        devices.push_back(device);
      const double w = in.weights[t * kk + j];
      double g = 0;
      for (std::size_t o = 0; o < hidden; ++o) {
        double fx = 0, gx = 0;
        for (std::size_t i = 0; i < hidden; ++i) {
          fx += experts.at(e, o, i) * static_cast<double>(static_cast<float>(in.x(t, i)));
          gx += experts.at(e, i, o) * static_cast<double>(static_cast<float>(in.x(t, i)));
        }
        yr[o] += w * fx;
        dxr[o] += w * gx;
        g += static_cast<double>(static_cast<float>(in.x(t, o))) * fx; // dL/dy = x
      }
      if (dw)
        CHECK((*dw)[t * kk + j] == doctest::Approx(g).epsilon(tolerance).scale(1.0));
    }
    copies += static_cast<std::int64_t>(devices.size());
    for (std::size_t o = 0; o < hidden; ++o) {
      REQUIRE(static_cast<float>(y(t, o)) == doctest::Approx(yr[o]).epsilon(tolerance).scale(1.0));
      if (dx)
        REQUIRE(static_cast<float>((*dx)(t, o)) ==
                doctest::Approx(dxr[o]).epsilon(tolerance).scale(1.0));
    }
  }
  CHECK(stats.dropped_pairs == dropped);
  CHECK(stats.routed_pairs == kept_pairs);
  CHECK(stats.sent_rows == copies);
  CHECK(stats.tokens == in.x.rows());
}

} // namespace moe_test
