//! \file
//! The steps of `basic_device_decode_exchange` (functors over raw pointers, run by any execution
//! space) and its wire layout.
//!
//! A message, one per (source rank, destination device) and phase, is a block of `block_rows`
//! rows of one stride: first `header_rows` rows holding its 128-byte `decode_header` (padded),
//! then `payload` rows, then (dispatch only) the side table: per record, `choices` int32 local
//! slots in the token's choice order, -1 after the last, then (with partial sums) as many f32
//! gate weights. A dispatch record is a token's row, sent once to each device it is routed to
//! (room for `max_tokens_per_rank` records); a combine row is the output of one (record, choice)
//! pair, at row record * choices + choice, or with partial sums the record's sum, at row record.
//! All rows share one
//! stride, so a single row view covers a whole buffer and the row moves address any payload row
//! by its index; every message is sent whole (its size is fixed: no host sync, capturable).
#pragma once

#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/exec/space.hpp"
#include "weave/overlap/decode_options.hpp"
#include "weave/overlap/detail/decode_records.hpp"
#include "weave/routing/device_dispatch_plan.hpp"

#include <cstddef>
#include <cstdint>

WEAVE_NAMESPACE_BEGIN

//! Bit of a device decode exchange's error word: a combine message returning other rows than
//! were sent to it (headers and records no sender writes are kept apart, see `decode_kept`).
inline constexpr std::uint32_t device_decode_bad_message = 1u << 8;
//! Bit of a device decode exchange's error word and of a failed header's flags: with an FP8
//! dispatch, a token held a NaN or an infinity (the call fails on every rank).
inline constexpr std::uint32_t device_decode_nonfinite = 1u << 9;

namespace detail {

// The wire layout shared by every step (see the file comment).
struct decode_layout {
  std::int64_t D = 0, M = 0; // ranks, max_tokens_per_rank
  std::int64_t payload = 0;  // payload rows per message (the most a header may announce)
  std::int64_t choices = 0;  // local slots per record: min(k, local experts)
  std::int64_t header_rows = 0, side_rows = 0, block_rows = 0;
  std::size_t stride = 0; // bytes per row
  bool side = false;      // a dispatch layout: records and their side table
  bool weights = false;   // the side table also holds the choices' gate weights

  // The dispatch's messages over `ranks` ranks: `max_tokens` records of `stride` bytes each, then
  // their side table (with `weights`, the gate weights too).
  static decode_layout dispatch(int ranks, std::size_t max_tokens, std::size_t choices,
                                std::size_t stride, bool weights = false) {
    const std::size_t side_bytes =
        checked_mul(checked_mul(max_tokens, choices, "records"),
                    (weights ? 2 : 1) * sizeof(std::int32_t), "side table bytes");
    decode_layout at = of(ranks, max_tokens, choices, max_tokens,
                          (side_bytes + stride - 1) / stride, stride, true);
    at.weights = weights;
    return at;
  }
  // The combine's messages: a row of `stride` bytes per (record, choice) (with `choices` 1: per
  // record).
  static decode_layout combine(int ranks, std::size_t max_tokens, std::size_t choices,
                               std::size_t stride) {
    return of(ranks, max_tokens, choices, checked_mul(max_tokens, choices, "pairs"), 0, stride,
              false);
  }

  std::size_t rows() const noexcept { return static_cast<std::size_t>(D * block_rows); }
  std::size_t bytes_per_peer() const noexcept {
    return static_cast<std::size_t>(block_rows) * stride;
  }
  // Row index, in a message buffer, of payload row r of rank d's message.
  WEAVE_HOST_DEVICE std::int64_t payload_row(std::int64_t d, std::int64_t r) const {
    return d * block_rows + header_rows + r;
  }
  WEAVE_HOST_DEVICE decode_header* header(std::byte* buffer, std::int64_t d) const {
    return reinterpret_cast<decode_header*>(buffer +
                                            static_cast<std::size_t>(d * block_rows) * stride);
  }
  // Rank d's side table (a dispatch layout): record r's choices at [r * choices, + choices).
  WEAVE_HOST_DEVICE std::int32_t* side_table(std::byte* buffer, std::int64_t d) const {
    return reinterpret_cast<std::int32_t*>(
        buffer + static_cast<std::size_t>(payload_row(d, payload)) * stride);
  }
  // Rank d's gate weights (a dispatch layout with `weights`), after its choices.
  WEAVE_HOST_DEVICE float* side_weights(std::byte* buffer, std::int64_t d) const {
    return reinterpret_cast<float*>(side_table(buffer, d) + payload * choices);
  }

