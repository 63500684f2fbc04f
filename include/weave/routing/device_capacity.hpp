//! \file
//! `device_capacity_filter<Space>`: weave's capacity decision, made where the choices live (in
//! every execution space), for a whole batch at once (so every chunk of a pipelined layer reads
//! its slice of one mask, and drops equal the unchunked batch's: Lancet's rule) or, in position
//! order, chunk by chunk (`reset`, `admit`).
//!
//! Pairs claim capacity in the policy's order (`drop_order`, see `weave/routing/capacity.hpp`),
//! with the policy's rounding. Steps: for the prioritized orders, the token priorities and their
//! stable descending order; one step per pair writing (expert, pair) at the pair's position in
//! the claiming order; a stable sort by expert; a scan of the per-expert counts; and one step per
//! sorted pair: its rank within its expert decides it. A serial space (`host_space`) visits the
//! pairs once in the claiming order instead, counting per expert. CI checks the masks against a
//! sequential host reference (tests/support) and a Tutel-style mask + cumsum reference.
#pragma once

#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/workspace.hpp"
#include "weave/exec/space.hpp"
#include "weave/routing/capacity.hpp"
#include "weave/routing/device_dispatch_plan.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <type_traits>

WEAVE_NAMESPACE_BEGIN

namespace detail {

// A sort key whose ascending order is the descending order of `p` (-0 counts as +0, NaN last).
// Decided on the bits alone: fast math may fold `p != p` and drop the -0 -> +0 step.
WEAVE_HOST_DEVICE inline std::uint32_t descending_key(float p) {
  if (is_nan(p))
    return 0xffffffffu;
  const std::uint32_t bits = is_zero(p) ? 0u : float_bits(p);
  const std::uint32_t ordered = (bits & 0x80000000u) != 0 ? ~bits : bits | 0x80000000u;
  return ~ordered;
}

// Per token: its priority key (the given priority, or else the best weight over its valid
// choices, -inf without any; a NaN weight is skipped, on its bits, as `w > best` skips it
// without fast math).
struct priority_step {
  const std::int32_t* ids;
  const float* weights;
  const float* priority; // null: from the weights
  int k, E;
  std::uint32_t* keys;
  std::int32_t* values;

  WEAVE_HOST_DEVICE void operator()(std::int64_t t) const {
    values[t] = static_cast<std::int32_t>(t);
    if (priority != nullptr) {
      keys[t] = descending_key(priority[t]);
      return;
    }
    const std::uint32_t minus_infinity = 0xff800000u;
    float best = 0.0f;
    memcpy(&best, &minus_infinity, sizeof(best));
    for (int j = 0; j < k; ++j) {
      const std::int32_t e = ids[t * k + j];
      const float w = weights[t * k + j];
      if (e >= 0 && e < E && !is_nan(w) && w > best)
        best = w;
    }
    keys[t] = descending_key(best);
  }
};

// Per rank r of the sorted priorities: the inverse permutation.
struct rank_of_token_step {
  const std::int32_t* token_of_rank;
  std::int32_t* rank_of_token;
  WEAVE_HOST_DEVICE void operator()(std::int64_t r) const {
    rank_of_token[token_of_rank[r]] = static_cast<std::int32_t>(r);
  }
};

// Per pair (t, j): (expert, pair) at the pair's position in the claiming order.
struct claim_step {
  const std::int32_t* ids;
  const std::int32_t* rank_of_token; // prioritized orders only
  int k, E;
  std::int64_t tokens;
  int order; // drop_order
  std::uint32_t* keys;
  std::int32_t* values;
  std::int64_t* counts;

  WEAVE_HOST_DEVICE void operator()(std::int64_t p) const {
    const std::int64_t t = p / k, j = p % k;
    std::int64_t at = p; // position order
    if (order == static_cast<int>(drop_order::rank_major))
      at = j * tokens + t;
    else if (order == static_cast<int>(drop_order::batch_prioritized))
      at = j * tokens + rank_of_token[t];
    else if (order == static_cast<int>(drop_order::priority_token_major))
      at = static_cast<std::int64_t>(rank_of_token[t]) * k + j;
    const std::int32_t e = ids[p];
    const bool valid = e >= 0 && e < E;
    keys[at] = static_cast<std::uint32_t>(valid ? e : E);
    values[at] = static_cast<std::int32_t>(p);
    if (valid)
      atomic_add(counts + e, 1);
  }
};

// Per sorted pair: kept while its rank within its expert, after the rows earlier chunks of the
// batch took (`used`, null for a whole batch), is below the capacity.
struct keep_step {
  const std::uint32_t* keys;
  const std::int32_t* values;
  const std::int64_t* starts;
  const std::int64_t* used;
  int E;
  std::int64_t capacity; // -1: unbounded
  std::uint8_t* keep;
  std::int64_t* dropped;

