//! \file
//! `device_expert_plan<Space>`: the receiver half of a dispatch built where the received rows
//! live, with no host round trip: weave's one receiver plan, in every execution space.
//!
//! The received rows of source s occupy [displs[s], displs[s] + counts[s]) of a buffer of
//! `max_rows` rows; counts and displacements are in memory of the space (what a count exchange
//! delivered), and the rows between the sources' ranges are padding (static shapes send
//! fixed-size slots). From the `k` route entries per row it builds the EPD layout, one row per
//! (received row, local expert), grouped by local expert and within an expert in received-row
//! order (for a compact layout every map equals the sequential host reference's, checked in
//! CI). Steps: one per received row (validate, emit a sort key per entry, count per
//! expert), a stable sort of (local expert, entry) keys, a scan of the counts, one step per EPD
//! row. Bad entries are flagged in an error word (`device_expert_error` bits).
#pragma once

#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/workspace.hpp"
#include "weave/exec/space.hpp"
#include "weave/routing/device_dispatch_plan.hpp"
#include "weave/routing/device_maps.hpp"
#include "weave/routing/route_entry.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <type_traits>

WEAVE_NAMESPACE_BEGIN

//! Bits a device expert plan sets in its error word.
enum device_expert_error : std::uint32_t {
  device_expert_bad_local = 1,  //!< a local expert outside [-1, local_experts)
  device_expert_duplicate = 2,  //!< a row naming one local expert twice
  device_expert_bad_weight = 4, //!< a non-finite gate weight
  device_expert_empty_row = 8,  //!< a received row with no expert (senders never send one)
  device_expert_overflow = 16,  //!< more (row, local expert) pairs than the plan holds EPD rows
};

namespace detail {

// The source whose range holds row q: the last s with displs[s] <= q (displacements ascend; a
// source with no rows shares its displacement with the next one).
WEAVE_HOST_DEVICE inline int source_of_row(const std::int64_t* displs, int sources,
                                           std::int64_t q) {
  int lo = 0, hi = sources;
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (displs[mid] <= q)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

// Per buffer row q: one sort key per entry (its local expert, or L when it is padding, empty
// or bad), the per-expert counts, and the -1 / 0 defaults of the row's merge map.
struct expert_rows_step {
  const route_entry* routes;
  const std::int64_t *counts, *displs;
  int sources, k, L;
  std::uint32_t* keys;
  std::int32_t* values;
  std::int64_t* expert_counts;
  std::int64_t* row_epd;
  float* row_weight;
  std::uint32_t* error;

  WEAVE_HOST_DEVICE void operator()(std::int64_t q) const {
    const int s = source_of_row(displs, sources, q);
    const bool valid = q >= displs[s] && q < displs[s] + counts[s];
    const route_entry* row = routes + q * k;
    std::uint32_t flags = 0;
    int entries = 0;
    for (int i = 0; i < k; ++i) {
      const std::int64_t p = q * k + i;
      row_epd[p] = -1;
      row_weight[p] = 0.0f;
      values[p] = static_cast<std::int32_t>(p);
      keys[p] = static_cast<std::uint32_t>(L);
      if (!valid)
        continue;
      const std::int32_t l = row[i].local;
      if (l == -1)
        continue;
      if (l < 0 || l >= L) {
        flags |= device_expert_bad_local;
        continue;
      }
      bool twice = false;
      for (int j = 0; j < i; ++j)
        twice = twice || row[j].local == l;
      if (twice) {
        flags |= device_expert_duplicate;
        continue;
      }
      if (!is_finite(row[i].weight))
        flags |= device_expert_bad_weight;
      keys[p] = static_cast<std::uint32_t>(l);
      atomic_add(expert_counts + l, 1);
      ++entries;
    }
    if (valid && entries == 0)
      flags |= device_expert_empty_row;
    if (flags != 0)
      atomic_or(error, flags);
  }
};

// One step: flags an EPD total past the plan's EPD rows (pairs beyond them get no row).
struct expert_capacity_step {
  const std::int64_t* total;
  std::int64_t capacity;
  std::uint32_t* error;
  WEAVE_HOST_DEVICE void operator()(std::int64_t) const {
    if (*total > capacity)
      atomic_or(error, device_expert_overflow);
  }
};

// Per EPD row j (sorted position j < total): its received row and weight, and the way back.
struct expert_epd_step {
  const std::int32_t* values; // sorted
  const route_entry* routes;
  int k;
  std::int64_t* epd_source;
  float* epd_weight;
  std::int64_t* row_epd;
  float* row_weight;

  WEAVE_HOST_DEVICE void operator()(std::int64_t j) const {
    const std::int64_t v = values[j];
    const float w = routes[v].weight;
    epd_source[j] = v / k;
    epd_weight[j] = w;
    row_epd[v] = j;
    row_weight[v] = w;
  }
};

} // namespace detail

//! Receiver-side plan in `Space` for a device with `local_experts` slots, receiving up to
//! `max_rows` rows (padding included) of `k` route entries from `sources` senders. Construct,
//! allocate `workspace_size()` bytes of memory of the space, `initialize` once, `build` per
//! chunk (no allocation). Accessors return spans over memory of the space; the EPD row count
//! is `expert_offsets()[local_experts]`, in memory of the space (`epd_rows_count()`).
//!
//! Sized at call time instead (a dynamic-shape exchange, once it knows what it receives): its
//! fixed part (`fixed_workspace_size`, `initialize_fixed`) once, then the per-row arrays for
//! `max_rows` rows and `max_epd` EPD rows (`rows_workspace_size`, `attach_rows`) whenever the
//! rows outgrow them.
template <execution_space Space>
class device_expert_plan {
 public:
  using stream_arg = typename Space::stream_arg;

