//! \file
//! `dispatch_plan`: the sender half of a dispatch. From top-k choices (expert ids, gate
//! weights), an optional capacity keep mask and a placement it builds, in O(T * k) with a
//! counting sort, the SFD layout: one row per (token, destination device), grouped by
//! destination device (ascending), tokens ascending within a device. It gives
//! - per-destination counts and offsets (64-bit), ready for an all_to_all_v;
//! - `row_token()`: the ORI token of each SFD row (the ORI -> SFD gather map);
//! - `row_routes()`: the routing metadata sent beside the rows, `k` `route_entry`s per SFD row
//!   (local slot on the destination device and gate weight, rank order, padded with
//!   {-1, 0}); the receiver builds its `expert_plan` from it;
//! - `token_rows()`: the SFD rows of each token, `k` per token, ascending, padded with -1
//!   (the SFD -> ORI combine map: sum of the returned rows in that order);
//! - the dropped (token, rank, expert) pairs, per-slot loads and copies per token.
//! A plan for the token range [t0, t1) of a batch is built from that range's choices, its slice
//! of the batch keep mask and `token_offset = t0` (replica resolution uses global token ids).
#pragma once

#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/float_bits.hpp"
#include "weave/placement/placement.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

WEAVE_NAMESPACE_BEGIN

//! One (local expert, gate weight) choice carried by an SFD row; local = -1 pads.
struct route_entry {
  std::int32_t local = -1; //!< slot index on the destination device, or -1
  float weight = 0.0f;     //!< gate weight of that choice
  friend bool operator==(const route_entry&, const route_entry&) = default;
};
static_assert(sizeof(route_entry) == 8, "route_entry is sent as 8 raw bytes");

//! A (token, expert) pair the capacity filter dropped.
struct dropped_route {
  std::int64_t token = 0;  //!< global token index (token_offset + row)
  std::int32_t rank = 0;   //!< position of the choice among the token's k
  std::int32_t expert = 0; //!< logical expert id
  friend bool operator==(const dropped_route&, const dropped_route&) = default;
};

namespace detail {

// Checks pair p of `ids` / `weights` (k per token; ids[p] != -1) as `dispatch_plan::build`
// does: an id in [0, E), not chosen twice by its token, a finite weight. Token numbers in the
// messages count from `token_offset`.
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
// checked by the caller) as `dispatch_plan::build` does, without building a plan: a token at a
// time, its ids looked for twice only where a 64-bucket mask of the token's ids says they may
// repeat (a decode layer's one token of k = 8 took about 300 instructions pair by pair), and
// `check_pair` for the error of a token that fails (its number counted from `token_offset`).
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

//! Sender-side plan: ORI -> SFD and back. Reusable; rebuilding with at most as many tokens
//! does not allocate.
class dispatch_plan {
 public:
  dispatch_plan() = default;
  //! A plan for tokens on `source_device` with `k` choices each under `where` (copied).
  dispatch_plan(placement where, int k, int source_device)
      : placement_(std::move(where))
      , k_(k)
      , source_(source_device) {
    WEAVE_EXPECT(placement_.num_experts() > 0, errc::invalid_argument, "empty placement");
    WEAVE_EXPECT(k >= 1 && k <= placement_.num_experts(), errc::invalid_argument, "k = ", k,
                 " outside 1..", placement_.num_experts());
    WEAVE_EXPECT(source_device >= 0 && source_device < placement_.num_devices(), errc::out_of_range,
                 "source device ", source_device, " outside [0, ", placement_.num_devices(), ")");
  }

