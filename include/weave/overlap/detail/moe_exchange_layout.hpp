//! \file
//! `detail::exchange_layout<Space>`: the buffers of `basic_moe_exchange` and their sizes. What a
//! chunk sends is bounded by its tokens (min(k, D) rows per token) and lives in the workspace.
//! What it receives is sized one of three ways:
//! - at call time (dynamic shapes where host code runs at enqueue time, as on CUDA): once the
//!   host has a chunk's counts (rows per peer, and the (token, expert) pairs they carry), the
//!   chunk's receive side is allocated for them through the layer's `stream_allocator`,
//!   grow-only with an eighth to spare, the old block freed in stream order;
//! - in the stream (dynamic shapes on host streams, whose host code runs in the streams' tasks):
//!   the received rows in the workspace, every peer sending every token (the all-to-all names
//!   its buffer when it is issued), and the expert (EPD) rows, the bulk, grown like the above by
//!   the task that opens the chunk, once it knows how many it builds;
//! - in advance, in the workspace: static shapes (D fixed slots per chunk; expert rows bounded
//!   by the capacity factor when there is one).
//! One carving code serves the size queries (a measuring carver) and the real carving. Internal.
#pragma once

#include "weave/comm/device_status_exchange.hpp"
#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/core/dtype.hpp"
#include "weave/core/tensor.hpp"
#include "weave/core/workspace.hpp"
#include "weave/exec/stream_allocator.hpp"
#include "weave/overlap/detail/moe_exchange_state.hpp"
#include "weave/overlap/detail/moe_exchange_steps.hpp"
#include "weave/overlap/moe_options.hpp"
#include "weave/placement/placement.hpp"
#include "weave/routing/capacity.hpp"
#include "weave/routing/quantize.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>

WEAVE_NAMESPACE_BEGIN
namespace detail {

template <class Space>
class exchange_layout {
 public:
  using stream_type = typename Space::stream_type;
  using chunk_state = exchange_chunk<Space>;
  using call_state = exchange_call_state<Space>;

  exchange_layout(const moe_options& o, const placement& where, int devices)
      : o_(o)
      , D_(static_cast<std::size_t>(devices))
      , k_(static_cast<std::size_t>(o.k))
      , L_(static_cast<std::size_t>(where.slots_per_device()))
      , experts_(where.num_experts()) {
    const auto chunks = static_cast<std::size_t>(o.chunks);
    chunk_tokens_ = (o.max_tokens + chunks - 1) / chunks;
    slot_rows_ = o.static_shape ? static_slot_rows() : 0;
    send_cap_ = o.static_shape ? checked_mul(D_, slot_rows_, "send rows")
                               : checked_mul(chunk_tokens_, std::min(k_, D_), "send rows");
    recv_cap_ = o.static_shape ? send_cap_ : checked_mul(chunk_tokens_, D_, "receive rows");
    if (o.fp8_dispatch)
      wire_ = quantized_row_layout::of(o.hidden, o.fp8_dispatch->blocks.block);
  }

  //! Whether the receive side is sized from each call's counts (see the file comment).
  static constexpr bool sized_at_call(const moe_options& o) noexcept {
    return !Space::runs_later && !o.static_shape;
  }
  bool at_call() const noexcept { return sized_at_call(o_); }
  //! Whether the expert rows are sized by the task that opens a chunk (see the file comment).
  static constexpr bool sized_in_stream(const moe_options& o) noexcept {
    return Space::runs_later && !o.static_shape;
  }
  bool in_stream() const noexcept { return sized_in_stream(o_); }

  std::size_t chunk_tokens() const noexcept { return chunk_tokens_; }
  std::size_t slot_rows() const noexcept { return slot_rows_; }
  std::size_t send_cap() const noexcept { return send_cap_; }
  //! The most rows a chunk can receive (static: D slots; dynamic: every peer's every token).
  std::size_t recv_cap() const noexcept { return recv_cap_; }
  const quantized_row_layout& wire() const noexcept { return wire_; }
  std::size_t row_bytes() const noexcept { return o_.hidden * size_of(o_.element); }
  //! The experts get their inputs in the element type (else FP8 codes and scales only).
  bool has_inputs() const noexcept {
    return !o_.fp8_dispatch || o_.fp8_dispatch->dequantized_inputs;
  }

