// Independent naive references for the routing tests: random placements, Tutel/GShard-style
// mask + cumsum dispatch, and a multi-device exchange simulated in one process.
#pragma once

#include <weave/placement/placement.hpp>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

namespace ref {

// E experts over D devices; `replicas` extra slots per device filled with experts that device
// does not hold yet (0 = an unreplicated random permutation).
inline weave::placement random_placement(int E, int D, int extra_per_device, std::mt19937& rng) {
  const int base = (E + D - 1) / D;
  const int spd = std::min(base + extra_per_device, E); // a device holds each expert once
  std::vector<int> perm(static_cast<std::size_t>(E));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  std::vector<std::int32_t> slots(static_cast<std::size_t>(spd * D), -1);
  for (int i = 0; i < E; ++i)
    slots[static_cast<std::size_t>((i % D) * spd + i / D)] = perm[static_cast<std::size_t>(i)];
  for (int d = 0; d < D; ++d)
    for (int s = 0; s < spd; ++s) {
      auto& slot = slots[static_cast<std::size_t>(d * spd + s)];
      if (slot >= 0)
        continue;
      for (;;) {
        const int e = std::uniform_int_distribution<int>(0, E - 1)(rng);
        bool here = false;
        for (int o = 0; o < spd; ++o)
          here = here || slots[static_cast<std::size_t>(d * spd + o)] == e;
        if (!here) {
          slot = e;
          break;
        }
      }
    }
  return weave::placement(E, D, std::move(slots));
}

// Tutel-style capacity decision with one-hot masks and cumulative sums, one pass per choice r
// as Tutel's extract_critical: the [T, E] one-hot mask of every token's r-th choice, its rows
// visited in token order or (prioritized) by descending priority, stable; the cumsum down each
// column is a pair's location among that choice's pairs, plus the pairs every earlier choice
// sent to the expert (acc_base); a pair is kept when its location < capacity.
// order: 0 token-major, 1 rank-major, 2 rank-major over prioritized tokens (Tutel's batch
// prioritized routing), 3 prioritized tokens, each token's choices in rank order.
inline std::vector<std::uint8_t> mask_keep(const std::vector<std::int32_t>& ids, int k, int E,
                                           long long capacity, int order,
                                           const std::vector<float>& priority) {
  const std::size_t T = ids.size() / static_cast<std::size_t>(k);
  const auto EE = static_cast<std::size_t>(E);
  std::vector<std::size_t> rows(T); // token of each mask row
  std::iota(rows.begin(), rows.end(), 0);
  if (order >= 2)
    std::stable_sort(rows.begin(), rows.end(),
                     [&](std::size_t a, std::size_t b) { return priority[a] > priority[b]; });
  std::vector<std::uint8_t> keep(ids.size(), 0);
  auto kept = [&](long long location) { return capacity < 0 || location < capacity; };
  if (order == 1 || order == 2) {
    std::vector<long long> acc_base(EE, 0);
    for (int r = 0; r < k; ++r) {
      std::vector<long long> mask(T * EE, 0);
      for (std::size_t n = 0; n < T; ++n) {
        const int e = ids[rows[n] * static_cast<std::size_t>(k) + static_cast<std::size_t>(r)];
        if (e >= 0)
          mask[n * EE + static_cast<std::size_t>(e)] = 1;
      }
      for (std::size_t e = 0; e < EE; ++e) {
        long long run = 0;
        for (std::size_t n = 0; n < T; ++n) {
          run += mask[n * EE + e];
          if (mask[n * EE + e] == 1)
            keep[rows[n] * static_cast<std::size_t>(k) + static_cast<std::size_t>(r)] =
                kept(acc_base[e] + run - 1) ? 1 : 0;
        }
        acc_base[e] += run;
      }
    }
    return keep;
  }
  // Token-major orders: one mask row per pair, pairs of a token together.
  std::vector<std::size_t> pairs;
  for (const std::size_t t : rows)
    for (int r = 0; r < k; ++r)
      pairs.push_back(t * static_cast<std::size_t>(k) + static_cast<std::size_t>(r));
  std::vector<long long> mask(pairs.size() * EE, 0);
  for (std::size_t n = 0; n < pairs.size(); ++n)
    if (ids[pairs[n]] >= 0)
      mask[n * EE + static_cast<std::size_t>(ids[pairs[n]])] = 1;
  for (std::size_t e = 0; e < EE; ++e) {
    long long run = 0;
    for (std::size_t n = 0; n < pairs.size(); ++n) {
      run += mask[n * EE + e];
      if (mask[n * EE + e] == 1)
        keep[pairs[n]] = kept(run - 1) ? 1 : 0;
    }
  }
  return keep;
}

// Mask-based SFD layout: a [T, D] one-hot device mask per kept pair, cumsum per device column
// gives each (token, device) row its place within the device's segment.
struct mask_dispatch {
  std::vector<long long> counts, offsets;                     // [D], [D+1]
  std::vector<long long> row_token;                           // [rows]
  std::vector<std::vector<long long>> token_rows;             // ascending device order
  std::vector<std::vector<std::pair<int, float>>> row_routes; // (local, weight) rank order
  double copies_per_token = 0;
};

inline mask_dispatch naive_dispatch(const std::vector<std::int32_t>& ids,
                                    const std::vector<float>& weights,
                                    const std::vector<std::uint8_t>& keep, int k,
                                    const weave::placement& p, int source, std::size_t offset) {
  const std::size_t T = ids.size() / static_cast<std::size_t>(k);
  const int D = p.num_devices();
  std::vector<int> mask(T * static_cast<std::size_t>(D), 0);
  std::vector<int> slot_of(ids.size(), -1);
  for (std::size_t t = 0; t < T; ++t)
    for (int r = 0; r < k; ++r) {
      const std::size_t q = t * static_cast<std::size_t>(k) + static_cast<std::size_t>(r);
      if (ids[q] < 0 || (!keep.empty() && !keep[q]))
        continue;
      slot_of[q] = p.slot_for(ids[q], offset + t, source);
      mask[t * static_cast<std::size_t>(D) +
           static_cast<std::size_t>(p.device_of_slot(slot_of[q]))] = 1;
    }
  mask_dispatch out;
  out.counts.assign(static_cast<std::size_t>(D), 0);
  std::vector<long long> location(mask.size(), -1);
  for (int d = 0; d < D; ++d) {
    long long run = 0;
    for (std::size_t t = 0; t < T; ++t) {
      run += mask[t * static_cast<std::size_t>(D) + static_cast<std::size_t>(d)];
      if (mask[t * static_cast<std::size_t>(D) + static_cast<std::size_t>(d)])
        location[t * static_cast<std::size_t>(D) + static_cast<std::size_t>(d)] = run - 1;
    }
    out.counts[static_cast<std::size_t>(d)] = run;
  }
  out.offsets.assign(static_cast<std::size_t>(D) + 1, 0);
  for (int d = 0; d < D; ++d)
    out.offsets[static_cast<std::size_t>(d) + 1] =
        out.offsets[static_cast<std::size_t>(d)] + out.counts[static_cast<std::size_t>(d)];
  const auto rows = static_cast<std::size_t>(out.offsets.back());
  out.row_token.assign(rows, -1);
  out.row_routes.assign(rows, {});
  out.token_rows.assign(T, {});
  for (std::size_t t = 0; t < T; ++t)
    for (int d = 0; d < D; ++d) {
      const long long loc = location[t * static_cast<std::size_t>(D) + static_cast<std::size_t>(d)];
      if (loc < 0)
        continue;
      const auto row = static_cast<std::size_t>(out.offsets[static_cast<std::size_t>(d)] + loc);
      out.row_token[row] = static_cast<long long>(t);
      out.token_rows[t].push_back(static_cast<long long>(row));
      for (int r = 0; r < k; ++r) {
        const std::size_t q = t * static_cast<std::size_t>(k) + static_cast<std::size_t>(r);
        if (slot_of[q] >= 0 && p.device_of_slot(slot_of[q]) == d)
          out.row_routes[row].push_back({p.local_of_slot(slot_of[q]), weights[q]});
      }
    }
  out.copies_per_token = T == 0 ? 0.0 : static_cast<double>(rows) / static_cast<double>(T);
  return out;
}

} // namespace ref
