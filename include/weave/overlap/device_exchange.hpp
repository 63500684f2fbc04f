//! \file
//! `basic_device_exchange<Space, Comm>`: an MoE layer's communication around the caller's
//! experts, with every plan built where the data lives (`cuda_moe_exchange` is this class in
//! `cuda_space` over NCCL; in `host_space` it runs on host streams, which is how CI checks it).
//!
//! The stages and guarantees are `moe_exchange`'s (Occult's exact mode, one row per (token,
//! device) both ways, pipelined over `chunks` by `chunk_pipeline`, results bitwise identical
//! for every chunk count, capacity decided once per batch so drops equal the unchunked
//! batch's), with two shapes:
//! - dynamic (default): rows are packed; the exchanged counts are copied to the host once per
//!   chunk (on CUDA, the comm stream synchronizes there), which the all-to-all needs.
//! - static (`moe_options::static_shape`): every peer gets a slot of `slot_rows()` rows per
//!   chunk, counts stay in memory of the space and ride beside the rows. No call waits for the
//!   GPU, and a call can be captured in a CUDA graph; the price is sending whole slots.
//! Replicas are chosen as `moe_exchange` chooses them (`placement::slot_for`). Construct,
//! allocate `workspace_size()` bytes of memory of the space (256-byte aligned), `initialize`
//! once; calls then allocate nothing. Bad ids, weights and slot overflows are flagged in
//! memory of the space and reported by `check_errors`.
#pragma once

#include "weave/comm/communicator.hpp"
#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/tensor.hpp"
#include "weave/core/workspace.hpp"
#include "weave/exec/space.hpp"
#include "weave/overlap/device_exchange_steps.hpp"
#include "weave/overlap/moe_options.hpp"
#include "weave/overlap/pipeline.hpp"
#include "weave/placement/placement.hpp"
#include "weave/routing/device_capacity.hpp"
#include "weave/routing/device_dispatch_plan.hpp"
#include "weave/routing/device_expert_plan.hpp"
#include "weave/routing/row_moves.hpp"

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

WEAVE_NAMESPACE_BEGIN

template <execution_space Space, communicator Comm>
requires std::same_as<typename Comm::stream_type, typename Space::stream_type> &&
    has_exchange_counts<Comm> && has_all_to_all_v<Comm>
class basic_device_exchange {
 public:
  using space = Space;
  using stream_type = typename Space::stream_type;
  using stream_arg = typename Space::stream_arg;
  using experts_fn = std::function<void(const device_expert_batch<Space>&)>;
  using experts_grad_fn = std::function<void(const device_expert_grad_batch<Space>&)>;

  //! An exchange for rank `comm.rank()` of `comm.size()` devices placed by `where`. Throws
  //! `errc::invalid_argument` for bad options or a placement of another size. With
  //! `cuda_space` it needs a current device (it sizes CUB's scratch).
  basic_device_exchange(Comm& comm, placement where, moe_options options)
      : comm_(&comm)
      , placement_(std::move(where))
      , options_(options)
      , pipeline_(options.chunks) {
    detail::check_moe_options(options_);
    WEAVE_EXPECT(placement_.num_devices() == comm.size(), errc::invalid_argument, "placement of ",
                 placement_.num_devices(), " devices for a world of ", comm.size());
    WEAVE_EXPECT(options_.k <= placement_.num_experts(), errc::invalid_argument, "k = ", options_.k,
                 " exceeds the ", placement_.num_experts(), " experts");
    rank_ = comm.rank();
    D_ = comm.size();
    k_ = options_.k;
    const int spd = placement_.slots_per_device();
    for (int l = 0; l < spd; ++l)
      local_experts_.push_back(placement_.expert_of_slot(rank_ * spd + l));
    const auto D = static_cast<std::size_t>(D_), k = static_cast<std::size_t>(k_);
    const auto chunks = static_cast<std::size_t>(options_.chunks);
    chunk_tokens_ = (options_.max_tokens + chunks - 1) / chunks;
    if (options_.capacity.factor != 0.0)
      filter_.emplace(placement_.num_experts(), k_, options_.max_tokens, options_.capacity);
    slot_rows_ = options_.static_shape ? static_slot_rows() : 0;
    send_cap_ = options_.static_shape ? checked_mul(D, slot_rows_, "send rows")
                                      : checked_mul(chunk_tokens_, std::min(k, D), "send rows");
    recv_cap_ = options_.static_shape ? send_cap_ : checked_mul(chunk_tokens_, D, "receive rows");
    uniform_counts_.assign(D, static_cast<std::int64_t>(slot_rows_));
    uniform_displs_.resize(D);
    for (std::size_t d = 0; d < D; ++d)
      uniform_displs_[d] = static_cast<std::int64_t>(d * slot_rows_);
    chunks_.reserve(chunks);
    for (std::size_t c = 0; c < chunks; ++c)
      chunks_.emplace_back(placement_, k_, rank_, chunk_tokens_, spd, D_, recv_cap_);
  }

