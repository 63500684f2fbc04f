//! \file
//! `detail::decode_arrivals`: the device side of a host `decode_exchange` call. It reads the
//! side tables of the token records each source sent (checked), and keeps where each received
//! (token, expert) pair goes in the expert pool, from which the combine takes the outputs back.
#pragma once

#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/overlap/detail/decode_records.hpp"
#include "weave/overlap/detail/decode_slot_counts.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

WEAVE_NAMESPACE_BEGIN
namespace detail {

//! The pairs of one decode call received from every source: `begin`, `read` once per source,
//! `finish`; read back until the next `begin`.
class decode_arrivals {
 public:
  //! A received (token, expert) pair: its local slot, its row among that slot's, its record in
  //! the source's message, and (partial sums) its gate weight.
  struct arrival {
    std::int32_t slot = 0;
    std::int64_t row = 0;
    std::int64_t record = 0;
    float weight = 0.0f;
  };

  decode_arrivals() = default;
  //! Room for `sources` messages of `layout` into `local_slots` slots; `partial`: the records
  //! carry gate weights.
  decode_arrivals(std::size_t sources, std::size_t local_slots, const decode_record_layout& layout,
                  bool partial)
      : layout_(layout)
      , local_slots_(local_slots)
      , partial_(partial)
      , pairs_(checked_mul(sources, layout.pairs(), "arrivals"))
      , pair_count_(sources, 0)
      , records_(sources, 0)
      , choices_(layout.choices, 0)
      , slots_(local_slots, sources) {
    if (partial) { // one source's records, merged at a time
      merge_index_.assign(layout.pairs(), -1);
      merge_weight_.assign(layout.pairs(), 0.0f);
    }
  }

  //! Starts a call: nothing received.
  void begin() { slots_.begin(); }

  //! Reads the side tables of source d's `records` records in `message` (compacted: see
  //! `decode_record_layout::compact`) and counts each pair's
  //! row in its slot. A record no weave rank writes (no choice, a slot outside the local ones,
  //! a slot twice, a choice after the end) calls `bad(record, choice, entry)`, which must not
  //! return. Returns the pairs read.
  template <class Bad>
  std::size_t read(std::size_t d, const std::byte* message, std::size_t records, Bad&& bad) {
    const std::size_t per_source = layout_.pairs();
    arrival* out = pairs_.data() + d * per_source;
    std::size_t n = 0;
    for (std::size_t r = 0; r < records; ++r) {
      const auto got = layout_.read_choices(message, records, r, local_slots_, choices_);
      if (got.bad >= 0)
        bad(r, static_cast<std::size_t>(got.bad), got.value);
      for (std::size_t c = 0; c < static_cast<std::size_t>(got.count); ++c) {
        const auto slot = static_cast<std::size_t>(choices_[c]);
        const float w = partial_ ? layout_.weight(message, records, r, c) : 0.0f;
        out[n++] = {choices_[c], slots_.add(slot, d), static_cast<std::int64_t>(r), w};
      }
    }
    pair_count_[d] = static_cast<std::int64_t>(n);
    records_[d] = static_cast<std::int64_t>(records);
    return n;
  }

  //! Ends a call's reads: the pool holds the slots' rows in slot order.
  void finish() { slots_.finish(); }

  //! Source d's pairs, in arrival order (a record's consecutive, in choice order).
  std::span<const arrival> pairs(std::size_t d) const noexcept {
    return {pairs_.data() + d * layout_.pairs(), static_cast<std::size_t>(pair_count_[d])};
  }
  //! Source d's records.
  std::size_t records(std::size_t d) const noexcept {
    return static_cast<std::size_t>(records_[d]);
  }
  //! Where a pair's row is in the expert pool.
  std::size_t pool_row(const arrival& a) const noexcept {
    return static_cast<std::size_t>(slots_.first(static_cast<std::size_t>(a.slot)) + a.row);
  }
  //! The rows per slot and source, the fed slots, each slot's first pool row.
  const decode_slot_counts& slots() const noexcept { return slots_; }

  //! Partial sums: per record of source d, its choices' pool rows (-1 after the last) and their
  //! gate weights, `choices` per record.
  std::pair<const std::int64_t*, const float*> record_rows(std::size_t d) {
    const std::size_t C = layout_.choices;
    std::fill_n(merge_index_.begin(), records(d) * C, std::int64_t{-1});
    std::int64_t record = -1;
    std::size_t c = 0;
    for (const arrival& a : pairs(d)) { // a record's pairs are consecutive
      c = a.record == record ? c + 1 : 0;
      record = a.record;
      const std::size_t at = static_cast<std::size_t>(a.record) * C + c;
      merge_index_[at] = static_cast<std::int64_t>(pool_row(a));
      merge_weight_[at] = a.weight;
    }
    return {merge_index_.data(), merge_weight_.data()};
  }

 private:
  decode_record_layout layout_;
  std::size_t local_slots_ = 0;
  bool partial_ = false;
  std::vector<arrival> pairs_;            // [source][pair]
  std::vector<std::int64_t> pair_count_;  // pairs received per source
  std::vector<std::int64_t> records_;     // token records received per source
  std::vector<std::int32_t> choices_;     // one record's choices (scratch)
  std::vector<std::int64_t> merge_index_; // partial sums: one source's pool rows per record
  std::vector<float> merge_weight_;       // and their gate weights
  decode_slot_counts slots_;              // rows per local slot and source, the fed slots
};

} // namespace detail
WEAVE_NAMESPACE_END
