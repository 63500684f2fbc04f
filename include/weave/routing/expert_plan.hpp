//! \file
//! `expert_plan`: the receiver half of a dispatch. From the route entries that arrived with the
//! SFD rows (`k` per row, sources concatenated in rank order, as an all_to_all_v delivers them)
//! and the per-source receive counts it builds, in O(rows * k) with a counting sort, the EPD
//! layout: one row per (received row, local expert), grouped by local expert (ascending), and
//! within an expert in received-row order, so a grouped GEMM sees one contiguous range per
//! local expert. It gives
//! - `epd_row_source()` / `epd_weight()`: the received row and gate weight of each EPD row (the
//!   SFD -> EPD scatter map, optionally gate-scaled);
//! - `expert_offsets()`: the EPD row range of each local expert (64-bit);
//! - `row_epd()` / `row_weight()`: `k` EPD rows and weights per received row, in the order of
//!   its route entries, -1 / 0 padded (the EPD -> SFD weighted local merge map; the merged
//!   rows go back in received order, so the return all_to_all_v swaps the counts).
#pragma once

#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/float_bits.hpp"
#include "weave/routing/dispatch_plan.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

WEAVE_NAMESPACE_BEGIN

//! Receiver-side plan: SFD -> EPD and back. Reusable; rebuilding at most as large does not
//! allocate.
class expert_plan {
 public:
  expert_plan() = default;
  //! A plan for a device with `local_experts` expert slots receiving rows with `k` entries each.
  expert_plan(int local_experts, int k)
      : local_(local_experts)
      , k_(k) {
    WEAVE_EXPECT(local_experts >= 1, errc::invalid_argument, "local_experts = ", local_experts);
    WEAVE_EXPECT(k >= 1, errc::invalid_argument, "k = ", k);
  }

  //! Builds the plan from the received `routes` (`k` per row) and the rows received from each
  //! source. Throws `errc::size_mismatch` unless `routes` holds k entries per counted row,
  //! `errc::out_of_range` for a local id outside [-1, local_experts), `errc::invalid_argument`
  //! for a negative count, a row with no entry, a local expert named twice by one row or a
  //! non-finite weight.
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
  //! Received SFD rows (also the rows the merge sends back).
  std::int64_t rows() const noexcept { return static_cast<std::int64_t>(rows_); }
  //! EPD rows: one per (received row, local expert).
  std::int64_t epd_rows() const noexcept { return offsets_.empty() ? 0 : offsets_.back(); }
  //! First received row of each source; sources + 1 entries.
  std::span<const std::int64_t> source_offsets() const noexcept { return source_offsets_; }
  //! EPD rows of each local expert.
  std::span<const std::int64_t> expert_counts() const noexcept { return counts_; }
  //! First EPD row of each local expert; local_experts + 1 entries.
  std::span<const std::int64_t> expert_offsets() const noexcept { return offsets_; }
  //! Received row of each EPD row.
  std::span<const std::int64_t> epd_row_source() const noexcept { return epd_source_; }
  //! Gate weight of each EPD row.
  std::span<const float> epd_weight() const noexcept { return epd_weight_; }
  //! `k` EPD rows per received row, -1 padded.
  std::span<const std::int64_t> row_epd() const noexcept { return row_epd_; }
  //! `k` gate weights per received row, 0 padded (aligned with `row_epd`).
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

WEAVE_NAMESPACE_END
