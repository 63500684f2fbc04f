//! \file
//! Expert capacity and the order pairs claim it: the vocabulary of the capacity decision that
//! `device_capacity_filter<Space>` (`device_capacity.hpp`) makes, decided so that chunked
//! planning drops exactly what the whole batch would (Lancet's rule).
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
//!   capacity of chunks < i (`device_capacity_filter::admit`);
//! - `rank_major`: all first choices of the batch in token order, then all second choices...
//!   (Tutel's default, GShard);
//! - `batch_prioritized`: the same, each choice's pass visiting tokens by descending priority
//!   (Tutel's `batch_prioritized_routing`; the priority is the token's top gate score);
//! - `priority_token_major`: tokens by descending priority, all k choices of a token before the
//!   next token's (the most confident tokens keep their whole mixture).
//! Priority ties go to the earlier token. The last three depend on tokens of later chunks, so the
//! decision is made once per batch (`device_capacity_filter::decide`) and every chunk plan reads
//! its slice of the keep mask.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/float_bits.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>

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

WEAVE_NAMESPACE_END
