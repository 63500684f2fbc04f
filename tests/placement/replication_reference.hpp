// Today's replicated placement, kept verbatim as the reference the incremental packing in
// weave/placement/replication.hpp must equal: every copy placed recomputes every device's
// load and size from scratch. Used by the tests (equality on random shapes) and the placement
// benchmark (the from-scratch baseline).
#pragma once

#include <weave/placement/placement.hpp>
#include <weave/placement/policies.hpp>
#include <weave/placement/replication.hpp>
#include <weave/placement/topology.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

namespace replication_reference {

using namespace weave;

//! Copies of experts assigned to bins of `capacity` copies each, at most `per_bin` copies of an
//! expert per bin. `bin_of[i]` is the bin of copy i (-1 while unassigned).
struct replica_packing {
  std::vector<std::int32_t> expert; // copy -> expert
  std::vector<double> weight;       // copy -> load it carries
  std::vector<int> bin_of;
  int bins = 0, capacity = 0, per_bin = 1;

  std::vector<double> bin_loads() const {
    std::vector<double> l(static_cast<std::size_t>(bins), 0.0);
    for (std::size_t i = 0; i < bin_of.size(); ++i)
      if (bin_of[i] >= 0)
        l[static_cast<std::size_t>(bin_of[i])] += weight[i];
    return l;
  }
  std::vector<int> held; // bin × experts: copies of each expert in each bin
  // Optional E×E co-activation: when set, `pack_rest` puts a copy in the bin it collaborates
  // with most among those whose load stays within `cap`.
  std::span<const double> affinity;
  double cap = 0;

  double affinity_to(std::size_t i, int bin) const {
    const auto E = static_cast<std::size_t>(std::sqrt(static_cast<double>(affinity.size())) + 0.5);
    double a = 0;
    for (std::size_t x = 0; x < bin_of.size(); ++x)
      if (bin_of[x] == bin)
        a +=
            affinity[static_cast<std::size_t>(expert[i]) * E + static_cast<std::size_t>(expert[x])];
    return a;
  }
  int num_experts = 0;

  // Rebuilds `held` after `bin_of` was written directly.
  void sync() {
    num_experts = expert.empty() ? 0 : *std::max_element(expert.begin(), expert.end()) + 1;
    held.assign(static_cast<std::size_t>(bins) * static_cast<std::size_t>(num_experts), 0);
    for (std::size_t i = 0; i < bin_of.size(); ++i)
      if (bin_of[i] >= 0)
        ++held[index(bin_of[i], expert[i])];
  }
  std::size_t index(int bin, std::int32_t e) const {
    return static_cast<std::size_t>(bin) * static_cast<std::size_t>(num_experts) +
           static_cast<std::size_t>(e);
  }
  void set_bin(std::size_t i, int bin) {
    if (bin_of[i] >= 0)
      --held[index(bin_of[i], expert[i])];
    bin_of[i] = bin;
    if (bin >= 0)
      ++held[index(bin, expert[i])];
  }
  int copies_in(int bin, std::int32_t e) const { return held[index(bin, e)]; }
  int size_of(int bin) const {
    return static_cast<int>(std::count(bin_of.begin(), bin_of.end(), bin));
  }

