//! \file
//! `detail::decode_slot_counts`: what a host decode call received per local expert slot (rows
//! per slot and per (slot, source), the slots that got any, each slot's first row in the pool),
//! with a call's fixed work following the rows it received, not the slot count.
#pragma once

#include "weave/core/config.hpp"

#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

WEAVE_NAMESPACE_BEGIN
namespace detail {

//! Per-slot counts of one decode call: `begin`, then `add` once per received (slot, source) row,
//! then `finish`; read until the next `begin`. The fed slots are kept as bits, set on a slot's
//! first row: `begin` resets only the slots the last call fed (even one a bad record stopped
//! half way), and `finish` lists them ascending without a sort or a pass over idle slots.
class decode_slot_counts {
 public:
  decode_slot_counts() = default;
  decode_slot_counts(std::size_t slots, std::size_t sources)
      : sources_(sources)
      , rows_(slots, 0)
      , from_(slots * sources, 0)
      , first_(slots, 0)
      , bits_((slots + 63) / 64, 0) {
    busy_.reserve(slots);
  }

  //! Starts a call: every count zero.
  void begin() {
    for_each_fed([&](std::size_t l) {
      rows_[l] = 0;
      for (std::size_t s = 0; s < sources_; ++s)
        from_[l * sources_ + s] = 0;
    });
    for (std::uint64_t& word : bits_)
      word = 0;
    busy_.clear();
  }

  //! Counts a row for `slot` from `source`; returns its index among the slot's rows.
  std::int64_t add(std::size_t slot, std::size_t source) {
    if (rows_[slot] == 0)
      bits_[slot / 64] |= std::uint64_t{1} << (slot % 64);
    ++from_[slot * sources_ + source];
    return rows_[slot]++;
  }

  //! Lists the fed slots ascending and places their rows back to back in that order.
  void finish() {
    std::int64_t first = 0;
    for_each_fed([&](std::size_t l) {
      busy_.push_back(static_cast<int>(l));
      first_[l] = first;
      first += rows_[l];
    });
  }

  //! The slots that received rows, ascending.
  std::span<const int> busy() const noexcept { return busy_; }
  std::int64_t rows(std::size_t slot) const noexcept { return rows_[slot]; }
  std::int64_t rows(std::size_t slot, std::size_t source) const noexcept {
    return from_[slot * sources_ + source];
  }
  //! The slot's first row in the pool (0 for a slot without rows).
  std::int64_t first(std::size_t slot) const noexcept {
    return rows_[slot] == 0 ? 0 : first_[slot];
  }

 private:
  template <class F>
  void for_each_fed(F&& f) const {
    for (std::size_t w = 0; w < bits_.size(); ++w)
      for (std::uint64_t word = bits_[w]; word != 0; word &= word - 1)
        f(w * 64 + static_cast<std::size_t>(std::countr_zero(word)));
  }

  std::size_t sources_ = 0;
  std::vector<std::int64_t> rows_;  // rows per slot
  std::vector<std::int64_t> from_;  // rows per (slot, source)
  std::vector<std::int64_t> first_; // per fed slot: its first row in the pool
  std::vector<std::uint64_t> bits_; // the fed slots: slot l is bit l % 64 of word l / 64
  std::vector<int> busy_;           // the fed slots, ascending (after `finish`)
};

} // namespace detail
WEAVE_NAMESPACE_END
