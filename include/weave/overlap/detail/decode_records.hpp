//! \file
//! The wire format of the host `decode_exchange`'s messages (`detail::decode_record_layout`).
//!
//! A dispatch message, one per (source rank, destination device), is a `decode_header` (its
//! `rows`: the n records that follow), their n token rows (the token's row on the wire: T, or its
//! FP8 codes and scales), then their side table: per record, `choices = min(k, local experts)`
//! int32 local slots in the token's choice order, -1 after the last, then with
//! `decode_options::partial_sums` as many f32 gate weights per record. Its room is that of
//! `max_tokens_per_rank` records (rounded up to 16 bytes): the sender writes the side table at
//! the end of the room while it routes, then moves it after the n rows (`compact`), so that the
//! occupied part is a prefix (`sent_bytes(n)`), all a bounded all-to-all sends. A combine
//! message, one per (device, source), is a header and one row of T per
//! (token, expert) pair the source dispatched there, in record order, choices in order within a
//! record (with partial sums: one row per record); it is sent at its exact size.
#pragma once

#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/overlap/decode_options.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

WEAVE_NAMESPACE_BEGIN

namespace detail {

// What a record's side-table entries hold (`read_record`): `count` valid choices, or the first
// entry no sender writes (`bad` its index, `value` the entry).
struct record_read {
  std::int64_t count = 0;
  std::int64_t bad = -1;
  std::int32_t value = 0;
};

// Reads a record's `choices` entries (`entry(c)`): distinct local slots in [0, `local`), at least
// one, then -1 to the end, or the first entry that breaks it. Shared by both decode exchanges.
// An entry is looked for among the earlier ones only where a 64-bucket mask of them says it may
// repeat.
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

// With partial sums, the rows a token's output sums: for each device its k pairs went to, in
// ascending device order, `row(j)` of the first pair j there (a token's pairs on one device
// share its record), then -1 up to `per_token` (min(devices, k)). `device(j)`: pair j's device
// (below 2^31), or -1 for a pair not routed. Both decode exchanges' (the host one knows each
// pair's device from its dispatch, the device one divides the slot). An insertion of each
// device's first pair into `rows` as (device << 32 | pair), then each replaced by its row.
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

// A decode phase's all-to-all: one message per peer, back to back (bytes). The dispatch's have a
// fixed size (`stride`); the combine's are set per call, to sizes both sides know from the
// dispatch (`stride`: the largest). A rank's message to itself (`own`) is a header, but keeps a
// whole message's room in the send buffer (the dispatch's side tables are read from there).
struct decode_phase {
  std::size_t stride = 0;
  std::vector<std::int64_t> send_counts, recv_counts, send_displs, recv_displs;

  static decode_phase of(std::size_t stride, std::size_t ranks, std::size_t own) {
    decode_phase p;
    p.stride = stride;
    p.send_counts.assign(ranks, static_cast<std::int64_t>(stride));
    p.send_displs.assign(ranks, 0);
    p.place_sends();
    p.send_counts[own] = sizeof(decode_header);
    p.recv_counts = p.send_counts;
    p.recv_displs = p.send_displs;
    return p;
  }
  //! The send messages back to back in rank order.
  void place_sends() {
    std::int64_t at = 0;
    for (std::size_t d = 0; d < send_counts.size(); ++d) {
      send_displs[d] = at;
      at += send_counts[d];
    }
  }
  //! A message of a header and `rows` rows of `row` bytes.
  static std::int64_t message_bytes(std::size_t rows, std::size_t row) {
    return static_cast<std::int64_t>(sizeof(decode_header) + rows * row);
  }
  //! The receive displacements of messages of `rows[d]` rows of `row` bytes: each where its rows
  //! start a whole number of rows into the buffer, so that one row view addresses them all.
  void place_receives(std::span<const std::int64_t> rows, std::size_t row) {
    const auto r = static_cast<std::int64_t>(row);
    const auto header = static_cast<std::int64_t>(sizeof(decode_header));
    std::int64_t end = 0;
    for (std::size_t d = 0; d < rows.size(); ++d) {
      recv_displs[d] = (end + header + r - 1) / r * r - header;
      end = recv_displs[d] + message_bytes(static_cast<std::size_t>(rows[d]), row);
    }
  }
  //! Row `r` of peer d's received message, counted in rows of `row` bytes from the buffer's start.
  std::int64_t row_of(std::size_t d, std::int64_t r, std::size_t row) const noexcept {
    return (recv_displs[d] + static_cast<std::int64_t>(sizeof(decode_header))) /
               static_cast<std::int64_t>(row) +
           r;
  }
};

struct decode_record_layout {
  std::size_t wire_row = 0;       //!< bytes of a dispatched token row
  std::size_t combine_row = 0;    //!< bytes of a returned row (T)
  std::size_t records = 0;        //!< room per dispatch message: max_tokens_per_rank
  std::size_t choices = 0;        //!< local slots a record holds: min(k, local experts)
  std::size_t side_at = 0;        //!< where the side table is written (room for every record)
  std::size_t weights_at = 0;     //!< where its weights are written (partial sums), else 0
  std::size_t entry_bytes = 0;    //!< a record's side-table bytes (slots, and weights)
  std::size_t dispatch_bytes = 0; //!< a dispatch message (a multiple of 16)
  std::size_t combine_rows = 0;   //!< the most rows of a combine message: records, or pairs
  std::size_t combine_bytes = 0;  //!< the largest combine message (a multiple of 16)