  //! Throws `errc::invalid_argument` for non-positive sizes, `errc::out_of_range` when
  //! max_rows * k exceeds 2^31 - 1. `max_epd`: the EPD rows to hold, when a bound tighter than
  //! max_rows * min(k, local_experts) is known (a capacity factor); more are flagged
  //! (`device_expert_overflow`).
  device_expert_plan(int local_experts, int k, int sources, std::size_t max_rows,
                     std::size_t max_epd = static_cast<std::size_t>(-1))
      : L_(local_experts)
      , k_(k)
      , sources_(sources)
      , max_rows_(max_rows) {
    WEAVE_EXPECT(local_experts >= 1 && k >= 1 && sources >= 1, errc::invalid_argument,
                 "device expert plan with ", local_experts, " local experts, k = ", k, ", ",
                 sources, " sources");
    const std::size_t n = checked_mul(max_rows, static_cast<std::size_t>(k), "route entries");
    WEAVE_EXPECT(n <= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()),
                 errc::out_of_range, max_rows, " rows with k = ", k,
                 " exceed 2^31 - 1 entries in a device expert plan");
    max_epd_ = std::min(max_epd, max_rows * static_cast<std::size_t>(std::min(k_, L_)));
    temp_bytes_ = temp_bytes_for(n);
  }

  //! The most EPD rows a build can produce.
  std::size_t max_epd_rows() const noexcept { return max_epd_; }
  std::size_t max_rows() const noexcept { return max_rows_; }
  int local_experts() const noexcept { return L_; }
  int k() const noexcept { return k_; }

  std::size_t workspace_size() const {
    workspace_carver measure;
    carve_fixed(*this, measure);
    return carve_rows(*this, measure).used();
  }

  void initialize(void* workspace, std::size_t bytes, stream_arg stream) {
    WEAVE_EXPECT(workspace != nullptr, errc::invalid_argument, "null workspace");
    workspace_carver carver(workspace, bytes);
    carve_fixed(*this, carver);
    carve_rows(*this, carver);
    Space::fill(stream, error_, 0, sizeof(std::uint32_t));
    initialized_ = true;
  }

