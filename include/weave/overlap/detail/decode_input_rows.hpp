//! \file
//! `detail::decode_input_rows`: where a host decode call's expert inputs are. By default each
//! received (token, expert) row is copied into the pool, one block per local slot; a slot fed
//! one row by a peer reads it where it arrived (a block of one row needs no copy). With gathered
//! inputs every row stays where it arrived and the experts get one pointer per row.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

WEAVE_NAMESPACE_BEGIN
namespace detail {

//! The expert input rows of one decode call for rows of `T`: `place` every received pair's row
//! once, then read `block` (or `gathered`) until the next call places its rows.
template <class T>
class decode_input_rows {
 public:
  //! How the rows are kept.
  enum class mode {
    copied,   //!< every row copied into the pool (FP8 wire rows: the pool holds the codes)
    blocks,   //!< copied, but a slot fed one row by a peer reads it where it arrived
    gathered, //!< every row where it arrived, one pointer each
  };

  decode_input_rows() = default;
  //! Room for `pool_rows` pairs in `slots` local slots.
  decode_input_rows(mode how, std::size_t pool_rows, std::size_t slots)
      : mode_(how)
      , gathered_(how == mode::gathered ? pool_rows : 0, nullptr)
      , one_row_(how == mode::blocks ? slots : 0, nullptr) {}

  //! Places one received pair's row of `bytes` at `from`: pool row `pool_row` (of `pool`, rows
  //! of `bytes`) of `slot`, which holds `slot_rows` rows this call. `own`: the row is in the
  //! caller's tokens, which the dispatch does not borrow (copied, unless gathered).
  void place(std::byte* pool, std::size_t pool_row, std::size_t slot, std::int64_t slot_rows,
             const std::byte* from, std::size_t bytes, bool own) noexcept {
    if (mode_ == mode::gathered) {
      gathered_[pool_row] = reinterpret_cast<const T*>(from);
      return;
    }
    if (mode_ == mode::blocks && slot_rows == 1) { // set for every slot of one row, each call
      one_row_[slot] = own ? nullptr : reinterpret_cast<const T*>(from);
      if (!own)
        return;
    }
    std::memcpy(pool + pool_row * bytes, from, bytes);
  }

  //! Slot `slot`'s block of `n` rows of `hidden` elements, the first at pool row `first` of
  //! `pool`. With gathered inputs: `errc::invalid_state`.
  std::span<const T> block(const T* pool, std::size_t slot, std::size_t first, std::size_t n,
                           std::size_t hidden) const {
    WEAVE_EXPECT(mode_ != mode::gathered, errc::invalid_state,
                 "decode_exchange: with gathered_inputs the experts read input_rows (the rows "
                 "are not copied into one block)");
    if (n == 1 && mode_ == mode::blocks && one_row_[slot] != nullptr)
      return {one_row_[slot], hidden};
    return {pool + first * hidden, n * hidden};
  }

  //! With gathered inputs: the pointers of a slot's `n` rows, the first at pool row `first`.
  //! Without: `errc::invalid_state`.
  std::span<const T* const> gathered(std::size_t first, std::size_t n) const {
    WEAVE_EXPECT(mode_ == mode::gathered, errc::invalid_state,
                 "decode_exchange: input_rows needs decode_options::gathered_inputs (read input)");
    return {gathered_.data() + first, n};
  }

 private:
  mode mode_ = mode::copied;
  std::vector<const T*> gathered_; // gathered inputs: each pool row where it is
  std::vector<const T*> one_row_;  // per slot fed one row: where it arrived, or null (copied)
};

} // namespace detail
WEAVE_NAMESPACE_END
