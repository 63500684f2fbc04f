//! \file
//! The steps of the decode exchange (`basic_decode_exchange`): functors over raw pointers, one
//! index per call, run by any execution space (CUDA kernels; emulated_gpu_space's tasks). Serial
//! spaces (`host_space`) run some of them in a form that visits a whole phase in one pass
//! (`decode_serial_steps.hpp`), with the same results. The wire format is `decode_wire.hpp`'s.
//! Here: the dispatch's routes, records, headers and the check of what arrived; the expert pool's
//! layout and the combine's steps are in `decode_pool_steps.hpp`.
#pragma once

#include "weave/core/config.hpp"
#include "weave/exec/space.hpp"
#include "weave/overlap/decode_options.hpp"
#include "weave/overlap/detail/decode_wire.hpp"
#include "weave/routing/device_dispatch_plan.hpp"

#include <cstddef>
#include <cstdint>

WEAVE_NAMESPACE_BEGIN

//! Bit of a decode exchange's error word: a combine message returning other rows than were
//! sent to it (headers and records no sender writes are kept apart, see `decode_kept`).
inline constexpr std::uint32_t decode_bad_message_flag = 1u << 8;
//! Bit of a decode exchange's error word and of a failed header's flags: with an FP8 dispatch,
//! a token held a NaN or an infinity (the call fails on every rank).
inline constexpr std::uint32_t decode_nonfinite_flag = 1u << 9;

namespace detail {

// The arrays of one decode call, in memory of the space (see `basic_decode_exchange::carve`).
struct decode_call_arrays {
  std::int32_t* pair_slot = nullptr;    // [tokens * k] physical slot of each pair, or -1
  std::int64_t* pair_pos = nullptr;     // [tokens * k] the pair's row in its device's combine
  std::int64_t* records = nullptr;      // [D] token records sent to each device
  std::int64_t* pairs_to = nullptr;     // [D] (token, expert) pairs sent to each device
  std::int64_t* send_index = nullptr;   // [dispatch rows] the token a record row carries, or -1
  std::int64_t* token_rows = nullptr;   // [tokens * k] a token's record rows (the scatter's map)
  std::int64_t* own_token = nullptr;    // [M] this rank's own records: their tokens
  std::int64_t* arrived = nullptr;      // [D] rows each source's combine gets back
  std::int64_t* slot_rows = nullptr;    // [L] rows per local slot
  std::int64_t* first = nullptr;        // [L + 1] first pool row of each slot (a scan)
  std::int64_t* source_rows = nullptr;  // [L * D] rows per (slot, source)
  std::int64_t* source_first = nullptr; // [L * D] each (slot, source)'s first row in its slot
  std::int64_t* busy = nullptr;         // [L + 1] the fed slots ascending; busy[L]: their count
  std::int64_t* from_peer = nullptr;    // [pool rows] the received row a pool row copies, or -1
  std::int64_t* from_own = nullptr;     // [pool rows] this rank's token (FP8: send row), or -1
  std::int64_t* merge_index = nullptr;  // partial sums: [combine rows * choices] -> pool row
  float* merge_weight = nullptr;        // and its gate weight
  std::int64_t* own_index = nullptr;    // this rank's own combine rows: [M * choices] -> pool row
  float* own_weight = nullptr;          // partial sums: and their weights
  std::int64_t* return_index = nullptr; // per pair: [combine rows] -> pool row, or -1
  std::int64_t* final_rows = nullptr;   // [tokens * k] the returned rows each token's output sums
  const std::byte** row_ptr = nullptr;  // [pool rows] gathered inputs: where each row arrived
  const std::byte** block = nullptr;    // [L] each slot's input rows (the pool, or one in place)
};

// Per token: the physical slot of each of its choices (-1: not routed), as the dispatch plans
// choose them; bad choices are flagged in the call's word.
struct decode_route_step {
  const std::int32_t* ids;
  const float* weights;
  int k, E;
  const std::int32_t *fixed_slot, *replica_offsets, *replicas;
  std::int32_t* pair_slot;
  std::uint32_t* call_flags;

  WEAVE_HOST_DEVICE void operator()(std::int64_t t) const {
    const std::int64_t base = t * k;
    std::uint32_t flags = 0;
    for (int j = 0; j < k; ++j)
      pair_slot[base + j] =
          routed_choice(ids, weights, base, j, E, flags)
              ? replica_slot(fixed_slot, replica_offsets, replicas, ids[base + j], t)
              : -1;
    if (flags != 0)
      atomic_or(call_flags, flags);
  }
};

// Per destination device d: one record per token routed there, in token order: the token's
// local slots on d in its choice order go to the record's side-table entries (after the records'
// rows: the count first, then the entries), -1 after the last; each pair gets its combine row
// (record * choices + choice; with partial sums the record, its weight beside its slot); the
// record's row carries the token (`send_index`, `token_rows` at the token's first pair on d),
// except on this rank's own message unless `own_rows` (an FP8 dispatch quantises them there).
struct decode_position_step {
  decode_wire at; // the dispatch's
  std::int64_t tokens;
  int k;
  std::int64_t spd, own;
  bool own_rows;
  const std::int32_t* pair_slot;
  const float* weights; // partial sums: the call's gate weights; else null
  std::byte* send;
  std::int64_t *pair_pos, *records, *pairs_to, *send_index, *token_rows, *own_token;