  // Unassigned copies heaviest first into the lightest bin that can take them; when no bin
  // can (all bins with room already hold enough copies), a copy from another bin moves over.
  void pack_rest() {
    sync();
    std::vector<std::size_t> order;
    for (std::size_t i = 0; i < bin_of.size(); ++i)
      if (bin_of[i] < 0)
        order.push_back(i);
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t a, std::size_t b) { return weight[a] > weight[b]; });
    std::vector<double> load = bin_loads();
    std::vector<int> size(static_cast<std::size_t>(bins), 0);
    for (int b = 0; b < bins; ++b)
      size[static_cast<std::size_t>(b)] = size_of(b);
    for (const std::size_t i : order) {
      int best = -1;
      for (int b = 0; b < bins; ++b)
        if (size[static_cast<std::size_t>(b)] < capacity && copies_in(b, expert[i]) < per_bin &&
            (best < 0 || load[static_cast<std::size_t>(b)] < load[static_cast<std::size_t>(best)]))
          best = b;
      if (best >= 0 && !affinity.empty()) {
        // Among bins that stay under the cap, the one whose copies collaborate most with it.
        double best_aff = -1;
        for (int b = 0; b < bins; ++b) {
          if (size[static_cast<std::size_t>(b)] >= capacity || copies_in(b, expert[i]) >= per_bin ||
              load[static_cast<std::size_t>(b)] + weight[i] > cap)
            continue;
          const double a = affinity_to(i, b);
          if (a > best_aff) {
            best_aff = a;
            best = b;
          }
        }
      }
      if (best < 0)
        best = make_room(i);
      set_bin(i, best);
      load = bin_loads();
      for (int b = 0; b < bins; ++b)
        size[static_cast<std::size_t>(b)] = size_of(b);
    }
  }

  // Some bin h has room but already holds enough copies of copy i's expert: move a copy x from
  // a bin o that can take i (and whose expert h can take) into h; i then goes to o.
  int make_room(std::size_t i) {
    for (int h = 0; h < bins; ++h) {
      if (size_of(h) >= capacity)
        continue;
      for (std::size_t x = 0; x < bin_of.size(); ++x) {
        const int o = bin_of[x];
        if (o < 0 || o == h || copies_in(o, expert[i]) >= per_bin ||
            copies_in(h, expert[x]) >= per_bin)
          continue;
        set_bin(x, h);
        return o;
      }
    }
    WEAVE_THROW(weave::errc::internal, "no bin can take a copy of expert ", expert[i]);
  }

  // Swaps between the heaviest bin and the others while one lowers the pair maximum, until
  // the maximum is at most `good_enough` (each swap moves two copies; stopping early keeps
  // more of a starting placement).
  void refine(double good_enough = 0) {
    sync();
    std::vector<double> load = bin_loads();
    const std::size_t n = bin_of.size();
    for (std::size_t round = 0; round < 4 * n * n + 16; ++round) {
      const auto hi = static_cast<int>(std::max_element(load.begin(), load.end()) - load.begin());
      const double top = load[static_cast<std::size_t>(hi)];
      if (top <= good_enough)
        break;
      double best_peak = top;
      std::size_t ba = n, bb = n;
      for (std::size_t a = 0; a < n; ++a) {
        if (bin_of[a] != hi)
          continue;
        for (std::size_t b = 0; b < n; ++b) {
          const int o = bin_of[b];
          if (o == hi || weight[b] >= weight[a] || expert[a] == expert[b])
            continue;
          if (copies_in(o, expert[a]) >= per_bin || copies_in(hi, expert[b]) >= per_bin)
            continue;
          const double d = weight[a] - weight[b];
          const double peak = std::max(top - d, load[static_cast<std::size_t>(o)] + d);
          if (peak < best_peak - 1e-12 * std::max(1.0, top)) {
            best_peak = peak;
            ba = a;
            bb = b;
          }
        }
      }
      if (ba == n)
        break;
      const int o = bin_of[bb];
      const double d = weight[ba] - weight[bb];
      load[static_cast<std::size_t>(hi)] -= d;
      load[static_cast<std::size_t>(o)] += d;
      set_bin(ba, o);
      set_bin(bb, hi);
    }
  }
};

inline double peak_of(const std::vector<double>& l) {
  return *std::max_element(l.begin(), l.end());
}

//! All copies of all experts (copy i of expert e carries load[e] / count[e]).
inline replica_packing make_copies(std::span<const double> loads, const std::vector<int>& count,
                                   int bins, int capacity, int per_bin) {
  replica_packing p;
  p.bins = bins;
  p.capacity = capacity;
  p.per_bin = per_bin;
  for (std::size_t e = 0; e < count.size(); ++e)
    for (int c = 0; c < count[e]; ++c) {
      p.expert.push_back(static_cast<std::int32_t>(e));
      p.weight.push_back(loads[e] / count[e]);
      p.bin_of.push_back(-1);
    }
  return p;
}

inline placement placement_from_packing(int E, const replica_packing& p) {
  std::vector<std::vector<std::int32_t>> groups(static_cast<std::size_t>(p.bins));
  for (std::size_t i = 0; i < p.bin_of.size(); ++i)
    groups[static_cast<std::size_t>(p.bin_of[i])].push_back(p.expert[i]);
  return weave::detail::placement_from_groups(E, std::move(groups));
}

