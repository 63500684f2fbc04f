//! \file
//! Collaboration-aware placement (Occult): experts that one token activates together
//! "collaborate"; keeping them on one device means the token is copied to fewer devices.
//!
//! The policy partitions experts into G equal groups (devices) maximising
//!   J = K − λ · W · CV²,   CV² = Σ_g (L_g − m)² / (G · m²),
//! where K is the co-activation weight kept inside groups, W the total co-activation weight,
//! L_g a group's token load, m their mean, and λ = `load_weight` (0: co-activation only). The
//! load term is scale free: λ = 1 trades 1 % of W for 0.01 of squared load variation. It seeds
//! groups greedily (heaviest remaining expert, then the expert most attached to the group) and
//! refines with Kernighan-Lin passes of pair swaps, so the result is at least a local optimum
//! under single swaps. Two-level mode first partitions experts over nodes (keeping
//! collaborators off the slow inter-node links), then over the devices of each node.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/float_bits.hpp"
#include "weave/placement/placement.hpp"
#include "weave/placement/policies.hpp"
#include "weave/placement/statistics.hpp"
#include "weave/placement/topology.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

WEAVE_NAMESPACE_BEGIN

//! Options of `place_collaborative`.
struct collaboration_options {
  //! λ: weight of the load imbalance (squared coefficient of variation of group loads) against
  //! the share of co-activation kept (0 = ignore load).
  double load_weight = 0.0;
  //! On a multi-node topology, partition over nodes first, then inside each node.
  bool two_level = true;
  //! Kernighan-Lin passes at most per partition (each pass tries up to n/2 locked swaps).
  int max_passes = 32;
};

namespace detail {

//! Balanced partition of `n` items into `parts` groups of n/parts maximising
//! Σ_{a<b same group} w(a, b) − λ · W · Σ_g (L_g − m)² / (G m²), W = Σ_{a<b} w(a, b).
//! `w` is n×n symmetric row-major. Internally the load term is c · Σ_g (L_g − m)² / m.
class balanced_partitioner {
 public:
  balanced_partitioner(std::span<const double> w, std::span<const double> loads, int parts,
                       double lambda)
      : n_(loads.size())
      , parts_(static_cast<std::size_t>(parts))
      , w_(w)
      , loads_(loads)
      , lambda_(lambda) {
    double total = 0;
    for (const double l : loads)
      total += l;
    mean_ = total / static_cast<double>(parts_);
    double pairs = 0;
    for (const double x : w)
      pairs += x;
    pairs /= 2;
    if (!(mean_ > 0))
      lambda_ = 0; // no load: the penalty is identically zero
    else
      lambda_ *= pairs / (static_cast<double>(parts_) * mean_);
  }

  std::vector<int> run(int max_passes) {
    seed();
    for (int pass = 0; pass < max_passes; ++pass)
      if (!kernighan_lin_pass())
        break;
    return part_;
  }

 private:
  double w(std::size_t a, std::size_t b) const noexcept { return w_[a * n_ + b]; }
  double& conn(std::size_t i, std::size_t p) noexcept { return conn_[i * parts_ + p]; }

  // Change of the penalty term when group p gains delta load and q loses it.
  double penalty_change(std::size_t p, std::size_t q, double delta) const noexcept {
    if (lambda_ == 0)
      return 0;
    return lambda_ * (2 * delta * (group_load_[p] - group_load_[q]) + 2 * delta * delta) / mean_;
  }

  void seed() {
    const std::size_t cap = n_ / parts_;
    part_.assign(n_, -1);
    group_load_.assign(parts_, 0.0);
    conn_.assign(n_ * parts_, 0.0);
    std::vector<double> strength(n_, 0.0);
    for (std::size_t a = 0; a < n_; ++a)
      for (std::size_t b = 0; b < n_; ++b)
        strength[a] += w(a, b);
    for (std::size_t p = 0; p < parts_; ++p) {
      for (std::size_t filled = 0; filled < cap; ++filled) {
        std::size_t best = n_;
        double best_score = 0;
        for (std::size_t i = 0; i < n_; ++i) {
          if (part_[i] >= 0)
            continue;
          // First member: the most connected remaining expert; then the one most attached to
          // the group (ties: more connected overall), minus its load penalty.
          double score = filled == 0 ? strength[i] : conn(i, p) + 1e-9 * strength[i];
          if (lambda_ != 0) {
            const double l = loads_[i];
            score -= lambda_ * l * (2 * group_load_[p] + l - 2 * mean_) / mean_;
          }
          if (best == n_ || score > best_score) {
            best = i;
            best_score = score;
          }
        }
        assign(best, p);
        for (std::size_t i = 0; i < n_; ++i)
          if (part_[i] < 0)
            strength[i] -= w(i, best);
      }
    }
  }