 private:
  static decode_layout of(int ranks, std::size_t max_tokens, std::size_t choices,
                          std::size_t payload, std::size_t side_rows, std::size_t stride,
                          bool side) {
    decode_layout at;
    at.D = ranks;
    at.M = static_cast<std::int64_t>(max_tokens);
    at.choices = static_cast<std::int64_t>(choices);
    at.payload = static_cast<std::int64_t>(payload);
    at.stride = stride;
    at.side = side;
    at.header_rows = static_cast<std::int64_t>((sizeof(decode_header) + stride - 1) / stride);
    at.side_rows = static_cast<std::int64_t>(side_rows);
    at.block_rows = static_cast<std::int64_t>(checked_add(
        checked_add(static_cast<std::size_t>(at.header_rows), payload, "rows"), side_rows, "rows"));
    (void)checked_mul(checked_mul(static_cast<std::size_t>(ranks),
                                  static_cast<std::size_t>(at.block_rows), "rows"),
                      stride, "message buffer bytes");
    return at;
  }
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

// Per destination device d: one record per token routed there, in token order (so the rows come
// out in the same order in every space): the token's local slots on d in its choice order go to
// the record's side-table entries, -1 after the last; each pair gets its combine row (record *
// choices + choice; with partial sums the record, and its weight goes beside its slot); the
// record's row index becomes the send gather's. Counts the records and pairs sent to d.
struct decode_position_step {
  decode_layout at; // the dispatch's
  std::int64_t tokens;
  int k;
  std::int64_t spd;
  const std::int32_t* pair_slot;
  const float* weights; // partial sums: the call's gate weights; else null
  std::byte* send;
  std::int64_t *pair_pos, *records, *pairs_to, *send_index;

  WEAVE_HOST_DEVICE void operator()(std::int64_t d) const {
    std::int32_t* side = at.side_table(send, d);
    float* side_w = weights != nullptr ? at.side_weights(send, d) : nullptr;
    std::int64_t n = 0, pairs = 0;
    for (std::int64_t t = 0; t < tokens; ++t) {
      std::int64_t c = 0;
      for (int j = 0; j < k; ++j) {
        const std::int64_t p = t * k + j;
        const std::int32_t s = pair_slot[p];
        if (s < 0 || s / spd != d)
          continue;
        // A token's choices are distinct experts, so distinct slots: at most `choices` of them.
        if (c == at.choices) {
          pair_pos[p] = -1;
          continue;
        }
        side[n * at.choices + c] = static_cast<std::int32_t>(s - d * spd);
        if (side_w != nullptr)
          side_w[n * at.choices + c] = weights[p];
        pair_pos[p] = side_w != nullptr ? n : n * at.choices + c;
        ++c;
      }
      if (c == 0)
        continue;
      for (std::int64_t rest = c; rest < at.choices; ++rest)
        side[n * at.choices + rest] = -1;
      send_index[at.payload_row(d, n)] = t;
      pairs += c;
      ++n;
    }
    records[d] = n;
    pairs_to[d] = pairs;
  }
};

// Per destination rank d: its message's header. `rejected` is the host's failure of this call
// (status `ok` when none); the call's flagged choices, or a non-finite token of an FP8 dispatch
// (`bad_token` >= 0), fail it too; else the header carries rows[d], or 0 once `empty_if` (the
// combine: the call failed here, so its experts' rows were never filled) is set. Index 0 also
// adds the call's flags to the sticky error word.
struct decode_header_step {
  decode_layout at;
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
        *call_flags | (bad_token != nullptr && *bad_token >= 0 ? device_decode_nonfinite : 0u);
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
    if (d == 0 && flags != 0)
      atomic_or(error, flags);
  }
};

// What a device decode exchange's receive steps keep for `check_errors` since its last check
// (memory of the space; all zero: nothing kept). Each is kept by the first index of a step that
// claims it.
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
};

// Per source rank d, after a phase's all-to-all: the header of d's message. A failed one, one no
// sender writes (`decode_header_fault_of`, at most `payload` rows) or, in a dispatch, a record
// whose side-table entries no sender writes (`read_record` over `local` slots) fails the call
// (`call_failed`) and is kept in `kept` unless one is kept already. A dispatch counts the rows
// d's combine gets back (`arrived`: its records' pairs, or its records with partial sums; 0 when
// its message failed). With `expected` (the combine) the message must return the rows sent to d,
// else the sticky `error` word is flagged.
struct decode_receive_step {
  decode_layout at;
  std::byte* recv;
  std::uint32_t known_flags;    // the flags a failed header may carry
  std::int64_t local;           // dispatch: local slots of this rank
  const std::int64_t* expected; // combine: pairs sent to each rank, or null
  std::int64_t* arrived;        // dispatch: pairs received from each rank, or null
  std::uint32_t *call_failed, *error;
  decode_kept* kept;

