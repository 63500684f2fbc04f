//! \file
//! Routing traces (token -> top-k expert ids) and a synthetic generator with tunable structure:
//! experts fall into clusters that tend to fire together (co-activation), and popularity follows
//! a Zipf law (load skew). Real traces are read and written by `trace_io.hpp`.
#pragma once

#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/float_bits.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

WEAVE_NAMESPACE_BEGIN

//! A routing trace: `k` expert ids per token, token-major; -1 marks "no expert" (dropped).
struct routing_trace {
  int num_experts = 0;           //!< E
  int k = 0;                     //!< experts per token
  std::vector<std::int32_t> ids; //!< tokens × k

  std::size_t num_tokens() const noexcept {
    return k > 0 ? ids.size() / static_cast<std::size_t>(k) : 0;
  }
  //! The ids of token `t`.
  std::span<const std::int32_t> token(std::size_t t) const noexcept {
    return std::span<const std::int32_t>(ids).subspan(t * static_cast<std::size_t>(k),
                                                      static_cast<std::size_t>(k));
  }
  friend bool operator==(const routing_trace&, const routing_trace&) = default;
};

//! A recorded trace of several MoE layers over the same tokens (`trace_io.hpp` reads and writes
//! it): one `routing_trace` per layer, all of one E, k and token count, and optionally the
//! gate's score of each choice.
struct layered_trace {
  std::vector<routing_trace> layers;
  //! Per layer, the score of each id (same layout as its `ids`); empty when not recorded.
  std::vector<std::vector<float>> scores;
  friend bool operator==(const layered_trace&, const layered_trace&) = default;
};

//! Parameters of `generate_trace`.
struct trace_options {
  int num_experts = 64;      //!< E
  int k = 8;                 //!< distinct experts per token
  std::size_t tokens = 4096; //!< tokens to generate
  //! Clusters of experts that fire together (experts are dealt to clusters in a random order,
  //! so clusters are not ranges of ids). 1 = no structure.
  int clusters = 8;
  //! Probability that each of a token's experts is drawn from the token's cluster rather than
  //! from all experts: 0 = no co-activation structure, 1 = tokens stay inside one cluster.
  double affinity = 0.8;
  //! Zipf exponent s of expert popularity: the expert of popularity rank r (0-based) has weight
  //! (r + 1)^-s; ranks are a random permutation of the ids. 0 = uniform.
  double zipf = 0.0;
  std::uint64_t seed = 1; //!< same seed, same trace (on every platform)
};

//! What `generate_trace` drew besides the ids, for checking a trace's structure.
struct synthetic_trace : routing_trace {
  std::vector<std::int32_t> cluster_of; //!< expert -> cluster
  std::vector<double> popularity;       //!< expert -> Zipf weight (sums to 1)
};

