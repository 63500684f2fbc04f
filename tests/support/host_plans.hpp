// The host reference implementations of weave's routing plans, kept as test oracles: the
// sender plan (`dispatch_plan`: ORI -> SFD counting sort, route entries, combine map, dropped
// pairs), the receiver plan (`expert_plan`: SFD -> EPD), the capacity decision
// (`capacity_filter`, whole batch or chunk by chunk) and the four layout moves over their maps,
// each move written as its definition (`gather_rows` / `merge_rows` over the plan's map). The
// library's plans are `weave::device_dispatch_plan<Space>`, `weave::device_expert_plan<Space>`
// and `weave::device_capacity_filter<Space>` (one algorithm in every execution space); the tests
// check these oracles against brute force (tests/routing/plan_test.cpp, capacity_test.cpp,
// kernels_test.cpp) and the library's plans against these oracles, exactly
// (tests/routing/device_plan_test.cpp, gate_plan_test.cu). Plain sequential loops, one pass per
// step, written independently of the device plans' steps (they share only the rule for valid
// choices, `weave::detail::check_pair`).
#pragma once

#include <weave/core/checked.hpp>
#include <weave/core/error.hpp>
#include <weave/core/float_bits.hpp>
#include <weave/core/tensor.hpp>
#include <weave/placement/placement.hpp>
#include <weave/routing/capacity.hpp>
#include <weave/routing/kernels_host.hpp>
#include <weave/routing/route_entry.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <utility>
#include <vector>

namespace oracle {

using weave::capacity_policy;
using weave::checked_add;
using weave::checked_mul;
using weave::const_token_view;
using weave::drop_order;
using weave::errc;
using weave::expert_capacity;
using weave::placement;
using weave::route_entry;
using weave::token_view;
namespace detail = weave::detail;

// A (token, expert) pair the keep mask dropped.
struct dropped_route {
  std::int64_t token = 0;  // global token index (token_offset + row)
  std::int32_t rank = 0;   // position of the choice among the token's k
  std::int32_t expert = 0; // logical expert id
  friend bool operator==(const dropped_route&, const dropped_route&) = default;
};

// Sender-side plan: ORI -> SFD and back. Reusable; rebuilding with at most as many tokens does
// not allocate.
class dispatch_plan {
 public:
  dispatch_plan() = default;
  // A plan for tokens on `source_device` with `k` choices each under `where` (copied).
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

  // Builds the plan for `ids` / `weights` (k per token, -1 = no expert). `keep`, if not empty,
  // holds one flag per pair (from a capacity filter); pairs with 0 and a valid id are dropped
  // and reported. Throws `errc::out_of_range` for ids outside [-1, E), `errc::invalid_argument`
  // for an expert chosen twice by one token or a non-finite weight, `errc::size_mismatch` for
  // spans of different lengths.
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
  // Tokens in the plan (ORI rows) and the global index of the first.
  std::size_t tokens() const noexcept { return tokens_; }
  std::size_t token_offset() const noexcept { return token_offset_; }
  // SFD rows: one per (token, destination device).
  std::int64_t rows() const noexcept { return offsets_.empty() ? 0 : offsets_.back(); }
  // SFD rows sent to each device.
  std::span<const std::int64_t> send_counts() const noexcept { return counts_; }
  // First SFD row of each device; `num_devices() + 1` entries.
  std::span<const std::int64_t> send_offsets() const noexcept { return offsets_; }
  // ORI token (plan-local) of each SFD row.
  std::span<const std::int64_t> row_token() const noexcept { return row_token_; }
  // `k` route entries per SFD row, to send beside the rows (`k * send_counts()[d]` to device d).
  std::span<const route_entry> row_routes() const noexcept { return routes_; }
  // `k` SFD rows per token, ascending, -1 padded.
  std::span<const std::int64_t> token_rows() const noexcept { return token_rows_; }
  // The routed logical expert of each pair; -1 where there was none or it was dropped.
  std::span<const std::int32_t> kept_experts() const noexcept { return kept_; }
  // Pairs sent to each physical slot.
  std::span<const std::int64_t> slot_loads() const noexcept { return slot_loads_; }
  // Pairs the keep mask dropped, in token then rank order.
  std::span<const dropped_route> dropped() const noexcept { return dropped_; }
  // Copies per token (CT): SFD rows / tokens (mean distinct destination devices per token).
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

// Receiver-side plan: SFD -> EPD and back. Reusable; rebuilding at most as large does not
// allocate.
class expert_plan {
 public:
  expert_plan() = default;
  // A plan for a device with `local_experts` expert slots receiving rows with `k` entries each.
  expert_plan(int local_experts, int k)
      : local_(local_experts)
      , k_(k) {
    WEAVE_EXPECT(local_experts >= 1, errc::invalid_argument, "local_experts = ", local_experts);
    WEAVE_EXPECT(k >= 1, errc::invalid_argument, "k = ", k);
  }