  WEAVE_HOST_DEVICE void operator()(std::int64_t d) const {
    const bool checks_returns = expected != nullptr && *call_failed == 0;
    const decode_header* h = at.header(recv, d);
    const decode_header_fault fault = decode_header_fault_of(*h, d, at.payload, known_flags);
    std::int64_t pairs = 0;
    bool failed = true;
    if (fault != decode_header_fault::none) {
      if (atomic_claim(&kept->bad_claimed)) {
        kept->bad = *h;
        kept->bad_limit = at.payload;
        kept->bad_sender = static_cast<std::int32_t>(d);
        kept->bad_fault = static_cast<std::int32_t>(fault);
      }
    } else if (h->status == decode_status::failed) {
      if (atomic_claim(&kept->peer_claimed))
        kept->peer = *h;
    } else if (checks_returns && h->rows != expected[d]) {
      atomic_or(error, device_decode_bad_message);
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
    if (!at.side)
      return true;
    const std::int32_t* side = at.side_table(recv, d);
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

// Per local slot l, after the dispatch's receive: l's rows in source order, records in order.
// Each gets its expert row (l * D * M + q): the received record it is gathered from
// (`expert_index`, -1 past the last) and the combine row it returns to (`return_index`, whose
// other entries stay -1; with partial sums `merge_index` / `merge_weight` instead: entry c of
// the record's combine row, and the choice's weight); per source the count and first row, and
// the total. All empty when the call failed.
struct decode_slot_layout_step {
  decode_layout at, back; // the dispatch's, the combine's
  std::byte* recv;
  const std::uint32_t* call_failed;
  std::int64_t *source_rows, *source_offsets, *expert_rows, *expert_index, *return_index;
  std::int64_t* merge_index; // partial sums; else null
  float* merge_weight;

  WEAVE_HOST_DEVICE void operator()(std::int64_t l) const {
    const std::int64_t first = l * at.D * at.M;
    const bool failed = *call_failed != 0;
    std::int64_t q = 0;
    for (std::int64_t d = 0; d < at.D; ++d) {
      source_offsets[l * at.D + d] = q;
      const std::int64_t records = failed ? 0 : at.header(recv, d)->rows;
      const std::int32_t* side = at.side_table(recv, d);
      for (std::int64_t r = 0; r < records; ++r)
        for (std::int64_t c = 0; c < at.choices && side[r * at.choices + c] >= 0; ++c)
          if (side[r * at.choices + c] == l) {
            expert_index[first + q] = at.payload_row(d, r);
            if (merge_index != nullptr) {
              const std::int64_t e = back.payload_row(d, r) * at.choices + c;
              merge_index[e] = first + q;
              merge_weight[e] = at.side_weights(recv, d)[r * at.choices + c];
            } else {
              return_index[back.payload_row(d, r * at.choices + c)] = first + q;
            }
            ++q;
            break;
          }
      source_rows[l * at.D + d] = q - source_offsets[l * at.D + d];
    }
    expert_rows[l] = q;
    for (; q < at.D * at.M; ++q)
      expert_index[first + q] = -1;
  }
};

// Per (token, choice): the returned row it sums, or -1 (not routed, or the call failed).
struct decode_pair_row_step {
  decode_layout back; // the combine's
  std::int64_t spd;
  const std::int32_t* pair_slot;
  const std::int64_t* pair_pos;
  const std::uint32_t* call_failed;
  std::int64_t* index;

  WEAVE_HOST_DEVICE void operator()(std::int64_t p) const {
    const std::int32_t s = pair_slot[p];
    index[p] =
        s < 0 || pair_pos[p] < 0 || *call_failed != 0 ? -1 : back.payload_row(s / spd, pair_pos[p]);
  }
};

// Partial sums, per token: the returned rows it sums, one per device it was routed to, in
// ascending device order, -1 after the last (all -1 when the call failed).
struct decode_token_rows_step {
  decode_layout back; // the combine's
  std::int64_t spd;
  int k, per_token; // per_token: min(ranks, k)
  const std::int32_t* pair_slot;
  const std::int64_t* pair_pos;
  const std::uint32_t* call_failed;
  std::int64_t* index;

  WEAVE_HOST_DEVICE void operator()(std::int64_t t) const {
    std::int64_t* rows = index + t * per_token;
    if (*call_failed != 0) {
      for (int n = 0; n < per_token; ++n)
        rows[n] = -1;
      return;
    }
    const std::int32_t* slot = pair_slot + t * k;
    const std::int64_t* record = pair_pos + t * k;
    const std::int64_t slots = spd;
    const auto device = [slot, record, slots](int j) -> std::int64_t {
      return slot[j] < 0 || record[j] < 0 ? -1 : slot[j] / slots;
    };
    const decode_layout at = back;
    rows_by_device(
        k, per_token, device, [&](int j) { return at.payload_row(device(j), record[j]); }, rows);
  }
};

// One index: a failed call's output becomes all-ones bytes (NaN in f32, bf16 and f16), so no
// rank can read numbers from it.
struct decode_poison_step {
  const std::uint32_t* call_failed;
  std::byte* y;
  std::int64_t bytes;

  WEAVE_HOST_DEVICE void operator()(std::int64_t) const {
    if (*call_failed != 0)
      for (std::int64_t i = 0; i < bytes; ++i)
        y[i] = std::byte{0xFF};
  }
};

} // namespace detail

WEAVE_NAMESPACE_END
