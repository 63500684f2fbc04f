//! \file
//! The decode exchange's steps after the dispatch's receive (`decode_steps.hpp` has those before
//! it): the expert pool's layout (rows per slot and source, the fed slots, which row each pool
//! row copies) and the combine's (each pair's returned row, a token's rows, a failed call's NaN
//! outputs). Functors over raw pointers, one index per call, run by any execution space.
#pragma once

#include "weave/core/config.hpp"
#include "weave/overlap/detail/decode_steps.hpp"

#include <cstddef>
#include <cstdint>

WEAVE_NAMESPACE_BEGIN
namespace detail {

// Per local slot l, after the dispatch's receive: its rows from each source (in source order,
// records in order) and in all (`slot_rows`, `source_rows`, `source_first`). Nothing when the
// call failed.
struct decode_slot_count_step {
  decode_received in;
  std::int64_t* slot_rows;
  std::int64_t *source_rows, *source_first;

  WEAVE_HOST_DEVICE void operator()(std::int64_t l) const {
    const decode_wire& at = in.at;
    std::int64_t q = 0;
    for (std::int64_t d = 0; d < at.D; ++d) {
      const std::int64_t n = in.records(d);
      const std::int32_t* side = in.side(d, n);
      source_first[l * at.D + d] = q;
      for (std::int64_t e = 0; e < n * at.choices; ++e)
        q += side[e] == l ? 1 : 0;
      source_rows[l * at.D + d] = q - source_first[l * at.D + d];
    }
    slot_rows[l] = q;
  }
};

// One index: the slots that received rows, ascending, and their count at busy[L].
struct decode_busy_step {
  const std::int64_t* slot_rows;
  std::int64_t L;
  std::int64_t* busy;
  WEAVE_HOST_DEVICE void operator()(std::int64_t) const {
    std::int64_t n = 0;
    for (std::int64_t l = 0; l < L; ++l)
      if (slot_rows[l] > 0)
        busy[n++] = l;
    busy[L] = n;
  }
};

// How a pool row gets its input, and where its output returns (`decode_place_step`).
struct decode_pool_maps {
  decode_wire at, back; // the dispatch's and the combine's
  std::int64_t own;
  bool partial, gathered, in_place, own_rows; // own_rows: own records' rows are in `send`
  std::size_t x_row;                          // bytes of a token row of the caller's x
  const std::byte *x, *recv, *send;
  detail::decode_call_arrays a;

  // Pool row p gets choice c of source d's record r (`weights`: its side table's; `pair`: the
  // choice's pair among d's): its input (`from_peer`: a received row; `from_own`: this rank's
  // token, or with an FP8 dispatch its row in `send`; with gathered inputs a pointer to where it
  // arrived) and its return (partial sums: entry c of the record's combine row, and the
  // choice's weight; else the pair's combine row).
  WEAVE_HOST_DEVICE void place(std::int64_t p, std::int64_t d, std::int64_t r, std::int64_t c,
                               std::int64_t pair, const float* weights) const {
    const bool mine = d == own;
    const std::int64_t row = at.payload_row(d, r);
    a.from_peer[p] = mine ? -1 : row;
    a.from_own[p] = !mine ? -1 : own_rows ? row : a.own_token[r];
    if (gathered)
      a.row_ptr[p] = mine ? x + static_cast<std::size_t>(a.from_own[p]) * x_row
                          : recv + static_cast<std::size_t>(row) * at.row;
    if (partial) {
      const std::int64_t entry = (mine ? r : back.payload_row(d, r)) * at.choices + c;
      (mine ? a.own_index : a.merge_index)[entry] = p;
      (mine ? a.own_weight : a.merge_weight)[entry] = weights[r * at.choices + c];
    } else if (mine) {
      a.own_index[pair] = p;
    } else {
      a.return_index[back.payload_row(d, pair)] = p;
    }
  }
  // With `in_place`: slot l, fed `rows` rows from pool row `first`, reads a peer's one row where
  // it arrived (`block`), not copied.
  WEAVE_HOST_DEVICE void read_in_place(std::int64_t l, std::int64_t first,
                                       std::int64_t rows) const {
    const bool one = rows == 1 && a.from_peer[first] >= 0;
    a.block[l] = one ? recv + static_cast<std::size_t>(a.from_peer[first]) * at.row : nullptr;
    if (one)
      a.from_peer[first] = -1;
  }
};

// Per local slot l, after the counts: each of l's rows, source by source and record by record,
// gets its pool row (first[l] + q) and is placed there (`decode_pool_maps::place`).
struct decode_place_step {
  decode_received in;
  decode_pool_maps m;

  WEAVE_HOST_DEVICE void operator()(std::int64_t l) const {
    const decode_wire& at = in.at;
    const std::int64_t first = m.a.first[l];
    std::int64_t q = 0;
    for (std::int64_t d = 0; d < at.D; ++d) {
      const std::int64_t n = in.records(d);
      const std::int32_t* side = in.side(d, n);
      const float* weights =
          m.partial ? reinterpret_cast<const float*>(side + n * at.choices) : nullptr;
      std::int64_t pair = 0; // the record's first pair among d's (per-pair combine rows)
      for (std::int64_t r = 0; r < n; ++r) {
        std::int64_t c = 0;
        for (; c < at.choices && side[r * at.choices + c] >= 0; ++c)
          if (side[r * at.choices + c] == l)
            m.place(first + q++, d, r, c, pair + c, weights);
        pair += c;
      }
    }
    if (m.in_place)
      m.read_in_place(l, first, q);
  }
};

// Per (token, choice): the returned row it sums, or -1 (not routed, or the call failed).
struct decode_pair_row_step {
  decode_wire back; // the combine's
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
  decode_wire back; // the combine's
  std::int64_t spd;
  int k, per_token; // per_token: min(ranks, k)
  const std::int32_t* pair_slot;
  const std::int64_t* pair_pos;
  const std::uint32_t* call_failed;
  std::int64_t* index;

  WEAVE_HOST_DEVICE void operator()(std::int64_t t) const {
    const std::int32_t* slot = pair_slot + t * k;
    const std::int64_t* record = pair_pos + t * k;
    const std::int64_t slots = spd;
    const bool failed = *call_failed != 0;
    const auto device = [slot, record, slots, failed](int j) -> std::int64_t {
      return failed || slot[j] < 0 || record[j] < 0 ? -1 : slot[j] / slots;
    };
    const decode_wire at = back;
    rows_by_device(
        k, per_token, device, [&](int j) { return at.payload_row(device(j), record[j]); },
        index + t * per_token);
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