  // Builds the plan from the received `routes` (`k` per row) and the rows received from each
  // source. Throws `errc::size_mismatch` unless `routes` holds k entries per counted row,
  // `errc::out_of_range` for a local id outside [-1, local_experts), `errc::invalid_argument`
  // for a negative count, a row with no entry, a local expert named twice by one row or a
  // non-finite weight.
  void build(std::span<const route_entry> routes, std::span<const std::int64_t> recv_counts) {
    WEAVE_EXPECT(k_ > 0, errc::invalid_state, "expert_plan is not initialised");
    const auto kk = static_cast<std::size_t>(k_);
    const auto L = static_cast<std::size_t>(local_);
    source_offsets_.assign(recv_counts.size() + 1, 0);
    for (std::size_t s = 0; s < recv_counts.size(); ++s) {
      WEAVE_EXPECT(recv_counts[s] >= 0, errc::invalid_argument, "receive count ", recv_counts[s],
                   " from source ", s);
      source_offsets_[s + 1] = static_cast<std::int64_t>(
          checked_add(static_cast<std::size_t>(source_offsets_[s]),
                      static_cast<std::size_t>(recv_counts[s]), "received rows"));
    }
    const auto rows = static_cast<std::size_t>(source_offsets_.back());
    WEAVE_EXPECT(routes.size() == checked_mul(rows, kk, "route entries"), errc::size_mismatch,
                 routes.size(), " route entries for ", rows, " received rows with k = ", k_);
    rows_ = rows;
    counts_.assign(L, 0);
    for (std::size_t r = 0; r < rows; ++r) {
      const route_entry* row = routes.data() + r * kk;
      int entries = 0;
      for (std::size_t i = 0; i < kk; ++i) {
        const std::int32_t l = row[i].local;
        if (l == -1)
          continue;
        WEAVE_EXPECT(l >= 0 && l < local_, errc::out_of_range, "received row ", r,
                     " names local expert ", l, " outside [-1, ", local_, ")");
        WEAVE_EXPECT(detail::is_finite(row[i].weight), errc::invalid_argument, "received row ", r,
                     " carries weight ", row[i].weight);
        for (std::size_t j = 0; j < i; ++j)
          WEAVE_EXPECT(row[j].local != l, errc::invalid_argument, "received row ", r,
                       " names local expert ", l, " twice");
        ++counts_[static_cast<std::size_t>(l)];
        ++entries;
      }
      WEAVE_EXPECT(entries > 0, errc::invalid_argument, "received row ", r,
                   " carries no expert (senders never send empty rows)");
    }
    offsets_.assign(L + 1, 0);
    for (std::size_t l = 0; l < L; ++l)
      offsets_[l + 1] = offsets_[l] + counts_[l];
    const auto epd = static_cast<std::size_t>(offsets_[L]);
    epd_source_.resize(epd);
    epd_weight_.resize(epd);
    row_epd_.assign(rows * kk, -1);
    row_weight_.assign(rows * kk, 0.0f);
    cursor_.assign(offsets_.begin(), offsets_.end() - 1);
    for (std::size_t r = 0; r < rows; ++r) {
      const route_entry* row = routes.data() + r * kk;
      for (std::size_t i = 0; i < kk; ++i) {
        if (row[i].local < 0)
          continue;
        const auto j = static_cast<std::size_t>(cursor_[static_cast<std::size_t>(row[i].local)]++);
        epd_source_[j] = static_cast<std::int64_t>(r);
        epd_weight_[j] = row[i].weight;
        row_epd_[r * kk + i] = static_cast<std::int64_t>(j);
        row_weight_[r * kk + i] = row[i].weight;
      }
    }
  }

  int local_experts() const noexcept { return local_; }
  int k() const noexcept { return k_; }
  // Received SFD rows (also the rows the merge sends back).
  std::int64_t rows() const noexcept { return static_cast<std::int64_t>(rows_); }
  // EPD rows: one per (received row, local expert).
  std::int64_t epd_rows() const noexcept { return offsets_.empty() ? 0 : offsets_.back(); }
  // First received row of each source; sources + 1 entries.
  std::span<const std::int64_t> source_offsets() const noexcept { return source_offsets_; }
  // EPD rows of each local expert.
  std::span<const std::int64_t> expert_counts() const noexcept { return counts_; }
  // First EPD row of each local expert; local_experts + 1 entries.
  std::span<const std::int64_t> expert_offsets() const noexcept { return offsets_; }
  // Received row of each EPD row.
  std::span<const std::int64_t> epd_row_source() const noexcept { return epd_source_; }
  // Gate weight of each EPD row.
  std::span<const float> epd_weight() const noexcept { return epd_weight_; }
  // `k` EPD rows per received row, -1 padded.
  std::span<const std::int64_t> row_epd() const noexcept { return row_epd_; }
  // `k` gate weights per received row, 0 padded (aligned with `row_epd`).
  std::span<const float> row_weight() const noexcept { return row_weight_; }