  basic_device_exchange(const basic_device_exchange&) = delete;
  basic_device_exchange& operator=(const basic_device_exchange&) = delete;

  const moe_options& options() const noexcept { return options_; }
  const placement& where() const noexcept { return placement_; }
  const chunk_pipeline<stream_type>& pipeline() const noexcept { return pipeline_; }
  bool static_shape() const noexcept { return options_.static_shape; }
  //! Rows of each peer's slot per chunk (static shapes; 0 otherwise).
  std::size_t slot_rows() const noexcept { return slot_rows_; }
  //! Rows a chunk's send buffer holds (static: peers * slot rows).
  std::size_t send_rows_capacity() const noexcept { return send_cap_; }

  //! Bytes of memory of the space `initialize` needs.
  std::size_t workspace_size() const {
    workspace_carver measure;
    return carve(*this, measure).used();
  }

  //! Carves every buffer out of `workspace` and initialises the plans on `stream`.
  void initialize(void* workspace, std::size_t bytes, stream_arg stream) {
    WEAVE_EXPECT(workspace != nullptr, errc::invalid_argument, "null workspace");
    workspace_carver carver(workspace, bytes);
    carve(*this, carver);
    for (chunk_state& ch : chunks_) {
      ch.plan.initialize(ch.plan_ws, ch.plan.workspace_size(), stream);
      ch.experts.initialize(ch.experts_ws, ch.experts.workspace_size(), stream);
    }
    if (filter_)
      filter_->initialize(filter_ws_, filter_->workspace_size(), stream);
    Space::fill(stream, error_, 0, sizeof(std::uint32_t));
    Space::fill(stream, counters_, 0, counter_count * sizeof(std::int64_t));
    Space::copy_from_host(stream, static_displs_, uniform_displs_.data(),
                          uniform_displs_.size() * sizeof(std::int64_t));
    stream.synchronize(); // the uploads read host vectors of this object
    initialized_ = true;
  }

  //! Enqueues the forward of `x` routed by `ids` / `weights` (k per token, -1 = none) into `y`,
  //! all in memory of the space. Throws `errc::size_mismatch` / `errc::invalid_argument` for
  //! shapes or memory that disagree with the options; bad values are flagged (`check_errors`).
  //! `hooks` (optional, borrowed) partitions the operators around the layer into the same
  //! chunks (see `moe_chunk_hooks`).
  void forward(const_token_view x, std::span<const std::int32_t> ids,
               std::span<const float> weights, token_view y, experts_fn experts, stream_arg compute,
               stream_arg comm, const device_chunk_hooks<Space>* hooks = nullptr) {
    check_call(x, y, ids.size(), weights.size());
    detail::check_hooks(hooks, options_);
    begin_call(0);
    calls_[0] = {x, y, ids, weights, {}, std::move(experts), {}, x.rows(), hooks};
    direction_ = false;
    pipeline_.run(compute, comm, *this);
    end_call(0, compute);
  }

