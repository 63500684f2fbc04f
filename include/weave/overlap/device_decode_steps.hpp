//! \file
//! The steps of `basic_device_decode_exchange` (functors over raw pointers, run by any execution
//! space) and its wire layout.
//!
//! Every rank's block of a decode message buffer is `block_rows` rows of `stride` bytes: first
//! `header_rows` rows holding one 128-byte `decode_header` per local expert slot (padded), then
//! each slot's `max_tokens_per_rank` payload rows. All rows share one stride, so a single row
//! view covers the whole buffer and the row moves address any payload row by its index.
#pragma once

#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/exec/space.hpp"
#include "weave/overlap/decode_options.hpp"
#include "weave/routing/device_dispatch_plan.hpp"

#include <cstddef>
#include <cstdint>

WEAVE_NAMESPACE_BEGIN

//! Bit of a device decode exchange's error word: a combine message returning other rows than
//! were sent to it (headers no sender writes are kept apart, see `decode_header_fault`).
inline constexpr std::uint32_t device_decode_bad_message = 1u << 8;
//! Bit of a device decode exchange's error word and of a failed header's flags: with an FP8
//! dispatch, a token held a NaN or an infinity (the call fails on every rank).
inline constexpr std::uint32_t device_decode_nonfinite = 1u << 9;

namespace detail {

// The wire layout shared by every step (see the file comment).
struct decode_layout {
  std::int64_t D = 0, spd = 0, M = 0; // ranks, local slots, max_tokens_per_rank
  std::int64_t header_rows = 0, block_rows = 0;
  std::size_t stride = 0; // bytes per row

  // The layout of `ranks` blocks of `slots` slots of `max_tokens` rows of `stride` bytes.
  static decode_layout of(int ranks, int slots, std::size_t max_tokens, std::size_t stride) {
    decode_layout at;
    at.D = ranks;
    at.spd = slots;
    at.M = static_cast<std::int64_t>(max_tokens);
    at.stride = stride;
    const std::size_t headers =
        checked_mul(static_cast<std::size_t>(slots), sizeof(decode_header), "header bytes");
    at.header_rows = static_cast<std::int64_t>((headers + stride - 1) / stride);
    at.block_rows = static_cast<std::int64_t>(
        checked_add(static_cast<std::size_t>(at.header_rows),
                    checked_mul(static_cast<std::size_t>(slots), max_tokens, "rows"), "rows"));
    (void)checked_mul(checked_mul(static_cast<std::size_t>(ranks),
                                  static_cast<std::size_t>(at.block_rows), "rows"),
                      stride, "message buffer bytes");
    return at;
  }
  std::size_t rows() const noexcept { return static_cast<std::size_t>(D * block_rows); }
  std::size_t bytes_per_peer() const noexcept {
    return static_cast<std::size_t>(block_rows) * stride;
  }

  // Row index, in a message buffer, of row r of local slot l's payload in rank d's block.
  WEAVE_HOST_DEVICE std::int64_t payload_row(std::int64_t d, std::int64_t l, std::int64_t r) const {
    return d * block_rows + header_rows + l * M + r;
  }
  WEAVE_HOST_DEVICE decode_header* header(std::byte* buffer, std::int64_t d, std::int64_t l) const {
    return reinterpret_cast<decode_header*>(buffer +
                                            static_cast<std::size_t>(d * block_rows) * stride +
                                            static_cast<std::size_t>(l) * sizeof(decode_header));
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

// Per physical slot: its pairs in token order get rows 0, 1, ... of the slot's message (so the
// rows come out in the same order in every space), recorded for the combine and as the send
// gather's index.
struct decode_position_step {
  decode_layout at;
  std::int64_t pairs;
  int k;
  const std::int32_t* pair_slot;
  std::int64_t *pair_pos, *slot_rows, *send_index;

  WEAVE_HOST_DEVICE void operator()(std::int64_t s) const {
    const std::int64_t d = s / at.spd, l = s % at.spd;
    std::int64_t n = 0;
    for (std::int64_t p = 0; p < pairs; ++p)
      if (pair_slot[p] == s) {
        pair_pos[p] = n;
        send_index[at.payload_row(d, l, n)] = p / k;
        ++n;
      }
    slot_rows[s] = n;
  }
};

// Per (rank d, local slot l) message: its header. `rejected` is the host's failure of this call
// (status `ok` when none); the call's flagged choices, or a non-finite token of an FP8 dispatch
// (`bad_token` >= 0), fail it too; else the header carries rows[d * rows_d + l * rows_l].
// Index 0 also adds the call's flags to the sticky error word.
struct decode_header_step {
  decode_layout at;
  std::byte* send;
  decode_header rejected;
  const std::int64_t* rows;
  std::int64_t rows_d, rows_l;
  const std::uint32_t* call_flags;
  const std::int64_t* bad_token; // FP8 dispatch: the first non-finite token, or -1; else null
  std::uint32_t* error;
  int rank;

  WEAVE_HOST_DEVICE void operator()(std::int64_t s) const {
    const std::int64_t d = s / at.spd, l = s % at.spd;
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
      h.rows = rows[d * rows_d + l * rows_l];
    }
    h.source = rank;
    *at.header(send, d, l) = h;
    if (s == 0 && flags != 0)
      atomic_or(error, flags);
  }
};

// What a device decode exchange's receive steps keep for `check_errors` since its last check
// (memory of the space; all zero: nothing kept). Each is kept by the first index of a step that
// claims it; a sender that failed writes the same header to every slot, so which index keeps its
// header does not matter.
struct decode_kept {
  decode_header peer;             // the first failed header received (this rank's own too)
  decode_header bad;              // the first header no sender writes
  std::int32_t bad_sender = 0;    // where `bad` came from: the rank,
  std::int32_t bad_slot = 0;      // the local slot,
  std::int32_t bad_fault = 0;     // and its `decode_header_fault`
  std::uint32_t peer_claimed = 0; // 1 once `peer` is kept
  std::uint32_t bad_claimed = 0;  // 1 once `bad` is kept
};

// Per local slot l, after a phase's all-to-all: the headers of l's messages, one per source. A
// failed one, or one no sender writes (`decode_header_fault_of`), fails the call
// (`call_failed`) and is kept in `kept` unless one is kept already; a header no sender writes
// counts as no rows. With `source_rows` (the dispatch) it lays out slot l's received rows: per
// source the count and offset, and the total (all 0 when the slot saw a failure). With
// `expected` (the combine) each message must return the rows sent to it, else the sticky
// `error` word is flagged.
struct decode_receive_step {
  decode_layout at;
  std::byte* recv;
  std::uint32_t known_flags;    // the flags a failed header may carry
  const std::int64_t* expected; // combine: rows sent per (d, l), or null
  std::int64_t *source_rows, *source_offsets, *expert_rows; // dispatch: the layout, or null
  std::uint32_t *call_failed, *error;
  decode_kept* kept;

