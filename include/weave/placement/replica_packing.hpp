//! \file
//! The packing engine of the replicated placement (`replication.hpp`): replica counts, then
//! copies of experts into bins (nodes or devices) of a fixed number of copies each, heaviest
//! copy first into the lightest bin that may take it, then swaps off the heaviest bin.
//!
//! Incremental: each bin keeps its copies (ascending copy index), its size and its load, and
//! placing or moving a copy updates only the two bins involved. A bin's load is always the sum
//! of its copies' weights in ascending copy index, the order a from-scratch recount adds them
//! in, so every comparison (and every tie) comes out as it would after a full recount.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/placement/placement.hpp"
#include "weave/placement/policies.hpp"
#include "weave/placement/topology.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <vector>

WEAVE_NAMESPACE_BEGIN

namespace detail {

//! Copies of experts assigned to bins of `capacity` copies each, at most `per_bin` copies of an
//! expert per bin. `bin_of[i]` is the bin of copy i (-1 while unassigned); after writing
//! `bin_of` directly, `sync()` rebuilds the per-bin state (`pack_rest` and `refine` do).
struct replica_packing {
  std::vector<std::int32_t> expert; // copy -> expert
  std::vector<double> weight;       // copy -> load it carries
  std::vector<int> bin_of;
  int bins = 0, capacity = 0, per_bin = 1;
  // Optional E×E co-activation: when set, `pack_rest` puts a copy in the bin it collaborates
  // with most among those whose load stays within `cap`.
  std::span<const double> affinity;
  double cap = 0;

  //! Load of each bin, summed from scratch in ascending copy index.
  std::vector<double> bin_loads() const {
    std::vector<double> l(static_cast<std::size_t>(bins), 0.0);
    for (std::size_t i = 0; i < bin_of.size(); ++i)
      if (bin_of[i] >= 0)
        l[static_cast<std::size_t>(bin_of[i])] += weight[i];
    return l;
  }

  //! Rebuilds the per-bin state (copies held, members, loads) from `bin_of`.
  void sync() {
    num_experts_ = expert.empty() ? 0 : *std::max_element(expert.begin(), expert.end()) + 1;
    held_.assign(static_cast<std::size_t>(bins) * static_cast<std::size_t>(num_experts_), 0);
    // One spare place per bin: a swap moves a copy in before the other one leaves.
    stride_ = static_cast<std::size_t>(capacity) + 1;
    member_.resize(static_cast<std::size_t>(bins) * stride_);
    size_.assign(static_cast<std::size_t>(bins), 0);
    for (std::size_t i = 0; i < bin_of.size(); ++i)
      if (bin_of[i] >= 0) {
        ++held_[index(bin_of[i], expert[i])];
        push(bin_of[i], i);
      }
    load_ = bin_loads();
  }

  //! Moves copy i to `bin` (-1: unassigned), updating the two bins involved.
  void set_bin(std::size_t i, int bin) {
    const int old = bin_of[i];
    if (old >= 0) {
      --held_[index(old, expert[i])];
      std::size_t* row = member_.data() + static_cast<std::size_t>(old) * stride_;
      std::size_t* end = row + size_[static_cast<std::size_t>(old)]--;
      std::size_t* at = std::lower_bound(row, end, i);
      std::copy(at + 1, end, at);
      recount(old);
    }
    bin_of[i] = bin;
    if (bin >= 0) {
      ++held_[index(bin, expert[i])];
      push(bin, i);
      std::size_t* row = member_.data() + static_cast<std::size_t>(bin) * stride_;
      std::size_t* end = row + size_[static_cast<std::size_t>(bin)];
      std::rotate(std::upper_bound(row, end - 1, i), end - 1, end); // keep ascending
      recount(bin);
    }
  }