  //! Enqueues the backward of the last forward (needs `save_for_backward`): from `dy` it writes
  //! `dx` and the gate gradients `dw` (k per token; 0 for dropped or absent choices).
  void backward(const_token_view dy, token_view dx, std::span<float> dw,
                experts_grad_fn experts_grad, stream_arg compute, stream_arg comm) {
    WEAVE_EXPECT(options_.save_for_backward, errc::invalid_state,
                 "backward needs moe_options.save_for_backward");
    const std::size_t T = calls_[0].tokens;
    check_call(dy, dx, T * static_cast<std::size_t>(k_), dw.size());
    WEAVE_EXPECT(dy.rows() == T, errc::size_mismatch, "backward: ", dy.rows(),
                 " rows for a forward of ", T, " tokens");
    begin_call(1);
    calls_[1] = {dy, dx, calls_[0].ids, calls_[0].weights, dw, {}, std::move(experts_grad), T};
    direction_ = true;
    pipeline_.run(compute, comm, *this);
    end_call(1, compute);
  }

  //! What the last forward moved; waits for `stream` (enqueue it after the forward's work).
  moe_stats read_stats(stream_arg stream) const {
    std::int64_t c[counter_count] = {};
    Space::copy_to_host(stream, c, counters_, sizeof(c));
    stream.synchronize();
    return {calls_[0].tokens,       c[counter_routed],
            c[counter_dropped],     c[counter_sent],
            c[counter_received],    c[counter_local],
            c[counter_expert_rows], options_.hidden * size_of(options_.element)};
  }

  //! Waits for `stream`, then throws for what the device flagged since the last check: bad ids
  //! (`errc::out_of_range`), duplicate choices or non-finite weights (`errc::invalid_argument`),
  //! an overflowing static slot (`errc::size_overflow`). Clears the flags.
  void check_errors(stream_arg stream) const {
    std::vector<std::uint32_t> words(1 + 2 * chunks_.size(), 0);
    take_error_word<Space>(stream, &words[0], error_);
    for (std::size_t c = 0; c < chunks_.size(); ++c) {
      take_error_word<Space>(stream, &words[1 + 2 * c], chunks_[c].plan.error_word());
      take_error_word<Space>(stream, &words[2 + 2 * c], chunks_[c].experts.error_word());
    }
    stream.synchronize();
    std::uint32_t plan = 0, experts = 0;
    for (std::size_t c = 0; c < chunks_.size(); ++c) {
      plan |= words[1 + 2 * c];
      experts |= words[2 + 2 * c];
    }
    device_dispatch_plan<Space>::throw_plan_errors(plan, placement_.num_experts());
    device_expert_plan<Space>::throw_expert_errors(experts, placement_.slots_per_device());
    WEAVE_EXPECT((words[0] & device_exchange_slot_overflow) == 0, errc::size_overflow,
                 "a chunk sent more rows to a peer than its static slot of ", slot_rows_,
                 " rows (moe_options.static_rows_per_peer)");
  }

  //! The stage hook `chunk_pipeline` calls (not for direct use).
  void enqueue(pipeline_stage stage, int c, stream_type& s) {
    chunk_state& ch = chunks_[static_cast<std::size_t>(c)];
    const bool bwd = direction_;
    switch (stage) {
    case pipeline_stage::prepare:
      bwd ? gather_send(ch, s, calls_[1].x.subrows(ch.first, ch.count)) : prepare(c, s);
      break;
    case pipeline_stage::dispatch:
      dispatch(c, s, bwd);
      break;
    case pipeline_stage::experts:
      bwd ? experts_backward(c, s) : experts_forward(c, s);
      break;
    case pipeline_stage::combine:
      exchange_back(ch, s, ch.back, ch.returned, options_.hidden * size_of(options_.element));
      if (bwd)
        exchange_back(ch, s, reinterpret_cast<std::byte*>(ch.send_dw),
                      reinterpret_cast<std::byte*>(ch.returned_dw),
                      static_cast<std::size_t>(k_) * sizeof(float));
      break;
    case pipeline_stage::finish:
      finish(c, s, bwd);
      break;
    }
  }