  //! Bytes of the fixed part (error word, per-expert counts): sized at call time, the plan
  //! takes it once and its per-row arrays from `attach_rows`.
  std::size_t fixed_workspace_size() const {
    workspace_carver measure;
    return carve_fixed(*this, measure).used();
  }
  void initialize_fixed(void* workspace, std::size_t bytes, stream_arg stream) {
    WEAVE_EXPECT(workspace != nullptr, errc::invalid_argument, "null workspace");
    workspace_carver carver(workspace, bytes);
    carve_fixed(*this, carver);
    Space::fill(stream, error_, 0, sizeof(std::uint32_t));
  }
  //! Bytes of the per-row arrays for `max_rows` rows and `max_epd` EPD rows.
  std::size_t rows_workspace_size(std::size_t max_rows, std::size_t max_epd) const {
    device_expert_plan sized(*this);
    sized.resize(max_rows, max_epd);
    workspace_carver measure;
    return carve_rows(sized, measure).used();
  }
  //! Carves the per-row arrays for `max_rows` rows and `max_epd` EPD rows out of `workspace`
  //! (after `initialize_fixed`); enqueues nothing. Earlier builds' arrays must not be in use.
  void attach_rows(void* workspace, std::size_t bytes, std::size_t max_rows, std::size_t max_epd) {
    WEAVE_EXPECT(error_ != nullptr, errc::invalid_state,
                 "device expert plan: attach_rows before initialize_fixed");
    WEAVE_EXPECT(workspace != nullptr || bytes == 0, errc::invalid_argument, "null workspace");
    resize(max_rows, max_epd);
    workspace_carver carver(workspace, bytes);
    carve_rows(*this, carver);
    initialized_ = true;
  }

  //! Builds the plan on `stream` from `routes` (k per buffer row, max_rows rows) and the
  //! `sources` counts and displacements in memory of the space, over the first `rows` buffer
  //! rows (all by default; the rest are padding). Throws `errc::size_mismatch` for a routes span
  //! of another length or more rows than the plan holds, `errc::invalid_state` before
  //! `initialize`.
  void build(stream_arg stream, std::span<const route_entry> routes, const std::int64_t* counts,
             const std::int64_t* displs, std::size_t rows = static_cast<std::size_t>(-1)) {
    WEAVE_EXPECT(initialized_, errc::invalid_state, "device expert plan is not initialised");
    if (rows == static_cast<std::size_t>(-1))
      rows = max_rows_;
    WEAVE_EXPECT(routes.size() == max_rows_ * static_cast<std::size_t>(k_) && rows <= max_rows_,
                 errc::size_mismatch, routes.size(), " route entries and ", rows,
                 " rows for a plan of ", max_rows_, " rows with k = ", k_);
    const std::size_t n = rows * static_cast<std::size_t>(k_);
    Space::fill(stream, counts_, 0, (static_cast<std::size_t>(L_) + 1) * sizeof(std::int64_t));
    if (n > 0)
      Space::for_each(stream, static_cast<std::int64_t>(rows),
                      detail::expert_rows_step{routes.data(), counts, displs, sources_, k_, L_,
                                               keys_in_, values_in_, counts_, row_epd_, row_weight_,
                                               error_});
    Space::exclusive_scan(stream, counts_, offsets_, L_ + 1, temp_, temp_bytes_);
    Space::for_each(
        stream, 1,
        detail::expert_capacity_step{offsets_ + L_, static_cast<std::int64_t>(max_epd_), error_});
    if (n == 0)
      return;
    Space::sort_pairs(stream, keys_in_, keys_out_, values_in_, values_out_,
                      static_cast<std::int64_t>(n), detail::key_bits(L_), temp_, temp_bytes_);
    Space::for_each_counted(stream, offsets_ + L_, static_cast<std::int64_t>(max_epd_rows()),
                            detail::expert_epd_step{values_out_, routes.data(), k_, epd_source_,
                                                    epd_weight_, row_epd_, row_weight_});
  }

  //! First EPD row of each local expert; local_experts + 1 values, the last = EPD rows.
  std::span<const std::int64_t> expert_offsets() const noexcept {
    return {offsets_, static_cast<std::size_t>(L_) + 1};
  }
  //! Where the EPD row count lives (for steps counted by it).
  const std::int64_t* epd_rows_count() const noexcept { return offsets_ + L_; }
  std::span<const std::int64_t> epd_row_source() const noexcept {
    return {epd_source_, max_epd_rows()};
  }
  std::span<const float> epd_weight() const noexcept { return {epd_weight_, max_epd_rows()}; }
  //! `k` EPD rows per buffer row, -1 padded (padding rows: all -1).
  std::span<const std::int64_t> row_epd() const noexcept {
    return {row_epd_, max_rows_ * static_cast<std::size_t>(k_)};
  }
  std::span<const float> row_weight() const noexcept {
    return {row_weight_, max_rows_ * static_cast<std::size_t>(k_)};
  }
  //! The maps for the row moves (full capacity; the counted steps bound them).
  device_expert_maps maps() const noexcept {
    return {epd_row_source(), epd_weight(), row_epd(), row_weight(), k_};
  }
  std::uint32_t* error_word() const noexcept { return error_; }