  WEAVE_HOST_DEVICE void operator()(std::int64_t d) const {
    std::int64_t n = 0;
    for (std::int64_t t = 0; t < tokens; ++t)
      for (int j = 0; j < k; ++j)
        if (pair_slot[t * k + j] >= 0 && pair_slot[t * k + j] / spd == d) {
          ++n;
          break;
        }
    std::int32_t* side = at.side_table(send, d, n);
    float* side_w = weights != nullptr ? at.side_weights(send, d, n) : nullptr;
    std::int64_t r = 0, pairs = 0;
    for (std::int64_t t = 0; t < tokens; ++t) {
      std::int64_t c = 0;
      for (int j = 0; j < k; ++j)
        if (pair_slot[t * k + j] >= 0 && pair_slot[t * k + j] / spd == d)
          add(d, r, c++, t, t * k + j, pairs++, side, side_w);
      if (c == 0)
        continue;
      for (std::int64_t rest = c; rest < at.choices; ++rest)
        side[r * at.choices + rest] = -1;
      ++r;
    }
    records[d] = n;
    pairs_to[d] = pairs;
  }

  // Pair p (of token t; d's pairs before it: `pairs`) becomes entry c of record r in d's side
  // table (`side`, and `side_w` with partial sums); the record's first also places its row.
  WEAVE_HOST_DEVICE void add(std::int64_t d, std::int64_t r, std::int64_t c, std::int64_t t,
                             std::int64_t p, std::int64_t pairs, std::int32_t* side,
                             float* side_w) const {
    if (c == 0 && (d != own || own_rows)) {
      token_rows[p] = at.payload_row(d, r);
      send_index[at.payload_row(d, r)] = t;
    }
    if (c == 0 && d == own)
      own_token[r] = t;
    side[r * at.choices + c] = static_cast<std::int32_t>(pair_slot[p] - d * spd);
    if (weights != nullptr)
      side_w[r * at.choices + c] = weights[p];
    pair_pos[p] = weights != nullptr ? r : pairs;
  }
};

// Per destination rank d: its message's header. `rejected` is the host's failure of this call
// (status `ok` when none); the call's flagged choices, or a non-finite token of an FP8 dispatch
// (`bad_token` >= 0), fail it too; else the header carries rows[d], or 0 once `empty_if` (the
// combine: the call failed here, so its experts' rows were never filled) is set. Index 0 also
// adds the call's flags to the sticky error word.
struct decode_header_step {
  decode_wire at;
  std::byte* send;
  decode_header rejected;
  const std::int64_t* rows;
  const std::uint32_t* call_flags;
  const std::int64_t* bad_token; // FP8 dispatch: the first non-finite token, or -1; else null
  const std::uint32_t* empty_if; // combine: the call failed word; else null
  std::uint32_t* error;
  int rank;

  WEAVE_HOST_DEVICE void operator()(std::int64_t d) const {
    decode_header h;
    const std::uint32_t flags =
        *call_flags | (bad_token != nullptr && *bad_token >= 0 ? decode_nonfinite_flag : 0u);
    if (rejected.status != decode_status::ok) {
      h = rejected;
    } else if (flags != 0) {
      h.status = decode_status::failed;
      h.code = static_cast<std::int32_t>(
          (flags & device_plan_bad_expert) != 0 ? errc::out_of_range : errc::invalid_argument);
      h.flags = static_cast<std::int32_t>(flags); // the peers rebuild the message from them
    } else {
      h.rows = empty_if != nullptr && *empty_if != 0 ? 0 : rows[d];
    }
    h.source = rank;
    *at.header(send, d) = h;
    if (d == 0 && flags != 0 && rejected.status == decode_status::ok) // else reported as refused
      atomic_or(error, flags);
  }
};

// What a decode exchange's receive steps keep for `check_errors` since its last check (memory
// of the space; all zero: nothing kept). Each is kept by the first index of a step that claims it.
struct decode_kept {
  decode_header peer;               // the first failed header received (this rank's own too)
  decode_header bad;                // the first header no sender writes
  std::int64_t bad_limit = 0;       // the most rows its phase's headers announce,
  std::int32_t bad_sender = 0;      // where `bad` came from,
  std::int32_t bad_fault = 0;       // and its `decode_header_fault`
  std::int32_t record_sender = 0;   // the first record no sender writes: its sender,
  std::int32_t record = 0;          // its index,
  std::int32_t record_choice = 0;   // the entry that breaks it,
  std::int32_t record_value = 0;    // and that entry's value
  std::uint32_t peer_claimed = 0;   // 1 once `peer` is kept
  std::uint32_t bad_claimed = 0;    // 1 once `bad` is kept
  std::uint32_t record_claimed = 0; // 1 once a bad record is kept