  WEAVE_HOST_DEVICE void operator()(std::int64_t l) const {
    const bool checks_returns = expected != nullptr && *call_failed == 0;
    bool failed = false, bad = false, short_return = false;
    for (std::int64_t d = 0; d < at.D; ++d) {
      const decode_header* h = at.header(recv, d, l);
      const decode_header_fault fault = decode_header_fault_of(*h, d, at.M, known_flags);
      if (fault != decode_header_fault::none) {
        bad = true;
        if (atomic_claim(&kept->bad_claimed)) {
          kept->bad = *h;
          kept->bad_sender = static_cast<std::int32_t>(d);
          kept->bad_slot = static_cast<std::int32_t>(l);
          kept->bad_fault = static_cast<std::int32_t>(fault);
        }
      } else if (h->status == decode_status::failed) {
        failed = true;
        if (atomic_claim(&kept->peer_claimed))
          kept->peer = *h;
      } else if (checks_returns && h->rows != expected[d * at.spd + l]) {
        short_return = true;
      }
    }
    if (failed || bad || short_return)
      atomic_or(call_failed, 1u);
    if (short_return)
      atomic_or(error, device_decode_bad_message);
    if (source_rows == nullptr)
      return;
    std::int64_t total = 0;
    for (std::int64_t d = 0; d < at.D; ++d) {
      const std::int64_t n = failed || bad ? 0 : at.header(recv, d, l)->rows;
      source_rows[l * at.D + d] = n;
      source_offsets[l * at.D + d] = total;
      total += n;
    }
    expert_rows[l] = total;
  }
};

// Per expert row (slot l, row q of its D * M): the received row it is copied from, or -1.
struct decode_expert_index_step {
  decode_layout at;
  const std::int64_t *source_rows, *source_offsets, *expert_rows;
  std::int64_t* index;

  WEAVE_HOST_DEVICE void operator()(std::int64_t i) const {
    const std::int64_t per = at.D * at.M, l = i / per, q = i % per;
    index[i] = -1;
    if (q >= expert_rows[l])
      return;
    for (std::int64_t d = 0; d < at.D; ++d) {
      const std::int64_t first = source_offsets[l * at.D + d];
      if (q >= first && q < first + source_rows[l * at.D + d]) {
        index[i] = at.payload_row(d, l, q - first);
        return;
      }
    }
  }
};

// Per row of a message buffer (the combine's send): the expert output row it returns, or -1.
struct decode_return_index_step {
  decode_layout at;
  const std::int64_t *source_rows, *source_offsets;
  std::int64_t* index;

  WEAVE_HOST_DEVICE void operator()(std::int64_t i) const {
    const std::int64_t d = i / at.block_rows, r = i % at.block_rows - at.header_rows;
    index[i] = -1;
    if (r < 0)
      return;
    const std::int64_t l = r / at.M, q = r % at.M;
    if (q < source_rows[l * at.D + d])
      index[i] = l * at.D * at.M + source_offsets[l * at.D + d] + q;
  }
};

// Per (token, choice): the returned row it sums, or -1 (not routed, or the call failed).
struct decode_pair_row_step {
  decode_layout at;
  const std::int32_t* pair_slot;
  const std::int64_t* pair_pos;
  const std::uint32_t* call_failed;
  std::int64_t* index;

  WEAVE_HOST_DEVICE void operator()(std::int64_t p) const {
    const std::int32_t s = pair_slot[p];
    index[p] =
        s < 0 || *call_failed != 0 ? -1 : at.payload_row(s / at.spd, s % at.spd, pair_pos[p]);
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