 private:
  using moves = row_moves<Space>;

  struct chunk_state {
    chunk_state(const placement& where, int k, int rank, std::size_t tokens, int local, int peers,
                std::size_t recv_rows)
        : plan(where, k, rank, tokens)
        , experts(local, k, peers, recv_rows)
        , send_counts_h(static_cast<std::size_t>(peers))
        , send_displs_h(static_cast<std::size_t>(peers))
        , recv_counts_h(static_cast<std::size_t>(peers))
        , recv_displs_h(static_cast<std::size_t>(peers)) {}

    device_dispatch_plan<Space> plan;  // sender half (ORI <-> SFD)
    device_expert_plan<Space> experts; // receiver half (SFD <-> EPD)
    std::size_t first = 0, count = 0;  // token range of the chunk
    std::byte *plan_ws = nullptr, *experts_ws = nullptr;
    std::byte *send = nullptr, *recv = nullptr, *back = nullptr, *returned = nullptr;
    std::byte *epd_in = nullptr, *epd_out = nullptr;
    route_entry *send_routes = nullptr, *recv_routes = nullptr; // send: static shapes only
    std::int64_t *slot_row_token = nullptr, *layout_rows = nullptr, *slot_counts = nullptr;
    std::int64_t *recv_counts = nullptr, *recv_displs = nullptr, *recv_total = nullptr;
    float *send_dw = nullptr, *returned_dw = nullptr; // backward: gate gradients per entry
    // Dynamic shapes: the counts the all-to-alls read on the host.
    std::vector<std::int64_t> send_counts_h, send_displs_h, recv_counts_h, recv_displs_h;
  };

  using call_arguments =
      detail::moe_call_arguments<experts_fn, experts_grad_fn, device_chunk_hooks<Space>>;

  // The worst case of a peer's rows per chunk: every token of the chunk, or fewer when a
  // capacity factor bounds what the experts of one device take from a batch.
  std::size_t static_slot_rows() const {
    if (options_.static_rows_per_peer != 0)
      return options_.static_rows_per_peer;
    std::size_t rows = chunk_tokens_;
    if (options_.capacity.factor > 0.0) {
      const std::int64_t cap =
          expert_capacity(options_.capacity, options_.max_tokens, k_, placement_.num_experts());
      rows = std::min(rows, checked_mul(static_cast<std::size_t>(cap),
                                        static_cast<std::size_t>(placement_.slots_per_device()),
                                        "slot rows"));
    }
    return std::max<std::size_t>(rows, 1);
  }

  // Measures (const self, null base) or carves and records every buffer; one code for both.
  template <class Self>
  static workspace_carver& carve(Self& self, workspace_carver& c) {
    const auto set = carve_into<Self>(c);
    const std::size_t row = self.options_.hidden * size_of(self.options_.element);
    const auto rows = [&](std::byte* const& ptr, std::size_t n) {
      set(ptr, checked_mul(n, row, "row buffer bytes"));
    };
    const auto D = static_cast<std::size_t>(self.D_), k = static_cast<std::size_t>(self.k_);
    const bool fixed = self.options_.static_shape, grads = self.options_.save_for_backward;
    set(self.error_, 1);
    set(self.counters_, counter_count);
    set(self.static_displs_, D);
    if (self.filter_) {
      set(self.filter_ws_, self.filter_->workspace_size());
      set(self.keep_, std::max<std::size_t>(self.options_.max_tokens * k, 1));
    }
    std::size_t epd = 0;
    for (auto& ch : self.chunks_) {
      epd = ch.experts.max_epd_rows();
      set(ch.plan_ws, ch.plan.workspace_size());
      set(ch.experts_ws, ch.experts.workspace_size());
      rows(ch.send, self.send_cap_);
      rows(ch.returned, self.send_cap_);
      rows(ch.recv, self.recv_cap_);
      rows(ch.back, self.recv_cap_);
      rows(ch.epd_in, epd);
      rows(ch.epd_out, epd);
      set(ch.recv_routes, self.recv_cap_ * k);
      set(ch.recv_counts, D);
      set(ch.recv_displs, D);
      set(ch.recv_total, 1);
      if (fixed) {
        set(ch.send_routes, self.send_cap_ * k);
        set(ch.slot_row_token, self.send_cap_);
        set(ch.layout_rows, self.chunk_tokens_ * k);
        set(ch.slot_counts, D);
      }
      if (grads) {
        set(ch.send_dw, self.recv_cap_ * k);
        set(ch.returned_dw, self.send_cap_ * k);
      }
    }
    if (grads) {
      rows(self.grad_dy_, epd);
      rows(self.grad_scaled_, epd);
      set(self.grad_dot_, epd);
    }
    return c;
  }

