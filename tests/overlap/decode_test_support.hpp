// What the decode exchange tests share on every communicator: one rank's call run through a
// decode_exchange with linear experts, the naive per-token reference (sum over the token's
// choices, in order, of w * f_e(x)), per-slot row counts counted directly from the ids, and a
// run that records the typed error a rank's call ended with.
#pragma once

#include "moe_test_support.hpp"

#include <weave/overlap/decode_exchange.hpp>

#include <cstring>
#include <string>
#include <vector>

namespace decode_test {

// The naive reference of one rank's layer output.
template <class T>
std::vector<T> reference(const moe_test::rank_input<T>& in, int k,
                         const moe_test::linear_experts& f) {
  const std::size_t H = f.hidden;
  std::vector<T> y(in.x.rows() * H), out(H);
  std::vector<float> acc(H);
  for (std::size_t t = 0; t < in.x.rows(); ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int j = 0; j < k; ++j) {
      const std::int32_t e = in.ids[t * static_cast<std::size_t>(k) + static_cast<std::size_t>(j)];
      if (e < 0)
        continue;
      f.apply(e, in.x.row(t).data(), out.data());
      const float w = in.weights[t * static_cast<std::size_t>(k) + static_cast<std::size_t>(j)];
      for (std::size_t i = 0; i < H; ++i)
        acc[i] += w * static_cast<float>(out[i]);
    }
    for (std::size_t i = 0; i < H; ++i)
      y[t * H + i] = T(acc[i]);
  }
  return y;
}

// The naive reference with `decode_options::partial_sums`, for rank `rank`'s tokens: per device
// (ascending), the sum over the token's choices there, in order, of w * f_e(x) rounded to T;
// then the sum of those rows. A choice's device is its slot's (`placement::slot_for`).
template <class T>
std::vector<T> partial_sums_reference(const moe_test::rank_input<T>& in, int k,
                                      const moe_test::linear_experts& f,
                                      const weave::placement& where, int rank) {
  const std::size_t H = f.hidden;
  const int spd = where.slots_per_device();
  std::vector<T> y(in.x.rows() * H), out(H);
  std::vector<float> acc(H), part(H);
  for (std::size_t t = 0; t < in.x.rows(); ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int d = 0; d < where.num_devices(); ++d) {
      std::fill(part.begin(), part.end(), 0.0f);
      bool any = false;
      for (int j = 0; j < k; ++j) {
        const std::size_t p = t * static_cast<std::size_t>(k) + static_cast<std::size_t>(j);
        const std::int32_t e = in.ids[p];
        if (e < 0 || where.slot_for(e, t, rank) / spd != d)
          continue;
        any = true;
        f.apply(e, in.x.row(t).data(), out.data());
        for (std::size_t i = 0; i < H; ++i)
          part[i] += in.weights[p] * static_cast<float>(out[i]);
      }
      if (any)
        for (std::size_t i = 0; i < H; ++i)
          acc[i] += static_cast<float>(T(part[i]));
    }
    for (std::size_t i = 0; i < H; ++i)
      y[t * H + i] = T(acc[i]);
  }
  return y;
}

// The reference of a decode call built with `o`: per device (`partial_sums`, the default) or
// per (token, expert) pair.
template <class T>
std::vector<T> expected(const moe_test::rank_input<T>& in, const weave::decode_options& o,
                        const moe_test::linear_experts& f, const weave::placement& where,
                        int rank) {
  return o.partial_sums ? partial_sums_reference(in, o.k, f, where, rank) : reference(in, o.k, f);
}

// Rows expert `e` gets from a rank with these ids (unreplicated placements).
inline std::int64_t pairs_for(const std::vector<std::int32_t>& ids, int e) {
  return std::count(ids.begin(), ids.end(), e);
}

// One decode call: dispatch, the linear experts on every local slot's rows, combine. Returns
// y; `rows[l * D + s]` receives the per-(slot, source) counts the handle reported.
template <class T, class Exchange, class Stream>
std::vector<T> decode_call(Exchange& ex, const moe_test::rank_input<T>& in,
                           const moe_test::linear_experts& f, Stream& s,
                           std::vector<std::int64_t>* rows = nullptr) {
  const std::size_t H = f.hidden;
  std::vector<T> y(in.x.rows() * H, T(-7.0f));
  auto h = ex.dispatch(in.x.elements(), in.ids, in.weights, s);
  s.synchronize();
  const auto xs = h.experts();
  const int D = ex.where().num_devices();
  const bool gathered = ex.options().gathered_inputs;
  std::vector<int> busy; // brute force: the slots that received rows
  for (int l = 0; l < xs.local_experts(); ++l)
    if (xs.rows(l) > 0)
      busy.push_back(l);
  CHECK(std::vector<int>(xs.busy().begin(), xs.busy().end()) == busy);
  for (int l = 0; l < xs.local_experts(); ++l) {
    const auto output = xs.output(l);
    for (std::int64_t r = 0; r < xs.rows(l); ++r) // (the rows where they arrived, or copies)
      f.apply(xs.expert(l),
              gathered ? xs.input_rows(l)[static_cast<std::size_t>(r)]
                       : xs.input(l).data() + r * static_cast<std::int64_t>(H),
              output.data() + r * static_cast<std::int64_t>(H));
    if (rows != nullptr)
      for (int src = 0; src < D; ++src)
        rows->push_back(xs.rows(l, src));
  }
  ex.combine(h, std::span<T>(y), s);
  s.synchronize();
  return y;
}

// How a rank's call ended.
struct outcome {
  weave::errc code{};
  std::string message;
};

template <class F>
outcome outcome_of(F&& f) {
  try {
    f();
  } catch (const weave::error& e) {
    return {e.code(), e.what()};
  }
  return {};
}

template <class T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

} // namespace decode_test
