//! \file
//! The wire format of the decode exchange (`basic_decode_exchange`), one for every execution
//! space, and the record helpers both of its sides share. Internal.
//!
//! A phase's buffer holds one message per rank, each in a room of `room_rows` rows of `row`
//! bytes (16-byte multiples), at a fixed place. A message is its 128-byte `decode_header`, in the
//! last 128 bytes of the room's first `head_rows` rows, then its n payload rows (the first at a
//! row boundary, so that one row view with the row stride addresses every payload row of the
//! buffer), then, in a dispatch, its side table: per record, `choices = min(k, local experts)`
//! int32 local slots in the token's choice order, -1 after the last, then with partial sums as
//! many f32 gate weights. Its occupied part is a prefix of its room (`message_bytes(n)`): where
//! a layer knows its counts when it sends (host streams) it sends that prefix (a bounded
//! all-to-all, or exact combine sizes); elsewhere (CUDA) whole rooms. A rank's message to itself
//! is its header alone: its records' rows, side table and combine rows are read where they are.
//!
//! A dispatch record is a token's row (T, or its FP8 codes and scales), sent once to each device
//! it is routed to; a combine row is one (record, choice) pair's output, or with partial sums the
//! record's gate-weighted sum of them.
#pragma once

#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/overlap/decode_options.hpp"

#include <cstddef>
#include <cstdint>

WEAVE_NAMESPACE_BEGIN
namespace detail {

//! One phase's messages (see the file comment).
struct decode_wire {
  std::int64_t D = 0;         //!< ranks
  std::int64_t M = 0;         //!< the most payload rows a message holds (records, or rows)
  std::int64_t choices = 0;   //!< dispatch: local slots per record; combine: 0
  bool weights = false;       //!< dispatch with partial sums: the side table holds weights too
  std::size_t row = 0;        //!< bytes per row (a multiple of 16)
  std::int64_t head_rows = 0; //!< rows before the payload (the header in their last 128 bytes)
  std::int64_t room_rows = 0; //!< rows of one message's room

  //! The dispatch's messages over `ranks` ranks: `max_records` records of `row_bytes` each, and
  //! their side table.
  static decode_wire dispatch(int ranks, std::size_t max_records, std::size_t choices,
                              std::size_t row_bytes, bool weights) {
    decode_wire w;
    w.D = ranks;
    w.M = static_cast<std::int64_t>(max_records);
    w.choices = static_cast<std::int64_t>(choices);
    w.weights = weights;
    w.row = checked_add(row_bytes, std::size_t{15}, "row bytes") / 16 * 16;
    w.head_rows = static_cast<std::int64_t>((sizeof(decode_header) + w.row - 1) / w.row);
    w.room_rows = checked_add(static_cast<std::size_t>(w.head_rows + w.M),
                              (w.side_bytes(w.M) + w.row - 1) / w.row, "decode message rows");
    (void)checked_mul(checked_mul(static_cast<std::size_t>(ranks),
                                  static_cast<std::size_t>(w.room_rows), "decode message rows"),
                      w.row, "decode message bytes");
    return w;
  }
  //! The combine's messages: `max_rows` rows of `row_bytes` each (no side table).
  static decode_wire combine(int ranks, std::size_t max_rows, std::size_t row_bytes) {
    return dispatch(ranks, max_rows, 0, row_bytes, false);
  }

  //! Bytes of the side table of n records.
  WEAVE_HOST_DEVICE std::size_t side_bytes(std::int64_t n) const noexcept {
    return static_cast<std::size_t>(n * choices) * sizeof(std::int32_t) * (weights ? 2 : 1);
  }
  //! The occupied part of a message of n payload rows (header, rows, side table).
  std::size_t message_bytes(std::int64_t n) const noexcept {
    return sizeof(decode_header) + static_cast<std::size_t>(n) * row + side_bytes(n);
  }
  std::size_t room_bytes() const noexcept { return message_bytes(M); }
  //! Rows, and bytes, of a whole buffer (one room per rank).
  std::size_t rows() const noexcept { return static_cast<std::size_t>(D * room_rows); }
  std::size_t buffer_bytes() const noexcept { return rows() * row; }

