//! \file
//! The packing engine of the replicated placement (`replication.hpp`): replica counts, then
//! copies of experts into bins (nodes or devices) of a fixed number of copies each (one number
//! for all bins, or one per bin), heaviest copy first into the lightest bin that may take it,
//! then swaps off the heaviest bin.
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
#include <functional>
#include <limits>
#include <numeric>
#include <span>
#include <vector>

WEAVE_NAMESPACE_BEGIN

namespace detail {

//! Copies of experts assigned to bins of `capacity` copies each (or `capacities[b]` when that is
//! set), at most `per_bin` copies of an expert per bin. `bin_of[i]` is the bin of copy i (-1 while
//! unassigned); after writing `bin_of` directly, `sync()` rebuilds the per-bin state (`pack_rest`
//! and `refine` do).
struct replica_packing {
  std::vector<std::int32_t> expert; // copy -> expert
  std::vector<double> weight;       // copy -> load it carries
  std::vector<int> bin_of;
  int bins = 0, capacity = 0, per_bin = 1;
  std::vector<int> capacities; // per bin; empty: `capacity` each
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
    int widest = capacity;
    for (const int c : capacities)
      widest = std::max(widest, c);
    stride_ = static_cast<std::size_t>(widest) + 1;
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
  int capacity_of(int bin) const {
    return capacities.empty() ? capacity : capacities[static_cast<std::size_t>(bin)];
  }
  bool has_room(int bin) const { return size_of(bin) < capacity_of(bin); }
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
  //! False when that fails too (only seen with unequal capacities; the copies are then partly
  //! placed).
  bool try_pack_rest() {
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
        if ((best < 0 || load_of(b) < load_of(best)) && has_room(b) &&
            copies_in(b, expert[i]) < per_bin)
          best = b;
      if (best >= 0 && !affinity.empty()) {
        // Among bins that stay under the cap, the one whose copies collaborate most with it.
        double best_aff = -1;
        for (int b = 0; b < bins; ++b) {
          if (!has_room(b) || copies_in(b, expert[i]) >= per_bin || load_of(b) + weight[i] > cap)
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
      if (best < 0)
        return false;
      set_bin(i, best);
    }
    return true;
  }

  //! `try_pack_rest`, for packings that always succeed (equal capacities).
  void pack_rest() {
    if (!try_pack_rest())
      WEAVE_THROW(errc::internal, "no bin can take a copy of an expert");
  }

  //! Every copy placed again ignoring load: experts with the most copies first, each expert's
  //! copies into the bins with the most room left (lightest, then lowest index, on ties). With
  //! `per_bin == 1` this succeeds whenever any placement does (the constructive side of the
  //! Gale-Ryser theorem: a row may always take the columns of largest remaining degree).
  void pack_by_room() {
    std::fill(bin_of.begin(), bin_of.end(), -1);
    sync();
    std::vector<std::size_t> first(static_cast<std::size_t>(num_experts_) + 1, 0);
    for (const std::int32_t e : expert)
      ++first[static_cast<std::size_t>(e) + 1];
    std::vector<std::int32_t> experts(static_cast<std::size_t>(num_experts_));
    std::iota(experts.begin(), experts.end(), 0);
    std::stable_sort(experts.begin(), experts.end(), [&](std::int32_t a, std::int32_t b) {
      return first[static_cast<std::size_t>(a) + 1] > first[static_cast<std::size_t>(b) + 1];
    });
    std::vector<int> order(static_cast<std::size_t>(bins));
    for (const std::int32_t e : experts) {
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
        const int ra = capacity_of(a) - size_of(a), rb = capacity_of(b) - size_of(b);
        return ra != rb ? ra > rb : load_of(a) < load_of(b);
      });
      std::size_t next = 0;
      for (std::size_t i = 0; i < expert.size(); ++i)
        if (expert[i] == e) {
          const int b = order[next++];
          WEAVE_EXPECT(has_room(b), errc::internal, "no bin left for a copy of expert ", e);
          set_bin(i, b);
        }
    }
  }