  //! Receive-side rows and EPD rows a chunk holds when sized in advance (none at call time).
  std::size_t advance_rows() const noexcept { return at_call() ? 0 : recv_cap_; }
  std::size_t advance_epd_rows() const { return at_call() ? 0 : static_epd_rows(); }
  //! The most EPD rows a chunk can produce (every received row naming min(k, L) experts).
  std::size_t most_epd_rows() const noexcept { return recv_cap_ * std::min(k_, L_); }

  //! The workspace of one call (slot): what it sends, its plans, counts, status and tags, and its
  //! receive side unless sized at call time. `set(ptr, count)` as `carve_into`.
  template <class Set, class Status, class Tags>
  void carve_call(call_state& st, Set&& set, const Status& status, const Tags& tags) const {
    const bool fixed = o_.static_shape, grads = o_.save_for_backward;
    const bool fp8 = o_.fp8_dispatch.has_value();
    set(st.counters, counter_count);
    set(st.reported, failure_words);
    if (st.filter) {
      set(st.filter_ws, st.filter->workspace_size());
      set(st.keep, std::max<std::size_t>(o_.max_tokens * k_, 1));
    }
    for (chunk_state& ch : st.chunks) {
      set(ch.plan_ws, ch.plan.workspace_size());
      set(ch.experts_ws,
          at_call() ? ch.experts.fixed_workspace_size() : ch.experts.workspace_size());
      if (!fp8 || grads) // rows in the element type cross the dispatch
        rows(set, ch.send, send_cap_);
      rows(set, ch.returned, send_cap_);
      if (fp8) {
        set(ch.send_fp8, checked_mul(send_cap_, wire_.stride, "FP8 send bytes"));
        set(ch.quant_status, 1);
      }
      set(ch.recv_counts, D_);
      set(ch.recv_displs, D_);
      set(ch.recv_total, 1);
      set(ch.expert_rows, std::max<std::size_t>(chunk_tokens_ * k_, 1));
      set(ch.error, 1);
      status.carve(ch.status, set);
      tags.carve(ch.tags, set);
      if (at_call()) {
        set(ch.send_pairs, D_);
        set(ch.recv_pairs, D_);
      }
      if (fixed) {
        set(ch.send_routes, send_cap_ * k_);
        set(ch.slot_row_token, send_cap_);
        set(ch.layout_rows, chunk_tokens_ * k_);
        set(ch.slot_counts, D_);
      }
      if (grads)
        set(ch.returned_dw, send_cap_ * k_);
      if (in_stream())
        carve_received(ch, set, ch.rows_cap, 0);
      else if (!at_call())
        carve_receive(ch, set, ch.rows_cap, ch.epd_cap);
    }
    if (grads && !at_call() && !in_stream()) // shared by the chunks of a call (run in order)
      carve_grads(st, set, st.chunks.front().epd_cap);
  }

  //! The receive side of a chunk for `rows` received rows and `epd` EPD rows.
  template <class Set>
  void carve_receive(const chunk_state& ch, Set&& set, std::size_t rows, std::size_t epd) const {
    carve_received(ch, set, rows, epd);
    carve_expert_rows(ch, set, epd);
  }

  //! What arrives (rows, routes, FP8 wire rows), what goes back, and where sized at call time
  //! the expert plan's per-row arrays.
  template <class Set>
  void carve_received(const chunk_state& ch, Set&& set, std::size_t rows, std::size_t epd) const {
    const bool grads = o_.save_for_backward, fp8 = o_.fp8_dispatch.has_value();
    if (!fp8 || grads)
      this->rows(set, ch.recv, rows);
    this->rows(set, ch.back, rows);
    if (fp8)
      set(ch.recv_fp8, checked_mul(rows, wire_.stride, "FP8 receive bytes"));
    set(ch.recv_routes, checked_mul(rows, k_, "route entries"));
    if (grads)
      set(ch.send_dw, checked_mul(rows, k_, "gate gradients"));
    if (at_call())
      set(ch.experts_rows_ws, ch.experts.rows_workspace_size(rows, epd));
  }