  token_view rows_view(std::byte* p, std::size_t n) const {
    return token_view(p, n, options_.hidden, options_.element, Space::memory);
  }

  void check_call(const const_token_view& x, const const_token_view& y, std::size_t ids,
                  std::size_t weights) const {
    WEAVE_EXPECT(initialized_, errc::invalid_state, "device exchange is not initialised");
    for (const const_token_view* v : {&x, &y}) {
      WEAVE_EXPECT(v->cols() == options_.hidden && v->element_type() == options_.element,
                   errc::size_mismatch, "device exchange rows of ", v->cols(), " ",
                   v->element_type(), " for an exchange of ", options_.hidden, " ",
                   options_.element);
      WEAVE_EXPECT(Space::memory == memory_space::host ? host_accessible(v->space())
                                                       : device_accessible(v->space()),
                   errc::invalid_argument, "device exchange rows in ", v->space(),
                   " memory for a space of ", Space::memory, " memory");
    }
    const std::size_t T = x.rows(), k = static_cast<std::size_t>(k_);
    WEAVE_EXPECT(T <= options_.max_tokens, errc::invalid_argument, "device exchange call of ", T,
                 " tokens exceeds max_tokens = ", options_.max_tokens);
    WEAVE_EXPECT(y.rows() == T && ids == T * k && weights == T * k, errc::size_mismatch,
                 "device exchange: ", T, " input rows, ", y.rows(), " output rows, ", ids,
                 " ids and ", weights, " weights (or gate gradients) with k = ", k);
  }

  // Host spaces run the stages later and read the call's arguments then: a new call of the
  // same direction waits until the previous one has run (its end event completes even if a
  // stream failed; the failure surfaces at the caller's synchronize).
  void begin_call(int direction) {
    if constexpr (Space::runs_later) {
      try {
        call_done_[direction].synchronize();
      } catch (...) {
      }
    }
  }
  void end_call(int direction, stream_type& compute) {
    if constexpr (Space::runs_later)
      compute.record(call_done_[direction]);
  }

  std::pair<std::size_t, std::size_t> chunk_range(int c) const noexcept {
    const std::size_t T = calls_[0].tokens, C = chunks_.size(), i = static_cast<std::size_t>(c);
    return {T * i / C, T * (i + 1) / C - T * i / C};
  }