  //! Some bin h has room but already holds enough copies of copy i's expert: moves a copy x
  //! from a bin o that can take i (and whose expert h can take) into h; returns o for i, or -1
  //! when no single move does it.
  int make_room(std::size_t i) {
    for (int h = 0; h < bins; ++h) {
      if (!has_room(h))
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
    return -1;
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
      WEAVE_THROW(errc::internal, "bin ", bin, " holds more than ", stride_ - 1, " copies");
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
                                   int bins, int capacity, int per_bin,
                                   std::vector<int> capacities = {}) {
  replica_packing p;
  p.bins = bins;
  p.capacity = capacity;
  p.per_bin = per_bin;
  p.capacities = std::move(capacities);
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

namespace detail {

//! Gives up to `extra` more copies, each to the expert with the largest load per copy (lowest id
//! on ties) among those below `max_copies`; returns how many it gave (fewer only when every
//! expert reached `max_copies`).
inline long long add_copies(std::span<const double> loads, std::vector<int>& count, long long extra,
                            int max_copies) {
  const auto E = loads.size();
  std::vector<double> copies(count.begin(), count.end()); // as doubles: no conversions below
  for (long long r = 0; r < extra; ++r) {
    std::size_t best = E;
    double best_load = 0, best_copies = 1; // of `best`, kept in registers
    for (std::size_t e = 0; e < E; ++e)
      if (count[e] < max_copies && (best == E || loads[e] * best_copies > best_load * copies[e])) {
        best = e;
        best_load = loads[e];
        best_copies = copies[e];
      }
    if (best == E)
      return r;
    ++count[best];
    copies[best] += 1.0;
  }
  return extra;
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
  detail::add_copies(loads, count, redundant_slots, max_replicas);
  return count;
}

namespace detail {

//! A copy the current layout holds: `expert` on `device`.
struct held_copy {
  int expert = 0;
  int device = 0;
};

//! Whether copies of experts with `count[e]` copies each fit bins of `capacity[b]` copies, at
//! most one copy of an expert per bin, every bin full (Gale-Ryser: a simple bipartite graph
//! with these degrees exists).
inline bool copies_fit(std::vector<int> capacity, std::span<const int> count) {
  std::sort(capacity.begin(), capacity.end(), std::greater<>());
  long long need = 0, total = 0;
  for (const int c : count)
    total += c;
  for (const int c : capacity)
    need += c;
  if (need != total)
    return false;
  need = 0;
  for (std::size_t k = 1; k <= capacity.size(); ++k) {
    need += capacity[k - 1];
    long long have = 0;
    for (const int c : count)
      have += std::min<long long>(c, static_cast<long long>(k));
    if (need > have)
      return false;
  }
  return true;
}

//! Device -> experts of the replicated placement of `loads` on `topo` with `caps[d]` slots on
//! device d (see the file comment). With `grow`, the copies in `holdings` (slot order) are a
//! start. Throws `errc::invalid_argument` when the replica counts cannot fill the devices
//! without two copies of an expert on one.
inline std::vector<std::vector<std::int32_t>>
pack_replicated(std::span<const double> loads, std::span<const double> coact, const topology& topo,
                std::span<const int> caps, bool grow, std::span<const held_copy> holdings,
                double keep_tolerance) {
  const int E = static_cast<int>(loads.size());
  const int D = topo.num_devices();
  const int S = *std::max_element(caps.begin(), caps.end());
  const bool uniform = std::all_of(caps.begin(), caps.end(), [&](int c) { return c == S; });
  // Per-bin capacities only where they differ (the uniform path stays as it always was).
  auto caps_of = [&](int first, int n) {
    return uniform ? std::vector<int>{}
                   : std::vector<int>(caps.begin() + first, caps.begin() + first + n);
  };
  const long long slots = std::accumulate(caps.begin(), caps.end(), 0LL);
  const std::vector<int> count = replica_counts(loads, static_cast<int>(slots - E), D);
  if (!uniform)
    WEAVE_EXPECT(copies_fit(std::vector<int>(caps.begin(), caps.end()), count),
                 errc::invalid_argument,
                 "the per-device slot counts cannot be filled with the replica counts of these "
                 "loads without two copies of an expert on one device");

  // Flat: replicate-hottest + LPT + swaps.
  auto flat = make_copies(loads, count, D, S, 1, caps_of(0, D));
  if (!flat.try_pack_rest()) // unequal capacities only: the Gale-Ryser check passed above
    flat.pack_by_room();
  flat.refine();
  const replica_packing* best = &flat;
  replica_packing hier, sticky;
  if (topo.nodes > 1) {
    // Hierarchical: copies onto nodes first, then onto each node's devices.
    const int dpn = topo.devices_per_node;
    std::vector<int> node_caps;
    if (!uniform)
      for (int n = 0; n < topo.nodes; ++n)
        node_caps.push_back(
            std::accumulate(caps.begin() + n * dpn, caps.begin() + (n + 1) * dpn, 0));
    auto nodes = make_copies(loads, count, topo.nodes, S * dpn, dpn, std::move(node_caps));
    bool packed = nodes.try_pack_rest(); // fails only with unequal capacities: flat it is
    if (packed)
      nodes.refine();
    hier = make_copies(loads, count, D, S, 1, caps_of(0, D)); // the same copies, node by node
    for (int n = 0; n < topo.nodes && packed; ++n) {
      replica_packing inner;
      inner.bins = dpn;
      inner.capacity = S;
      inner.capacities = caps_of(n * dpn, dpn);
      std::vector<std::size_t> ids;
      for (std::size_t i = 0; i < nodes.bin_of.size(); ++i)
        if (nodes.bin_of[i] == n) {
          ids.push_back(i);
          inner.expert.push_back(nodes.expert[i]);
          inner.weight.push_back(nodes.weight[i]);
          inner.bin_of.push_back(-1);
        }
      if (!uniform) {
        // Unequal devices: a node's share may not split over its devices; then flat it is.
        std::vector<int> node_count(static_cast<std::size_t>(E), 0);
        for (const std::int32_t e : inner.expert)
          ++node_count[static_cast<std::size_t>(e)];
        packed = copies_fit(inner.capacities, node_count);
        if (!packed)
          break;
      }
      packed = inner.try_pack_rest();
      if (!packed)
        break;
      inner.refine();
      for (std::size_t c = 0; c < ids.size(); ++c)
        hier.bin_of[ids[c]] = n * dpn + inner.bin_of[c];
    }
    if (packed) {
      hier.refine();
      if (peak_of(hier.bin_loads()) <= peak_of(flat.bin_loads()))
        best = &hier;
    }
  }
  if (grow) {
    sticky = make_copies(loads, count, D, S, 1, caps_of(0, D));
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
      if (kept[e] < count[e] && size[d] < caps[d]) {
        sticky.bin_of[first_copy[e] + static_cast<std::size_t>(kept[e]++)] = static_cast<int>(d);
        ++size[d];
      }
    }
    sticky.affinity = coact;
    sticky.cap = peak_of(best->bin_loads()) * (1.0 + keep_tolerance);
    if (sticky.try_pack_rest()) {
      sticky.refine(sticky.cap);
      if (peak_of(sticky.bin_loads()) <= peak_of(best->bin_loads()) * (1.0 + keep_tolerance))
        best = &sticky;
    }
  }
  return groups_of_packing(*best);
}

} // namespace detail

WEAVE_NAMESPACE_END