  WEAVE_HOST_DEVICE void operator()(std::int64_t i) const {
    const auto e = static_cast<std::int64_t>(keys[i]);
    const std::int64_t p = values[i];
    if (e >= E) {
      keep[p] = 0; // no expert: neither kept nor dropped
      return;
    }
    const std::int64_t before = used != nullptr ? used[e] : 0;
    const bool fits = capacity < 0 || before + (i - starts[e]) < capacity;
    keep[p] = fits ? 1 : 0;
    if (!fits)
      atomic_add(dropped, 1);
  }
};

// Serial spaces: the whole decision in one pass over the pairs in the claiming order (each
// pair's rank within its expert is the count of that expert's pairs before it), instead of the
// claim, the sort by expert, the scan and the keep step.
struct claim_in_order_step {
  const std::int32_t* ids;
  const std::int32_t* token_of_rank; // prioritized orders only
  int k, E;
  std::int64_t tokens;
  int order; // drop_order
  const std::int64_t* used;
  std::int64_t capacity; // -1: unbounded
  std::int64_t* counts;
  std::uint8_t* keep;
  std::int64_t* dropped;

  WEAVE_HOST_DEVICE void claim(std::int64_t p) const {
    const std::int32_t e = ids[p];
    if (e < 0 || e >= E) {
      keep[p] = 0;
      return;
    }
    const std::int64_t before = (used != nullptr ? used[e] : 0) + counts[e]++;
    const bool fits = capacity < 0 || before < capacity;
    keep[p] = fits ? 1 : 0;
    *dropped += fits ? 0 : 1;
  }

  WEAVE_HOST_DEVICE void operator()(std::int64_t) const {
    const auto token = [&](std::int64_t r) { return token_of_rank ? token_of_rank[r] : r; };
    if (order == static_cast<int>(drop_order::position) ||
        order == static_cast<int>(drop_order::priority_token_major)) {
      for (std::int64_t r = 0; r < tokens; ++r)
        for (int j = 0; j < k; ++j)
          claim(token(r) * k + j);
    } else { // choice-major: every token's first choice, then every second choice, ...
      for (int j = 0; j < k; ++j)
        for (std::int64_t r = 0; r < tokens; ++r)
          claim(token(r) * k + j);
    }
  }
};

// Per expert, after a chunk: the rows its chunks have taken so far.
struct used_step {
  const std::int64_t* counts;
  std::int64_t capacity;
  std::int64_t* used;
  WEAVE_HOST_DEVICE void operator()(std::int64_t e) const {
    const std::int64_t total = used[e] + counts[e];
    used[e] = capacity >= 0 && total > capacity ? capacity : total;
  }
};

} // namespace detail

//! Capacity decisions in `Space` for batches of up to `max_tokens` tokens. Construct, allocate
//! `workspace_size()` bytes of memory of the space, `initialize` once, `decide` per batch.
template <execution_space Space>
class device_capacity_filter {
 public:
  using stream_arg = typename Space::stream_arg;

