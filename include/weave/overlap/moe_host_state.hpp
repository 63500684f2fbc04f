//! \file
//! The per-call state of the host `moe_exchange` (one per in-flight slot): each chunk's plans,
//! counts and row buffers, the batch's capacity decision and statistics. Internal.
#pragma once

#include "weave/comm/status_exchange.hpp"
#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/overlap/moe_options.hpp"
#include "weave/overlap/row_buffer.hpp"
#include "weave/placement/placement.hpp"
#include "weave/routing/capacity.hpp"
#include "weave/routing/dispatch_plan.hpp"
#include "weave/routing/expert_plan.hpp"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

WEAVE_NAMESPACE_BEGIN
namespace detail {

// One chunk of one call.
struct host_chunk {
  std::size_t first = 0, count = 0; // token range of the chunk
  dispatch_plan plan;               // sender half (ORI <-> SFD)
  expert_plan experts;              // receiver half (SFD <-> EPD)
  std::vector<std::int64_t> send_counts, send_displs, recv_counts, recv_displs;
  row_buffer send, recv, back, returned, epd_in, epd_out, grad_dy, grad_scaled;
  // FP8 dispatch: the forward's packed wire rows (codes, then scales) and the expert layout's
  // codes and scales (kept for the backward).
  row_buffer send_fp8, recv_fp8, epd_codes, epd_scales;
  std::vector<route_entry> send_routes, recv_routes;
  std::vector<float> send_dw, returned_dw;     // backward: gate gradients per route entry
  std::vector<float> grad_dot;                 // backward: <dy, expert output> per EPD row
  std::vector<std::int64_t> expert_rows;       // (token, choice) -> EPD row here, or a mark
  std::atomic<bool> ready[2] = {false, false}; // forward / backward expert rows are valid
  status_block status;                         // its count exchange with every rank's status

  std::size_t received() const noexcept {
    return static_cast<std::size_t>(recv_displs.back() + recv_counts.back());
  }
};

// Everything one call needs, reused by the calls of its slot.
struct host_call_state {
  std::vector<host_chunk> chunks;
  std::vector<std::uint8_t> keep; // capacity keep mask of the batch
  std::vector<float> priority;    // batch-prioritized drop order: each token's best weight
  capacity_filter filter;
  std::size_t filter_tokens = 0;
  moe_stats pending, stats;
  std::atomic<bool> stats_ready{false};

  // Sizes every communication buffer (the EPD ones grow when first needed).
  void allocate(const placement& where, const moe_options& o, int rank, std::size_t send_rows,
                std::size_t recv_rows) {
    const auto D = static_cast<std::size_t>(where.num_devices());
    const auto k = static_cast<std::size_t>(o.k);
    keep.resize(checked_mul(o.max_tokens, k, "pairs"));
    chunks = std::vector<host_chunk>(static_cast<std::size_t>(o.chunks));
    for (host_chunk& c : chunks) {
      c.plan = dispatch_plan(where, o.k, rank);
      c.experts = expert_plan(where.slots_per_device(), o.k);
      c.send_counts.assign(D, 0);
      c.send_displs.assign(D, 0);
      c.recv_counts.assign(D, 0);
      c.recv_displs.assign(D, 0);
      for (row_buffer* b : {&c.send, &c.recv, &c.back, &c.returned, &c.epd_in, &c.epd_out,
                            &c.grad_dy, &c.grad_scaled})
        *b = row_buffer(o.hidden, o.element);
      // Rows in the element type cross the dispatch unless it is quantised and has no backward.
      if (!o.fp8_dispatch || o.save_for_backward) {
        c.send.reserve(send_rows);
        c.recv.reserve(recv_rows);
      }
      if (o.fp8_dispatch) {
        const auto& f = *o.fp8_dispatch;
        c.send_fp8 = row_buffer(dispatch_row_bytes(o), dtype::u8);
        c.recv_fp8 = row_buffer(dispatch_row_bytes(o), dtype::u8);
        c.epd_codes = row_buffer(o.hidden, f.format);
        c.epd_scales = row_buffer(o.hidden / f.blocks.block, dtype::f32);
        c.send_fp8.reserve(send_rows);
        c.recv_fp8.reserve(recv_rows);
      }
      c.returned.reserve(send_rows);
      c.back.reserve(recv_rows);
      c.send_routes.resize(send_rows * k);
      c.recv_routes.resize(recv_rows * k);
      c.send_dw.resize(recv_rows * k);
      c.returned_dw.resize(send_rows * k);
    }
  }

  std::size_t bytes() const noexcept {
    std::size_t total = keep.size();
    for (const host_chunk& c : chunks)
      total += c.send.bytes() + c.recv.bytes() + c.back.bytes() + c.returned.bytes() +
               c.epd_in.bytes() + c.epd_out.bytes() + c.grad_dy.bytes() + c.grad_scaled.bytes() +
               c.send_fp8.bytes() + c.recv_fp8.bytes() + c.epd_codes.bytes() +
               c.epd_scales.bytes() +
               (c.send_routes.size() + c.recv_routes.size()) * sizeof(route_entry) +
               (c.send_dw.size() + c.returned_dw.size()) * sizeof(float);
    return total;
  }
};

// Where pair (t, j) of a chunk plan travels: its destination device, the SFD row carrying it
// and its entry in that row (the row's route entries are the token's kept choices on that
// device, in rank order); device -1 for a pair that was not routed.
struct pair_route {
  int device = -1;
  std::int64_t row = -1;
  std::size_t entry = 0;
};

inline pair_route route_of_pair(const dispatch_plan& plan, const placement& where, std::size_t t,
                                std::size_t j) {
  const auto k = static_cast<std::size_t>(plan.k());
  const auto kept = plan.kept_experts();
  if (kept[t * k + j] < 0)
    return {};
  const int spd = where.slots_per_device();
  const std::size_t token = plan.token_offset() + t;
  const int source = plan.source_device();
  const auto device_of = [&](std::size_t i) {
    return where.slot_for(kept[t * k + i], token, source) / spd;
  };
  pair_route r;
  r.device = device_of(j);
  for (std::size_t i = 0; i < j; ++i)
    r.entry += kept[t * k + i] >= 0 && device_of(i) == r.device ? 1 : 0;
  const auto offsets = plan.send_offsets();
  const auto d = static_cast<std::size_t>(r.device);
  for (std::size_t i = 0; i < k; ++i) {
    const std::int64_t row = plan.token_rows()[t * k + i];
    if (row >= offsets[d] && row < offsets[d + 1]) {
      r.row = row;
      break;
    }
  }
  return r;
}

} // namespace detail
WEAVE_NAMESPACE_END