  //! Row index, in a buffer, of payload row r of rank d's message.
  WEAVE_HOST_DEVICE std::int64_t payload_row(std::int64_t d, std::int64_t r) const noexcept {
    return d * room_rows + head_rows + r;
  }
  //! Where rank d's message starts in a buffer (bytes: its header).
  WEAVE_HOST_DEVICE std::size_t start(std::int64_t d) const noexcept {
    return static_cast<std::size_t>(payload_row(d, 0)) * row - sizeof(decode_header);
  }
  WEAVE_HOST_DEVICE decode_header* header(std::byte* buffer, std::int64_t d) const noexcept {
    return reinterpret_cast<decode_header*>(buffer + start(d));
  }
  //! Rank d's side table when its message holds n records: record r's choices at
  //! [r * choices, + choices), then (weights) as many gate weights after all n records' choices.
  WEAVE_HOST_DEVICE std::int32_t* side_table(std::byte* buffer, std::int64_t d,
                                             std::int64_t n) const noexcept {
    return reinterpret_cast<std::int32_t*>(buffer +
                                           static_cast<std::size_t>(payload_row(d, n)) * row);
  }
  WEAVE_HOST_DEVICE float* side_weights(std::byte* buffer, std::int64_t d,
                                        std::int64_t n) const noexcept {
    return reinterpret_cast<float*>(side_table(buffer, d, n) + n * choices);
  }
};

//! What a record's side-table entries hold (`read_record`): `count` valid choices, or the first
//! entry no sender writes (`bad` its index, `value` the entry).
struct record_read {
  std::int64_t count = 0;
  std::int64_t bad = -1;
  std::int32_t value = 0;
};

//! Reads a record's `choices` entries (`entry(c)`): distinct local slots in [0, `local`), at
//! least one, then -1 to the end, or the first entry that breaks it. An entry is looked for among
//! the earlier ones only where a 64-bucket mask of them says it may repeat.
template <class Entry>
WEAVE_HOST_DEVICE record_read read_record(Entry&& entry, std::int64_t choices, std::int64_t local) {
  record_read got;
  std::uint64_t buckets = 0; // bit slot % 64 of each slot so far
  for (std::int64_t c = 0; c < choices; ++c) {
    const std::int32_t slot = entry(c);
    if (slot == -1 && got.count > 0)
      continue;
    const std::uint64_t bit = std::uint64_t{1} << (static_cast<std::uint32_t>(slot) & 63u);
    bool seen = false;
    if ((buckets & bit) != 0) // the same slot, or another of its bucket
      for (std::int64_t j = 0; j < c; ++j)
        seen = seen || entry(j) == slot;
    if (got.count != c || slot < 0 || slot >= local || seen) {
      got.bad = c;
      got.value = slot;
      return got;
    }
    buckets |= bit;
    ++got.count;
  }
  return got;
}

//! With partial sums, the rows a token's output sums: for each device its k pairs went to, in
//! ascending device order, `row(j)` of the first pair j there (a token's pairs on one device
//! share its record), then -1 up to `per_token` (min(devices, k)). `device(j)`: pair j's device
//! (below 2^31), or -1 for a pair not routed. An insertion of each device's first pair into
//! `rows` as (device << 32 | pair), then each replaced by its row.
template <class Device, class Row>
WEAVE_HOST_DEVICE void rows_by_device(int k, int per_token, Device&& device, Row&& row,
                                      std::int64_t* rows) {
  int n = 0;
  for (int j = 0; j < k; ++j) {
    const std::int64_t d = device(j);
    if (d < 0)
      continue;
    int i = n;
    std::int64_t before = -1; // the device at position i - 1
    while (i > 0 && (before = rows[i - 1] >> 32) > d)
      --i;
    if ((i > 0 && before == d) || n == per_token)
      continue; // a device seen (n == per_token: more devices than one token reaches, none)
    // Into position i, the rest one up: a loop GCC does not make a memmove call of a few bytes.
    std::int64_t carry = d << 32 | j;
    for (int m = i; m < n; ++m) {
      const std::int64_t next = rows[m];
      rows[m] = carry;
      carry = next;
    }
    rows[n++] = carry;
  }
  for (int m = 0; m < n; ++m)
    rows[m] = row(static_cast<int>(rows[m] & 0xffffffff));
  for (; n < per_token; ++n)
    rows[n] = -1;
}

} // namespace detail
WEAVE_NAMESPACE_END
