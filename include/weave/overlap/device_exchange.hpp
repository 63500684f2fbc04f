//! \file
//! `basic_device_exchange<Space, Comm>`: an MoE layer's communication around the caller's
//! experts, with every plan built where the data lives (`cuda_moe_exchange` is this class in
//! `cuda_space` over NCCL; in `host_space` it runs on host streams, which is how CI checks it).
//!
//! The stages, the handle API and the guarantees are `moe_exchange`'s (Occult's exact mode, one
//! row per (token, device) both ways, chunks pipelined as `moe_exchange_base` describes,
//! results bitwise identical for every chunk count, capacity decided once per batch so drops
//! equal the unchunked batch's), with two shapes:
//! - dynamic (default): rows are packed; the exchanged counts are copied to the host once per
//!   chunk (on CUDA, the comm stream synchronizes there), which the all-to-all needs.
//! - static (`moe_options::static_shape`): every peer gets a slot of `slot_rows()` rows per
//!   chunk, counts stay in memory of the space and ride beside the rows. No call waits for the
//!   GPU, and a call can be captured in a CUDA graph; the price is sending whole slots.
//! Replicas are chosen as `moe_exchange` chooses them (`placement::slot_for`). Construct,
//! allocate `workspace_size()` bytes of memory of the space (256-byte aligned; it grows with
//! `max_in_flight`), `initialize` once; calls then allocate nothing. Bad ids, weights and slot
//! overflows are flagged in memory of the space and reported by `check_errors`. A chunk's
//! `experts()` are views of the workspace (capacity rows, of which `expert_offsets[L]` are
//! valid) and device-side offsets, valid in stream order: the caller's work reads them on
//! `batch.stream`.
//!
//! Fail-stop (docs/faults.md): the ranks agree on the configuration at construction; each
//! chunk's count exchange carries every rank's status (its flags, or a call rejected on the
//! host), so with dynamic shapes every rank fails at that exchange, and with static shapes
//! `check_errors` reports the peers' failures; host waits go through the communicator (NCCL:
//! its timeout and abort). `synchronize` is the one wait that reports the root cause.
#pragma once

#include "weave/comm/communicator.hpp"
#include "weave/comm/device_status_exchange.hpp"
#include "weave/comm/fail_stop.hpp"
#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/tensor.hpp"
#include "weave/core/workspace.hpp"
#include "weave/exec/host_mirror.hpp"
#include "weave/exec/space.hpp"
#include "weave/overlap/device_exchange_state.hpp"
#include "weave/overlap/device_exchange_steps.hpp"
#include "weave/overlap/moe_exchange_base.hpp"
#include "weave/overlap/moe_options.hpp"
#include "weave/placement/placement.hpp"
#include "weave/routing/quantize.hpp"
#include "weave/routing/row_moves.hpp"

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <tuple>
#include <utility>
#include <vector>

WEAVE_NAMESPACE_BEGIN

namespace detail {
template <class Space, class Comm>
struct device_exchange_traits {
  using comm_type = Comm;
  using stream_type = typename Space::stream_type;
  using stream_arg = typename Space::stream_arg;
  using hooks_type = device_chunk_hooks<Space>;
  using experts_fn = std::function<void(const device_expert_batch<Space>&)>;
  using experts_grad_fn = std::function<void(const device_expert_grad_batch<Space>&)>;
  using state_type = device_call_state<Space>;
  static constexpr bool runs_later = Space::runs_later;
};
} // namespace detail

template <execution_space Space, communicator Comm>
requires std::same_as<typename Comm::stream_type, typename Space::stream_type> &&
    has_exchange_counts<Comm> && has_all_to_all_v<Comm>
