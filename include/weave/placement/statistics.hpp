//! \file
//! `expert_statistics`: per-expert load and E×E co-activation counts, the input of placement
//! policies. Accumulated from routing decisions (top-k expert ids per token), decayed over time
//! so placements follow drifting routing, and merged across ranks (element-wise sums, so any
//! all-reduce works: `raw()` is one contiguous array of doubles).
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

WEAVE_NAMESPACE_BEGIN

class expert_statistics {
 public:
  expert_statistics() = default;
  explicit expert_statistics(int num_experts)
      : num_experts_(num_experts)
      , data_(static_cast<std::size_t>(num_experts) * (static_cast<std::size_t>(num_experts) + 1)) {
    WEAVE_EXPECT(num_experts > 0, errc::invalid_argument, "num_experts = ", num_experts);
  }

  int num_experts() const noexcept { return num_experts_; }

  //! Adds one routing step: `ids` holds `k` expert ids per token, token-major. Negative ids mean
  //! "no expert" (dropped or padded) and are skipped. Each unordered pair of distinct experts
  //! chosen by one token adds `weight` to both symmetric entries of the co-activation matrix.
  void accumulate(std::span<const std::int32_t> ids, int k, double weight = 1.0) {
    WEAVE_EXPECT(k > 0 && ids.size() % static_cast<std::size_t>(k) == 0, errc::size_mismatch,
                 ids.size(), " ids are not a whole number of tokens with k = ", k);
    const auto kk = static_cast<std::size_t>(k);
    for (std::size_t t = 0; t < ids.size(); t += kk) {
      for (std::size_t a = 0; a < kk; ++a) {
        const std::int32_t ea = ids[t + a];
        if (ea < 0)
          continue;
        WEAVE_EXPECT(ea < num_experts_, errc::out_of_range, "expert id ", ea, " of token ", t / kk,
                     " >= num_experts ", num_experts_);
        load_ref(ea) += weight;
        for (std::size_t b = a + 1; b < kk; ++b) {
          const std::int32_t eb = ids[t + b];
          if (eb < 0 || eb == ea)
            continue;
          WEAVE_EXPECT(eb < num_experts_, errc::out_of_range, "expert id ", eb, " of token ",
                       t / kk, " >= num_experts ", num_experts_);
          pair_ref(ea, eb) += weight;
          pair_ref(eb, ea) += weight;
        }
      }
    }
  }

  //! Multiplies every count by `factor` in [0, 1] (exponential forgetting between steps).
  void decay(double factor) {
    WEAVE_EXPECT(factor >= 0.0 && factor <= 1.0, errc::invalid_argument, "decay factor ", factor,
                 " outside [0, 1]");
    for (double& x : data_)
      x *= factor;
  }

  //! Adds another rank's statistics (same number of experts).
  void merge(const expert_statistics& other) {
    WEAVE_EXPECT(other.num_experts_ == num_experts_, errc::size_mismatch, "merging statistics of ",
                 other.num_experts_, " experts into ", num_experts_);
    for (std::size_t i = 0; i < data_.size(); ++i)
      data_[i] += other.data_[i];
  }

  //! Tokens routed to expert `e` (weighted).
  double load(int e) const noexcept { return data_[static_cast<std::size_t>(e)]; }
  //! All loads, indexed by expert.
  std::span<const double> loads() const noexcept {
    return std::span<const double>(data_).first(static_cast<std::size_t>(num_experts_));
  }
  //! Tokens that chose both `a` and `b` (symmetric, zero diagonal).
  double coactivation(int a, int b) const noexcept { return data_[offset(a, b)]; }
  //! The whole E×E co-activation matrix, row-major.
  std::span<const double> coactivation_matrix() const noexcept {
    return std::span<const double>(data_).subspan(static_cast<std::size_t>(num_experts_));
  }

  //! Loads then the co-activation matrix as one array: the buffer to all-reduce (sum).
  std::span<double> raw() noexcept { return data_; }
  std::span<const double> raw() const noexcept { return data_; }

 private:
  std::size_t offset(int a, int b) const noexcept {
    return static_cast<std::size_t>(num_experts_) +
           static_cast<std::size_t>(a) * static_cast<std::size_t>(num_experts_) +
           static_cast<std::size_t>(b);
  }
  double& load_ref(int e) noexcept { return data_[static_cast<std::size_t>(e)]; }
  double& pair_ref(int a, int b) noexcept { return data_[offset(a, b)]; }

  int num_experts_ = 0;
  std::vector<double> data_; // [E loads][E*E co-activation]
};

WEAVE_NAMESPACE_END