  void assign(std::size_t i, std::size_t p) {
    part_[i] = static_cast<int>(p);
    group_load_[p] += loads_[i];
    for (std::size_t x = 0; x < n_; ++x)
      conn(x, p) += w(x, i);
  }

  double swap_gain(std::size_t a, std::size_t b) const noexcept {
    const auto p = static_cast<std::size_t>(part_[a]);
    const auto q = static_cast<std::size_t>(part_[b]);
    const double kept = conn_[a * parts_ + q] - conn_[a * parts_ + p] + conn_[b * parts_ + p] -
                        conn_[b * parts_ + q] - 2 * w(a, b);
    return kept - penalty_change(p, q, loads_[b] - loads_[a]);
  }

  void apply_swap(std::size_t a, std::size_t b) {
    const auto p = static_cast<std::size_t>(part_[a]);
    const auto q = static_cast<std::size_t>(part_[b]);
    for (std::size_t x = 0; x < n_; ++x) {
      const double d = w(x, b) - w(x, a);
      conn(x, p) += d;
      conn(x, q) -= d;
    }
    const double delta = loads_[b] - loads_[a];
    group_load_[p] += delta;
    group_load_[q] -= delta;
    part_[a] = static_cast<int>(q);
    part_[b] = static_cast<int>(p);
  }

  // One Kernighan-Lin pass: take the best swap among unlocked experts even when it loses,
  // lock both, and keep the prefix of swaps with the largest total gain. Returns whether that
  // gain was positive (the first swap taken is the best single swap, so a pass that gains
  // nothing proves a local optimum under single swaps).
  bool kernighan_lin_pass() {
    std::vector<char> locked(n_, 0);
    std::vector<std::pair<std::size_t, std::size_t>> done;
    double total = 0, best_total = 0;
    std::size_t best_len = 0;
    const double eps = 1e-9 * (1.0 + scale());
    for (std::size_t step = 0; step < n_ / 2; ++step) {
      std::size_t ba = n_, bb = n_;
      double best = 0;
      for (std::size_t a = 0; a < n_; ++a) {
        if (locked[a])
          continue;
        for (std::size_t b = a + 1; b < n_; ++b) {
          if (locked[b] || part_[a] == part_[b])
            continue;
          const double g = swap_gain(a, b);
          if (ba == n_ || g > best) {
            ba = a;
            bb = b;
            best = g;
          }
        }
      }
      if (ba == n_)
        break;
      apply_swap(ba, bb);
      locked[ba] = locked[bb] = 1;
      done.emplace_back(ba, bb);
      total += best;
      if (total > best_total + eps) {
        best_total = total;
        best_len = done.size();
      }
    }
    for (std::size_t i = done.size(); i > best_len; --i)
      apply_swap(done[i - 1].second, done[i - 1].first);
    return best_len > 0;
  }

  double scale() const noexcept {
    double s = 0;
    for (const double x : w_)
      s += std::abs(x);
    return s;
  }

