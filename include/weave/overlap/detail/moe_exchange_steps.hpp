//! \file
//! The data-parallel steps of `basic_moe_exchange` that are not plans or row moves: the
//! fixed-slot layout of static shapes, the (token, choice) -> expert row map, the gate-gradient
//! maps of the backward, and the statistics counters. Every step is a functor run by an
//! execution space (host tasks or CUDA kernels).
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/tensor.hpp"
#include "weave/exec/space.hpp"
#include "weave/routing/device_expert_plan.hpp"
#include "weave/routing/route_entry.hpp"

#include <cstddef>
#include <cstdint>
#include <span>

WEAVE_NAMESPACE_BEGIN

//! Bits the exchange sets in its own error word.
enum device_exchange_error : std::uint32_t {
  device_exchange_slot_overflow = 1, //!< a chunk sent more rows to a peer than its static slot
  device_exchange_bad_count = 2,     //!< a peer announced a row count outside its static slot
};

//! Indices of the exchange's statistics counters.
enum device_exchange_counter : int {
  counter_routed = 0,
  counter_dropped,
  counter_sent,
  counter_received,
  counter_local,
  counter_expert_rows,
  counter_call, //!< the call whose forward ran to its last finish (0: none yet, or it failed)
  counter_count
};

namespace detail {

// Static shapes, per slot row q of the send buffer (D slots of S rows): the token it carries
// (-1 for padding) and its route entries.
struct slot_layout_step {
  const std::int64_t *counts, *offsets, *row_token;
  const route_entry* routes;
  std::int64_t S;
  int k;
  std::int64_t* slot_row_token;
  route_entry* slot_routes;

  WEAVE_HOST_DEVICE void operator()(std::int64_t q) const {
    const std::int64_t d = q / S, pos = q % S;
    if (pos >= counts[d]) {
      slot_row_token[q] = -1;
      return;
    }
    const std::int64_t r = offsets[d] + pos;
    slot_row_token[q] = row_token[r];
    for (int i = 0; i < k; ++i)
      slot_routes[q * k + i] = routes[r * k + i];
  }
};

// Static shapes, per peer d: the rows its slot carries, and the overflow flag.
struct slot_counts_step {
  const std::int64_t* counts;
  std::int64_t S;
  std::int64_t* slot_counts;
  std::uint32_t* error;

  WEAVE_HOST_DEVICE void operator()(std::int64_t d) const {
    const std::int64_t c = counts[d];
    slot_counts[d] = c < S ? c : S;
    if (c > S)
      atomic_or(error, device_exchange_slot_overflow);
  }
};

// Static shapes, per peer d, after the count exchange: the rows it announced, checked before
// any step reads or sums them (no host reads them): a count outside [0, S] is flagged and
// counts as no rows.
struct received_counts_step {
  std::int64_t* counts;
  std::int64_t S;
  std::uint32_t* error;

  WEAVE_HOST_DEVICE void operator()(std::int64_t d) const {
    const std::int64_t c = counts[d];
    if (c < 0 || c > S) {
      counts[d] = 0;
      atomic_or(error, device_exchange_bad_count);
    }
  }
};

// Where SFD row r of the plan travels in the send layout: r itself (S = 0, compact), or its
// slot row (-1 past a full slot).
WEAVE_HOST_DEVICE inline std::int64_t layout_row(const std::int64_t* offsets, int D, std::int64_t S,
                                                 std::int64_t r) {
  if (r < 0 || S == 0)
    return r;
  const int d = source_of_row(offsets, D, r);
  const std::int64_t pos = r - offsets[d];
  return pos < S ? d * S + pos : -1;
}

// Static shapes, per pair: the token's returned rows in slot coordinates (the combine map).
struct layout_token_rows_step {
  const std::int64_t *token_rows, *offsets;
  int D;
  std::int64_t S;
  std::int64_t* out;
  WEAVE_HOST_DEVICE void operator()(std::int64_t i) const {
    out[i] = layout_row(offsets, D, S, token_rows[i]);
  }
};

// Backward, per received route entry: the gate gradient of its EPD row (0 for none).
struct entry_dw_step {
  const std::int64_t* row_epd;
  const float* dot;
  float* dw;
  WEAVE_HOST_DEVICE void operator()(std::int64_t p) const {
    dw[p] = row_epd[p] >= 0 ? dot[row_epd[p]] : 0.0f;
  }
};

// Where kept pair (t, j) travels: its device's SFD row (returned in `row`, -1 if none) and
// its entry in that row (the row's entries are the token's kept choices on that device, in
// rank order).
WEAVE_HOST_DEVICE inline int pair_entry(const std::int32_t* kept, const std::int32_t* pair_device,
                                        const std::int64_t* token_rows, const std::int64_t* offsets,
                                        int k, std::int64_t t, int j, std::int64_t& row) {
  const std::int32_t d = pair_device[t * k + j];
  int entry = 0;
  for (int i = 0; i < j; ++i)
    entry += kept[t * k + i] >= 0 && pair_device[t * k + i] == d ? 1 : 0;
  row = -1;
  for (int m = 0; m < k; ++m) {
    const std::int64_t r = token_rows[t * k + m];
    if (r >= offsets[d] && r < offsets[d + 1]) {
      row = r;
      break;
    }
  }
  return entry;
}

// Per pair of the chunk: its row in this device's EPD layout, or an expert_row_mark value (-1
// no expert, -2 dropped, -3 on another device). A pair served here arrived in the rows this
// rank sent itself: received row recv_displs[rank] + its position among them.
struct pair_expert_rows_step {
  const std::int32_t *ids, *kept, *pair_device;
  const std::int64_t *token_rows, *offsets, *recv_displs, *row_epd;
  int k, rank;
  std::int64_t S; // 0: compact layout; else a slot holds S rows
  std::int64_t* out;

