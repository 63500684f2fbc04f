//! \file
//! The steps of `device_dispatch_plan` (`device_dispatch_plan.hpp`), as functors of one index
//! that every execution space runs (`Space::for_each`): the pairs step (a token's pairs resolved
//! to replicas, devices and sort keys), the rows steps (a row's route entries: one thread per
//! route slot on a GPU, one pass per row on serial spaces), the count sums over the stripes, and
//! the replica table the pairs step reads (`placement::slot_for`'s choice). Internal.
#pragma once

#include "weave/core/config.hpp"
#include "weave/exec/space.hpp"
#include "weave/placement/placement.hpp"
#include "weave/routing/route_entry.hpp"

#include <cstddef>
#include <cstdint>
#include <vector>

WEAVE_NAMESPACE_BEGIN

namespace detail {

// The replica of expert e a token of global index `token` goes to, as `placement::slot_for`
// chooses it from the table `replica_table` builds.
WEAVE_HOST_DEVICE inline std::int32_t replica_slot(const std::int32_t* fixed_slot,
                                                   const std::int32_t* replica_offsets,
                                                   const std::int32_t* replicas, std::int32_t e,
                                                   std::int64_t token) {
  std::int32_t slot = fixed_slot[e];
  if (slot < 0) {
    const std::int32_t first = replica_offsets[e], n = replica_offsets[e + 1] - first;
    slot = replicas[first + static_cast<std::int32_t>(token % n)];
  }
  return slot;
}

// The replica table of `source_device`, as one array for upload: the slot on the source device
// or the only one, else -1 (E entries); replica offsets (E + 1); the replicas of every expert.
inline std::vector<std::int32_t> replica_table(const placement& where, int source_device) {
  const int E = where.num_experts();
  std::vector<std::int32_t> table(static_cast<std::size_t>(2 * E + 1), 0);
  for (int e = 0; e < E; ++e) {
    const auto replicas = where.slots_of(e);
    std::int32_t fixed = replicas.size() == 1 ? replicas[0] : -1;
    for (const std::int32_t r : replicas)
      if (fixed < 0 && where.device_of_slot(r) == source_device)
        fixed = r;
    table[static_cast<std::size_t>(e)] = fixed;
    table[static_cast<std::size_t>(E + e + 1)] =
        table[static_cast<std::size_t>(E + e)] + static_cast<std::int32_t>(replicas.size());
    table.insert(table.end(), replicas.begin(), replicas.end());
  }
  return table;
}

// Choices per token up to which the plan steps keep a token's data in thread-local arrays.
inline constexpr int plan_local_choices = 16;

// Copies of the plan's counters that the pairs step adds into, token t into copy t % 32: on a
// GPU all of a step's atomics on D (or slots) counters contended on a few L2 lines, which made
// the step take 220 us for 64k tokens, k = 8, D = 64 on an H200.
inline constexpr int plan_count_stripes = 32;

// Per token: resolves its pairs to (device, local slot), keeps its distinct devices ascending
// and emits one sort key per (token, device) row.
struct plan_pairs_step {
  const std::int32_t* ids;
  const float* weights;
  const std::uint8_t* keep; // null: keep every pair
  int k, E, D, spd;
  std::int64_t token_offset; // global index of token 0 (replicas are chosen by it)
  // Replica table: the slot on the source device (or the only one), else -1 and the expert's
  // replicas at replicas[replica_offsets[e] ..), taken in turn by global token index.
  const std::int32_t *fixed_slot, *replica_offsets, *replicas;
  std::int32_t *pair_device, *pair_local, *kept, *token_devices;
  std::uint32_t* keys;
  std::int32_t* values;
  std::uint32_t* stripes; // plan_count_stripes copies of [D device counts, slots loads]
  int slots;
  std::uint32_t* error;

  WEAVE_HOST_DEVICE void operator()(std::int64_t t) const {
    // A token's ids and devices live in thread-local arrays (registers or L1 on a GPU) when k
    // fits, so the duplicate checks and the insertion below read no global memory. On the H200
    // this alone changed nothing measurable (the step was bound by its contended atomics, now
    // striped); it is kept because it removes a dependent chain of global loads per token.
    if (k <= plan_local_choices) {
      std::int32_t id[plan_local_choices], devs[plan_local_choices];
      for (int i = 0; i < k; ++i)
        id[i] = ids[t * k + i];
      resolve(t, id, 0, devs);
    } else {
      resolve(t, ids, t * k, token_devices + t * k);
    }
  }