  //! The expert (EPD) rows: inputs, outputs, and with an FP8 dispatch codes and scales.
  template <class Set>
  void carve_expert_rows(const chunk_state& ch, Set&& set, std::size_t epd) const {
    if (has_inputs())
      this->rows(set, ch.epd_in, epd);
    this->rows(set, ch.epd_out, epd);
    if (o_.fp8_dispatch) {
      const std::size_t blocks = o_.hidden / o_.fp8_dispatch->blocks.block;
      set(ch.epd_codes, checked_mul(epd, o_.hidden, "FP8 expert rows"));
      set(ch.epd_scales, checked_mul(epd, blocks, "FP8 expert scales"));
    }
  }

  //! The backward's buffers of a call for `epd` EPD rows (the most of its chunks).
  template <class Set>
  void carve_grads(const call_state& st, Set&& set, std::size_t epd) const {
    rows(set, st.grad_dy, epd);
    rows(set, st.grad_scaled, epd);
    set(st.grad_dot, epd);
  }

  //! Bytes of what is sized after a chunk's counts: its receive side for `rows` rows and `epd`
  //! EPD rows at call time, its expert rows in the stream.
  std::size_t receive_bytes(const chunk_state& ch, std::size_t rows, std::size_t epd) const {
    workspace_carver measure;
    if (in_stream())
      carve_expert_rows(ch, carve_into<const exchange_layout>(measure), epd);
    else
      carve_receive(ch, carve_into<const exchange_layout>(measure), rows, epd);
    return measure.used();
  }
  std::size_t grads_bytes(const call_state& st, std::size_t epd) const {
    workspace_carver measure;
    carve_grads(st, carve_into<const exchange_layout>(measure), epd);
    return measure.used();
  }

  //! What a buffer outgrown by `need` rows is reallocated for: an eighth to spare.
  static constexpr std::size_t grown(std::size_t need) noexcept { return need + need / 8; }

  //! At call time: chunk `ch`'s receive side holds at least `rows` rows and `epd` EPD rows,
  //! reallocated on `s` when outgrown (the old block freed there, in stream order).
  void reserve_receive(chunk_state& ch, std::size_t rows, std::size_t epd,
                       const stream_allocator<Space>& alloc, stream_type& s) const {
    if (rows <= ch.rows_cap && epd <= ch.epd_cap)
      return;
    const std::size_t new_rows = rows <= ch.rows_cap ? ch.rows_cap : grown(rows);
    const std::size_t new_epd = epd <= ch.epd_cap ? ch.epd_cap : grown(epd);
    ch.receive.replace(alloc, receive_bytes(ch, new_rows, new_epd), s);
    workspace_carver carver(ch.receive.data(), ch.receive.bytes());
    carve_receive(ch, carve_into<exchange_layout>(carver), new_rows, new_epd);
    ch.experts.attach_rows(ch.experts_rows_ws, ch.experts.rows_workspace_size(new_rows, new_epd),
                           new_rows, new_epd);
    ch.rows_cap = new_rows;
    ch.epd_cap = new_epd;
  }

  //! In the stream: chunk `ch`'s expert rows hold at least `epd` rows (grown on `s`).
  void reserve_expert_rows(chunk_state& ch, std::size_t epd, const stream_allocator<Space>& alloc,
                           stream_type& s) const {
    if (epd <= ch.epd_cap)
      return;
    const std::size_t fresh = grown(epd);
    ch.receive.replace(alloc, receive_bytes(ch, 0, fresh), s);
    workspace_carver carver(ch.receive.data(), ch.receive.bytes());
    carve_expert_rows(ch, carve_into<exchange_layout>(carver), fresh);
    ch.epd_cap = fresh;
  }