  int copies_in(int bin, std::int32_t e) const { return held_[index(bin, e)]; }
  int size_of(int bin) const { return size_[static_cast<std::size_t>(bin)]; }
  double load_of(int bin) const { return load_[static_cast<std::size_t>(bin)]; }
  //! The copies in `bin`, ascending.
  std::span<const std::size_t> members(int bin) const {
    return {member_.data() + static_cast<std::size_t>(bin) * stride_,
            static_cast<std::size_t>(size_[static_cast<std::size_t>(bin)])};
  }

  //! Co-activation of copy i's expert with the copies in `bin`.
  double affinity_to(std::size_t i, int bin) const {
    const auto E = static_cast<std::size_t>(std::sqrt(static_cast<double>(affinity.size())) + 0.5);
    double a = 0;
    for (const std::size_t x : members(bin))
      a += affinity[static_cast<std::size_t>(expert[i]) * E + static_cast<std::size_t>(expert[x])];
    return a;
  }

  //! Unassigned copies heaviest first into the lightest bin that can take them; when no bin
  //! can (all bins with room already hold enough copies), a copy from another bin moves over.
  void pack_rest() {
    sync();
    std::vector<std::size_t> order;
    for (std::size_t i = 0; i < bin_of.size(); ++i)
      if (bin_of[i] < 0)
        order.push_back(i);
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t a, std::size_t b) { return weight[a] > weight[b]; });
    for (const std::size_t i : order) {
      int best = -1; // the lightest bin that may take it (lowest index on ties)
      for (int b = 0; b < bins; ++b)
        if ((best < 0 || load_of(b) < load_of(best)) && size_of(b) < capacity &&
            copies_in(b, expert[i]) < per_bin)
          best = b;
      if (best >= 0 && !affinity.empty()) {
        // Among bins that stay under the cap, the one whose copies collaborate most with it.
        double best_aff = -1;
        for (int b = 0; b < bins; ++b) {
          if (size_of(b) >= capacity || copies_in(b, expert[i]) >= per_bin ||
              load_of(b) + weight[i] > cap)
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
    }
  }

  //! Some bin h has room but already holds enough copies of copy i's expert: moves a copy x
  //! from a bin o that can take i (and whose expert h can take) into h; returns o for i.
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
    WEAVE_THROW(errc::internal, "no bin can take a copy of expert ", expert[i]);
  }

