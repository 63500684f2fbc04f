//! \file
//! `device_dispatch_plan<Space>`: the dispatch plan built where the choices live, with no host
//! round trip: weave's one sender plan, in every execution space. `cuda_dispatch_plan`
//! (`plan.cuh`) is this class in `cuda_space`; in `host_space` the same steps run as
//! host-stream tasks (at once on the calling thread under the stream's `claim_if_idle`), and
//! `emulated_gpu_space` runs the GPU's forms of them on host streams.
//!
//! From top-k choices (and an optional keep mask) in memory of the space it builds the SFD
//! layout: per-destination counts and offsets, `row_token`, `token_rows`, the `route_entry`s of
//! every row, the kept experts and the per-slot loads, replicas chosen as
//! `placement::slot_for` does (the one on the source device, else in turn by global token
//! index); CI checks every space against a sequential host reference (tests/support). The
//! counting sort is one step per token
//! (its distinct devices, ascending), an exclusive scan of the per-device counts and a stable
//! sort of (device, token-major pair) keys, so rows of a device come out in token order
//! deterministically (atomics only count). The list of dropped pairs is not built (the keep
//! mask says which they are). Bad input is reported in an error word (`device_plan_error`
//! bits, `route_entry.hpp`), checked with `check_errors`. The steps are in
//! `detail/dispatch_plan_steps.hpp`.
#pragma once

#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/workspace.hpp"
#include "weave/exec/space.hpp"
#include "weave/placement/placement.hpp"
#include "weave/routing/detail/dispatch_plan_steps.hpp"
#include "weave/routing/device_maps.hpp"
#include "weave/routing/route_entry.hpp"

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <type_traits>
#include <vector>

WEAVE_NAMESPACE_BEGIN

//! Dispatch plan for up to `max_tokens` tokens with `k` choices each, built in `Space`.
//! Construct, allocate `workspace_size()` bytes of memory of the space, `initialize` once, then
//! `build` on a stream as often as needed (no allocation). The accessors return spans over
//! memory of the space, valid once `build`'s work has run.
template <execution_space Space>
class device_dispatch_plan {
 public:
  using stream_arg = typename Space::stream_arg;

