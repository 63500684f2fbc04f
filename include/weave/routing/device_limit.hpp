//! \file
//! Device-limited routing (collaboration pruning): each token's experts span at most M devices.
//!
//! Two rules, as in the literature:
//! - by score (DeepSeek-V3 node-limited routing): before top-k, each device is scored by the sum
//!   of the best `group_experts` selection scores among the experts the token would reach there,
//!   the M best devices are kept and top-k runs over their experts only (`top_k_gate` applies it
//!   when `gate_options::limit` is set; `select_devices` is the per-token step);
//! - by similarity (Occult-style pruning): after top-k, the devices of the token's first
//!   choices are kept (in rank order, until M distinct devices) and every expert outside them is
//!   replaced by the most similar unselected expert inside them (`prune_by_similarity`).
//!
//! The device of an expert for a token is the device of the replica `placement::slot_for`
//! resolves it to, so a plan built from the result sends the token to at most M devices.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/float_bits.hpp"
#include "weave/placement/placement.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

WEAVE_NAMESPACE_BEGIN

//! Which devices a token may reach and how replicas are resolved.
struct device_limit {
  const placement* where = nullptr; //!< the expert placement (borrowed, must outlive the call)
  int max_devices = 0;              //!< M: the most devices one token is sent to (>= 1)
  int source_device = 0;            //!< device the tokens come from (replica resolution)
  std::size_t token_offset = 0;     //!< global index of the first token (replica resolution)
  int group_experts = 0;            //!< best experts summed per device; 0 means ceil(k / M)
};

namespace detail {

inline void validate_limit(const device_limit& limit, int num_experts, int k) {
  WEAVE_EXPECT(limit.where != nullptr, errc::invalid_argument, "device_limit without a placement");
  const placement& p = *limit.where;
  WEAVE_EXPECT(p.num_experts() == num_experts, errc::size_mismatch, "placement of ",
               p.num_experts(), " experts for ", num_experts, " experts");
  WEAVE_EXPECT(limit.max_devices >= 1, errc::invalid_argument, "max_devices = ", limit.max_devices);
  WEAVE_EXPECT(limit.source_device >= 0 && limit.source_device < p.num_devices(),
               errc::out_of_range, "source device ", limit.source_device, " outside [0, ",
               p.num_devices(), ")");
  WEAVE_EXPECT(limit.group_experts >= 0, errc::invalid_argument,
               "group_experts = ", limit.group_experts);
  // Any M devices must hold k experts: the M with the fewest filled slots (empty slots hold
  // none; without them this is M * slots_per_device).
  std::vector<int> filled(static_cast<std::size_t>(p.num_devices()));
  for (int d = 0; d < p.num_devices(); ++d)
    filled[static_cast<std::size_t>(d)] = p.filled_slots_on(d);
  std::sort(filled.begin(), filled.end());
  long long reachable = 0;
  for (int d = 0; d < std::min(limit.max_devices, p.num_devices()); ++d)
    reachable += filled[static_cast<std::size_t>(d)];
  WEAVE_EXPECT(reachable >= k || limit.max_devices >= p.num_devices(), errc::invalid_argument,
               "k = ", k, " experts cannot fit on max_devices = ", limit.max_devices,
               " devices holding at least ", reachable, " experts between them");
}

//! Device of expert `e` for token `token` under `limit`.
inline int routed_device(const device_limit& limit, int e, std::size_t token) {
  const placement& p = *limit.where;
  return p.device_of_slot(p.slot_for(e, limit.token_offset + token, limit.source_device));
}

} // namespace detail

//! Scratch for `select_devices`, reused across tokens (no allocation per token).
struct device_select_scratch {
  std::vector<int> device_of; // expert -> device for the current token
  std::vector<float> best;    // device-major, group_experts best scores each
  std::vector<int> filled;    // per device: scores held in `best`
  std::vector<double> score;  // per device group score
  std::vector<std::uint8_t> allowed;
};