  //! Swaps between the heaviest bin and the others while one lowers the pair maximum, until
  //! the maximum is at most `good_enough` (each swap moves two copies; stopping early keeps
  //! more of a starting placement). Each round takes the first pair, in (copy of the heaviest
  //! bin, copy) index order, that lowers the best peak so far by more than a relative 1e-12.
  void refine(double good_enough = 0) {
    sync();
    // The swap loop tracks loads by differences (its own arithmetic, kept as it always was);
    // the per-bin state stays exact for later packing steps.
    std::vector<double> load = load_;
    const std::size_t n = bin_of.size();
    // Copies by weight, to visit only those whose weight can make a better swap (a superset,
    // widened by `margin`, then visited in index order with the exact test).
    std::vector<std::size_t> by_weight(n), window;
    std::iota(by_weight.begin(), by_weight.end(), std::size_t{0});
    std::stable_sort(by_weight.begin(), by_weight.end(),
                     [&](std::size_t a, std::size_t b) { return weight[a] < weight[b]; });
    std::vector<double> sorted_weight(n);
    for (std::size_t r = 0; r < n; ++r)
      sorted_weight[r] = weight[by_weight[r]];
    for (std::size_t round = 0; round < 4 * n * n + 16; ++round) {
      const auto hi = static_cast<int>(std::max_element(load.begin(), load.end()) - load.begin());
      const double top = load[static_cast<std::size_t>(hi)];
      if (top <= good_enough)
        break;
      const double lightest = *std::min_element(load.begin(), load.end());
      const double tol = 1e-12 * std::max(1.0, top);
      const double margin = 1e-9 * std::max(1.0, top);
      double best_peak = top;
      std::size_t ba = n, bb = n;
      for (const std::size_t a : members(hi)) {
        const double wa = weight[a];
        const std::int32_t ea = expert[a];
        // Swap a (in the heaviest bin) with a lighter copy b of another expert in bin o, when
        // o may take a's expert and the heaviest bin b's.
        auto consider = [&](std::size_t b) {
          if (!(weight[b] < wa) || expert[b] == ea)
            return;
          const int o = bin_of[b];
          if (o == hi || copies_in(o, ea) >= per_bin || copies_in(hi, expert[b]) >= per_bin)
            return;
          const double d = wa - weight[b];
          const double peak = std::max(top - d, load[static_cast<std::size_t>(o)] + d);
          if (peak < best_peak - tol) {
            best_peak = peak;
            ba = a;
            bb = b;
          }
        };
        // A better swap needs top - d < best_peak and lightest + d < best_peak, d = wa - wb.
        const double lo = wa - (best_peak - lightest) - margin;
        const double up = wa - (top - best_peak) + margin;
        const auto first = std::lower_bound(sorted_weight.begin(), sorted_weight.end(), lo);
        const auto last = std::upper_bound(first, sorted_weight.end(), up);
        if (static_cast<std::size_t>(last - first) * 8 >= n) {
          for (std::size_t b = 0; b < n; ++b)
            consider(b);
          continue;
        }
        window.assign(by_weight.begin() + (first - sorted_weight.begin()),
                      by_weight.begin() + (last - sorted_weight.begin()));
        std::sort(window.begin(), window.end());
        for (const std::size_t b : window)
          consider(b);
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

 private:
  std::size_t index(int bin, std::int32_t e) const {
    return static_cast<std::size_t>(bin) * static_cast<std::size_t>(num_experts_) +
           static_cast<std::size_t>(e);
  }
  void recount(int bin) {
    double s = 0.0;
    for (const std::size_t i : members(bin))
      s += weight[i];
    load_[static_cast<std::size_t>(bin)] = s;
  }
  // Appends copy i to `bin`'s row.
  void push(int bin, std::size_t i) {
    int& n = size_[static_cast<std::size_t>(bin)];
    if (static_cast<std::size_t>(n) == stride_)
      WEAVE_THROW(errc::internal, "bin ", bin, " holds more than ", capacity, " copies");
    member_[static_cast<std::size_t>(bin) * stride_ + static_cast<std::size_t>(n++)] = i;
  }

  int num_experts_ = 0;
  std::vector<int> held_;           // bin × experts: copies of each expert
  std::vector<std::size_t> member_; // bin-major rows of stride_: each bin's copies, ascending
  std::vector<int> size_;           // bin -> copies in it
  std::size_t stride_ = 0;
  std::vector<double> load_; // bin -> sum of its members' weights
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

//! The experts of each bin of a complete packing.
inline std::vector<std::vector<std::int32_t>> groups_of_packing(const replica_packing& p) {
  std::vector<std::vector<std::int32_t>> groups(static_cast<std::size_t>(p.bins));
  for (std::size_t i = 0; i < p.bin_of.size(); ++i)
    groups[static_cast<std::size_t>(p.bin_of[i])].push_back(p.expert[i]);
  return groups;
}

} // namespace detail

//! Replica count per expert: one each, then each of `redundant_slots` extra slots to the expert
//! with the largest load per replica (lowest id on ties), at most `max_replicas` each.
//! Throws `errc::invalid_argument` when the slots cannot all be used.
inline std::vector<int> replica_counts(std::span<const double> loads, int redundant_slots,
                                       int max_replicas) {
  detail::expect_loads(loads);
  const auto E = loads.size();
  WEAVE_EXPECT(redundant_slots >= 0, errc::invalid_argument, "redundant_slots = ", redundant_slots);
  WEAVE_EXPECT(static_cast<long long>(redundant_slots) <=
                   static_cast<long long>(E) * (max_replicas - 1),
               errc::invalid_argument, redundant_slots, " redundant slots exceed what ", E,
               " experts with at most ", max_replicas, " replicas each can use");
  std::vector<int> count(E, 1);
  std::vector<double> replicas(E, 1.0); // count as doubles: the same products, no conversions
  for (int r = 0; r < redundant_slots; ++r) {
    std::size_t best = E;
    double best_load = 0, best_replicas = 1; // of `best`, kept in registers
    for (std::size_t e = 0; e < E; ++e)
      if (count[e] < max_replicas &&
          (best == E || loads[e] * best_replicas > best_load * replicas[e])) {
        best = e;
        best_load = loads[e];
        best_replicas = replicas[e];
      }
    ++count[best];
    replicas[best] += 1.0;
  }
  return count;
}

namespace detail {

//! A copy the current layout holds: `expert` on `device`.
struct held_copy {
  int expert = 0;
  int device = 0;
};

//! Device -> experts of the replicated placement of `loads` on `topo` with `S` slots per device
//! (see the file comment). With `grow`, the copies in `holdings` (slot order) are a start.
inline std::vector<std::vector<std::int32_t>>
pack_replicated(std::span<const double> loads, std::span<const double> coact, const topology& topo,
                int S, bool grow, std::span<const held_copy> holdings, double keep_tolerance) {
  const int E = static_cast<int>(loads.size());
  const int D = topo.num_devices();
  const std::vector<int> count =
      replica_counts(loads, static_cast<int>(static_cast<long long>(D) * S - E), D);

  // Flat: replicate-hottest + LPT + swaps.
  auto flat = make_copies(loads, count, D, S, 1);
  flat.pack_rest();
  flat.refine();
  const replica_packing* best = &flat;
  replica_packing hier, sticky;
  if (topo.nodes > 1) {
    // Hierarchical: copies onto nodes first, then onto each node's devices.
    auto nodes =
        make_copies(loads, count, topo.nodes, S * topo.devices_per_node, topo.devices_per_node);
    nodes.pack_rest();
    nodes.refine();
    hier = make_copies(loads, count, D, S, 1); // the same copies, to be placed node by node
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
      for (std::size_t c = 0; c < ids.size(); ++c)
        hier.bin_of[ids[c]] = n * topo.devices_per_node + inner.bin_of[c];
    }
    hier.refine();
    if (peak_of(hier.bin_loads()) <= peak_of(flat.bin_loads()))
      best = &hier;
  }
  if (grow) {
    sticky = make_copies(loads, count, D, S, 1);
    // Keep each expert's copies on the devices that hold it now, heaviest first per device.
    std::vector<int> kept(static_cast<std::size_t>(E), 0), size(static_cast<std::size_t>(D), 0);
    std::vector<std::size_t> first_copy(static_cast<std::size_t>(E) + 1, 0);
    for (int e = 0; e < E; ++e)
      first_copy[static_cast<std::size_t>(e) + 1] =
          first_copy[static_cast<std::size_t>(e)] +
          static_cast<std::size_t>(count[static_cast<std::size_t>(e)]);
    std::vector<std::size_t> order(holdings.size());
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      const auto ea = static_cast<std::size_t>(holdings[a].expert);
      const auto eb = static_cast<std::size_t>(holdings[b].expert);
      return loads[ea] / count[ea] > loads[eb] / count[eb];
    });
    for (const std::size_t h : order) {
      const auto e = static_cast<std::size_t>(holdings[h].expert);
      const auto d = static_cast<std::size_t>(holdings[h].device);
      if (kept[e] < count[e] && size[d] < S) {
        sticky.bin_of[first_copy[e] + static_cast<std::size_t>(kept[e]++)] = static_cast<int>(d);
        ++size[d];
      }
    }
    sticky.affinity = coact;
    sticky.cap = peak_of(best->bin_loads()) * (1.0 + keep_tolerance);
    sticky.pack_rest();
    sticky.refine(sticky.cap);
    if (peak_of(sticky.bin_loads()) <= peak_of(best->bin_loads()) * (1.0 + keep_tolerance))
      best = &sticky;
  }
  return groups_of_packing(*best);
}

} // namespace detail

WEAVE_NAMESPACE_END