  //! Waits for `stream`, throws for flagged entries (`errc::out_of_range` for a local expert,
  //! `errc::invalid_argument` for the others) and clears the word.
  void check_errors(stream_arg stream) const {
    std::uint32_t flags = 0;
    take_error_word<Space>(stream, &flags, error_);
    stream.synchronize();
    throw_expert_errors(flags, L_);
  }

  //! Throws for the `device_expert_error` bits in `flags` (no-op for 0).
  static void throw_expert_errors(std::uint32_t flags, int local_experts) {
    WEAVE_EXPECT((flags & device_expert_bad_local) == 0, errc::out_of_range,
                 "a received row names a local expert outside [-1, ", local_experts, ")");
    WEAVE_EXPECT((flags & device_expert_duplicate) == 0, errc::invalid_argument,
                 "a received row names one local expert twice");
    WEAVE_EXPECT((flags & device_expert_bad_weight) == 0, errc::invalid_argument,
                 "a received row carries a non-finite gate weight");
    WEAVE_EXPECT((flags & device_expert_empty_row) == 0, errc::invalid_argument,
                 "a received row carries no expert (senders never send one)");
    WEAVE_EXPECT((flags & device_expert_overflow) == 0, errc::size_mismatch,
                 "the received rows name more (row, local expert) pairs than their senders "
                 "announced");
  }

 private:
  std::size_t temp_bytes_for(std::size_t entries) const {
    return std::max(Space::scan_temp_bytes(L_ + 1),
                    Space::sort_temp_bytes(static_cast<std::int64_t>(entries)));
  }

  void resize(std::size_t max_rows, std::size_t max_epd) {
    const std::size_t n = checked_mul(max_rows, static_cast<std::size_t>(k_), "route entries");
    WEAVE_EXPECT(n <= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()),
                 errc::out_of_range, max_rows, " rows with k = ", k_,
                 " exceed 2^31 - 1 entries in a device expert plan");
    max_rows_ = max_rows;
    max_epd_ = max_epd;
    temp_bytes_ = temp_bytes_for(n);
  }

  template <class Self>
  static workspace_carver& carve_fixed(Self& self, workspace_carver& c) {
    const auto L = static_cast<std::size_t>(self.L_);
    const auto set = carve_into<Self>(c);
    set(self.error_, 1);
    set(self.counts_, L + 1);
    set(self.offsets_, L + 1);
    return c;
  }

  template <class Self>
  static workspace_carver& carve_rows(Self& self, workspace_carver& c) {
    const std::size_t n = self.max_rows_ * static_cast<std::size_t>(self.k_);
    const std::size_t epd = self.max_epd_rows();
    const auto set = carve_into<Self>(c);
    set(self.keys_in_, n);
    set(self.keys_out_, n);
    set(self.values_in_, n);
    set(self.values_out_, n);
    set(self.row_epd_, n);
    set(self.row_weight_, n);
    set(self.epd_source_, epd);
    set(self.epd_weight_, epd);
    set(self.temp_, self.temp_bytes_ == 0 ? 1 : self.temp_bytes_);
    return c;
  }

  int L_ = 0, k_ = 0, sources_ = 0;
  std::size_t max_rows_ = 0, max_epd_ = 0;
  std::size_t temp_bytes_ = 0;
  bool initialized_ = false;
  std::uint32_t* error_ = nullptr;
  std::int64_t *counts_ = nullptr, *offsets_ = nullptr;
  std::uint32_t *keys_in_ = nullptr, *keys_out_ = nullptr;
  std::int32_t *values_in_ = nullptr, *values_out_ = nullptr;
  std::int64_t* row_epd_ = nullptr;
  float* row_weight_ = nullptr;
  std::int64_t* epd_source_ = nullptr;
  float* epd_weight_ = nullptr;
  std::byte* temp_ = nullptr;
};

WEAVE_NAMESPACE_END