  // Token t's pairs, its ids at token_ids[first ..), its distinct devices built in `devs`.
  WEAVE_HOST_DEVICE void resolve(std::int64_t t, const std::int32_t* token_ids, std::int64_t first,
                                 std::int32_t* devs) const {
    const std::int64_t base = t * k;
    std::uint32_t* stripe = stripes + (t % plan_count_stripes) * (D + slots);
    std::uint32_t flags = 0;
    int ndev = 0;
    for (int i = 0; i < k; ++i) {
      const std::int64_t p = base + i;
      std::int32_t device = -1, local = -1, expert = -1;
      if (routed_choice(token_ids, weights + base - first, first, i, E, flags) &&
          (keep == nullptr || keep[p] != 0)) {
        expert = token_ids[first + i];
        const std::int32_t slot =
            replica_slot(fixed_slot, replica_offsets, replicas, expert, token_offset + t);
        device = slot / spd;
        local = slot - device * spd;
        atomic_add(stripe + D + slot, 1u);
        bool seen = false;
        for (int j = 0; j < ndev; ++j)
          seen = seen || devs[j] == device;
        if (!seen) {
          int at = ndev;
          while (at > 0 && devs[at - 1] > device) { // insertion keeps the devices ascending
            devs[at] = devs[at - 1];
            --at;
          }
          devs[at] = device;
          ++ndev;
        }
      }
      pair_device[p] = device;
      pair_local[p] = local;
      kept[p] = expert;
    }
    for (int j = 0; j < k; ++j) {
      const std::int64_t q = base + j;
      const std::int32_t d = j < ndev ? devs[j] : -1;
      token_devices[q] = d;
      if (d >= 0) {
        keys[q] = static_cast<std::uint32_t>(d);
        atomic_add(stripe + d, 1u);
      } else {
        keys[q] = static_cast<std::uint32_t>(D); // sorts after every real row
      }
      values[q] = static_cast<std::int32_t>(q);
    }
    if (flags != 0)
      atomic_or(error, flags);
  }
};

// Per route slot q = r * k + i of SFD row r < rows (sorted position r is SFD row r: a device's
// rows start at its offset, the stable sort keeps token-major order within a device): slot i
// holds the i-th of the token's pairs that go to the row's device, or {-1, 0}. One thread per
// slot rather than per row: a row's k threads read the same few bytes (one request per row, not
// per thread, on a GPU) and a warp writes consecutive slots; per row, the step was bound by
// memory requests (k strided loads and stores per thread).
struct plan_rows_step {
  const std::uint32_t* keys;
  const std::int32_t* values;
  int k;
  const std::int32_t *pair_device, *pair_local;
  const float* weights;
  std::int64_t *row_token, *token_rows;
  route_entry* routes;

  WEAVE_HOST_DEVICE void operator()(std::int64_t q) const {
    const std::int64_t r = q / k;
    const auto i = static_cast<int>(q - r * k);
    const std::int64_t v = values[r];
    const std::int64_t t = v / k;
    const auto d = static_cast<std::int32_t>(keys[r]);
    if (i == 0) {
      row_token[r] = t;
      token_rows[v] = r; // v = t * k + (position of d among the token's devices)
    }
    route_entry entry{-1, 0.0f};
    for (int j = 0, seen = 0; j < k; ++j) {
      const std::int64_t p = t * k + j;
      if (pair_device[p] != d)
        continue;
      if (seen++ == i) {
        entry = route_entry{pair_local[p], weights[p]};
        break;
      }
    }
    routes[q] = entry;
  }
};

// The same per SFD row r < rows, for serial spaces: one pass over the token's pairs fills the
// row's k slots in order (k reads per row, where a thread per slot rescans them: k^2).
struct plan_row_step {
  const std::uint32_t* keys;
  const std::int32_t* values;
  int k;
  const std::int32_t *pair_device, *pair_local;
  const float* weights;
  std::int64_t *row_token, *token_rows;
  route_entry* routes;

  WEAVE_HOST_DEVICE void operator()(std::int64_t r) const {
    const std::int64_t v = values[r];
    const std::int64_t t = v / k;
    const auto d = static_cast<std::int32_t>(keys[r]);
    row_token[r] = t;
    token_rows[v] = r;
    route_entry* out = routes + r * k;
    int e = 0;
    for (int j = 0; j < k; ++j) {
      const std::int64_t p = t * k + j;
      if (pair_device[p] == d)
        out[e++] = route_entry{pair_local[p], weights[p]};
    }
    for (; e < k; ++e)
      out[e] = route_entry{};
  }
};

// Route slots of the rows (rows * k), for the step above: rows = offsets[D].
struct plan_route_slots_step {
  const std::int64_t* rows;
  int k;
  std::int64_t* slots;
  WEAVE_HOST_DEVICE void operator()(std::int64_t) const { *slots = *rows * k; }
};

// Counts per device and pairs per slot, summed over the stripes the pairs step adds into.
struct plan_sum_stripes_step {
  const std::uint32_t* stripes; // plan_count_stripes copies of [D device counts, slots loads]
  int D, slots;
  std::int64_t *counts, *slot_loads;
  WEAVE_HOST_DEVICE void operator()(std::int64_t i) const {
    const std::int64_t width = D + slots;
    std::int64_t sum = 0;
    for (int s = 0; s < plan_count_stripes; ++s)
      sum += stripes[s * width + i];
    if (i < D)
      counts[i] = sum;
    else
      slot_loads[i - D] = sum;
  }
};

// Bits of a sort key that holds values 0..max.
inline int key_bits(std::int64_t max) {
  int bits = 1;
  while ((std::int64_t{1} << bits) <= max)
    ++bits;
  return bits;
}

} // namespace detail

WEAVE_NAMESPACE_END