  std::size_t n_, parts_;
  std::span<const double> w_, loads_;
  double lambda_, mean_ = 0;
  std::vector<int> part_;
  std::vector<double> group_load_, conn_;
};

//! The partition of `members` (expert ids) into `parts` groups, using the rows and columns of
//! the full co-activation matrix `coact` (E×E) that belong to the members.
inline std::vector<std::vector<std::int32_t>>
partition_experts(std::span<const std::int32_t> members, std::span<const double> coact,
                  std::span<const double> loads, int num_experts, int parts,
                  const collaboration_options& options) {
  const std::size_t n = members.size();
  const auto E = static_cast<std::size_t>(num_experts);
  std::vector<double> w(n * n), l(n);
  for (std::size_t a = 0; a < n; ++a) {
    l[a] = loads[static_cast<std::size_t>(members[a])];
    for (std::size_t b = 0; b < n; ++b)
      w[a * n + b] =
          coact[static_cast<std::size_t>(members[a]) * E + static_cast<std::size_t>(members[b])];
  }
  const std::vector<int> part =
      balanced_partitioner(w, l, parts, options.load_weight).run(options.max_passes);
  std::vector<std::vector<std::int32_t>> groups(static_cast<std::size_t>(parts));
  for (std::size_t a = 0; a < n; ++a)
    groups[static_cast<std::size_t>(part[a])].push_back(members[a]);
  return groups;
}

} // namespace detail

//! The objective `place_collaborative` maximises (flat mode), for a placement without
//! replicas: kept co-activation K minus `options.load_weight` · W · CV² over devices.
//! Throws `errc::size_mismatch` if `stats` and `p` disagree on the number of experts.
inline double collaboration_objective(const expert_statistics& stats, const placement& p,
                                      const collaboration_options& options = {}) {
  WEAVE_EXPECT(stats.num_experts() == p.num_experts(), errc::size_mismatch, "statistics of ",
               stats.num_experts(), " experts for a placement of ", p.num_experts());
  const int E = p.num_experts();
  double kept = 0, total = 0, pairs = 0;
  std::vector<double> load(static_cast<std::size_t>(p.num_devices()), 0.0);
  for (int a = 0; a < E; ++a) {
    load[static_cast<std::size_t>(p.device_of(a))] += stats.load(a);
    total += stats.load(a);
    for (int b = a + 1; b < E; ++b) {
      pairs += stats.coactivation(a, b);
      if (p.device_of(a) == p.device_of(b))
        kept += stats.coactivation(a, b);
    }
  }
  const double mean = total / p.num_devices();
  double cv2 = 0;
  if (mean > 0)
    for (const double l : load)
      cv2 += (l - mean) * (l - mean) / (mean * mean * p.num_devices());
  return kept - options.load_weight * pairs * cv2;
}

//! Co-activation weight kept inside devices: the objective with λ = 0.
inline double kept_coactivation(const expert_statistics& stats, const placement& p) {
  return collaboration_objective(stats, p, collaboration_options{});
}

//! Collaboration-aware placement of `stats.num_experts()` experts, E/D per device (see the file
//! comment). Throws `errc::invalid_argument` when the experts do not divide over the devices,
//! for a negative or non-finite `load_weight`, or for statistics that are negative or NaN.
inline placement place_collaborative(const expert_statistics& stats, const topology& topo,
                                     const collaboration_options& options = {}) {
  const int E = stats.num_experts();
  detail::expect_even_split(E, topo);
  WEAVE_EXPECT(weave::detail::is_finite(options.load_weight) && options.load_weight >= 0,
               errc::invalid_argument, "load_weight = ", options.load_weight);
  WEAVE_EXPECT(options.max_passes >= 0, errc::invalid_argument,
               "max_passes = ", options.max_passes);
  detail::expect_loads(stats.raw());
  std::vector<std::int32_t> all(static_cast<std::size_t>(E));
  for (int e = 0; e < E; ++e)
    all[static_cast<std::size_t>(e)] = e;
  const auto coact = stats.coactivation_matrix();
  const auto loads = stats.loads();
  if (topo.nodes == 1 || !options.two_level)
    return detail::placement_from_groups(
        E, detail::partition_experts(all, coact, loads, E, topo.num_devices(), options));
  std::vector<std::vector<std::int32_t>> groups;
  for (const auto& node : detail::partition_experts(all, coact, loads, E, topo.nodes, options))
    for (auto& g : detail::partition_experts(node, coact, loads, E, topo.devices_per_node, options))
      groups.push_back(std::move(g));
  return detail::placement_from_groups(E, std::move(groups));
}

WEAVE_NAMESPACE_END