namespace detail {

//! splitmix64: a small, fast, portable generator (std distributions differ between libraries).
class trace_rng {
 public:
  explicit trace_rng(std::uint64_t seed)
      : state_(seed) {}
  std::uint64_t next() noexcept {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  //! Uniform in [0, 1).
  double uniform() noexcept { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  //! Uniform in [0, n).
  std::size_t below(std::size_t n) noexcept {
    return static_cast<std::size_t>(uniform() * static_cast<double>(n));
  }

 private:
  std::uint64_t state_;
};

//! Index drawn from `cumulative` (inclusive prefix sums) by inverse transform.
inline std::size_t draw(std::span<const double> cumulative, trace_rng& rng) {
  const double u = rng.uniform() * cumulative.back();
  const auto it = std::upper_bound(cumulative.begin(), cumulative.end(), u);
  return std::min(static_cast<std::size_t>(it - cumulative.begin()), cumulative.size() - 1);
}

} // namespace detail

//! A synthetic trace: each token picks a cluster (probability proportional to the cluster's
//! popularity), then `k` distinct experts, each from its cluster with probability `affinity`
//! (by popularity within the cluster; from all experts once the cluster is used up) and
//! otherwise from all experts by popularity. Throws `errc::invalid_argument` for k outside
//! [1, E], clusters outside [1, E], affinity outside [0, 1] or a negative/NaN exponent.
inline synthetic_trace generate_trace(const trace_options& o) {
  WEAVE_EXPECT(o.num_experts > 0, errc::invalid_argument, "num_experts = ", o.num_experts);
  WEAVE_EXPECT(o.k > 0 && o.k <= o.num_experts, errc::invalid_argument, "k = ", o.k,
               " outside [1, ", o.num_experts, "]");
  WEAVE_EXPECT(o.clusters > 0 && o.clusters <= o.num_experts, errc::invalid_argument,
               "clusters = ", o.clusters, " outside [1, ", o.num_experts, "]");
  WEAVE_EXPECT(o.affinity >= 0 && o.affinity <= 1, errc::invalid_argument,
               "affinity = ", o.affinity, " outside [0, 1]");
  WEAVE_EXPECT(weave::detail::is_finite(o.zipf) && o.zipf >= 0, errc::invalid_argument,
               "zipf = ", o.zipf);
  const auto E = static_cast<std::size_t>(o.num_experts);
  const auto C = static_cast<std::size_t>(o.clusters);
  const auto K = static_cast<std::size_t>(o.k);
  detail::trace_rng rng(o.seed);
  auto shuffled = [&] {
    std::vector<std::int32_t> v(E);
    std::iota(v.begin(), v.end(), 0);
    for (std::size_t i = E; i > 1; --i)
      std::swap(v[i - 1], v[rng.below(i)]);
    return v;
  };
  synthetic_trace t;
  t.num_experts = o.num_experts;
  t.k = o.k;
  t.popularity.assign(E, 0.0);
  const auto rank = shuffled();
  double total = 0;
  for (std::size_t r = 0; r < E; ++r)
    total += std::pow(static_cast<double>(r + 1), -o.zipf);
  for (std::size_t r = 0; r < E; ++r)
    t.popularity[static_cast<std::size_t>(rank[r])] =
        std::pow(static_cast<double>(r + 1), -o.zipf) / total;
  t.cluster_of.assign(E, 0);
  const auto deal = shuffled();
  std::vector<std::vector<std::int32_t>> members(C);
  for (std::size_t i = 0; i < E; ++i) {
    t.cluster_of[static_cast<std::size_t>(deal[i])] = static_cast<std::int32_t>(i % C);
    members[i % C].push_back(deal[i]);
  }
  std::vector<double> all_cum(E), cluster_cum(C);
  std::vector<std::vector<double>> member_cum(C);
  std::partial_sum(t.popularity.begin(), t.popularity.end(), all_cum.begin());
  for (std::size_t c = 0; c < C; ++c) {
    double acc = 0;
    for (const std::int32_t e : members[c])
      member_cum[c].push_back(acc += t.popularity[static_cast<std::size_t>(e)]);
    cluster_cum[c] = (c > 0 ? cluster_cum[c - 1] : 0.0) + acc;
  }
  t.ids.resize(checked_mul(o.tokens, K, "trace ids"));
  std::vector<char> taken(E, 0);
  std::vector<double> scratch(E);
  for (std::size_t tok = 0; tok < o.tokens; ++tok) {
    const std::size_t c = detail::draw(cluster_cum, rng);
    std::span<std::int32_t> out(t.ids.data() + tok * K, K);
    std::size_t in_cluster = 0;
    for (std::size_t j = 0; j < K; ++j) {
      const bool local = rng.uniform() < o.affinity && in_cluster < members[c].size();
      const auto& pool_cum = local ? member_cum[c] : all_cum;
      auto pool_expert = [&](std::size_t i) {
        return local ? members[c][i] : static_cast<std::int32_t>(i);
      };
      // Rejection keeps the draw cheap; after a few misses draw exactly among the rest.
      std::int32_t e = -1;
      for (int tries = 0; tries < 16 && e < 0; ++tries) {
        const std::int32_t cand = pool_expert(detail::draw(pool_cum, rng));
        if (!taken[static_cast<std::size_t>(cand)])
          e = cand;
      }
      if (e < 0) {
        double acc = 0;
        const std::size_t n = pool_cum.size();
        for (std::size_t i = 0; i < n; ++i) {
          const std::int32_t cand = pool_expert(i);
          acc += taken[static_cast<std::size_t>(cand)]
                     ? 0.0
                     : t.popularity[static_cast<std::size_t>(cand)];
          scratch[i] = acc;
        }
        if (acc > 0) {
          e = pool_expert(detail::draw(std::span<const double>(scratch).first(n), rng));
        } else { // only zero-weight experts are left: the first free one
          for (std::size_t i = 0; i < n && e < 0; ++i)
            if (!taken[static_cast<std::size_t>(pool_expert(i))])
              e = pool_expert(i);
        }
      }
      taken[static_cast<std::size_t>(e)] = 1;
      in_cluster += t.cluster_of[static_cast<std::size_t>(e)] == static_cast<std::int32_t>(c);
      out[j] = e;
    }
    for (const std::int32_t e : out)
      taken[static_cast<std::size_t>(e)] = 0;
  }
  return t;
}

WEAVE_NAMESPACE_END