  //! Builds the plan for `ids` / `weights` (k per token, -1 = no expert). `keep`, if not empty,
  //! holds one flag per pair (from `capacity_filter`); pairs with 0 and a valid id are dropped
  //! and reported. Throws `errc::out_of_range` for ids outside [-1, E), `errc::invalid_argument`
  //! for an expert chosen twice by one token or a non-finite weight, `errc::size_mismatch` for
  //! spans of different lengths.
  void build(std::span<const std::int32_t> ids, std::span<const float> weights,
             std::span<const std::uint8_t> keep = {}, std::size_t token_offset = 0) {
    WEAVE_EXPECT(k_ > 0, errc::invalid_state, "dispatch_plan is not initialised");
    const auto kk = static_cast<std::size_t>(k_);
    WEAVE_EXPECT(ids.size() % kk == 0, errc::size_mismatch, ids.size(),
                 " ids are not a whole number of tokens with k = ", k_);
    WEAVE_EXPECT(weights.size() == ids.size(), errc::size_mismatch, weights.size(), " weights for ",
                 ids.size(), " ids");
    WEAVE_EXPECT(keep.empty() || keep.size() == ids.size(), errc::size_mismatch, "keep mask of ",
                 keep.size(), " entries for ", ids.size(), " ids");
    const std::size_t T = ids.size() / kk;
    const auto D = static_cast<std::size_t>(placement_.num_devices());
    const int E = placement_.num_experts();
    const int spd = placement_.slots_per_device();
    tokens_ = T;
    token_offset_ = token_offset;
    pair_device_.assign(ids.size(), -1);
    pair_local_.resize(ids.size());
    fill_.resize(kk);
    kept_.assign(ids.size(), -1);
    token_devices_.assign(ids.size(), -1);
    counts_.assign(D, 0);
    slot_loads_.assign(static_cast<std::size_t>(placement_.num_slots()), 0);
    dropped_.clear();

    // Pass 1: resolve replicas, count distinct devices per token (k is small: O(k^2) dedupe).
    for (std::size_t t = 0; t < T; ++t) {
      std::int32_t* devs = token_devices_.data() + t * kk;
      int ndev = 0;
      for (std::size_t i = 0; i < kk; ++i) {
        const std::size_t p = t * kk + i;
        const std::int32_t e = ids[p];
        if (e == -1)
          continue;
        detail::check_pair(ids, weights, p, kk, E, token_offset);
        if (!keep.empty() && keep[p] == 0) {
          dropped_.push_back(
              {static_cast<std::int64_t>(token_offset + t), static_cast<std::int32_t>(i), e});
          continue;
        }
        const int slot = placement_.slot_for(e, token_offset + t, source_);
        const std::int32_t d = slot / spd;
        pair_device_[p] = d;
        pair_local_[p] = slot - d * spd;
        kept_[p] = e;
        ++slot_loads_[static_cast<std::size_t>(slot)];
        int at = ndev;
        bool seen = false;
        for (int j = 0; j < ndev; ++j)
          seen = seen || devs[j] == d;
        if (seen)
          continue;
        while (at > 0 && devs[at - 1] > d) { // keep the token's devices ascending
          devs[at] = devs[at - 1];
          --at;
        }
        devs[at] = d;
        ++ndev;
        ++counts_[static_cast<std::size_t>(d)];
      }
    }
    offsets_.assign(D + 1, 0);
    for (std::size_t d = 0; d < D; ++d)
      offsets_[d + 1] = offsets_[d] + counts_[d];
    const auto rows = static_cast<std::size_t>(offsets_[D]);

    // Pass 2: place rows; a device's rows come out in token order because t ascends.
    row_token_.resize(rows);
    routes_.resize(checked_mul(rows, kk, "route entries")); // each entry written once below
    token_rows_.assign(ids.size(), -1);
    cursor_.assign(offsets_.begin(), offsets_.end() - 1);
    for (std::size_t t = 0; t < T; ++t) {
      const std::int32_t* devs = token_devices_.data() + t * kk;
      std::int64_t* rows_of = token_rows_.data() + t * kk; // rows of the token, device order
      std::size_t ndev = 0;
      for (; ndev < kk && devs[ndev] >= 0; ++ndev) {
        const std::int64_t r = cursor_[static_cast<std::size_t>(devs[ndev])]++;
        row_token_[static_cast<std::size_t>(r)] = static_cast<std::int64_t>(t);
        rows_of[ndev] = r;
        fill_[ndev] = 0;
      }
      // Entries in rank order; a pair finds its row among the token's <= k devices.
      for (std::size_t i = 0; i < kk; ++i) {
        const std::int32_t d = pair_device_[t * kk + i];
        if (d < 0)
          continue;
        std::size_t j = 0;
        while (devs[j] != d)
          ++j;
        routes_[static_cast<std::size_t>(rows_of[j]) * kk + fill_[j]++] = {pair_local_[t * kk + i],
                                                                           weights[t * kk + i]};
      }
      for (std::size_t j = 0; j < ndev; ++j)
        for (std::size_t f = fill_[j]; f < kk; ++f)
          routes_[static_cast<std::size_t>(rows_of[j]) * kk + f] = route_entry{};
    }
  }