class basic_device_exchange
    : public moe_exchange_base<basic_device_exchange<Space, Comm>,
                               detail::device_exchange_traits<Space, Comm>> {
  using base = moe_exchange_base<basic_device_exchange<Space, Comm>,
                                 detail::device_exchange_traits<Space, Comm>>;

 public:
  using space = Space;
  using typename base::handle;
  using typename base::stream_arg;
  using typename base::stream_type;

  //! An exchange for rank `comm.rank()` of `comm.size()` devices placed by `where`. Collective:
  //! checks that every rank builds the layer alike (`agree_on_layer`: `errc::config_mismatch`
  //! on every rank otherwise). Throws `errc::invalid_argument` for bad options or a placement
  //! of another size (and its peers a `peer_error` naming this rank). With `cuda_space` it
  //! needs a current device (it sizes CUB's scratch).
  basic_device_exchange(Comm& comm, placement where, moe_options options)
      : base(comm, std::move(where), options, "device_exchange", [] {})
      , status_(comm.size(), comm.rank(), !options.static_shape, "device exchange",
                [this](int rank, std::uint32_t flags) {
                  return record_of_call(rank,
                                        [&] { throw_sender_errors(flags & 0xFFFFu, flags >> 16); });
                }) {
    D_ = comm.size();
    k_ = options.k;
    const int spd = this->placement_.slots_per_device();
    for (int l = 0; l < spd; ++l)
      local_experts_.push_back(this->placement_.expert_of_slot(this->rank_ * spd + l));
    const auto D = static_cast<std::size_t>(D_), k = static_cast<std::size_t>(k_);
    const auto chunks = static_cast<std::size_t>(options.chunks);
    chunk_tokens_ = (options.max_tokens + chunks - 1) / chunks;
    slot_rows_ = options.static_shape ? static_slot_rows() : 0;
    send_cap_ = options.static_shape ? checked_mul(D, slot_rows_, "send rows")
                                     : checked_mul(chunk_tokens_, std::min(k, D), "send rows");
    recv_cap_ = options.static_shape ? send_cap_ : checked_mul(chunk_tokens_, D, "receive rows");
    uniform_counts_.assign(D, static_cast<std::int64_t>(slot_rows_));
    uniform_displs_.resize(D);
    for (std::size_t d = 0; d < D; ++d)
      uniform_displs_[d] = static_cast<std::int64_t>(d * slot_rows_);
    if (options.fp8_dispatch)
      wire_ = quantized_row_layout::of(options.hidden, options.fp8_dispatch->blocks.block);
    std::size_t chunk_states = 0;
    for (const auto& s : this->slots()) {
      s->state.construct(this->placement_, options, this->rank_, chunk_tokens_, recv_cap_);
      for (chunk_state& ch : s->state.chunks)
        status_.size_block(ch.status);
      chunk_states += s->state.chunks.size();
    }
    error_words_ = host_mirror<Space, std::uint32_t>(3 * chunk_states);
    bad_tokens_ = host_mirror<Space, std::int64_t>(options.fp8_dispatch ? chunk_states : 0);
    last_forward_ = this->slots().front().get();
  }

  bool static_shape() const noexcept { return this->options_.static_shape; }
  //! Rows of each peer's slot per chunk (static shapes; 0 otherwise).
  std::size_t slot_rows() const noexcept { return slot_rows_; }
  //! Rows a chunk's send buffer holds (static: peers * slot rows).
  std::size_t send_rows_capacity() const noexcept { return send_cap_; }

  //! Bytes of memory of the space `initialize` needs (for `max_in_flight` calls).
  std::size_t workspace_size() const {
    workspace_carver measure;
    return carve(*this, measure).used();
  }

  //! Carves every buffer out of `workspace` and initialises the plans on `stream`.
  void initialize(void* workspace, std::size_t bytes, stream_arg stream) {
    WEAVE_EXPECT(workspace != nullptr, errc::invalid_argument, "null workspace");
    workspace_carver carver(workspace, bytes);
    carve(*this, carver);
    for (const auto& s : this->slots()) {
      auto& st = s->state;
      for (chunk_state& ch : st.chunks) {
        ch.plan.initialize(ch.plan_ws, ch.plan.workspace_size(), stream);
        ch.experts.initialize(ch.experts_ws, ch.experts.workspace_size(), stream);
        Space::fill(stream, ch.error, 0, sizeof(std::uint32_t));
        Space::fill(stream, ch.status.recv, 0, status_.words() * sizeof(std::int64_t));
        if (ch.quant_status != nullptr)
          Space::fill(stream, ch.quant_status, 0xff, sizeof(std::int64_t)); // -1: none
      }
      if (st.filter)
        st.filter->initialize(st.filter_ws, st.filter->workspace_size(), stream);
      Space::fill(stream, st.counters, 0, counter_count * sizeof(std::int64_t));
    }
    Space::copy_from_host(stream, static_displs_, uniform_displs_.data(),
                          uniform_displs_.size() * sizeof(std::int64_t));
    wait_watched(*this->comm_, stream); // the uploads read host vectors of this object
    initialized_ = true;
  }

  //! What the last forward moved; waits for `stream` (enqueue it after the forward's work).
  moe_stats read_stats(stream_arg stream) const { return read_counters(*last_forward_, stream); }
  //! What `h`'s forward moved; waits for `stream`.
  moe_stats read_stats(const handle& h, stream_arg stream) const {
    return read_counters(this->slot(this->slot_of(h)), stream);
  }

  //! Waits for `stream`, then throws for what the device flagged since the last check: bad ids
  //! (`errc::out_of_range`), duplicate choices or non-finite weights (`errc::invalid_argument`),
  //! an overflowing static slot (`errc::size_overflow`), a token holding a NaN or an infinity
  //! in an FP8 dispatch (`errc::invalid_argument`; its rows travelled as NaN, so its outputs are
  //! NaN, and no other token's are affected), else a peer's failure its count exchanges
  //! reported (`peer_error`), else bad received rows. Clears the flags.
  void check_errors(stream_arg stream) {
    const bool fp8 = this->options_.fp8_dispatch.has_value();
    host_mirror<Space, std::uint32_t>& words = error_words_; // the copies land here, pinned
    host_mirror<Space, std::int64_t>& bad_tokens = bad_tokens_;
    std::size_t at = 0, c = 0;
    for (const auto& s : this->slots())
      for (chunk_state& ch : s->state.chunks) {
        take_error_word<Space>(stream, &words[at++], ch.error);
        take_error_word<Space>(stream, &words[at++], ch.plan.error_word());
        take_error_word<Space>(stream, &words[at++], ch.experts.error_word());
        status_.take(stream, ch.status);
        if (fp8) {
          Space::copy_to_host(stream, &bad_tokens[c++], ch.quant_status, sizeof(std::int64_t));
          Space::fill(stream, ch.quant_status, 0xff, sizeof(std::int64_t)); // -1: none
        }
      }
    wait_watched(*this->comm_, stream);
    std::uint32_t own = 0, plan = 0, experts = 0;
    for (std::size_t i = 0; i < words.size(); i += 3) {
      own |= words[i];
      plan |= words[i + 1];
      experts |= words[i + 2];
    }
    throw_sender_errors(plan, own);
    c = 0;
    for (const auto& s : this->slots())
      for (const chunk_state& ch : s->state.chunks) {
        const std::int64_t bad = fp8 ? bad_tokens[c++] : -1;
        WEAVE_EXPECT(bad < 0, errc::invalid_argument, "token ",
                     static_cast<std::int64_t>(ch.first) + bad,
                     " of a forward holds a NaN or an infinity: the FP8 dispatch "
                     "(moe_options::fp8_dispatch) sent its rows as NaN");
      }
    for (const auto& s : this->slots()) // a peer's failure explains what this rank received
      for (const chunk_state& ch : s->state.chunks)
        if (std::exception_ptr peer = status_.peer_failure(ch.status))
          std::rethrow_exception(peer);
    device_expert_plan<Space>::throw_expert_errors(experts, this->placement_.slots_per_device());
  }

 private:
  friend base;
  friend struct detail::moe_access;
  using moves = row_moves<Space>;
  using quant = quant_moves<Space>;
  using slot_type = typename base::slot_type;
  using chunk_state = detail::device_chunk<Space>;
  using call_state = detail::device_call_state<Space>;

  // Throws for a sender's flags: the chunk plans' (`device_plan_error`) and this exchange's own
  // (`device_exchange_error`); used for this rank's and, through the status, for the peers'.
  void throw_sender_errors(std::uint32_t plan, std::uint32_t exchange) const {
    device_dispatch_plan<Space>::throw_plan_errors(plan, this->placement_.num_experts());
    WEAVE_EXPECT((exchange & device_exchange_slot_overflow) == 0, errc::size_overflow,
                 "a chunk sent more rows to a peer than its static slot of ", slot_rows_,
                 " rows (moe_options.static_rows_per_peer)");
  }

  // The one wait (`moe_exchange_base::synchronize`): both streams through the communicator,
  // then the device flags unless the communicator was aborted; rethrows the root cause.
  void synchronize_layer(stream_arg compute, stream_arg comm) {
    std::exception_ptr waited, flagged;
    try {
      synchronize_streams(*this->comm_, compute, comm);
    } catch (...) {
      waited = std::current_exception();
    }
    if (!communicator_aborted(*this->comm_)) {
      try {
        check_errors(compute);
      } catch (...) {
        flagged = std::current_exception();
      }
    }
    if (std::exception_ptr root = root_cause({waited, flagged}))
      std::rethrow_exception(root);
  }

  // A rejected call's turn (see `moe_exchange_base::reject`): on host streams both streams
  // carry `failure` while `issue` enqueues it; on CUDA its record is copied to the device and
  // sent by the call's count exchanges instead of the flags.
  template <class Issue>
  void enqueue_rejected(slot_type& s, const std::exception_ptr& failure, stream_arg compute,
                        stream_arg comm, Issue&& issue) {
    s.args.x = rows_view(nullptr, 0);
    s.args.y = rows_view(nullptr, 0);
    if constexpr (Space::runs_later) {
      enqueue_failed_call(*this->comm_, compute, comm, failure, std::forward<Issue>(issue));
    } else {
      status_.report(comm, failure, s.state.reported_h, s.state.reported);
      s.state.rejected = true;
      try {
        std::forward<Issue>(issue)();
      } catch (...) {
        s.state.rejected = false;
        throw;
      }
      s.state.rejected = false;
    }
  }

  // Space::launch for the caller's code. A failure before the dispatch on host streams travels
  // with the count exchange; any other one aborts the communicator, as the peers would
  // otherwise wait for this rank in a collective that carries no status.
  template <class F>
  void launch_fail_stop(stream_type& s, bool before_dispatch, F f) {
    if (before_dispatch && Space::runs_later)
      Space::launch(s, std::move(f));
    else
      Space::launch(s, [this, f = std::move(f)](stream_arg ls) mutable {
        abort_peers_on_failure(*this->comm_, [&] { f(ls); });
      });
  }

  // The worst case of a peer's rows per chunk: every token of the chunk, or fewer when a
  // capacity factor bounds what the experts of one device take from a batch.
  std::size_t static_slot_rows() const {
    if (this->options_.static_rows_per_peer != 0)
      return this->options_.static_rows_per_peer;
    std::size_t rows = chunk_tokens_;
    if (this->options_.capacity.factor > 0.0) {
      const std::int64_t cap = expert_capacity(this->options_.capacity, this->options_.max_tokens,
                                               k_, this->placement_.num_experts());
      rows =
          std::min(rows, checked_mul(static_cast<std::size_t>(cap),
                                     static_cast<std::size_t>(this->placement_.slots_per_device()),
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
    const bool fp8 = self.options_.fp8_dispatch.has_value();
    const std::size_t blocks =
        fp8 ? self.options_.hidden / self.options_.fp8_dispatch->blocks.block : 0;
    set(self.static_displs_, D);
    for (const auto& s : self.slots()) {
      call_state& st = s->state;
      set(st.counters, counter_count);
      set(st.reported, failure_words);
      if (st.filter) {
        set(st.filter_ws, st.filter->workspace_size());
        set(st.keep, std::max<std::size_t>(self.options_.max_tokens * k, 1));
      }
      std::size_t epd = 0;
      for (chunk_state& ch : st.chunks) {
        epd = ch.experts.max_epd_rows();
        set(ch.plan_ws, ch.plan.workspace_size());
        set(ch.experts_ws, ch.experts.workspace_size());
        if (!fp8 || grads) { // rows in the element type cross the dispatch
          rows(ch.send, self.send_cap_);
          rows(ch.recv, self.recv_cap_);
        }
        rows(ch.returned, self.send_cap_);
        rows(ch.back, self.recv_cap_);
        if (self.has_inputs())
          rows(ch.epd_in, epd);
        rows(ch.epd_out, epd);
        if (fp8) {
          set(ch.send_fp8, checked_mul(self.send_cap_, self.wire_.stride, "FP8 send bytes"));
          set(ch.recv_fp8, checked_mul(self.recv_cap_, self.wire_.stride, "FP8 receive bytes"));
          set(ch.epd_codes, checked_mul(epd, self.options_.hidden, "FP8 expert rows"));
          set(ch.epd_scales, checked_mul(epd, blocks, "FP8 expert scales"));
          set(ch.quant_status, 1);
        }
        set(ch.recv_routes, self.recv_cap_ * k);
        set(ch.recv_counts, D);
        set(ch.recv_displs, D);
        set(ch.recv_total, 1);
        set(ch.expert_rows, std::max<std::size_t>(self.chunk_tokens_ * k, 1));
        set(ch.error, 1);
        self.status_.carve(ch.status, set);
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
      if (grads) { // shared by the chunks of a call: its backward runs them in compute order
        rows(st.grad_dy, epd);
        rows(st.grad_scaled, epd);
        set(st.grad_dot, epd);
      }
    }
    return c;
  }

  token_view rows_view(std::byte* p, std::size_t n) const {
    return token_view(p, n, this->options_.hidden, this->options_.element, Space::memory);
  }

  // FP8 dispatch: packed wire rows as codes and scales, and the expert layout's codes and
  // scales; the expert inputs in the element type exist unless only codes are asked for.
  std::pair<token_view, token_view> wire_views(std::byte* p, std::size_t n) const {
    return wire_.views(p, n, this->options_.fp8_dispatch->format, Space::memory);
  }
  token_view codes_view(std::byte* p, std::size_t n) const {
    return token_view(p, n, this->options_.hidden, this->options_.fp8_dispatch->format,
                      Space::memory);
  }
  token_view scales_view(float* p, std::size_t n) const {
    return token_view(reinterpret_cast<std::byte*>(p), n,
                      this->options_.hidden / this->options_.fp8_dispatch->blocks.block, dtype::f32,
                      Space::memory);
  }
  bool has_inputs() const noexcept {
    return !this->options_.fp8_dispatch || this->options_.fp8_dispatch->dequantized_inputs;
  }
  const_token_view inputs_of(const chunk_state& ch, std::size_t epd) const {
    return has_inputs() ? const_token_view(rows_view(ch.epd_in, epd)) : const_token_view{};
  }
  const_token_view codes_of(const chunk_state& ch, std::size_t epd) const {
    return this->options_.fp8_dispatch ? const_token_view(codes_view(ch.epd_codes, epd))
                                       : const_token_view{};
  }
  const_token_view scales_of(const chunk_state& ch, std::size_t epd) const {
    return this->options_.fp8_dispatch ? const_token_view(scales_view(ch.epd_scales, epd))
                                       : const_token_view{};
  }

  moe_stats read_counters(const slot_type& s, stream_arg stream) const {
    std::int64_t* c = counters_h_.data();
    Space::copy_to_host(stream, c, s.state.counters, counter_count * sizeof(std::int64_t));
    wait_watched(*this->comm_, stream);
    return {s.tokens,
            c[counter_routed],
            c[counter_dropped],
            c[counter_sent],
            c[counter_received],
            c[counter_local],
            c[counter_expert_rows],
            this->options_.hidden * size_of(this->options_.element),
            detail::dispatch_row_bytes(this->options_)};
  }

  // --- checks and accessors (called by the base and by moe_chunk) ---------------------------

  void check_rows(const const_token_view& v, const char* what) const {
    WEAVE_EXPECT(initialized_, errc::invalid_state, "device exchange is not initialised");
    WEAVE_EXPECT(v.cols() == this->options_.hidden && v.element_type() == this->options_.element,
                 errc::size_mismatch, "device exchange ", what, " rows of ", v.cols(), " ",
                 v.element_type(), " for an exchange of ", this->options_.hidden, " ",
                 this->options_.element);
    WEAVE_EXPECT(Space::memory == memory_space::host ? host_accessible(v.space())
                                                     : device_accessible(v.space()),
                 errc::invalid_argument, "device exchange ", what, " rows in ", v.space(),
                 " memory for a space of ", Space::memory, " memory");
  }

  device_expert_batch<Space> experts_of(const slot_type& s, int c) const {
    const chunk_state& ch = s.state.chunks[static_cast<std::size_t>(c)];
    const std::size_t epd = ch.experts.max_epd_rows();
    return {c,
            this->rank_,
            ch.experts.expert_offsets(),
            local_experts_,
            inputs_of(ch, epd),
            rows_view(ch.epd_out, epd),
            base::arg_of(s.phase_compute[0]),
            codes_of(ch, epd),
            scales_of(ch, epd)};
  }

  device_expert_grad_batch<Space> experts_grad_of(const slot_type& s, int c) const {
    const chunk_state& ch = s.state.chunks[static_cast<std::size_t>(c)];
    const std::size_t epd = ch.experts.max_epd_rows();
    return {c,
            this->rank_,
            ch.experts.expert_offsets(),
            local_experts_,
            inputs_of(ch, epd),
            rows_view(s.state.grad_scaled, epd),
            rows_view(ch.epd_out, epd),
            base::arg_of(s.phase_compute[1]),
            codes_of(ch, epd),
            scales_of(ch, epd)};
  }

  device_expert_batch<Space> chunk_experts(int slot, int c) const {
    return experts_of(this->slot(slot), c);
  }
  device_expert_grad_batch<Space> chunk_experts_grad(int slot, int c) const {
    return experts_grad_of(this->slot(slot), c);
  }
  std::span<const std::int64_t> chunk_expert_rows(int slot, int c) const {
    const chunk_state& ch = this->slot(slot).state.chunks[static_cast<std::size_t>(c)];
    return {ch.expert_rows, ch.count * static_cast<std::size_t>(k_)};
  }

  // --- stages (issued by the base) ----------------------------------------------------------

  void on_dispatch(slot_type& s) { last_forward_ = &s; }

  // Dynamic shapes wait for the GPU once per chunk, which a CUDA graph cannot hold.
  void on_start(slot_type& s, stream_type& compute) {
    bool capturing = false;
    if constexpr (requires { Space::is_capturing(compute); })
      capturing = Space::is_capturing(compute);
    WEAVE_EXPECT(!capturing || this->options_.static_shape, errc::invalid_state,
                 "a call with dynamic shapes cannot be captured in a CUDA graph (it waits for the "
                 "GPU once per chunk): set moe_options::static_shape");
    s.pipeline().set_captured(capturing);
  }

  void enqueue_prepare(slot_type& s, int c, stream_type& st) {
    chunk_state& ch = s.state.chunks[static_cast<std::size_t>(c)];
    if (s.backward)
      gather_send(ch, st, s.args.dy.subrows(ch.first, ch.count));
    else
      prepare(s, c, st);
  }

  void prepare(slot_type& s, int c, stream_type& st) {
    call_state& cs = s.state;
    chunk_state& ch = cs.chunks[static_cast<std::size_t>(c)];
    const auto& args = s.args;
    const auto k = static_cast<std::size_t>(k_);
    std::tie(ch.first, ch.count) = this->chunk_range(s.tokens, c);
    const bool produced = args.hooks != nullptr && static_cast<bool>(args.hooks->produce);
    if (produced)
      launch_fail_stop(st, true,
                       [hooks = args.hooks, first = ch.first, count = ch.count](stream_arg ls) {
                         hooks->produce(first, count, ls);
                       });
    const std::span<std::uint8_t> keep =
        cs.filter ? std::span<std::uint8_t>(cs.keep + ch.first * k, ch.count * k)
                  : std::span<std::uint8_t>{};
    if (c == 0)
      Space::fill(st, cs.counters, 0, counter_count * sizeof(std::int64_t));
    if (cs.filter && produced) { // choices arrive chunk by chunk: admit them in position order
      if (c == 0)
        cs.filter->reset(st, s.tokens);
      cs.filter->admit(st, args.ids.subspan(ch.first * k, ch.count * k), keep);
    } else if (cs.filter && c == 0) { // the whole batch at once: every chunk reads its slice
      cs.filter->decide(st, args.ids, args.weights, std::span(cs.keep, s.tokens * k));
    }
    if (cs.filter)
      Space::copy(st, cs.counters + counter_dropped, cs.filter->dropped_count(),
                  sizeof(std::int64_t));
    ch.plan.build(st, args.ids.subspan(ch.first * k, ch.count * k),
                  args.weights.subspan(ch.first * k, ch.count * k),
                  std::span<const std::uint8_t>(keep), ch.first);
    Space::for_each(st, static_cast<std::int64_t>(ch.count * k),
                    detail::routed_pairs_step{ch.plan.kept_experts().data(), cs.counters});
    Space::for_each(st, 1,
                    detail::sent_rows_step{ch.plan.send_counts().data(),
                                           ch.plan.send_offsets().data(), D_, this->rank_,
                                           cs.counters});
    if (this->options_.static_shape) {
      const auto S = static_cast<std::int64_t>(slot_rows_);
      Space::for_each(
          st, static_cast<std::int64_t>(send_cap_),
          detail::slot_layout_step{ch.plan.send_counts().data(), ch.plan.send_offsets().data(),
                                   ch.plan.row_token().data(), ch.plan.row_routes().data(), S, k_,
                                   ch.slot_row_token, ch.send_routes});
      Space::for_each(
          st, D_,
          detail::slot_counts_step{ch.plan.send_counts().data(), S, ch.slot_counts, ch.error});
      Space::for_each(st, static_cast<std::int64_t>(ch.count * k),
                      detail::layout_token_rows_step{ch.plan.token_rows().data(),
                                                     ch.plan.send_offsets().data(), D_, S,
                                                     ch.layout_rows});
    }
    if (this->options_.fp8_dispatch)
      quantize_send(ch, st, args.x.subrows(ch.first, ch.count));
    else
      gather_send(ch, st, args.x.subrows(ch.first, ch.count));
  }

  // FP8 dispatch, ORI -> the send layout quantised (one quantisation per SFD row); a token
  // holding a NaN or an infinity is sent as NaN and lowers the chunk's status word.
  void quantize_send(chunk_state& ch, stream_type& s, const const_token_view& ori) {
    const auto [codes, scales] = wire_views(ch.send_fp8, send_cap_);
    const fp8_dispatch_options& f = *this->options_.fp8_dispatch;
    if (this->options_.static_shape)
      quant::quantize(s, ori, codes, scales, ch.slot_row_token, nullptr, f.blocks, ch.quant_status);
    else
      quant::quantize(s, ori, codes, scales, ch.plan.row_token().data(),
                      ch.plan.send_offsets().data() + D_, f.blocks, ch.quant_status);
  }

  // ORI -> the send layout (packed SFD rows, or fixed slots).
  void gather_send(chunk_state& ch, stream_type& s, const const_token_view& ori) {
    if (this->options_.static_shape)
      moves::gather(s, ori, rows_view(ch.send, send_cap_), ch.slot_row_token, nullptr, nullptr);
    else
      moves::gather(s, ori, rows_view(ch.send, send_cap_), ch.plan.row_token().data(), nullptr,
                    ch.plan.send_offsets().data() + D_);
  }

  // The dispatch of chunk c (the backward's reuses the forward's counts). Returns true when its
  // all-to-alls wait for counts on the host (dynamic shapes, when host code runs at enqueue
  // time, as on CUDA): they are issued by `complete_dispatch`, one step later (see
  // `moe_exchange_base::flush_dispatch`), so the host does not wait here for the comm stream
  // to drain through the previous chunk's combine.
  bool enqueue_dispatch(slot_type& s, int c, stream_type& st) {
    chunk_state& ch = s.state.chunks[static_cast<std::size_t>(c)];
    if (!s.backward) {
      exchange_chunk_counts(s, ch, st);
      if (!Space::runs_later && !this->options_.static_shape)
        return true;
    }
    complete_dispatch(s, c, st);
    return false;
  }

  // The all-to-alls of a dispatch, after its count exchange (dynamic shapes: the host reads the
  // counts first, unless host code runs later, in the stream, as on host streams).
  void complete_dispatch(slot_type& s, int c, stream_type& st) {
    chunk_state& ch = s.state.chunks[static_cast<std::size_t>(c)];
    const bool fixed = this->options_.static_shape;
    if (!s.backward && !fixed)
      read_counts(s, ch, st);
    const bool fp8 = !s.backward && this->options_.fp8_dispatch; // the backward keeps T
    const std::size_t row =
        fp8 ? wire_.stride : this->options_.hidden * size_of(this->options_.element);
    std::byte* send = fp8 ? ch.send_fp8 : ch.send;
    std::byte* recv = fp8 ? ch.recv_fp8 : ch.recv;
    if (!s.backward) {
      if (fixed)
        all_to_all_v(*this->comm_, st, ch.send_routes, uniform_counts_, uniform_displs_,
                     ch.recv_routes, uniform_counts_, uniform_displs_,
                     static_cast<std::size_t>(k_) * 8);
      else
        all_to_all_v(*this->comm_, st, ch.plan.row_routes().data(), ch.send_counts_h,
                     ch.send_displs_h, ch.recv_routes, ch.recv_counts_h, ch.recv_displs_h,
                     static_cast<std::size_t>(k_) * 8);
    }
    if (fixed)
      all_to_all_v(*this->comm_, st, send, uniform_counts_, uniform_displs_, recv, uniform_counts_,
                   uniform_displs_, row);
    else
      all_to_all_v(*this->comm_, st, send, ch.send_counts_h, ch.send_displs_h, recv,
                   ch.recv_counts_h, ch.recv_displs_h, row);
  }

  // The count exchange of a chunk (every path's one place), carrying this rank's status.
  // Static shapes keep the counts in memory of the space; dynamic ones copy them to the host
  // (pinned mirrors on CUDA), for `read_counts`.
  void exchange_chunk_counts(slot_type& s, chunk_state& ch, stream_type& st) {
    const auto D = static_cast<std::size_t>(D_);
    const std::int64_t* reported = s.state.rejected ? s.state.reported : nullptr;
    if (this->options_.static_shape) {
      status_.exchange(*this->comm_, st, ch.status, ch.slot_counts, ch.recv_counts,
                       ch.plan.error_word(), ch.error, reported);
      return;
    }
    status_.exchange(*this->comm_, st, ch.status, ch.plan.send_counts().data(), ch.recv_counts,
                     ch.plan.error_word(), ch.error, reported);
    Space::copy_to_host(st, ch.send_counts_h.data(), ch.plan.send_counts().data(), D * 8);
    Space::copy_to_host(st, ch.send_displs_h.data(), ch.plan.send_offsets().data(), D * 8);
    Space::copy_to_host(st, ch.recv_counts_h.data(), ch.recv_counts, D * 8);
    if constexpr (!Space::runs_later)
      st.record(ch.counts_ready);
  }

  // Dynamic shapes, once the counts are on the host (a wait through the communicator where host
  // code runs at enqueue time): every rank fails alike if a rank's status says so; else the
  // receive layout is planned and uploaded.
  void read_counts(slot_type& s, chunk_state& ch, stream_type& st) {
    const auto decide = [this, &ch, &s] {
      if (std::exception_ptr failed = status_.failure(ch.status)) {
        s.failed_together = true; // every rank raises it here
        std::rethrow_exception(failed);
      }
      abort_peers_on_failure(*this->comm_, [&] { plan_receive(ch); });
    };
    if constexpr (Space::runs_later) {
      Space::on_host(st, decide);
    } else {
      wait_watched(*this->comm_, ch.counts_ready);
      decide();
    }
    Space::copy_from_host(st, ch.recv_displs, ch.recv_displs_h.data(),
                          static_cast<std::size_t>(D_) * 8);
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
                 " planned from max_tokens = ", this->options_.max_tokens,
                 " (a rank passed more tokens, or the ranks' options differ)");
  }

  // The all-to-all back: the receive layout returns to the send layout.
  void exchange_back(chunk_state& ch, stream_type& s, std::byte* from, std::byte* to,
                     std::size_t unit) {
    if (this->options_.static_shape)
      all_to_all_v(*this->comm_, s, from, uniform_counts_, uniform_displs_, to, uniform_counts_,
                   uniform_displs_, unit);
    else
      all_to_all_v(*this->comm_, s, from, ch.recv_counts_h, ch.recv_displs_h, to, ch.send_counts_h,
                   ch.send_displs_h, unit);
  }

  const std::int64_t* receive_displs(const chunk_state& ch) const {
    return this->options_.static_shape ? static_displs_ : ch.recv_displs;
  }

  void enqueue_open_experts(slot_type& s, int c, stream_type& st) {
    chunk_state& ch = s.state.chunks[static_cast<std::size_t>(c)];
    const std::size_t epd = ch.experts.max_epd_rows();
    const std::int64_t* count = ch.experts.epd_rows_count();
    if (s.backward) {
      call_state& cs = s.state;
      const auto received = rows_view(ch.recv, recv_cap_);
      moves::gather(st, received, rows_view(cs.grad_dy, epd), ch.experts.epd_row_source().data(),
                    nullptr, count);
      moves::gather(st, received, rows_view(cs.grad_scaled, epd),
                    ch.experts.epd_row_source().data(), ch.experts.epd_weight().data(), count);
      // dL/dw of each EPD row: <dy, expert output>, before the outputs make room for dL/dx.
      moves::dot(st, rows_view(cs.grad_dy, epd), rows_view(ch.epd_out, epd), cs.grad_dot, count);
      Space::for_each(st, static_cast<std::int64_t>(recv_cap_ * static_cast<std::size_t>(k_)),
                      detail::entry_dw_step{ch.experts.row_epd().data(), cs.grad_dot, ch.send_dw});
      return;
    }
    const auto k = static_cast<std::size_t>(k_);
    ch.experts.build(st, std::span<const route_entry>(ch.recv_routes, recv_cap_ * k),
                     ch.recv_counts, receive_displs(ch));
    Space::for_each(st, 1,
                    detail::received_rows_step{ch.recv_counts, D_, ch.experts.epd_rows_count(),
                                               ch.recv_total, s.state.counters});
    if (this->options_.fp8_dispatch)
      scatter_quantized(ch, st, epd);
    else
      moves::gather(st, rows_view(ch.recv, recv_cap_), rows_view(ch.epd_in, epd),
                    ch.experts.epd_row_source().data(), nullptr, count);
    Space::for_each(st, static_cast<std::int64_t>(ch.count * k),
                    detail::pair_expert_rows_step{
                        s.args.ids.data() + ch.first * k, ch.plan.kept_experts().data(),
                        ch.plan.pair_devices().data(), ch.plan.token_rows().data(),
                        ch.plan.send_offsets().data(), receive_displs(ch),
                        ch.experts.row_epd().data(), k_, this->rank_,
                        static_cast<std::int64_t>(slot_rows_), ch.expert_rows});
  }

  // FP8 dispatch: the received codes and scales into the expert layout, and their dequantised
  // values when asked for.
  void scatter_quantized(chunk_state& ch, stream_type& st, std::size_t epd) {
    const auto [codes, scales] = wire_views(ch.recv_fp8, recv_cap_);
    const std::int64_t* source = ch.experts.epd_row_source().data();
    const std::int64_t* count = ch.experts.epd_rows_count();
    moves::gather(st, codes, codes_view(ch.epd_codes, epd), source, nullptr, count);
    moves::gather(st, scales, scales_view(ch.epd_scales, epd), source, nullptr, count);
    const fp8_dispatch_options& f = *this->options_.fp8_dispatch;
    if (f.dequantized_inputs)
      quant::dequantize(st, codes_view(ch.epd_codes, epd), scales_view(ch.epd_scales, epd),
                        rows_view(ch.epd_in, epd), nullptr, count, f.blocks);
  }

  void enqueue_experts_callback(slot_type& s, int c, stream_type& st) {
    const bool backward = s.backward; // host spaces run it later, maybe in the next phase
    launch_fail_stop(st, false, [this, &s, c, backward](stream_arg) {
      if (backward)
        s.args.experts_grad(experts_grad_of(s, c));
      else
        s.args.experts(experts_of(s, c));
    });
  }

  // EPD -> one row per received row (gate-weighted in the forward), back in received order.
  void enqueue_close_experts(slot_type& s, int c, stream_type& st) {
    chunk_state& ch = s.state.chunks[static_cast<std::size_t>(c)];
    const bool fixed = this->options_.static_shape;
    moves::merge(st, rows_view(ch.epd_out, ch.experts.max_epd_rows()),
                 rows_view(ch.back, recv_cap_), ch.experts.row_epd().data(), k_,
                 s.backward ? nullptr : ch.experts.row_weight().data(),
                 fixed ? nullptr : ch.recv_total, fixed);
  }

  void enqueue_combine(slot_type& s, int c, stream_type& st) {
    chunk_state& ch = s.state.chunks[static_cast<std::size_t>(c)];
    exchange_back(ch, st, ch.back, ch.returned,
                  this->options_.hidden * size_of(this->options_.element));
    if (s.backward)
      exchange_back(ch, st, reinterpret_cast<std::byte*>(ch.send_dw),
                    reinterpret_cast<std::byte*>(ch.returned_dw),
                    static_cast<std::size_t>(k_) * sizeof(float));
  }

  void enqueue_finish(slot_type& s, int c, stream_type& st) {
    chunk_state& ch = s.state.chunks[static_cast<std::size_t>(c)];
    const auto& args = s.args;
    const std::int64_t* token_rows =
        this->options_.static_shape ? ch.layout_rows : ch.plan.token_rows().data();
    moves::merge(st, rows_view(ch.returned, send_cap_),
                 (s.backward ? args.dx : args.y).subrows(ch.first, ch.count), token_rows, k_,
                 nullptr, nullptr, false);
    if (!s.backward && args.hooks != nullptr && args.hooks->consume)
      launch_fail_stop(st, false,
                       [hooks = args.hooks, first = ch.first, count = ch.count](stream_arg ls) {
                         hooks->consume(first, count, ls);
                       });
    if (s.backward)
      Space::for_each(
          st, static_cast<std::int64_t>(ch.count),
          detail::token_dw_step{ch.plan.kept_experts().data(), ch.plan.pair_devices().data(),
                                ch.plan.token_rows().data(), ch.plan.send_offsets().data(), k_, D_,
                                static_cast<std::int64_t>(slot_rows_), ch.returned_dw,
                                args.dw.data() + ch.first * static_cast<std::size_t>(k_)});
  }

  int D_ = 0, k_ = 0;
  std::size_t chunk_tokens_ = 0, slot_rows_ = 0, send_cap_ = 0, recv_cap_ = 0;
  quantized_row_layout wire_; // FP8 dispatch: one packed row of codes and scales
  std::vector<std::int32_t> local_experts_;
  std::vector<std::int64_t> uniform_counts_, uniform_displs_;
  bool initialized_ = false;
  std::int64_t* static_displs_ = nullptr;
  const slot_type* last_forward_ = nullptr;
  device_counts_with_status<Space> status_; // the count exchanges, carrying each rank's status
  // Where `check_errors` and `read_stats` copy flags and counters to (pinned on CUDA).
  host_mirror<Space, std::uint32_t> error_words_;
  host_mirror<Space, std::int64_t> bad_tokens_;
  mutable host_mirror<Space, std::int64_t> counters_h_{counter_count};
};

WEAVE_NAMESPACE_END