inline placement place_replicated(std::span<const double> loads, std::span<const double> coact,
                                  const topology& topo, const replication_options& options) {
  topo.validated();
  const int E = static_cast<int>(loads.size());
  const int D = topo.num_devices();
  WEAVE_EXPECT(E > 0, errc::invalid_argument, "no experts to place");
  const long long slots = static_cast<long long>(E) + options.redundant_slots;
  WEAVE_EXPECT(options.redundant_slots >= 0 && slots % D == 0, errc::invalid_argument, E,
               " experts + ", options.redundant_slots, " redundant slots do not divide over ", D,
               " devices");
  WEAVE_EXPECT(std::isfinite(options.keep_tolerance) && options.keep_tolerance >= 0,
               errc::invalid_argument, "keep_tolerance = ", options.keep_tolerance);
  const int S = static_cast<int>(slots / D);
  const std::vector<int> count = replica_counts(loads, options.redundant_slots, D);

  // Flat: replicate-hottest + LPT + swaps.
  auto flat = make_copies(loads, count, D, S, 1);
  flat.pack_rest();
  flat.refine();
  auto best = flat;
  if (topo.nodes > 1) {
    // Hierarchical: copies onto nodes first, then onto each node's devices.
    auto nodes =
        make_copies(loads, count, topo.nodes, S * topo.devices_per_node, topo.devices_per_node);
    nodes.pack_rest();
    nodes.refine();
    auto hier = flat;
    for (int n = 0; n < topo.nodes; ++n) {
      replica_packing inner;
      inner.bins = topo.devices_per_node;
      inner.capacity = S;
      std::vector<std::size_t> ids;
      for (std::size_t i = 0; i < nodes.bin_of.size(); ++i)
        if (nodes.bin_of[i] == n) {
          ids.push_back(i);
          inner.expert.push_back(nodes.expert[i]);
          inner.weight.push_back(nodes.weight[i]);
          inner.bin_of.push_back(-1);
        }
      inner.pack_rest();
      inner.refine();
      for (std::size_t c = 0; c < ids.size(); ++c) {
        hier.expert[ids[c]] = inner.expert[c];
        hier.weight[ids[c]] = inner.weight[c];
        hier.bin_of[ids[c]] = n * topo.devices_per_node + inner.bin_of[c];
      }
    }
    hier.refine();
    if (peak_of(hier.bin_loads()) <= peak_of(flat.bin_loads()))
      best = hier;
  }
  if (options.current != nullptr) {
    const placement& cur = *options.current;
    WEAVE_EXPECT(cur.num_experts() == E && cur.num_devices() == D, errc::size_mismatch,
                 "current placement has ", cur.num_experts(), " experts on ", cur.num_devices(),
                 " devices, expected ", E, " on ", D);
    auto sticky = make_copies(loads, count, D, S, 1);
    // Keep each expert's copies on the devices that hold it now, heaviest first per device.
    std::vector<int> kept(static_cast<std::size_t>(E), 0), size(static_cast<std::size_t>(D), 0);
    std::vector<std::size_t> first_copy(static_cast<std::size_t>(E) + 1, 0);
    for (int e = 0; e < E; ++e)
      first_copy[static_cast<std::size_t>(e) + 1] =
          first_copy[static_cast<std::size_t>(e)] +
          static_cast<std::size_t>(count[static_cast<std::size_t>(e)]);
    std::vector<int> order(static_cast<std::size_t>(cur.num_slots()));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      const auto ea = static_cast<std::size_t>(cur.expert_of_slot(a));
      const auto eb = static_cast<std::size_t>(cur.expert_of_slot(b));
      return loads[ea] / count[ea] > loads[eb] / count[eb];
    });
    for (const int s : order) {
      const auto e = static_cast<std::size_t>(cur.expert_of_slot(s));
      const auto d = static_cast<std::size_t>(cur.device_of_slot(s));
      if (kept[e] < count[e] && size[d] < S) {
        sticky.bin_of[first_copy[e] + static_cast<std::size_t>(kept[e]++)] = static_cast<int>(d);
        ++size[d];
      }
    }
    sticky.affinity = coact;
    sticky.cap = peak_of(best.bin_loads()) * (1.0 + options.keep_tolerance);
    sticky.pack_rest();
    sticky.refine(sticky.cap);
    if (peak_of(sticky.bin_loads()) <= peak_of(best.bin_loads()) * (1.0 + options.keep_tolerance))
      best = sticky;
  }
  return placement_from_packing(E, best);
}

} // namespace replication_reference
