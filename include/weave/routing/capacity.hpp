//! \file
//! Expert capacity and token dropping, decided so that chunked planning drops exactly what the
//! whole batch would (Lancet's rule).
//!
//! Capacity per expert on this rank, for a batch of T tokens with k choices over E experts and a
//! capacity factor f (`capacity_rounding`):
//! - `ceil` (default): ceil(k * T / E * |f|), the formula and evaluation order of Megatron-Core's
//!   `get_capacity(T * k, E, f)`;
//! - `tutel`: k * floor(|f| * ceil(T / E)), Tutel's `extract_critical` (a multiple of k; 0, so
//!   every pair dropped, when |f| * ceil(T / E) < 1).
//! f = 0 is dropless (no bound; layouts hold exactly the routed rows). f < 0 is capped dropless,
//! as Tutel: dropless up to the bound of |f|. weave's layouts are exact (never padded to the
//! capacity), so f and -f drop the same pairs; they differ only in what Tutel would pad.
//!
//! A (token, rank) pair is kept while its expert has room, visiting pairs in an order:
//! - `position`: token-major (token, then rank). Chunk i can be decided alone from the used
//!   capacity of chunks < i (`capacity_filter::admit`);
//! - `rank_major`: all first choices of the batch in token order, then all second choices...
//!   (Tutel's default, GShard);
//! - `batch_prioritized`: the same, each choice's pass visiting tokens by descending priority
//!   (Tutel's `batch_prioritized_routing`; the priority is the token's top gate score);
//! - `priority_token_major`: tokens by descending priority, all k choices of a token before the
//!   next token's (the most confident tokens keep their whole mixture).
//! Priority ties go to the earlier token. The last three depend on tokens of later chunks, so the
//! decision is made once per batch (`capacity_filter::decide`, O(T*k) plus a stable sort of T
//! priorities) and every chunk plan reads its slice of the keep mask.
#pragma once

#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/float_bits.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <vector>

WEAVE_NAMESPACE_BEGIN

//! Order in which (token, rank) pairs claim expert capacity.
enum class drop_order : std::uint8_t {
  position,             //!< token-major in token order; decidable chunk by chunk
  rank_major,           //!< every first choice before any second, tokens in order (Tutel, GShard)
  batch_prioritized,    //!< rank-major, tokens by descending priority (Tutel's batch prioritized)
  priority_token_major, //!< token-major, tokens by descending priority
};

//! How a capacity factor becomes rows per expert.
enum class capacity_rounding : std::uint8_t {
  ceil,  //!< ceil(k * T / E * |f|): Megatron-Core's rule, weave's default
  tutel, //!< k * floor(|f| * ceil(T / E)): Tutel's rule
};

//! Capacity factor, drop order and rounding.
struct capacity_policy {
  double factor = 0.0;                     //!< > 0 capacity factor, 0 dropless, < 0 capped dropless
  drop_order order = drop_order::position; //!< who keeps its place when an expert is full
  capacity_rounding rounding = capacity_rounding::ceil; //!< how the factor becomes rows
};

//! Rows an expert may take, or -1 for dropless (factor 0). Throws `errc::invalid_argument` for
//! a non-finite factor or k, E < 1, and `errc::size_overflow` if the bound exceeds 63 bits.
inline std::int64_t expert_capacity(double factor, std::size_t batch_tokens, int k, int num_experts,
                                    capacity_rounding rounding = capacity_rounding::ceil) {
  WEAVE_EXPECT(detail::is_finite(factor), errc::invalid_argument, "capacity factor ", factor);
  WEAVE_EXPECT(k >= 1 && num_experts >= 1, errc::invalid_argument, "capacity for k = ", k, " and ",
               num_experts, " experts");
  WEAVE_EXPECT(rounding == capacity_rounding::ceil || rounding == capacity_rounding::tutel,
               errc::invalid_argument, "capacity rounding ", static_cast<int>(rounding));
  if (factor == 0.0)
    return -1;
  const double f = std::fabs(factor), T = static_cast<double>(batch_tokens);
  const double E = static_cast<double>(num_experts), kk = static_cast<double>(k);
  double bound = 0.0;
  if (rounding == capacity_rounding::ceil) {
    bound = std::ceil(kk * T / E * f);
  } else {
    const std::size_t per_expert =
        batch_tokens / static_cast<std::size_t>(num_experts) +
        (batch_tokens % static_cast<std::size_t>(num_experts) != 0 ? 1 : 0); // ceil(T / E)
    bound = kk * std::floor(f * static_cast<double>(per_expert));
  }
  WEAVE_EXPECT(bound < 9.2e18, errc::size_overflow, "capacity ", bound, " overflows 63 bits");
  return static_cast<std::int64_t>(bound);
}