  const placement& where() const noexcept { return placement_; }
  int k() const noexcept { return k_; }
  int source_device() const noexcept { return source_; }
  int num_devices() const noexcept { return placement_.num_devices(); }
  //! Tokens in the plan (ORI rows) and the global index of the first.
  std::size_t tokens() const noexcept { return tokens_; }
  std::size_t token_offset() const noexcept { return token_offset_; }
  //! SFD rows: one per (token, destination device).
  std::int64_t rows() const noexcept { return offsets_.empty() ? 0 : offsets_.back(); }
  //! SFD rows sent to each device.
  std::span<const std::int64_t> send_counts() const noexcept { return counts_; }
  //! First SFD row of each device; `num_devices() + 1` entries.
  std::span<const std::int64_t> send_offsets() const noexcept { return offsets_; }
  //! ORI token (plan-local) of each SFD row.
  std::span<const std::int64_t> row_token() const noexcept { return row_token_; }
  //! `k` route entries per SFD row, to send beside the rows (`k * send_counts()[d]` to device d).
  std::span<const route_entry> row_routes() const noexcept { return routes_; }
  //! `k` SFD rows per token, ascending, -1 padded.
  std::span<const std::int64_t> token_rows() const noexcept { return token_rows_; }
  //! The routed logical expert of each pair; -1 where there was none or it was dropped.
  std::span<const std::int32_t> kept_experts() const noexcept { return kept_; }
  //! Pairs sent to each physical slot.
  std::span<const std::int64_t> slot_loads() const noexcept { return slot_loads_; }
  //! Pairs the keep mask dropped, in token then rank order.
  std::span<const dropped_route> dropped() const noexcept { return dropped_; }
  //! Copies per token (CT): SFD rows / tokens (mean distinct destination devices per token).
  double copies_per_token() const noexcept {
    return tokens_ == 0 ? 0.0 : static_cast<double>(rows()) / static_cast<double>(tokens_);
  }

 private:
  placement placement_;
  int k_ = 0;
  int source_ = 0;
  std::size_t tokens_ = 0;
  std::size_t token_offset_ = 0;
  std::vector<std::int32_t> pair_device_;   // [T*k] destination device or -1
  std::vector<std::int32_t> pair_local_;    // [T*k] local slot on that device
  std::vector<std::size_t> fill_;           // [k] entries written per row of one token
  std::vector<std::int32_t> kept_;          // [T*k] logical expert or -1
  std::vector<std::int32_t> token_devices_; // [T*k] distinct devices ascending, -1 padded
  std::vector<std::int64_t> counts_;        // [D]
  std::vector<std::int64_t> offsets_;       // [D+1]
  std::vector<std::int64_t> cursor_;        // [D]
  std::vector<std::int64_t> row_token_;     // [rows]
  std::vector<route_entry> routes_;         // [rows*k]
  std::vector<std::int64_t> token_rows_;    // [T*k]
  std::vector<std::int64_t> slot_loads_;    // [slots]
  std::vector<dropped_route> dropped_;
};

WEAVE_NAMESPACE_END
