//! \file
//! `route_entry`, the routing metadata a dispatched row carries to its destination device (the
//! local slot and gate weight of each of the token's choices there), and the host checks of the
//! top-k choices the entries are made from (`detail::check_pair`, `detail::check_routing`):
//! the rule every plan applies (an id in [-1, E), no expert twice per token, finite weights),
//! with an error that names the first bad pair.
//!
//! The same rule on the device, where a plan cannot throw: `device_plan_error`, the bits a
//! device plan sets in its error word, and `detail::routed_choice`, which each of its steps
//! asks of a choice (a bad one flagged and not routed).
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/float_bits.hpp"

#include <cstddef>
#include <cstdint>
#include <span>

WEAVE_NAMESPACE_BEGIN

//! One (local expert, gate weight) choice carried by an SFD row; local = -1 pads.
struct route_entry {
  std::int32_t local = -1; //!< slot index on the destination device, or -1
  float weight = 0.0f;     //!< gate weight of that choice
  friend bool operator==(const route_entry&, const route_entry&) = default;
};
static_assert(sizeof(route_entry) == 8, "route_entry is sent as 8 raw bytes");

//! Bits a device plan sets in its error word.
enum device_plan_error : std::uint32_t {
  device_plan_bad_expert = 1, //!< an id outside [-1, E) (treated as -1)
  device_plan_duplicate = 2,  //!< a token choosing one expert twice (the repeat is ignored)
  device_plan_bad_weight = 4, //!< a non-finite gate weight
};

namespace detail {

// Whether choice i of the token whose choices start at ids[base] is routed: false for -1, for an
// id outside [-1, E) and for a repeat of an earlier choice (each flagged: `detail::check_pair`
// rejects it on the host); a non-finite weight is flagged and the choice still routed.
WEAVE_HOST_DEVICE inline bool routed_choice(const std::int32_t* ids, const float* weights,
                                            std::int64_t base, int i, int E, std::uint32_t& flags) {
  const std::int32_t e = ids[base + i];
  if (e == -1)
    return false;
  if (e < 0 || e >= E) {
    flags |= device_plan_bad_expert;
    return false;
  }
  bool twice = false;
  for (int j = 0; j < i; ++j)
    twice = twice || ids[base + j] == e;
  if (twice) {
    flags |= device_plan_duplicate;
    return false;
  }
  if (!is_finite(weights[base + i]))
    flags |= device_plan_bad_weight;
  return true;
}

// Checks pair p of `ids` / `weights` (k per token; ids[p] != -1): an id in [0, E), not chosen
// twice by its token, a finite weight (read on its bits, so fast math keeps the check). Token
// numbers in the messages count from `token_offset`.
inline void check_pair(std::span<const std::int32_t> ids, std::span<const float> weights,
                       std::size_t p, std::size_t k, int E, std::size_t token_offset) {
  const std::int32_t e = ids[p];
  const std::size_t t = p / k;
  WEAVE_EXPECT(e >= 0 && e < E, errc::out_of_range, "expert id ", e, " of token ", token_offset + t,
               " outside [-1, ", E, ")");
  for (std::size_t j = t * k; j < p; ++j)
    WEAVE_EXPECT(ids[j] != e, errc::invalid_argument, "token ", token_offset + t,
                 " chooses expert ", e, " twice");
  WEAVE_EXPECT(is_finite(weights[p]), errc::invalid_argument, "weight ", weights[p], " of token ",
               token_offset + t, " for expert ", e);
}

// Checks every pair of `ids` / `weights` (as many, k per token, -1 = no expert; their shapes
// checked by the caller) by `check_pair`'s rule without building a plan: a token at a time, its
// ids looked for twice only where a 64-bucket mask of the token's ids says they may repeat (a
// decode layer's one token of k = 8 took about 300 instructions pair by pair), and `check_pair`
// for the error of a token that fails (its number counted from `token_offset`).
inline void check_routing(std::span<const std::int32_t> ids, std::span<const float> weights,
                          std::size_t k, int E, std::size_t token_offset = 0) {
  for (std::size_t first = 0; first < ids.size(); first += k) {
    const std::int32_t* id = ids.data() + first;
    const float* w = weights.data() + first;
    bool ok = true;
    std::uint64_t seen = 0; // bit e % 64 of each id so far
    for (std::size_t j = 0; j < k; ++j) {
      const std::int32_t e = id[j];
      if (e == -1)
        continue;
      ok &= (e >= 0) & (e < E) & is_finite(w[j]);
      const std::uint64_t bit = std::uint64_t{1} << (static_cast<std::uint32_t>(e) & 63u);
      if ((seen & bit) != 0) [[unlikely]] // the same id, or another of its bucket
        for (std::size_t i = 0; i < j; ++i)
          ok &= id[i] != e;
      seen |= bit;
    }
    if (!ok) [[unlikely]]
      for (std::size_t p = first; p < first + k; ++p)
        if (ids[p] != -1)
          check_pair(ids, weights, p, k, E, token_offset);
  }
}

} // namespace detail

WEAVE_NAMESPACE_END