  //! The layout of a decode exchange with `options`, rows of `row_bytes` (T) and
  //! `local_experts` slots per device (`errc::size_overflow` where a size does not fit).
  static decode_record_layout of(const decode_options& options, std::size_t row_bytes,
                                 std::size_t local_experts) {
    decode_record_layout L;
    L.wire_row = decode_wire_row_bytes(options, row_bytes);
    L.combine_row = row_bytes;
    L.records = options.max_tokens_per_rank;
    L.choices = std::min(static_cast<std::size_t>(options.k), local_experts);
    L.side_at = checked_add(sizeof(decode_header), checked_mul(L.records, L.wire_row, "rows"),
                            "dispatch message");
    const std::size_t pairs = checked_mul(L.records, L.choices, "pairs");
    const std::size_t entries = checked_mul(pairs, sizeof(std::int32_t), "side table");
    if (options.partial_sums)
      L.weights_at = checked_add(L.side_at, entries, "dispatch message");
    L.entry_bytes = L.choices * sizeof(std::int32_t) * (options.partial_sums ? 2 : 1);
    L.dispatch_bytes = round_up16(
        checked_add(L.side_at, options.partial_sums ? 2 * entries : entries, "dispatch message"));
    L.combine_rows = options.partial_sums ? L.records : pairs;
    L.combine_bytes = round_up16(checked_add(sizeof(decode_header),
                                             checked_mul(L.combine_rows, row_bytes, "combine rows"),
                                             "combine message"));
    return L;
  }

  //! The most (token, expert) pairs one source sends one device.
  std::size_t pairs() const noexcept { return records * choices; }

  //! The buffers of an exchange over `ranks` ranks taking `k` experts per token: the expert
  //! pool (a source's tokens reach at most `choices` local experts each), the send buffer (the
  //! dispatch's messages; the combine's, back to back, a row per pool row at most, or per record
  //! with partial sums; with `pool_inputs`, the pool's inputs between the two) and the receive
  //! buffer (the dispatch's messages or the combine's:
  //! at most the k pairs of each of its max_tokens_per_rank tokens, each message placed so that
  //! its rows start a whole number of rows into the buffer, which costs up to a row per message;
  //! then, from row `pool_out_row`, the pool's outputs).
  struct buffers {
    std::size_t pool_rows = 0, send_bytes = 0, recv_bytes = 0, pool_out_row = 0;
  };
  buffers buffers_for(std::size_t ranks, std::size_t k, bool pool_inputs) const {
    buffers b;
    b.pool_rows = checked_mul(ranks, pairs(), "expert rows");
    const std::size_t headers = checked_mul(ranks, sizeof(decode_header), "headers");
    const std::size_t dispatch = checked_mul(ranks, dispatch_bytes, "dispatch bytes");
    const std::size_t sent_rows =
        pool_inputs ? b.pool_rows : checked_mul(ranks, combine_rows, "combine rows");
    b.send_bytes = std::max(
        dispatch, checked_add(headers, checked_mul(sent_rows, combine_row, "combine bytes"),
                              "combine bytes"));
    const std::size_t rows = checked_add(checked_mul(records, k, "pairs"), ranks, "rows");
    const std::size_t messages = std::max(
        dispatch, checked_add(headers, checked_mul(rows, combine_row, "rows"), "combine bytes"));
    b.pool_out_row = checked_add(messages, combine_row - 1, "receive bytes") / combine_row;
    b.recv_bytes =
        checked_mul(checked_add(b.pool_out_row, b.pool_rows, "rows"), combine_row, "receive bytes");
    return b;
  }