  //! At call time (or in the stream): the backward's buffers of call `st` hold its chunks' EPD
  //! rows (or `epd` rows).
  void reserve_grads(call_state& st, const stream_allocator<Space>& alloc, stream_type& s,
                     std::size_t epd = 0) const {
    for (const chunk_state& ch : st.chunks)
      epd = std::max(epd, ch.epd);
    if (epd <= st.grads_cap)
      return;
    epd = grown(epd);
    st.grads.replace(alloc, grads_bytes(st, epd), s);
    workspace_carver carver(st.grads.data(), st.grads.bytes());
    carve_grads(st, carve_into<exchange_layout>(carver), epd);
    st.grads_cap = epd;
  }

  // --- views of the buffers ------------------------------------------------------------------

  //! `n` rows of the layer's element type at `p` (memory of the space).
  token_view rows_view(std::byte* p, std::size_t n) const {
    return token_view(p, n, o_.hidden, o_.element, Space::memory);
  }
  //! FP8 dispatch: `n` packed wire rows at `p`, as codes and scales.
  std::pair<token_view, token_view> wire_views(std::byte* p, std::size_t n) const {
    return wire_.views(p, n, o_.fp8_dispatch->format, Space::memory);
  }
  //! FP8 dispatch: the expert layout's codes and scales.
  token_view codes_view(std::byte* p, std::size_t n) const {
    return token_view(p, n, o_.hidden, o_.fp8_dispatch->format, Space::memory);
  }
  token_view scales_view(float* p, std::size_t n) const {
    return token_view(reinterpret_cast<std::byte*>(p), n, o_.hidden / o_.fp8_dispatch->blocks.block,
                      dtype::f32, Space::memory);
  }
  //! What a chunk's experts see: inputs in the element type (unless only codes are asked for),
  //! and with an FP8 dispatch the codes and scales; `epd` rows of capacity.
  const_token_view inputs_of(const chunk_state& ch, std::size_t epd) const {
    return has_inputs() ? const_token_view(rows_view(ch.epd_in, epd)) : const_token_view{};
  }
  const_token_view codes_of(const chunk_state& ch, std::size_t epd) const {
    return o_.fp8_dispatch ? const_token_view(codes_view(ch.epd_codes, epd)) : const_token_view{};
  }
  const_token_view scales_of(const chunk_state& ch, std::size_t epd) const {
    return o_.fp8_dispatch ? const_token_view(scales_view(ch.epd_scales, epd)) : const_token_view{};
  }

 private:
  template <class Set>
  void rows(Set& set, std::byte* const& ptr, std::size_t n) const {
    set(ptr, checked_mul(n, row_bytes(), "row buffer bytes"));
  }

  // The worst case of a peer's rows per chunk: every token of the chunk, or fewer when a
  // capacity factor bounds what the experts of one device take from a batch.
  std::size_t static_slot_rows() const {
    if (o_.static_rows_per_peer != 0)
      return o_.static_rows_per_peer;
    std::size_t n = chunk_tokens_;
    if (o_.capacity.factor > 0.0)
      n = std::min(n, checked_mul(capacity(), L_, "slot rows"));
    return std::max<std::size_t>(n, 1);
  }

  // The EPD rows a chunk can produce when sized in advance: one per received row and local
  // expert, and with a capacity factor at most `capacity` pairs per expert from each sender.
  std::size_t static_epd_rows() const {
    std::size_t epd = checked_mul(recv_cap_, std::min(k_, L_), "EPD rows");
    if (o_.capacity.factor > 0.0)
      epd = std::min(epd, checked_mul(checked_mul(capacity(), L_, "EPD rows"), D_, "EPD rows"));
    return std::max<std::size_t>(epd, 1);
  }

  std::size_t capacity() const {
    return static_cast<std::size_t>(
        expert_capacity(o_.capacity, o_.max_tokens, static_cast<int>(k_), experts_));
  }

  moe_options o_;
  std::size_t D_ = 0, k_ = 0, L_ = 0;
  int experts_ = 0;
  std::size_t chunk_tokens_ = 0, slot_rows_ = 0, send_cap_ = 0, recv_cap_ = 0;
  quantized_row_layout wire_;
};

} // namespace detail
WEAVE_NAMESPACE_END
