//! \file
//! `detail::replica_packing`, the bins of the replicated placement's packing engine
//! (`replica_packing.hpp`): copies of experts in bins of a fixed number of copies, each bin's
//! copies, size and load kept incrementally, and the packing steps over them (heaviest copy
//! first into the lightest bin, packing by room, swaps off the heaviest bin); with the helpers
//! that make a packing's copies and read its groups. Internal.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
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

WEAVE_NAMESPACE_END
