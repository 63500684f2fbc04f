//! \file
//! `detail::decode_routes`: the source side of a host `decode_exchange` call. It writes the
//! dispatch's token records (one per (token, device), the row once, then the token's local
//! choices there) and keeps where each (token, choice) pair went, from which the combine's
//! final sums take their rows.
#pragma once

#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/overlap/detail/decode_records.hpp"
#include "weave/placement/placement.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

WEAVE_NAMESPACE_BEGIN
namespace detail {

//! Where the pairs of one decode call went. `route` packs a call's records and records each pair's
//! slot, device and row in that device's combine; the combine reads them back (`pair_rows`,
//! `device_rows`) until the next `route`.
class decode_routes {
 public:
  decode_routes() = default;
  //! Room for `max_tokens` tokens of `k` choices over `ranks` devices.
  decode_routes(std::size_t ranks, std::size_t max_tokens, std::size_t k)
      : k_(k)
      , slot_(checked_mul(max_tokens, k, "pairs"), -1)
      , device_(slot_.size(), 0)
      , pos_(slot_.size(), 0)
      , rows_(slot_.size(), -1)
      , own_token_(max_tokens, 0)
      , records_(ranks, 0)
      , pairs_(ranks, 0)
      , last_token_(ranks, -1)
      , next_choice_(ranks, 0) {}

  //! Writes the records of `tokens` tokens routed by `ids` / `weights` (checked: ids in [-1, E),
  //! distinct per token) into `message(d)`, the dispatch message to device d, in `layout`:
  //! a token's record on d is its row (`row_bytes` at `rows` + t * `row_bytes`) once, then its
  //! local slots there in choice order (and their weights with `partial`). This rank's own
  //! records (`own`) keep their rows in `rows` (`own_token`). Each pair's combine row is its
  //! record's (`partial`) or its place among the pairs sent to its device.
  template <class Message>
  void route(std::span<const std::int32_t> ids, std::span<const float> weights, std::size_t tokens,
             const placement& where, std::size_t own, const decode_record_layout& layout,
             bool partial, const std::byte* rows, std::size_t row_bytes, Message&& message) {
    const std::size_t k = k_, ranks = records_.size();
    // The per-device counters as plain pointers: the row copies write through bytes, which would
    // make the compiler reload every vector's data pointer after each.
    std::int64_t* const records = records_.data();
    std::int64_t* const pairs_to = pairs_.data();
    std::int64_t* const last_token = last_token_.data();
    std::size_t* const next_choice = next_choice_.data();
    std::fill_n(records, ranks, 0);
    std::fill_n(pairs_to, ranks, 0);
    std::fill_n(last_token, ranks, -1);
    const auto slots = static_cast<std::uint32_t>(where.slots_per_device());
    const int rank = static_cast<int>(own);
    for (std::size_t t = 0, p = 0; t < tokens; ++t)
      for (std::size_t j = 0; j < k; ++j, ++p) {
        slot_[p] = -1;
        if (ids[p] < 0)
          continue;
        const int slot = where.slot_for(ids[p], t, rank);
        const auto d = static_cast<std::size_t>(static_cast<std::uint32_t>(slot) / slots);
        const auto l = static_cast<std::int32_t>(static_cast<std::uint32_t>(slot) % slots);
        std::byte* to = message(d);
        if (last_token[d] != static_cast<std::int64_t>(t)) { // the token's record on d
          last_token[d] = static_cast<std::int64_t>(t);
          const auto r = static_cast<std::size_t>(records[d]++);
          if (d == own)
            own_token_[r] = static_cast<std::int64_t>(t); // the row stays in `rows`
          else
            std::memcpy(layout.row(to, r), rows + t * row_bytes, row_bytes);
          layout.clear_choices(to, r);
          next_choice[d] = 0;
        }
        const auto r = static_cast<std::size_t>(records[d] - 1);
        // Distinct experts in distinct slots: at most `choices` per record.
        layout.put_choice(to, r, next_choice[d], l);
        if (partial)
          layout.put_weight(to, r, next_choice[d], weights[p]);
        ++next_choice[d];
        slot_[p] = slot;
        device_[p] = static_cast<std::int32_t>(d);
        pos_[p] = partial ? static_cast<std::int64_t>(r) : pairs_to[d];
        ++pairs_to[d];
      }
  }

  //! Token records sent to each device in the last `route`.
  std::span<const std::int64_t> records() const noexcept { return records_; }
  //! (token, expert) pairs sent to each device.
  std::span<const std::int64_t> pairs() const noexcept { return pairs_; }
  //! The token of this rank's own record r.
  std::size_t own_token(std::size_t r) const noexcept {
    return static_cast<std::size_t>(own_token_[r]);
  }

  //! Per pair of `tokens` tokens, `row(d, pos)` of its device d and combine row pos, or -1 for a
  //! pair not routed: the rows a per-pair combine's sums take, k per token.
  template <class Row>
  const std::int64_t* pair_rows(std::size_t tokens, Row&& row) {
    for (std::size_t p = 0; p < tokens * k_; ++p)
      rows_[p] = slot_[p] < 0 ? -1 : row(static_cast<std::size_t>(device_[p]), pos_[p]);
    return rows_.data();
  }
  //! Per token, `row(d, record)` of each device d its pairs went to, ascending (`rows_by_device`),
  //! then -1 up to `per_token`: the rows the partial sums' final sums take.
  template <class Row>
  const std::int64_t* device_rows(std::size_t tokens, std::size_t per_token, Row&& row) {
    for (std::size_t t = 0; t < tokens; ++t) {
      const std::int32_t* slot = slot_.data() + t * k_;
      const std::int32_t* device = device_.data() + t * k_;
      const std::int64_t* pos = pos_.data() + t * k_;
      rows_by_device(
          static_cast<int>(k_), static_cast<int>(per_token),
          [slot, device](int j) -> std::int64_t { return slot[j] < 0 ? -1 : device[j]; },
          [&row, device, pos](int j) { return row(static_cast<std::size_t>(device[j]), pos[j]); },
          rows_.data() + t * per_token);
    }
    return rows_.data();
  }

 private:
  std::size_t k_ = 0;
  std::vector<std::int32_t> slot_;       // (token, choice) -> physical slot, or -1
  std::vector<std::int32_t> device_;     // (token, choice) -> that slot's device
  std::vector<std::int64_t> pos_;        // (token, choice) -> row in its device's combine
  std::vector<std::int64_t> rows_;       // the final sums' returned rows
  std::vector<std::int64_t> own_token_;  // this rank's records to itself: their tokens
  std::vector<std::int64_t> records_;    // token records per device
  std::vector<std::int64_t> pairs_;      // (token, expert) pairs per device
  std::vector<std::int64_t> last_token_; // per device: the token of its last record
  std::vector<std::size_t> next_choice_; // per device: the last record's next free choice
};

} // namespace detail
WEAVE_NAMESPACE_END