//! The by-score rule for one token: marks `allowed_expert[e]` for the experts on the M devices
//! with the highest group score (sum of their best `g` selection scores; ties: lower device).
//! Experts with a selection score of -inf count as unavailable. Throws `errc::invalid_argument`
//! if the chosen devices hold fewer than `k` available experts.
inline void select_devices(const device_limit& limit, std::span<const float> selection, int k,
                           std::size_t token, device_select_scratch& s,
                           std::span<std::uint8_t> allowed_expert) {
  const placement& p = *limit.where;
  const int E = p.num_experts();
  const int D = p.num_devices();
  const int M = limit.max_devices;
  const int g = limit.group_experts > 0 ? limit.group_experts : (k + M - 1) / M;
  s.device_of.resize(static_cast<std::size_t>(E));
  s.best.resize(static_cast<std::size_t>(D) * static_cast<std::size_t>(g));
  s.filled.assign(static_cast<std::size_t>(D), 0);
  s.score.assign(static_cast<std::size_t>(D), 0.0);
  s.allowed.assign(static_cast<std::size_t>(D), 0);
  for (int e = 0; e < E; ++e) {
    const int d = detail::routed_device(limit, e, token);
    s.device_of[static_cast<std::size_t>(e)] = d;
    const float x = selection[static_cast<std::size_t>(e)];
    if (detail::is_negative_inf(x)) // masked (select_groups)
      continue;
    // Keep the device's g best scores sorted descending (insertion; g is small).
    float* best = s.best.data() + static_cast<std::size_t>(d) * static_cast<std::size_t>(g);
    int& n = s.filled[static_cast<std::size_t>(d)];
    int at = n < g ? n : g;
    if (n == g && !(x > best[g - 1]))
      continue;
    while (at > 0 && x > best[at - 1]) {
      if (at < g)
        best[at] = best[at - 1];
      --at;
    }
    best[at] = x;
    if (n < g)
      ++n;
  }
  for (int d = 0; d < D; ++d) {
    double sum = 0.0;
    for (int i = 0; i < s.filled[static_cast<std::size_t>(d)]; ++i)
      sum += s.best[static_cast<std::size_t>(d) * static_cast<std::size_t>(g) +
                    static_cast<std::size_t>(i)];
    s.score[static_cast<std::size_t>(d)] = sum;
  }
  for (int chosen = 0; chosen < M && chosen < D; ++chosen) {
    int pick = -1;
    for (int d = 0; d < D; ++d) {
      if (s.allowed[static_cast<std::size_t>(d)] || s.filled[static_cast<std::size_t>(d)] == 0)
        continue;
      if (pick < 0 ||
          s.score[static_cast<std::size_t>(d)] > s.score[static_cast<std::size_t>(pick)])
        pick = d;
    }
    if (pick < 0)
      break;
    s.allowed[static_cast<std::size_t>(pick)] = 1;
  }
  int available = 0;
  for (int e = 0; e < E; ++e) {
    const bool ok = s.allowed[static_cast<std::size_t>(s.device_of[static_cast<std::size_t>(e)])] &&
                    !detail::is_negative_inf(selection[static_cast<std::size_t>(e)]);
    allowed_expert[static_cast<std::size_t>(e)] = ok ? 1 : 0;
    available += ok ? 1 : 0;
  }
  WEAVE_EXPECT(available >= k, errc::invalid_argument, "token ", limit.token_offset + token,
               ": the ", M, " best devices hold ", available,
               " available experts, fewer than k = ", k);
}

//! The by-similarity rule on top-k output (`ids`, `weights`: k per token, rank order). Keeps the
//! devices of the token's choices in rank order until M distinct devices, and replaces each
//! expert on another device by the unselected expert on a kept device with the highest
//! `similarity[e * E + candidate]` (ties: lower id); the replacement keeps the gate weight of the
//! expert it replaces. Ids of -1 are skipped. Returns the number of replacements. Throws
//! `errc::invalid_argument` when the kept devices have no unselected expert left.
inline std::int64_t prune_by_similarity(std::span<std::int32_t> ids, int k,
                                        const device_limit& limit,
                                        std::span<const float> similarity) {
  WEAVE_EXPECT(k >= 1 && ids.size() % static_cast<std::size_t>(k) == 0, errc::size_mismatch,
               ids.size(), " ids are not a whole number of tokens with k = ", k);
  WEAVE_EXPECT(limit.where != nullptr, errc::invalid_argument, "device_limit without a placement");
  const int E = limit.where->num_experts();
  detail::validate_limit(limit, E, k);
  WEAVE_EXPECT(similarity.size() == static_cast<std::size_t>(E) * static_cast<std::size_t>(E),
               errc::size_mismatch, "similarity table of ", similarity.size(), " entries for ", E,
               " experts (needs E * E)");
  const auto kk = static_cast<std::size_t>(k);
  const std::size_t tokens = ids.size() / kk;
  std::vector<int> kept_devices;
  std::vector<int> marked; // experts marked selected for the current token
  std::vector<std::uint8_t> selected(static_cast<std::size_t>(E), 0);
  std::int64_t replaced = 0;
  for (std::size_t t = 0; t < tokens; ++t) {
    const std::span<std::int32_t> row = ids.subspan(t * kk, kk);
    kept_devices.clear();
    for (const std::int32_t e : row) {
      if (e < 0)
        continue;
      WEAVE_EXPECT(e < E, errc::out_of_range, "expert id ", e, " of token ", t, " >= ", E);
      selected[static_cast<std::size_t>(e)] = 1;
      marked.push_back(e);
      const int d = detail::routed_device(limit, e, t);
      bool seen = false;
      for (const int kd : kept_devices)
        seen = seen || kd == d;
      if (!seen && static_cast<int>(kept_devices.size()) < limit.max_devices)
        kept_devices.push_back(d);
    }
    auto kept = [&](int d) {
      for (const int kd : kept_devices)
        if (kd == d)
          return true;
      return false;
    };
    for (std::int32_t& e : row) {
      if (e < 0 || kept(detail::routed_device(limit, e, t)))
        continue;
      int best = -1;
      for (int c = 0; c < E; ++c) {
        if (selected[static_cast<std::size_t>(c)] || !kept(detail::routed_device(limit, c, t)))
          continue;
        const float sim = similarity[static_cast<std::size_t>(e) * static_cast<std::size_t>(E) +
                                     static_cast<std::size_t>(c)];
        WEAVE_EXPECT(!detail::is_nan(sim), errc::invalid_argument, "similarity(", e, ", ", c,
                     ") is NaN");
        if (best < 0 || sim > similarity[static_cast<std::size_t>(e) * static_cast<std::size_t>(E) +
                                         static_cast<std::size_t>(best)])
          best = c;
      }
      WEAVE_EXPECT(best >= 0, errc::invalid_argument, "token ", limit.token_offset + t,
                   ": no unselected expert left on its ", kept_devices.size(),
                   " kept devices to replace expert ", e);
      selected[static_cast<std::size_t>(best)] = 1;
      marked.push_back(best);
      e = best;
      ++replaced;
    }
    for (const int c : marked)
      selected[static_cast<std::size_t>(c)] = 0;
    marked.clear();
  }
  return replaced;
}

WEAVE_NAMESPACE_END