  //! Throws `errc::invalid_argument` for k outside 1..E or a source device outside the
  //! placement, `errc::out_of_range` when max_tokens * k exceeds 2^31 - 1. In the CUDA space it
  //! needs a current device.
  device_dispatch_plan(const placement& where, int k, int source_device, std::size_t max_tokens)
      : k_(k)
      , source_(source_device)
      , max_tokens_(max_tokens)
      , E_(where.num_experts())
      , D_(where.num_devices())
      , spd_(where.slots_per_device())
      , slots_(where.num_slots()) {
    WEAVE_EXPECT(E_ > 0, errc::invalid_argument, "empty placement");
    WEAVE_EXPECT(k >= 1 && k <= E_, errc::invalid_argument, "k = ", k, " outside 1..", E_);
    WEAVE_EXPECT(source_device >= 0 && source_device < D_, errc::invalid_argument, "source device ",
                 source_device, " outside [0, ", D_, ")");
    const std::size_t n = checked_mul(max_tokens, static_cast<std::size_t>(k), "plan pairs");
    WEAVE_EXPECT(n <= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()),
                 errc::out_of_range, max_tokens, " tokens with k = ", k,
                 " exceed 2^31 - 1 pairs in a device dispatch plan");
    table_host_ = detail::replica_table(where, source_device); // uploaded by `initialize`
    temp_bytes_ = std::max(Space::scan_temp_bytes(D_ + 1),
                           Space::sort_temp_bytes(static_cast<std::int64_t>(n)));
  }

  //! Bytes of memory of the space `initialize` needs.
  std::size_t workspace_size() const {
    workspace_carver measure;
    return carve(*this, measure).used();
  }

  //! Carves the plan's arrays out of `workspace` (256-byte aligned) and uploads the placement
  //! table on `stream`. Throws `errc::size_mismatch` for a workspace too small.
  void initialize(void* workspace, std::size_t bytes, stream_arg stream) {
    WEAVE_EXPECT(workspace != nullptr, errc::invalid_argument, "null workspace");
    workspace_carver carver(workspace, bytes);
    carve(*this, carver);
    Space::copy_from_host(stream, table_, table_host_.data(),
                          table_host_.size() * sizeof(std::int32_t));
    Space::fill(stream, error_, 0, sizeof(std::uint32_t));
    initialized_ = true;
  }

  //! Builds the plan on `stream` from `ids` / `weights` (k per token, -1 = none) and an
  //! optional keep mask (one flag per pair, 0 = dropped), all in memory of the space, for the
  //! tokens from global index `token_offset` on (a chunk's first token). Throws
  //! `errc::size_mismatch` for spans of different lengths or more than `max_tokens` tokens,
  //! `errc::invalid_state` before `initialize`. Errors in the values are flagged in the error
  //! word (`check_errors`).
  void build(stream_arg stream, std::span<const std::int32_t> ids, std::span<const float> weights,
             std::span<const std::uint8_t> keep = {}, std::size_t token_offset = 0) {
    WEAVE_EXPECT(initialized_, errc::invalid_state, "device dispatch plan is not initialised");
    const auto kk = static_cast<std::size_t>(k_);
    WEAVE_EXPECT(ids.size() % kk == 0, errc::size_mismatch, ids.size(),
                 " ids are not a whole number of tokens with k = ", k_);
    WEAVE_EXPECT(ids.size() / kk <= max_tokens_, errc::size_mismatch, ids.size() / kk,
                 " tokens in a device dispatch plan sized for ", max_tokens_);
    WEAVE_EXPECT(weights.size() == ids.size(), errc::size_mismatch, weights.size(), " weights for ",
                 ids.size(), " ids");
    WEAVE_EXPECT(keep.empty() || keep.size() == ids.size(), errc::size_mismatch, "keep mask of ",
                 keep.size(), " entries for ", ids.size(), " ids");
    tokens_ = ids.size() / kk;
    const auto n = static_cast<std::int64_t>(ids.size());
    const auto D = static_cast<std::size_t>(D_);
    const auto width = D + static_cast<std::size_t>(slots_);
    Space::fill(stream, stripes_, 0, detail::plan_count_stripes * width * sizeof(std::uint32_t));
    Space::fill(stream, counts_ + D, 0, sizeof(std::int64_t));                 // the scan's total
    Space::fill(stream, token_rows_, 0xFF, ids.size() * sizeof(std::int64_t)); // -1 padding
    if (n > 0)
      Space::for_each(stream, static_cast<std::int64_t>(tokens_),
                      detail::plan_pairs_step{ids.data(),
                                              weights.data(),
                                              keep.empty() ? nullptr : keep.data(),
                                              k_,
                                              E_,
                                              D_,
                                              spd_,
                                              static_cast<std::int64_t>(token_offset),
                                              table_,
                                              table_ + E_,
                                              table_ + 2 * E_ + 1,
                                              pair_device_,
                                              pair_local_,
                                              kept_,
                                              token_devices_,
                                              keys_in_,
                                              values_in_,
                                              stripes_,
                                              slots_,
                                              error_});
    Space::for_each(stream, static_cast<std::int64_t>(width),
                    detail::plan_sum_stripes_step{stripes_, D_, slots_, counts_, slot_loads_});
    Space::exclusive_scan(stream, counts_, offsets_, D_ + 1, temp_, temp_bytes_);
    if (n == 0)
      return;
    Space::sort_pairs(stream, keys_in_, keys_out_, values_in_, values_out_, n, detail::key_bits(D_),
                      temp_, temp_bytes_);
    if constexpr (serial_space<Space>) {
      Space::for_each_counted(stream, offsets_ + D_, n,
                              detail::plan_row_step{keys_out_, values_out_, k_, pair_device_,
                                                    pair_local_, weights.data(), row_token_,
                                                    token_rows_, routes_});
    } else {
      Space::for_each(stream, 1, detail::plan_route_slots_step{offsets_ + D_, k_, route_slots_});
      Space::for_each_counted(stream, route_slots_, n * k_,
                              detail::plan_rows_step{keys_out_, values_out_, k_, pair_device_,
                                                     pair_local_, weights.data(), row_token_,
                                                     token_rows_, routes_});
    }
  }

  int k() const noexcept { return k_; }
  int source_device() const noexcept { return source_; }
  int num_devices() const noexcept { return D_; }
  std::size_t max_tokens() const noexcept { return max_tokens_; }
  //! Tokens of the last build.
  std::size_t tokens() const noexcept { return tokens_; }
  //! SFD rows sent to each device (D values).
  std::span<const std::int64_t> send_counts() const noexcept {
    return {counts_, static_cast<std::size_t>(D_)};
  }
  //! First SFD row of each device; D + 1 values, the last = rows.
  std::span<const std::int64_t> send_offsets() const noexcept {
    return {offsets_, static_cast<std::size_t>(D_) + 1};
  }
  //! ORI token of each SFD row: capacity tokens() * k, the first rows valid.
  std::span<const std::int64_t> row_token() const noexcept { return {row_token_, pairs()}; }
  //! `k` SFD rows per token, ascending, -1 padded.
  std::span<const std::int64_t> token_rows() const noexcept { return {token_rows_, pairs()}; }
  //! `k` route entries per SFD row: capacity tokens() * k * k, the first rows * k valid.
  std::span<const route_entry> row_routes() const noexcept {
    return {routes_, pairs() * static_cast<std::size_t>(k_)};
  }
  //! `row_routes().data()` without reading the last build's size: for a thread that sends the
  //! entries while another may be building the plan in stream order (host streams).
  const route_entry* route_entries() const noexcept { return routes_; }
  //! Routed logical expert of each pair; -1 where none or dropped.
  std::span<const std::int32_t> kept_experts() const noexcept { return {kept_, pairs()}; }
  //! Destination device of each pair; -1 where none or dropped.
  std::span<const std::int32_t> pair_devices() const noexcept { return {pair_device_, pairs()}; }
  //! Pairs sent to each physical slot.
  std::span<const std::int64_t> slot_loads() const noexcept {
    return {slot_loads_, static_cast<std::size_t>(slots_)};
  }
  //! The error word (`device_plan_error` bits, OR-ed over builds until cleared).
  std::uint32_t* error_word() const noexcept { return error_; }

  //! SFD rows of the last build; waits for `stream`.
  std::int64_t read_rows(stream_arg stream) const {
    std::int64_t rows = 0;
    Space::copy_to_host(stream, &rows, offsets_ + D_, sizeof(rows));
    stream.synchronize();
    return rows;
  }

  //! Maps for the layout moves (ORI -> SFD over `row_token`, SFD -> ORI over `token_rows`:
  //! `layout_move` and `row_moves<Space>::merge`, on CUDA `cuda_row_moves.cuh`) given the row
  //! count.
  device_dispatch_maps maps(std::int64_t rows) const noexcept {
    return {{row_token_, static_cast<std::size_t>(rows)}, token_rows(), k_};
  }

  //! Waits for `stream`, then throws for flagged bad input (`errc::out_of_range` for an expert
  //! id, `errc::invalid_argument` for a duplicate or a non-finite weight) and clears the word.
  void check_errors(stream_arg stream) const {
    std::uint32_t flags = 0;
    take_error_word<Space>(stream, &flags, error_);
    stream.synchronize();
    throw_plan_errors(flags, E_);
  }

  //! Throws for the `device_plan_error` bits in `flags` (no-op for 0).
  static void throw_plan_errors(std::uint32_t flags, int experts) {
    WEAVE_EXPECT((flags & device_plan_bad_expert) == 0, errc::out_of_range,
                 "expert id outside [-1, ", experts, ") in a device dispatch plan");
    WEAVE_EXPECT((flags & device_plan_duplicate) == 0, errc::invalid_argument,
                 "a token chooses one expert twice in a device dispatch plan");
    WEAVE_EXPECT((flags & device_plan_bad_weight) == 0, errc::invalid_argument,
                 "non-finite gate weight in a device dispatch plan");
  }

 private:
  std::size_t pairs() const noexcept { return tokens_ * static_cast<std::size_t>(k_); }

  // Measures (const self, null base) or carves and records the arrays; the same code for both.
  template <class Self>
  static workspace_carver& carve(Self& self, workspace_carver& c) {
    const std::size_t n = self.max_tokens_ * static_cast<std::size_t>(self.k_);
    const auto D = static_cast<std::size_t>(self.D_);
    const auto set = carve_into<Self>(c);
    set(self.table_, self.table_host_.size());
    set(self.error_, 1);
    set(self.counts_, D + 1);
    set(self.offsets_, D + 1);
    set(self.slot_loads_, static_cast<std::size_t>(self.slots_));
    set(self.stripes_, detail::plan_count_stripes * (D + static_cast<std::size_t>(self.slots_)));
    set(self.route_slots_, 1);
    set(self.pair_device_, n);
    set(self.pair_local_, n);
    set(self.kept_, n);
    set(self.token_devices_, n);
    set(self.keys_in_, n);
    set(self.keys_out_, n);
    set(self.values_in_, n);
    set(self.values_out_, n);
    set(self.row_token_, n);
    set(self.token_rows_, n);
    set(self.routes_, n * static_cast<std::size_t>(self.k_));
    set(self.temp_, self.temp_bytes_ == 0 ? 1 : self.temp_bytes_);
    return c;
  }

  int k_ = 0;
  int source_ = 0;
  std::size_t max_tokens_ = 0;
  int E_ = 0, D_ = 0, spd_ = 0, slots_ = 0;
  std::size_t tokens_ = 0;
  std::size_t temp_bytes_ = 0;
  bool initialized_ = false;
  std::vector<std::int32_t> table_host_; // fixed slots, replica offsets, replicas
  std::int32_t* table_ = nullptr;
  std::uint32_t* error_ = nullptr;
  std::int64_t* counts_ = nullptr; // D + 1 (the last stays 0: the scan's total)
  std::int64_t* offsets_ = nullptr;
  std::int64_t* slot_loads_ = nullptr;
  std::uint32_t* stripes_ = nullptr;    // counts and slot loads, striped (see plan_count_stripes)
  std::int64_t* route_slots_ = nullptr; // rows * k, the rows step's bound
  std::int32_t *pair_device_ = nullptr, *pair_local_ = nullptr, *kept_ = nullptr;
  std::int32_t* token_devices_ = nullptr;
  std::uint32_t *keys_in_ = nullptr, *keys_out_ = nullptr;
  std::int32_t *values_in_ = nullptr, *values_out_ = nullptr;
  std::int64_t *row_token_ = nullptr, *token_rows_ = nullptr;
  route_entry* routes_ = nullptr;
  std::byte* temp_ = nullptr;
};

WEAVE_NAMESPACE_END
