//! \file
//! The per-call state of `basic_moe_exchange` (one per in-flight slot): each chunk's plans and
//! the pointers into the workspace (or the blocks sized at call time) its buffers are carved
//! at, the batch's capacity filter, statistics counters and backward scratch. Internal.
#pragma once

#include "weave/comm/device_call_tags.hpp"
#include "weave/comm/device_status_exchange.hpp"
#include "weave/core/config.hpp"
#include "weave/exec/host_mirror.hpp"
#include "weave/exec/stream_allocator.hpp"
#include "weave/overlap/moe_options.hpp"
#include "weave/placement/placement.hpp"
#include "weave/routing/capacity.hpp"
#include "weave/routing/device_capacity.hpp"
#include "weave/routing/device_dispatch_plan.hpp"
#include "weave/routing/device_expert_plan.hpp"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

WEAVE_NAMESPACE_BEGIN
namespace detail {

// A flag a stream's task sets and the issuing thread reads (movable, for the chunk vector).
struct ready_flag {
  std::atomic<bool> value{false};
  ready_flag() = default;
  ready_flag(ready_flag&& o) noexcept
      : value(o.value.load(std::memory_order_relaxed)) {}
  bool get() const noexcept { return value.load(std::memory_order_acquire); }
  void set(bool v) noexcept { value.store(v, std::memory_order_release); }
};

// One chunk of one call: plans, and where its buffers live.
template <class Space>
struct exchange_chunk {
  exchange_chunk(const placement& where, int k, int rank, std::size_t tokens, std::size_t recv_rows,
                 std::size_t epd_rows)
      : plan(where, k, rank, tokens)
      , experts(where.slots_per_device(), k, where.num_devices(), recv_rows, epd_rows)
      , rows_cap(recv_rows)
      , epd_cap(experts.max_epd_rows())
      , send_counts_h(static_cast<std::size_t>(where.num_devices()))
      , send_displs_h(static_cast<std::size_t>(where.num_devices()))
      , recv_counts_h(static_cast<std::size_t>(where.num_devices()))
      , recv_displs_h(static_cast<std::size_t>(where.num_devices()))
      , recv_pairs_h(static_cast<std::size_t>(where.num_devices())) {}

  device_dispatch_plan<Space> plan;  // sender half (ORI <-> SFD)
  device_expert_plan<Space> experts; // receiver half (SFD <-> EPD)
  std::size_t first = 0, count = 0;  // token range of the chunk
  // Receive-side rows and EPD rows the buffers hold; where they are sized at call time, also
  // what the current call received (counts read on the host) and the block that holds them.
  std::size_t rows_cap = 0, epd_cap = 0, rows = 0, epd = 0;
  stream_block<Space> receive; // the buffers sized at call time (or the expert rows, host)
  // Host streams: the forward's / backward's expert rows of the current call are ready (set by
  // the task that opened the chunk): what `experts()` read then is valid.
  ready_flag ready[2];
  std::byte *plan_ws = nullptr, *experts_ws = nullptr, *experts_rows_ws = nullptr;
  std::int64_t *send_pairs = nullptr, *recv_pairs = nullptr; // pairs per peer (sized at call)
  std::byte *send = nullptr, *recv = nullptr, *back = nullptr, *returned = nullptr;
  std::byte *epd_in = nullptr, *epd_out = nullptr;
  route_entry *send_routes = nullptr, *recv_routes = nullptr; // send: static shapes only
  std::int64_t *slot_row_token = nullptr, *layout_rows = nullptr, *slot_counts = nullptr;
  std::int64_t *recv_counts = nullptr, *recv_displs = nullptr, *recv_total = nullptr;
  std::int64_t* expert_rows = nullptr;              // (token, choice) -> EPD row here, or a mark
  float *send_dw = nullptr, *returned_dw = nullptr; // backward: gate gradients per entry
  // FP8 dispatch: packed wire rows (codes, then scales), the expert layout's codes and scales,
  // and the first chunk token found non-finite (-1 none) since the last check.
  std::byte *send_fp8 = nullptr, *recv_fp8 = nullptr, *epd_codes = nullptr;
  float* epd_scales = nullptr;
  std::int64_t* quant_status = nullptr;
  // Dynamic shapes: the counts the all-to-alls read on the host (pinned on CUDA: copied there
  // without blocking the host, which waits for them through the communicator).
  host_mirror<Space, std::int64_t> send_counts_h, send_displs_h, recv_counts_h, recv_displs_h,
      recv_pairs_h;
  // Where host code runs at enqueue time: recorded after the counts' copies to the host.
  typename Space::stream_type::event_type counts_ready{};
  std::uint32_t* error = nullptr;    // the exchange's own flags (a static slot overflowing)
  device_status_block<Space> status; // its count exchange with every rank's status
  device_tag_block<Space> tags;      // untagged communicators: its combine's call check
};

// Everything one call needs, reused by the calls of its slot.
template <class Space>
struct exchange_call_state {
  std::vector<exchange_chunk<Space>> chunks;
  std::optional<device_capacity_filter<Space>> filter; // none when dropless
  std::byte* filter_ws = nullptr;
  std::uint8_t* keep = nullptr;
  std::int64_t* counters = nullptr; // moe_stats of the forward (device_exchange_counter)
  std::byte *grad_dy = nullptr, *grad_scaled = nullptr;
  float* grad_dot = nullptr;
  std::size_t grads_cap = 0; // EPD rows the backward's buffers hold
  stream_block<Space> grads; // where they are sized at call time
  // A call rejected on the host: its record, sent by the call's count exchanges (`rejected`).
  std::int64_t* reported = nullptr;
  host_mirror<Space, std::int64_t> reported_h{failure_words};
  bool rejected = false;

  void construct(const placement& where, const moe_options& o, int rank, std::size_t chunk_tokens,
                 std::size_t recv_rows, std::size_t epd_rows) {
    if (o.capacity.factor != 0.0)
      filter.emplace(where.num_experts(), o.k, o.max_tokens, o.capacity);
    chunks.reserve(static_cast<std::size_t>(o.chunks));
    for (int c = 0; c < o.chunks; ++c)
      chunks.emplace_back(where, o.k, rank, chunk_tokens, recv_rows, epd_rows);
  }
};

} // namespace detail
WEAVE_NAMESPACE_END