  void prepare(int c, stream_type& s) {
    chunk_state& ch = chunks_[static_cast<std::size_t>(c)];
    const call_arguments& call = calls_[0];
    const auto k = static_cast<std::size_t>(k_);
    std::tie(ch.first, ch.count) = chunk_range(c);
    const bool produced = call.hooks != nullptr && static_cast<bool>(call.hooks->produce);
    if (produced)
      Space::launch(s, [hooks = call.hooks, first = ch.first, count = ch.count](stream_arg ls) {
        hooks->produce(first, count, ls);
      });
    const std::span<std::uint8_t> keep =
        filter_ ? std::span<std::uint8_t>(keep_ + ch.first * k, ch.count * k)
                : std::span<std::uint8_t>{};
    if (c == 0)
      Space::fill(s, counters_, 0, counter_count * sizeof(std::int64_t));
    if (filter_ && produced) { // choices arrive chunk by chunk: admit them in position order
      if (c == 0)
        filter_->reset(s, call.tokens);
      filter_->admit(s, call.ids.subspan(ch.first * k, ch.count * k), keep);
    } else if (filter_ && c == 0) { // the whole batch at once: every chunk reads its slice
      filter_->decide(s, call.ids, call.weights, std::span(keep_, call.tokens * k));
    }
    if (filter_)
      Space::copy(s, counters_ + counter_dropped, filter_->dropped_count(), sizeof(std::int64_t));
    ch.plan.build(s, call.ids.subspan(ch.first * k, ch.count * k),
                  call.weights.subspan(ch.first * k, ch.count * k),
                  std::span<const std::uint8_t>(keep), ch.first);
    Space::for_each(s, static_cast<std::int64_t>(ch.count * k),
                    detail::routed_pairs_step{ch.plan.kept_experts().data(), counters_});
    Space::for_each(s, 1,
                    detail::sent_rows_step{ch.plan.send_counts().data(),
                                           ch.plan.send_offsets().data(), D_, rank_, counters_});
    if (options_.static_shape) {
      const auto S = static_cast<std::int64_t>(slot_rows_);
      Space::for_each(
          s, static_cast<std::int64_t>(send_cap_),
          detail::slot_layout_step{ch.plan.send_counts().data(), ch.plan.send_offsets().data(),
                                   ch.plan.row_token().data(), ch.plan.row_routes().data(), S, k_,
                                   ch.slot_row_token, ch.send_routes});
      Space::for_each(
          s, D_, detail::slot_counts_step{ch.plan.send_counts().data(), S, ch.slot_counts, error_});
      Space::for_each(s, static_cast<std::int64_t>(ch.count * k),
                      detail::layout_token_rows_step{ch.plan.token_rows().data(),
                                                     ch.plan.send_offsets().data(), D_, S,
                                                     ch.layout_rows});
    }
    gather_send(ch, s, call.x.subrows(ch.first, ch.count));
  }

  // ORI -> the send layout (packed SFD rows, or fixed slots).
  void gather_send(chunk_state& ch, stream_type& s, const const_token_view& ori) {
    if (options_.static_shape)
      moves::gather(s, ori, rows_view(ch.send, send_cap_), ch.slot_row_token, nullptr, nullptr);
    else
      moves::gather(s, ori, rows_view(ch.send, send_cap_), ch.plan.row_token().data(), nullptr,
                    ch.plan.send_offsets().data() + D_);
  }

  void dispatch(int c, stream_type& s, bool backward) {
    chunk_state& ch = chunks_[static_cast<std::size_t>(c)];
    const std::size_t row = options_.hidden * size_of(options_.element);
    const auto D = static_cast<std::size_t>(D_);
    const std::span<std::int64_t> recv_counts(ch.recv_counts, D);
    if (options_.static_shape) {
      if (!backward) {
        comm_->exchange_counts(s, std::span<const std::int64_t>(ch.slot_counts, D), recv_counts);
        all_to_all_v(*comm_, s, ch.send_routes, uniform_counts_, uniform_displs_, ch.recv_routes,
                     uniform_counts_, uniform_displs_, static_cast<std::size_t>(k_) * 8);
      }
      all_to_all_v(*comm_, s, ch.send, uniform_counts_, uniform_displs_, ch.recv, uniform_counts_,
                   uniform_displs_, row);
      return;
    }
    if (!backward) {
      comm_->exchange_counts(s, ch.plan.send_counts(), recv_counts);
      Space::copy_to_host(s, ch.send_counts_h.data(), ch.plan.send_counts().data(), D * 8);
      Space::copy_to_host(s, ch.send_displs_h.data(), ch.plan.send_offsets().data(), D * 8);
      Space::copy_to_host(s, ch.recv_counts_h.data(), ch.recv_counts, D * 8);
      Space::on_host(
          s, [this, &ch] { detail::abort_peers_on_failure(*comm_, [&] { plan_receive(ch); }); });
      Space::copy_from_host(s, ch.recv_displs, ch.recv_displs_h.data(), D * 8);
      all_to_all_v(*comm_, s, ch.plan.row_routes().data(), ch.send_counts_h, ch.send_displs_h,
                   ch.recv_routes, ch.recv_counts_h, ch.recv_displs_h,
                   static_cast<std::size_t>(k_) * 8);
    }
    all_to_all_v(*comm_, s, ch.send, ch.send_counts_h, ch.send_displs_h, ch.recv, ch.recv_counts_h,
                 ch.recv_displs_h, row);
  }