  //! Throws `errc::invalid_argument` for bad sizes or a non-finite factor, `errc::out_of_range`
  //! when max_tokens * k exceeds 2^31 - 1.
  device_capacity_filter(int num_experts, int k, std::size_t max_tokens, capacity_policy policy)
      : E_(num_experts)
      , k_(k)
      , max_tokens_(max_tokens)
      , policy_(policy) {
    (void)expert_capacity(policy, max_tokens, k, num_experts); // validates
    WEAVE_EXPECT(policy.order <= drop_order::priority_token_major, errc::invalid_argument,
                 "drop order ", static_cast<int>(policy.order));
    const std::size_t n = checked_mul(max_tokens, static_cast<std::size_t>(k), "pairs");
    WEAVE_EXPECT(n <= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()),
                 errc::out_of_range, max_tokens, " tokens with k = ", k,
                 " exceed 2^31 - 1 pairs in a device capacity filter");
    temp_bytes_ = std::max(Space::scan_temp_bytes(E_ + 1),
                           Space::sort_temp_bytes(static_cast<std::int64_t>(n)));
  }

  const capacity_policy& policy() const noexcept { return policy_; }

  std::size_t workspace_size() const {
    workspace_carver measure;
    return carve(*this, measure).used();
  }

  void initialize(void* workspace, std::size_t bytes, stream_arg) {
    WEAVE_EXPECT(workspace != nullptr, errc::invalid_argument, "null workspace");
    workspace_carver carver(workspace, bytes);
    carve(*this, carver);
    initialized_ = true;
  }

  //! Writes the keep mask (one flag per pair, 1 = kept) of a batch of `ids.size() / k` tokens
  //! on `stream`; `ids`, `weights`, `keep` and `priority` are in memory of the space. The
  //! prioritized orders rank tokens by `priority` (one value per token; for Tutel's order the
  //! top gate score) or, when it is empty, by the best weight of the token's valid choices (as
  //! `moe_exchange` does); a NaN priority ranks last. Ids outside [0, E) are neither kept nor
  //! dropped (a dispatch plan flags the bad ones). Throws `errc::size_mismatch` for other
  //! lengths or more than `max_tokens` tokens.
  void decide(stream_arg stream, std::span<const std::int32_t> ids, std::span<const float> weights,
              std::span<std::uint8_t> keep, std::span<const float> priority = {}) {
    WEAVE_EXPECT(initialized_, errc::invalid_state, "device capacity filter is not initialised");
    const auto kk = static_cast<std::size_t>(k_);
    WEAVE_EXPECT(ids.size() % kk == 0 && ids.size() / kk <= max_tokens_ &&
                     weights.size() == ids.size() && keep.size() == ids.size(),
                 errc::size_mismatch, "device capacity filter: ", ids.size(), " ids, ",
                 weights.size(), " weights, ", keep.size(), " flags with k = ", k_, " for up to ",
                 max_tokens_, " tokens");
    WEAVE_EXPECT(priority.empty() || priority.size() == ids.size() / kk, errc::size_mismatch,
                 "device capacity filter: ", priority.size(), " priorities for ", ids.size() / kk,
                 " tokens");
    const auto T = static_cast<std::int64_t>(ids.size() / kk);
    const auto n = static_cast<std::int64_t>(ids.size());
    capacity_ = expert_capacity(policy_, static_cast<std::size_t>(T), k_, E_);
    Space::fill(stream, counts_, 0, (static_cast<std::size_t>(E_) + 1) * sizeof(std::int64_t));
    Space::fill(stream, dropped_, 0, sizeof(std::int64_t));
    if (n == 0)
      return;
    const bool prioritized = policy_.order == drop_order::batch_prioritized ||
                             policy_.order == drop_order::priority_token_major;
    if (prioritized) {
      Space::for_each(stream, T,
                      detail::priority_step{ids.data(), weights.data(),
                                            priority.empty() ? nullptr : priority.data(), k_, E_,
                                            keys_in_, values_in_});
      Space::sort_pairs(stream, keys_in_, keys_out_, values_in_, values_out_, T, 32, temp_,
                        temp_bytes_);
      if constexpr (!serial_space<Space>)
        Space::for_each(stream, T, detail::rank_of_token_step{values_out_, rank_of_token_});
    }
    if constexpr (serial_space<Space>) {
      Space::for_each(stream, 1,
                      detail::claim_in_order_step{ids.data(), prioritized ? values_out_ : nullptr,
                                                  k_, E_, T, static_cast<int>(policy_.order),
                                                  nullptr, capacity_, counts_, keep.data(),
                                                  dropped_});
      return;
    }
    Space::for_each(stream, n,
                    detail::claim_step{ids.data(), prioritized ? rank_of_token_ : nullptr, k_, E_,
                                       T, static_cast<int>(policy_.order), keys_in_, values_in_,
                                       counts_});
    Space::sort_pairs(stream, keys_in_, keys_out_, values_in_, values_out_, n, detail::key_bits(E_),
                      temp_, temp_bytes_);
    Space::exclusive_scan(stream, counts_, starts_, E_ + 1, temp_, temp_bytes_);
    Space::for_each(stream, n,
                    detail::keep_step{keys_out_, values_out_, starts_, nullptr, E_, capacity_,
                                      keep.data(), dropped_});
  }

  //! Position order, chunk by chunk (for chunks whose choices are produced one after the
  //! other): `reset` starts a batch of `batch_tokens` tokens, then `admit` decides each chunk's
  //! pairs against the capacity earlier chunks used, so the chunks together drop what `decide`
  //! drops for the whole batch. `dropped_count()` accumulates over the batch's chunks.
  void reset(stream_arg stream, std::size_t batch_tokens) {
    WEAVE_EXPECT(initialized_, errc::invalid_state, "device capacity filter is not initialised");
    WEAVE_EXPECT(policy_.order == drop_order::position, errc::invalid_state,
                 "chunk-by-chunk capacity needs drop_order::position");
    WEAVE_EXPECT(batch_tokens <= max_tokens_, errc::size_mismatch, batch_tokens,
                 " tokens in a device capacity filter for ", max_tokens_);
    capacity_ = expert_capacity(policy_, batch_tokens, k_, E_);
    Space::fill(stream, used_, 0, static_cast<std::size_t>(E_) * sizeof(std::int64_t));
    Space::fill(stream, dropped_, 0, sizeof(std::int64_t));
  }

  //! Decides the next chunk of the batch (`ids`, `keep`: k per token, memory of the space).
  void admit(stream_arg stream, std::span<const std::int32_t> ids, std::span<std::uint8_t> keep) {
    WEAVE_EXPECT(policy_.order == drop_order::position, errc::invalid_state,
                 "chunk-by-chunk capacity needs drop_order::position");
    WEAVE_EXPECT(ids.size() % static_cast<std::size_t>(k_) == 0 && keep.size() == ids.size() &&
                     ids.size() <= max_tokens_ * static_cast<std::size_t>(k_),
                 errc::size_mismatch, "device capacity filter: ", ids.size(), " ids and ",
                 keep.size(), " flags with k = ", k_);
    const auto n = static_cast<std::int64_t>(ids.size());
    Space::fill(stream, counts_, 0, (static_cast<std::size_t>(E_) + 1) * sizeof(std::int64_t));
    if (n == 0)
      return;
    if constexpr (serial_space<Space>) {
      Space::for_each(stream, 1,
                      detail::claim_in_order_step{ids.data(), nullptr, k_, E_, n / k_,
                                                  static_cast<int>(drop_order::position), used_,
                                                  capacity_, counts_, keep.data(), dropped_});
      Space::for_each(stream, E_, detail::used_step{counts_, capacity_, used_});
      return;
    }
    Space::for_each(stream, n,
                    detail::claim_step{ids.data(), nullptr, k_, E_, n / k_,
                                       static_cast<int>(drop_order::position), keys_in_, values_in_,
                                       counts_});
    Space::sort_pairs(stream, keys_in_, keys_out_, values_in_, values_out_, n, detail::key_bits(E_),
                      temp_, temp_bytes_);
    Space::exclusive_scan(stream, counts_, starts_, E_ + 1, temp_, temp_bytes_);
    Space::for_each(stream, n,
                    detail::keep_step{keys_out_, values_out_, starts_, used_, E_, capacity_,
                                      keep.data(), dropped_});
    Space::for_each(stream, E_, detail::used_step{counts_, capacity_, used_});
  }

  //! Rows per expert of the last batch, -1 for dropless.
  std::int64_t capacity() const noexcept { return capacity_; }
  //! Pairs the last `decide` dropped (one value in memory of the space).
  const std::int64_t* dropped_count() const noexcept { return dropped_; }

 private:
  template <class Self>
  static workspace_carver& carve(Self& self, workspace_carver& c) {
    const std::size_t n = self.max_tokens_ * static_cast<std::size_t>(self.k_);
    const auto E = static_cast<std::size_t>(self.E_);
    const auto set = carve_into<Self>(c);
    set(self.counts_, E + 1);
    set(self.starts_, E + 1);
    set(self.dropped_, 1);
    set(self.used_, E);
    set(self.keys_in_, n);
    set(self.keys_out_, n);
    set(self.values_in_, n);
    set(self.values_out_, n);
    set(self.rank_of_token_, self.max_tokens_ == 0 ? 1 : self.max_tokens_);
    set(self.temp_, self.temp_bytes_ == 0 ? 1 : self.temp_bytes_);
    return c;
  }

  int E_ = 0, k_ = 0;
  std::size_t max_tokens_ = 0;
  capacity_policy policy_;
  std::int64_t capacity_ = -1;
  std::size_t temp_bytes_ = 0;
  bool initialized_ = false;
  std::int64_t *counts_ = nullptr, *starts_ = nullptr, *dropped_ = nullptr, *used_ = nullptr;
  std::uint32_t *keys_in_ = nullptr, *keys_out_ = nullptr;
  std::int32_t *values_in_ = nullptr, *values_out_ = nullptr;
  std::int32_t* rank_of_token_ = nullptr;
  std::byte* temp_ = nullptr;
};

WEAVE_NAMESPACE_END
