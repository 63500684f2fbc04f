//! \file
//! How good a placement is for a routing trace: copies per token (CT, distinct destination
//! devices per token), the share of copies leaving the token's device or node, bytes sent per
//! token, and max/mean device load; plus the reference values CT is compared against.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/placement/placement.hpp"
#include "weave/placement/replica_choice.hpp"
#include "weave/placement/topology.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

WEAVE_NAMESPACE_BEGIN

//! Lower bound of CT: a token's `k` experts fill at least ceil(k·D/E) devices when each device
//! holds E/D experts.
inline double copies_per_token_lower_bound(int num_experts, int k, int num_devices) {
  WEAVE_EXPECT(num_experts > 0 && num_devices > 0 && k > 0 && k <= num_experts,
               errc::invalid_argument, "CT bound of k = ", k, ", E = ", num_experts,
               ", D = ", num_devices);
  const long long kd = static_cast<long long>(k) * num_devices;
  return static_cast<double>((kd + num_experts - 1) / num_experts);
}

//! Upper bound of CT: min(k, D).
inline double copies_per_token_upper_bound(int k, int num_devices) noexcept {
  return static_cast<double>(std::min(k, num_devices));
}

//! Expected CT when `k` distinct experts are drawn uniformly and each of `g` devices holds
//! E/g of them: g·(1 − C(E − E/g, k) / C(E, k)).
inline double copies_per_token_random(int num_experts, int k, int g) {
  WEAVE_EXPECT(g > 0 && num_experts % g == 0 && k > 0 && k <= num_experts, errc::invalid_argument,
               "random CT of k = ", k, ", E = ", num_experts, ", g = ", g);
  // C(E - m, k) / C(E, k) = prod_{i<k} (E - m - i) / (E - i), computed without overflow.
  const int m = num_experts / g;
  double ratio = 1.0;
  for (int i = 0; i < k; ++i)
    ratio *= std::max(0.0, static_cast<double>(num_experts - m - i)) / (num_experts - i);
  return g * (1.0 - ratio);
}

//! What `evaluate_placement` measures on a trace.
struct placement_metrics {
  std::int64_t tokens = 0;               //!< tokens with at least one expert
  double copies_per_token = 0;           //!< mean distinct destination devices (CT)
  double remote_per_token = 0;           //!< mean destination devices other than the source device
  double cross_node_per_token = 0;       //!< mean destination nodes other than the source node
  double bytes_per_token = 0;            //!< remote copies × `row_bytes` (one direction)
  std::vector<std::int64_t> device_rows; //!< (token, expert) rows each device computes
  double max_mean_load = 0;              //!< max / mean of `device_rows` (1 = perfectly even)
};

//! Evaluates `p` on a trace of `k` expert ids per token (token-major, negative = none).
//! `source_devices` gives each token's device; empty means token `t` on device `t % D`.
//! `row_bytes` is one token row (hidden size × element size). Throws `errc::size_mismatch`
//! for a trace that is not whole tokens, `errc::out_of_range` for ids or devices outside `p`.
inline placement_metrics evaluate_placement(const placement& p, const topology& topo,
                                            std::span<const std::int32_t> ids, int k,
                                            double row_bytes = 0,
                                            std::span<const std::int32_t> source_devices = {},
                                            replica_options options = {}) {
  WEAVE_EXPECT(k > 0 && ids.size() % static_cast<std::size_t>(k) == 0, errc::size_mismatch,
               ids.size(), " ids are not a whole number of tokens with k = ", k);
  const auto kk = static_cast<std::size_t>(k);
  const std::size_t tokens = ids.size() / kk;
  WEAVE_EXPECT(source_devices.empty() || source_devices.size() == tokens, errc::size_mismatch,
               source_devices.size(), " source devices for ", tokens, " tokens");
  replica_router router(p, topo, options);
  const auto D = static_cast<std::size_t>(p.num_devices());
  std::vector<std::int32_t> slots(kk);
  std::vector<std::int64_t> seen_device(D, -1), seen_node(static_cast<std::size_t>(topo.nodes), -1);
  placement_metrics m;
  std::int64_t copies = 0, remote = 0, cross_node = 0;
  for (std::size_t t = 0; t < tokens; ++t) {
    const int source = source_devices.empty() ? static_cast<int>(t % D) : source_devices[t];
    router.route(ids.subspan(t * kk, kk), t, source, slots);
    const auto stamp = static_cast<std::int64_t>(t);
    bool any = false;
    for (const std::int32_t s : slots) {
      if (s < 0)
        continue;
      any = true;
      const int d = p.device_of_slot(s);
      if (seen_device[static_cast<std::size_t>(d)] != stamp) {
        seen_device[static_cast<std::size_t>(d)] = stamp;
        ++copies;
        remote += d != source;
      }
      const int n = topo.node_of(d);
      if (n != topo.node_of(source) && seen_node[static_cast<std::size_t>(n)] != stamp) {
        seen_node[static_cast<std::size_t>(n)] = stamp;
        ++cross_node;
      }
    }
    m.tokens += any;
  }
  const double n = m.tokens > 0 ? static_cast<double>(m.tokens) : 1.0;
  m.copies_per_token = static_cast<double>(copies) / n;
  m.remote_per_token = static_cast<double>(remote) / n;
  m.cross_node_per_token = static_cast<double>(cross_node) / n;
  m.bytes_per_token = m.remote_per_token * row_bytes;
  m.device_rows.assign(router.device_rows().begin(), router.device_rows().end());
  std::int64_t total = 0, peak = 0;
  for (const std::int64_t r : m.device_rows) {
    total += r;
    peak = std::max(peak, r);
  }
  m.max_mean_load =
      total > 0 ? static_cast<double>(peak) * static_cast<double>(D) / static_cast<double>(total)
                : 0.0;
  return m;
}

//! Max/mean of the expected device loads of `p` when expert `e` receives `loads[e]` rows split
//! evenly over its replicas (what `replica_policy::in_turn` gives with tokens spread over
//! devices). Throws `errc::size_mismatch` unless there is one load per expert.
inline double expected_max_mean_load(const placement& p, std::span<const double> loads) {
  WEAVE_EXPECT(loads.size() == static_cast<std::size_t>(p.num_experts()), errc::size_mismatch,
               loads.size(), " loads for ", p.num_experts(), " experts");
  std::vector<double> device(static_cast<std::size_t>(p.num_devices()), 0.0);
  double total = 0;
  for (int s = 0; s < p.num_slots(); ++s) {
    const int e = p.expert_of_slot(s);
    if (e == placement::empty_slot)
      continue;
    device[static_cast<std::size_t>(p.device_of_slot(s))] +=
        loads[static_cast<std::size_t>(e)] / static_cast<double>(p.slots_of(e).size());
  }
  double peak = 0;
  for (const double l : device) {
    total += l;
    peak = std::max(peak, l);
  }
  return total > 0 ? peak * static_cast<double>(device.size()) / total : 0.0;
}

WEAVE_NAMESPACE_END