  // Dynamic shapes, on the host once the counts arrived: the receive layout.
  void plan_receive(chunk_state& ch) {
    std::int64_t total = 0;
    for (std::size_t src = 0; src < ch.recv_counts_h.size(); ++src) {
      ch.recv_displs_h[src] = total;
      total += ch.recv_counts_h[src];
    }
    WEAVE_EXPECT(static_cast<std::size_t>(total) <= recv_cap_, errc::size_mismatch,
                 "a chunk would receive ", total, " rows, more than the ", recv_cap_,
                 " planned from max_tokens = ", options_.max_tokens,
                 " (a rank passed more tokens, or the ranks' options differ)");
  }

  // The all-to-all back: the receive layout returns to the send layout.
  void exchange_back(chunk_state& ch, stream_type& s, std::byte* from, std::byte* to,
                     std::size_t unit) {
    if (options_.static_shape)
      all_to_all_v(*comm_, s, from, uniform_counts_, uniform_displs_, to, uniform_counts_,
                   uniform_displs_, unit);
    else
      all_to_all_v(*comm_, s, from, ch.recv_counts_h, ch.recv_displs_h, to, ch.send_counts_h,
                   ch.send_displs_h, unit);
  }

  std::size_t epd_capacity(const chunk_state& ch) const { return ch.experts.max_epd_rows(); }

  // Builds the EPD plan of what arrived and scatters the received rows to it.
  void build_experts(chunk_state& ch, stream_type& s) {
    const std::int64_t* displs = options_.static_shape ? static_displs_ : ch.recv_displs;
    const auto k = static_cast<std::size_t>(k_);
    ch.experts.build(s, std::span<const route_entry>(ch.recv_routes, recv_cap_ * k), ch.recv_counts,
                     displs);
    Space::for_each(s, 1,
                    detail::received_rows_step{ch.recv_counts, D_, ch.experts.epd_rows_count(),
                                               ch.recv_total, counters_});
  }

  // EPD -> one row per received row (gate-weighted in the forward), back in received order.
  void merge_back(chunk_state& ch, stream_type& s, bool weighted) {
    moves::merge(s, rows_view(ch.epd_out, epd_capacity(ch)), rows_view(ch.back, recv_cap_),
                 ch.experts.row_epd().data(), k_,
                 weighted ? ch.experts.row_weight().data() : nullptr,
                 options_.static_shape ? nullptr : ch.recv_total, options_.static_shape);
  }

  void experts_forward(int c, stream_type& s) {
    chunk_state& ch = chunks_[static_cast<std::size_t>(c)];
    build_experts(ch, s);
    moves::gather(s, rows_view(ch.recv, recv_cap_), rows_view(ch.epd_in, epd_capacity(ch)),
                  ch.experts.epd_row_source().data(), nullptr, ch.experts.epd_rows_count());
    Space::launch(s, [this, c](stream_arg ls) {
      chunk_state& x = chunks_[static_cast<std::size_t>(c)];
      calls_[0].experts(device_expert_batch<Space>{
          c, rank_, x.experts.expert_offsets(), local_experts_,
          rows_view(x.epd_in, epd_capacity(x)), rows_view(x.epd_out, epd_capacity(x)), ls});
    });
    merge_back(ch, s, true);
  }