//! `expert_capacity` with the policy's factor and rounding.
inline std::int64_t expert_capacity(const capacity_policy& policy, std::size_t batch_tokens, int k,
                                    int num_experts) {
  return expert_capacity(policy.factor, batch_tokens, k, num_experts, policy.rounding);
}

//! Decides which (token, rank) pairs fit their expert's capacity, for a whole batch at once or
//! chunk by chunk. Reusable: keeps its scratch between batches.
class capacity_filter {
 public:
  capacity_filter() = default;
  //! A filter for batches of `batch_tokens` tokens with `k` choices over `num_experts`.
  capacity_filter(int num_experts, int k, std::size_t batch_tokens, capacity_policy policy)
      : num_experts_(num_experts)
      , k_(k)
      , batch_tokens_(batch_tokens)
      , policy_(policy)
      , capacity_(expert_capacity(policy, batch_tokens, k, num_experts))
      , used_(static_cast<std::size_t>(num_experts), 0) {
    WEAVE_EXPECT(policy.order <= drop_order::priority_token_major, errc::invalid_argument,
                 "drop order ", static_cast<int>(policy.order));
  }

  int num_experts() const noexcept { return num_experts_; }
  int k() const noexcept { return k_; }
  const capacity_policy& policy() const noexcept { return policy_; }
  //! Rows per expert, -1 for dropless.
  std::int64_t capacity() const noexcept { return capacity_; }
  //! Rows kept per expert so far (since construction or `reset`).
  std::span<const std::int64_t> used() const noexcept { return used_; }

  //! Forgets the used capacity: the next `admit` starts a new batch.
  void reset() { std::fill(used_.begin(), used_.end(), std::int64_t{0}); }

  //! Position order, chunk by chunk: decides the pairs of the next chunk (`ids`, k per token,
  //! -1 = no expert) against the capacity used so far and records what they use. Writes
  //! keep[i] = 1 / 0 and returns the number dropped. Throws `errc::invalid_state` for another
  //! order, `errc::out_of_range` for ids outside [-1, E), `errc::size_mismatch` for sizes.
  std::int64_t admit(std::span<const std::int32_t> ids, std::span<std::uint8_t> keep) {
    WEAVE_EXPECT(policy_.order == drop_order::position, errc::invalid_state,
                 "admit() decides position order only; this filter drops in another order: call "
                 "decide() once for the whole batch");
    check_ids(ids, keep);
    std::int64_t dropped = 0;
    for (std::size_t i = 0; i < ids.size(); ++i)
      dropped += claim(ids[i], keep[i]);
    return dropped;
  }