  // The errors of `bad`, and of the bad record (of a rank with `slots` local slots).
  error bad_header() const {
    return error(
        errc::protocol,
        concat("decode_exchange: rank ", bad_sender, " sent a header no weave rank writes (",
               describe_header_fault(static_cast<decode_header_fault>(bad_fault), bad, bad_limit),
               ")"));
  }
  error bad_record(std::int64_t slots) const {
    return error(errc::protocol,
                 concat("decode_exchange: rank ", record_sender,
                        " sent a token record no weave rank writes (record ", record, ", choice ",
                        record_choice, ": local slot ", record_value, " of ", slots, ")"));
  }
};

// Per source rank d, after a phase's all-to-all: the header of d's message (this rank's own side
// table is read where it was written, in `send`). A failed one, one no sender writes, or in a
// dispatch a record whose side-table entries no sender writes fails the call (`call_failed`) and
// is kept in `kept` unless one is kept already. A dispatch counts the rows d's combine gets back
// (`arrived`: its records' pairs, or its records with partial sums; 0 when its message failed).
// With `expected` (the combine) the message must return the rows sent to d, else the sticky
// `error` word is flagged.
struct decode_receive_step {
  decode_wire at;
  std::byte *recv, *send;
  std::int64_t own;
  std::uint32_t known_flags;    // the flags a failed header may carry
  std::int64_t local;           // dispatch: local slots of this rank
  const std::int64_t* expected; // combine: rows sent to each rank, or null
  std::int64_t* arrived;        // dispatch: rows each source gets back, or null
  std::uint32_t *call_failed, *error;
  decode_kept* kept;

  WEAVE_HOST_DEVICE void operator()(std::int64_t d) const {
    const bool checks_returns = expected != nullptr && *call_failed == 0;
    const decode_header* h = at.header(recv, d);
    const decode_header_fault fault = decode_header_fault_of(*h, d, at.M, known_flags);
    std::int64_t pairs = 0;
    bool failed = true;
    if (fault != decode_header_fault::none) {
      if (atomic_claim(&kept->bad_claimed)) {
        kept->bad = *h;
        kept->bad_limit = at.M;
        kept->bad_sender = static_cast<std::int32_t>(d);
        kept->bad_fault = static_cast<std::int32_t>(fault);
      }
    } else if (h->status == decode_status::failed) {
      if (atomic_claim(&kept->peer_claimed))
        kept->peer = *h;
    } else if (checks_returns && h->rows != expected[d]) {
      atomic_or(error, decode_bad_message_flag);
    } else {
      failed = !records_read(d, h->rows, pairs);
    }
    if (failed)
      atomic_or(call_failed, 1u);
    if (arrived != nullptr)
      arrived[d] = failed ? 0 : at.weights ? h->rows : pairs;
  }

 private:
  // A dispatch's records from d: their pairs, or false after keeping the first bad one.
  WEAVE_HOST_DEVICE bool records_read(std::int64_t d, std::int64_t records,
                                      std::int64_t& pairs) const {
    if (at.choices == 0)
      return true;
    const std::int32_t* side = at.side_table(d == own ? send : recv, d, records);
    for (std::int64_t r = 0; r < records; ++r) {
      const std::int32_t* entries = side + r * at.choices;
      const record_read got =
          read_record([entries](std::int64_t c) { return entries[c]; }, at.choices, local);
      if (got.bad >= 0) {
        if (atomic_claim(&kept->record_claimed)) {
          kept->record_sender = static_cast<std::int32_t>(d);
          kept->record = static_cast<std::int32_t>(r);
          kept->record_choice = static_cast<std::int32_t>(got.bad);
          kept->record_value = got.value;
        }
        return false;
      }
      pairs += got.count;
    }
    return true;
  }
};

// Where a received (source d, record r)'s rows and side table are: rank d's message in `recv`,
// this rank's own in `send` (its records' rows there only with an FP8 dispatch).
struct decode_received {
  decode_wire at;
  std::byte *recv, *send;
  std::int64_t own;
  const std::uint32_t* call_failed;

  WEAVE_HOST_DEVICE std::int64_t records(std::int64_t d) const {
    return *call_failed != 0 ? 0 : at.header(recv, d)->rows;
  }
  WEAVE_HOST_DEVICE const std::int32_t* side(std::int64_t d, std::int64_t n) const {
    return at.side_table(d == own ? send : recv, d, n);
  }
};

} // namespace detail

WEAVE_NAMESPACE_END