 private:
  int local_ = 0;
  int k_ = 0;
  std::size_t rows_ = 0;
  std::vector<std::int64_t> source_offsets_;
  std::vector<std::int64_t> counts_, offsets_, cursor_;
  std::vector<std::int64_t> epd_source_;
  std::vector<float> epd_weight_;
  std::vector<std::int64_t> row_epd_;
  std::vector<float> row_weight_;
};

// Decides which (token, rank) pairs fit their expert's capacity, for a whole batch at once or
// chunk by chunk. Reusable: keeps its scratch between batches.
class capacity_filter {
 public:
  capacity_filter() = default;
  // A filter for batches of `batch_tokens` tokens with `k` choices over `num_experts`.
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
  // Rows per expert, -1 for dropless.
  std::int64_t capacity() const noexcept { return capacity_; }
  // Rows kept per expert so far (since construction or `reset`).
  std::span<const std::int64_t> used() const noexcept { return used_; }

  // Forgets the used capacity: the next `admit` starts a new batch.
  void reset() { std::fill(used_.begin(), used_.end(), std::int64_t{0}); }

  // Position order, chunk by chunk: decides the pairs of the next chunk (`ids`, k per token,
  // -1 = no expert) against the capacity used so far and records what they use. Writes
  // keep[i] = 1 / 0 and returns the number dropped. Throws `errc::invalid_state` for another
  // order, `errc::out_of_range` for ids outside [-1, E), `errc::size_mismatch` for sizes.
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

  // Any order, the whole batch at once (`ids` of `batch_tokens` tokens; `priority` one value per
  // token, read only by the prioritized orders: for Tutel's order, the token's top gate score,
  // `top_k_gate`'s `top_score`). Starts from zero used capacity. Writes the keep mask and
  // returns the number dropped. Throws `errc::invalid_argument` for a NaN priority.
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

// ORI -> SFD: the plan's tokens into its send rows (one per token and destination device):
// `gather_rows` over `row_token()`.
inline void dispatch_gather(const dispatch_plan& plan, const_token_view ori, token_view sfd) {
  WEAVE_EXPECT(ori.rows() == plan.tokens(), errc::size_mismatch, "dispatch_gather: ", ori.rows(),
               " ORI rows for a plan of ", plan.tokens(), " tokens");
  weave::gather_rows(ori, sfd, plan.row_token());
}

// SFD -> EPD: received rows into one row per local expert choice, grouped by local expert;
// `gate_scaled` multiplies each by its gate weight: `gather_rows` over `epd_row_source()`
// (times `epd_weight()`).
inline void expert_scatter(const expert_plan& plan, const_token_view received, token_view epd,
                           bool gate_scaled = false) {
  WEAVE_EXPECT(received.rows() == static_cast<std::size_t>(plan.rows()), errc::size_mismatch,
               "expert_scatter: ", received.rows(), " received rows for a plan of ", plan.rows());
  weave::gather_rows(received, epd, plan.epd_row_source(),
                     gate_scaled ? plan.epd_weight() : std::span<const float>{});
}

// EPD -> SFD: per received row, the sum of its local experts' outputs times their gate weights
// (`weighted`), in route-entry order: `merge_rows` over `row_epd()` (x `row_weight()`).
inline void expert_merge(const expert_plan& plan, const_token_view expert_out, token_view back,
                         bool weighted = true) {
  WEAVE_EXPECT(expert_out.rows() == static_cast<std::size_t>(plan.epd_rows()), errc::size_mismatch,
               "expert_merge: ", expert_out.rows(), " expert output rows for a plan of ",
               plan.epd_rows());
  weave::merge_rows(expert_out, back, plan.row_epd(), plan.k(),
                    weighted ? plan.row_weight() : std::span<const float>{});
}

// SFD -> ORI: per token, the sum of the rows its destination devices returned, in ascending
// device order; tokens sent nowhere get zeros: `merge_rows` over `token_rows()`.
inline void combine_merge(const dispatch_plan& plan, const_token_view returned, token_view ori) {
  WEAVE_EXPECT(returned.rows() == static_cast<std::size_t>(plan.rows()), errc::size_mismatch,
               "combine_merge: ", returned.rows(), " returned rows for a plan of ", plan.rows());
  weave::merge_rows(returned, ori, plan.token_rows(), plan.k());
}

} // namespace oracle