  WEAVE_HOST_DEVICE void operator()(std::int64_t p) const {
    if (kept[p] < 0) {
      out[p] = ids[p] < 0 ? -1 : -2;
      return;
    }
    if (pair_device[p] != rank) {
      out[p] = -3;
      return;
    }
    std::int64_t row = -1;
    const int entry =
        pair_entry(kept, pair_device, token_rows, offsets, k, p / k, static_cast<int>(p % k), row);
    const std::int64_t pos = row - offsets[rank];
    out[p] = S != 0 && pos >= S ? -2 : row_epd[(recv_displs[rank] + pos) * k + entry];
  }
};

// Backward, per token of the chunk: each kept choice's gate gradient, read from the entry its
// device returned.
struct token_dw_step {
  const std::int32_t *kept, *pair_device;
  const std::int64_t *token_rows, *offsets;
  int k, D;
  std::int64_t S; // 0: compact layout
  const float* returned_dw;
  float* dw;

  WEAVE_HOST_DEVICE void operator()(std::int64_t t) const {
    for (int j = 0; j < k; ++j) {
      const std::int64_t p = t * k + j;
      dw[p] = 0.0f;
      if (kept[p] < 0)
        continue;
      std::int64_t row = -1;
      const int entry = pair_entry(kept, pair_device, token_rows, offsets, k, t, j, row);
      const std::int64_t at = layout_row(offsets, D, S, row);
      if (at >= 0)
        dw[p] = returned_dw[at * k + entry];
    }
  }
};

// Statistics, per pair of a chunk: routed pairs.
struct routed_pairs_step {
  const std::int32_t* kept;
  std::int64_t* counters;
  WEAVE_HOST_DEVICE void operator()(std::int64_t p) const {
    if (kept[p] >= 0)
      atomic_add(counters + counter_routed, 1);
  }
};

// Per destination device j: the (token, expert) pairs this rank sends it (the sum of the loads
// of its slots), so the receiver learns its expert rows with its counts.
struct device_pairs_step {
  const std::int64_t* slot_loads;
  int spd;
  std::int64_t* pairs;
  WEAVE_HOST_DEVICE void operator()(std::int64_t j) const {
    std::int64_t total = 0;
    for (int l = 0; l < spd; ++l)
      total += slot_loads[j * spd + l];
    pairs[j] = total;
  }
};

// Statistics, once per chunk on the sender: rows sent and rows that stay on this rank.
struct sent_rows_step {
  const std::int64_t *counts, *offsets;
  int D, rank;
  std::int64_t* counters;
  WEAVE_HOST_DEVICE void operator()(std::int64_t) const {
    atomic_add(counters + counter_sent, offsets[D]);
    atomic_add(counters + counter_local, counts[rank]);
  }
};

// Once per chunk on the receiver: rows received (also the merge's count in a compact layout)
// and rows the local experts compute.
struct received_rows_step {
  const std::int64_t* counts;
  int D;
  const std::int64_t* epd_rows;
  std::int64_t* received; // this chunk's total
  std::int64_t* counters;
  WEAVE_HOST_DEVICE void operator()(std::int64_t) const {
    std::int64_t total = 0;
    for (int d = 0; d < D; ++d)
      total += counts[d];
    *received = total;
    atomic_add(counters + counter_received, total);
    atomic_add(counters + counter_expert_rows, *epd_rows);
  }
};

// Once per call, in the forward's last finish: the statistics are the call's, complete (a failed
// call's streams never get here).
struct stats_done_step {
  std::int64_t* counters;
  std::int64_t call;
  WEAVE_HOST_DEVICE void operator()(std::int64_t) const { counters[counter_call] = call; }
};

} // namespace detail

WEAVE_NAMESPACE_END