  //! Any order, the whole batch at once (`ids` of `batch_tokens` tokens; `priority` one value per
  //! token, read only by the prioritized orders: for Tutel's order, the token's top gate score,
  //! `top_k_gate`'s `top_score`). Starts from zero used capacity. Writes the keep mask and
  //! returns the number dropped. Throws `errc::invalid_argument` for a NaN priority.
  std::int64_t decide(std::span<const std::int32_t> ids, std::span<const float> priority,
                      std::span<std::uint8_t> keep) {
    const auto kk = static_cast<std::size_t>(k_);
    WEAVE_EXPECT(ids.size() == checked_mul(batch_tokens_, kk), errc::size_mismatch, ids.size(),
                 " ids for a batch of ", batch_tokens_, " tokens with k = ", k_);
    check_ids(ids, keep);
    reset();
    const std::size_t T = batch_tokens_;
    std::int64_t dropped = 0;
    switch (policy_.order) {
    case drop_order::position:
      for (std::size_t i = 0; i < ids.size(); ++i)
        dropped += claim(ids[i], keep[i]);
      break;
    case drop_order::rank_major:
      for (std::size_t r = 0; r < kk; ++r)
        for (std::size_t t = 0; t < T; ++t)
          dropped += claim(ids[t * kk + r], keep[t * kk + r]);
      break;
    case drop_order::batch_prioritized:
      sort_by_priority(priority);
      for (std::size_t r = 0; r < kk; ++r)
        for (const std::size_t t : order_)
          dropped += claim(ids[t * kk + r], keep[t * kk + r]);
      break;
    case drop_order::priority_token_major:
      sort_by_priority(priority);
      for (const std::size_t t : order_)
        for (std::size_t r = 0; r < kk; ++r)
          dropped += claim(ids[t * kk + r], keep[t * kk + r]);
      break;
    default:
      WEAVE_THROW(errc::invalid_argument, "drop order ", static_cast<int>(policy_.order));
    }
    return dropped;
  }

 private:
  void check_ids(std::span<const std::int32_t> ids, std::span<std::uint8_t> keep) const {
    WEAVE_EXPECT(num_experts_ > 0, errc::invalid_state, "capacity_filter is not initialised");
    WEAVE_EXPECT(keep.size() == ids.size(), errc::size_mismatch, "keep mask of ", keep.size(),
                 " entries for ", ids.size(), " ids");
    WEAVE_EXPECT(ids.size() % static_cast<std::size_t>(k_) == 0, errc::size_mismatch, ids.size(),
                 " ids are not a whole number of tokens with k = ", k_);
    for (std::size_t i = 0; i < ids.size(); ++i)
      WEAVE_EXPECT(ids[i] >= -1 && ids[i] < num_experts_, errc::out_of_range, "expert id ", ids[i],
                   " at pair ", i, " outside [-1, ", num_experts_, ")");
  }

  // Tokens by descending priority into order_, ties to the earlier token.
  void sort_by_priority(std::span<const float> priority) {
    WEAVE_EXPECT(priority.size() == batch_tokens_, errc::size_mismatch, priority.size(),
                 " priorities for ", batch_tokens_, " tokens");
    for (std::size_t t = 0; t < priority.size(); ++t)
      WEAVE_EXPECT(!detail::is_nan(priority[t]), errc::invalid_argument, "priority of token ", t,
                   " is NaN");
    order_.resize(batch_tokens_);
    std::iota(order_.begin(), order_.end(), std::size_t{0});
    std::stable_sort(order_.begin(), order_.end(),
                     [&](std::size_t a, std::size_t b) { return priority[a] > priority[b]; });
  }

  // Returns 1 if the pair is dropped.
  std::int64_t claim(std::int32_t e, std::uint8_t& keep) {
    if (e < 0) {
      keep = 0; // no expert: nothing to keep and nothing dropped
      return 0;
    }
    std::int64_t& used = used_[static_cast<std::size_t>(e)];
    if (capacity_ >= 0 && used >= capacity_) {
      keep = 0;
      return 1;
    }
    ++used;
    keep = 1;
    return 0;
  }

  int num_experts_ = 0;
  int k_ = 1;
  std::size_t batch_tokens_ = 0;
  capacity_policy policy_{};
  std::int64_t capacity_ = -1;
  std::vector<std::int64_t> used_;
  std::vector<std::size_t> order_;
};

WEAVE_NAMESPACE_END