  void experts_backward(int c, stream_type& s) {
    chunk_state& ch = chunks_[static_cast<std::size_t>(c)];
    const std::size_t epd = epd_capacity(ch);
    const std::int64_t* count = ch.experts.epd_rows_count();
    const auto received = rows_view(ch.recv, recv_cap_);
    moves::gather(s, received, rows_view(grad_dy_, epd), ch.experts.epd_row_source().data(),
                  nullptr, count);
    moves::gather(s, received, rows_view(grad_scaled_, epd), ch.experts.epd_row_source().data(),
                  ch.experts.epd_weight().data(), count);
    // dL/dw of each EPD row: <dy, expert output>, before the outputs make room for dL/dx.
    moves::dot(s, rows_view(grad_dy_, epd), rows_view(ch.epd_out, epd), grad_dot_, count);
    Space::for_each(s, static_cast<std::int64_t>(recv_cap_ * static_cast<std::size_t>(k_)),
                    detail::entry_dw_step{ch.experts.row_epd().data(), grad_dot_, ch.send_dw});
    Space::launch(s, [this, c, epd](stream_arg ls) {
      chunk_state& x = chunks_[static_cast<std::size_t>(c)];
      calls_[1].experts_grad(device_expert_grad_batch<Space>{
          c, rank_, x.experts.expert_offsets(), local_experts_, rows_view(x.epd_in, epd),
          rows_view(grad_scaled_, epd), rows_view(x.epd_out, epd), ls});
    });
    merge_back(ch, s, false);
  }

  void finish(int c, stream_type& s, bool backward) {
    chunk_state& ch = chunks_[static_cast<std::size_t>(c)];
    const call_arguments& call = calls_[backward ? 1 : 0];
    const std::int64_t* token_rows =
        options_.static_shape ? ch.layout_rows : ch.plan.token_rows().data();
    moves::merge(s, rows_view(ch.returned, send_cap_), call.y.subrows(ch.first, ch.count),
                 token_rows, k_, nullptr, nullptr, false);
    if (!backward && call.hooks != nullptr && call.hooks->consume)
      Space::launch(s, [hooks = call.hooks, first = ch.first, count = ch.count](stream_arg ls) {
        hooks->consume(first, count, ls);
      });
    if (backward)
      Space::for_each(
          s, static_cast<std::int64_t>(ch.count),
          detail::token_dw_step{ch.plan.kept_experts().data(), ch.plan.pair_devices().data(),
                                ch.plan.token_rows().data(), ch.plan.send_offsets().data(), k_, D_,
                                static_cast<std::int64_t>(slot_rows_), ch.returned_dw,
                                call.dw.data() + ch.first * static_cast<std::size_t>(k_)});
  }

  Comm* comm_;
  placement placement_;
  moe_options options_;
  chunk_pipeline<stream_type> pipeline_;
  int rank_ = 0, D_ = 0, k_ = 0;
  std::size_t chunk_tokens_ = 0, slot_rows_ = 0, send_cap_ = 0, recv_cap_ = 0;
  std::vector<std::int32_t> local_experts_;
  std::vector<std::int64_t> uniform_counts_, uniform_displs_;
  std::optional<device_capacity_filter<Space>> filter_;
  std::vector<chunk_state> chunks_;
  bool initialized_ = false;
  std::uint32_t* error_ = nullptr;
  std::int64_t* counters_ = nullptr;
  std::int64_t* static_displs_ = nullptr;
  std::byte* filter_ws_ = nullptr;
  std::uint8_t* keep_ = nullptr;
  std::byte *grad_dy_ = nullptr, *grad_scaled_ = nullptr;
  float* grad_dot_ = nullptr;
  call_arguments calls_[2];                       // [0] forward, [1] backward
  typename stream_type::event_type call_done_[2]; // host spaces: end of each direction's call
  bool direction_ = false;                        // of the call being enqueued
};

WEAVE_NAMESPACE_END
