//! \file
//! The decode exchange's steps in the form serial spaces run (`serial_space`: `host_space`): a
//! phase's per-destination or per-slot steps of `decode_steps.hpp` as one pass over what the call
//! routed or received, with the same results (CI checks both forms against each other and a
//! naive reference). At decode sizes most slots and devices see nothing: these passes follow
//! the records, not the slots or devices. Internal.
#pragma once

#include "weave/core/config.hpp"
#include "weave/overlap/detail/decode_pool_steps.hpp"

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>

WEAVE_NAMESPACE_BEGIN
namespace detail {

// `decode_position_step` for every destination in one pass over the tokens: each record's side
// entries are written at the end of its message's room while the records are counted, then moved
// after the message's rows.
inline void decode_position_serial(const decode_position_step& st, std::int64_t* last_token,
                                   std::int64_t* next_choice) {
  const decode_wire& at = st.at;
  for (std::int64_t d = 0; d < at.D; ++d) {
    st.records[d] = 0;
    st.pairs_to[d] = 0;
    last_token[d] = -1;
  }
  for (std::int64_t t = 0; t < st.tokens; ++t)
    for (int j = 0; j < st.k; ++j) {
      const std::int64_t p = t * st.k + j;
      const std::int32_t s = st.pair_slot[p];
      if (s < 0)
        continue;
      const std::int64_t d = s / st.spd;
      std::int32_t* side = at.side_table(st.send, d, at.M);
      if (last_token[d] != t) { // the token's record on d
        last_token[d] = t;
        const std::int64_t r = st.records[d]++;
        for (std::int64_t c = 0; c < at.choices; ++c)
          side[r * at.choices + c] = -1;
        next_choice[d] = 0;
      }
      st.add(d, st.records[d] - 1, next_choice[d]++, t, p, st.pairs_to[d]++, side,
             st.weights != nullptr ? at.side_weights(st.send, d, at.M) : nullptr);
    }
  for (std::int64_t d = 0; d < at.D; ++d) { // the side tables after the rows
    const std::int64_t n = st.records[d];
    const std::size_t entries = static_cast<std::size_t>(n * at.choices) * sizeof(std::int32_t);
    if (n == at.M || entries == 0)
      continue;
    std::memmove(at.side_table(st.send, d, n), at.side_table(st.send, d, at.M), entries);
    if (st.weights != nullptr)
      std::memmove(at.side_weights(st.send, d, n), at.side_weights(st.send, d, at.M), entries);
  }
}

// `decode_slot_count_step`, `decode_busy_step`, the scan of the slot rows and `decode_place_step`
// in two passes over the received records: counts (the slots the last call fed are cleared first;
// `fed` holds a bit per slot), then the fed slots' first rows in slot order, then each row's
// place. `cursor` is scratch of a count per slot.
inline void decode_slots_serial(const decode_received& in, const decode_pool_maps& m,
                                std::int64_t L, std::uint64_t* fed, std::int64_t* cursor) {
  const decode_wire& at = in.at;
  const decode_call_arrays& a = m.a;
  for (std::int64_t i = 0; i < a.busy[L]; ++i) { // the last call's fed slots
    const std::int64_t l = a.busy[i];
    a.slot_rows[l] = 0;
    a.block[l] = nullptr;
    for (std::int64_t d = 0; d < at.D; ++d)
      a.source_rows[l * at.D + d] = a.source_first[l * at.D + d] = 0;
  }
  const std::int64_t words = (L + 63) / 64;
  for (std::int64_t w = 0; w < words; ++w)
    fed[w] = 0;
  for (std::int64_t d = 0; d < at.D; ++d) {
    const std::int64_t n = in.records(d);
    const std::int32_t* side = in.side(d, n);
    for (std::int64_t e = 0; e < n * at.choices; ++e) {
      const std::int32_t l = side[e];
      if (l < 0)
        continue;
      if (a.slot_rows[l]++ == 0)
        fed[l / 64] |= std::uint64_t{1} << (l % 64);
      ++a.source_rows[l * at.D + d];
    }
  }
  std::int64_t busy = 0, first = 0, last = 0;
  for (std::int64_t w = 0; w < words; ++w)
    for (std::uint64_t word = fed[w]; word != 0; word &= word - 1) {
      const std::int64_t l = w * 64 + std::countr_zero(word);
      for (std::int64_t e = last; e < l; ++e) // slots without rows start where the next one does
        a.first[e] = first;
      a.busy[busy++] = l;
      a.first[l] = first;
      cursor[l] = first;
      std::int64_t q = 0;
      for (std::int64_t d = 0; d < at.D; ++d) {
        a.source_first[l * at.D + d] = q;
        q += a.source_rows[l * at.D + d];
      }
      first += a.slot_rows[l];
      last = l + 1;
    }
  for (std::int64_t e = last; e <= L; ++e)
    a.first[e] = first;
  a.busy[L] = busy;
  // Each row's place, as `decode_place_step` gives it slot by slot.
  for (std::int64_t d = 0; d < at.D; ++d) {
    const std::int64_t n = in.records(d);
    const std::int32_t* side = in.side(d, n);
    const float* weights =
        m.partial ? reinterpret_cast<const float*>(side + n * at.choices) : nullptr;
    const bool own = d == m.own;
    std::int64_t pair = 0;
    for (std::int64_t r = 0; r < n; ++r) {
      std::int64_t c = 0;
      for (; c < at.choices && side[r * at.choices + c] >= 0; ++c)
        m.place(cursor[side[r * at.choices + c]]++, d, r, c, pair + c, weights);
      if (m.partial) // the record's other entries: none (only the rows with records are read)
        for (std::int64_t rest = c; rest < at.choices; ++rest)
          (own ? a.own_index
               : a.merge_index)[(own ? r : m.back.payload_row(d, r)) * at.choices + rest] = -1;
      pair += c;
    }
  }
  if (m.in_place)
    for (std::int64_t i = 0; i < busy; ++i)
      m.read_in_place(a.busy[i], a.first[a.busy[i]], a.slot_rows[a.busy[i]]);
}

} // namespace detail
WEAVE_NAMESPACE_END