  //! Bytes a host `decode_exchange` of `ranks` ranks and `local_experts` slots per rank, rows
  //! of `row_bytes`, allocates at construction (its `buffer_bytes()`).
  static std::size_t buffer_bytes(std::size_t ranks, std::size_t local_experts,
                                  const decode_options& options, std::size_t row_bytes) {
    const auto L = of(options, row_bytes, local_experts);
    const auto b =
        L.buffers_for(ranks, static_cast<std::size_t>(options.k), !options.gathered_inputs);
    std::size_t bytes = checked_add(b.send_bytes, b.recv_bytes, "buffer bytes");
    if (options.fp8_dispatch) // the pool's wire rows and the call's tokens quantised
      bytes = checked_add(bytes,
                          checked_mul(checked_add(b.pool_rows, options.max_tokens_per_rank, "rows"),
                                      L.wire_row, "wire bytes"),
                          "buffer bytes");
    return bytes;
  }

  std::byte* row(std::byte* message, std::size_t r) const noexcept {
    return message + sizeof(decode_header) + r * wire_row;
  }
  //! Where the side table of a message of n records starts once compacted: after its n rows.
  std::size_t table_at(std::size_t n) const noexcept {
    return sizeof(decode_header) + n * wire_row;
  }
  //! The occupied part of a dispatch message of n records (a prefix of its room).
  std::size_t sent_bytes(std::size_t n) const noexcept { return table_at(n) + n * entry_bytes; }
  //! Moves the side table of a message of n records, written at `side_at` (and `weights_at`),
  //! to just after its rows. A full message's is there already.
  void compact(std::byte* message, std::size_t n) const noexcept {
    const std::size_t slots = n * choices * sizeof(std::int32_t);
    if (n == records || slots == 0)
      return;
    std::memmove(message + table_at(n), message + side_at, slots); // ends before weights_at
    if (weights_at != 0)
      std::memmove(message + table_at(n) + slots, message + weights_at, slots);
  }
  //! Starts record r's choices: none yet (every entry -1).
  void clear_choices(std::byte* message, std::size_t r) const noexcept {
    const std::int32_t none = -1;
    for (std::size_t c = 0; c < choices; ++c)
      std::memcpy(entry(message, r, c), &none, sizeof none);
  }
  void put_choice(std::byte* message, std::size_t r, std::size_t c,
                  std::int32_t slot) const noexcept {
    std::memcpy(entry(message, r, c), &slot, sizeof slot);
  }
  //! Record r's choice c's gate weight (partial sums).
  void put_weight(std::byte* message, std::size_t r, std::size_t c, float w) const noexcept {
    std::memcpy(message + weights_at + (r * choices + c) * sizeof(float), &w, sizeof w);
  }
  //! Record r's choice c's gate weight in a compacted message of n records.
  float weight(const std::byte* message, std::size_t n, std::size_t r,
               std::size_t c) const noexcept {
    float w = 0;
    std::memcpy(&w, message + table_at(n) + (n * choices + r * choices + c) * sizeof(float),
                sizeof w);
    return w;
  }

  //! Reads record r's choices in a compacted message of n records into `out` (room for
  //! `choices`; its first `count` are the valid ones) and checks them with `read_record`.
  record_read read_choices(const std::byte* message, std::size_t n, std::size_t r,
                           std::size_t local_experts, std::span<std::int32_t> out) const noexcept {
    std::memcpy(out.data(), message + table_at(n) + r * choices * sizeof(std::int32_t),
                choices * sizeof(std::int32_t));
    return read_record([&](std::int64_t c) { return out[static_cast<std::size_t>(c)]; },
                       static_cast<std::int64_t>(choices),
                       static_cast<std::int64_t>(local_experts));
  }

 private:
  static std::size_t round_up16(std::size_t bytes) {
    return checked_add(bytes, std::size_t{15}, "message bytes") / 16 * 16;
  }
  std::byte* entry(std::byte* message, std::size_t r, std::size_t c) const noexcept {
    return message + side_at + (r * choices + c) * sizeof(std::int32_t);
  }
};

//! The error of a received token record no weave rank writes: record `r` of rank `d`'s message
//! names, as its choice `c`, local slot `l` of a rank with `slots` (`who`: the exchange).
inline error bad_decode_record(const char* who, std::size_t d, std::size_t r, std::size_t c,
                               std::int32_t l, std::size_t slots) {
  return error(errc::protocol, concat(who, ": rank ", d,
                                      " sent a token record no weave rank writes "
                                      "(record ",
                                      r, ", choice ", c, ": local slot ", l, " of ", slots, ")"));
}

} // namespace detail

WEAVE_NAMESPACE_END
