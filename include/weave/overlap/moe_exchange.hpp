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
//! its timeout and abort). `synchronize` is the one wait that reports the root cause. Every
//! stage's first collective carries its call's tag; on communicators without tagged collectives
//! (NCCL) the count exchanges carry it in their blocks and the other stages exchange it first
//! (`device_call_tags`).
#pragma once

#include "weave/comm/communicator.hpp"
#include "weave/comm/device_call_tags.hpp"
#include "weave/comm/device_status_exchange.hpp"
#include "weave/comm/fail_stop.hpp"
#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/tensor.hpp"
#include "weave/core/workspace.hpp"
#include "weave/exec/host_mirror.hpp"
#include "weave/exec/space.hpp"
#include "weave/exec/stream_allocator.hpp"
#include "weave/overlap/device_exchange_layout.hpp"
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
      , status_(
            comm.size(), comm.rank(), !options.static_shape, "device exchange",
            [this](int rank, std::uint32_t flags) {
              return record_of_call(rank,
                                    [&] { throw_sender_errors(flags & 0xFFFFu, flags >> 16); });
            },
            layout_type::sized_at_call(options) ? 2 : 1,
            device_plan_bad_expert | device_plan_duplicate | device_plan_bad_weight |
                (device_exchange_slot_overflow | device_exchange_bad_count) << 16)
      , tags_(comm.size(), comm.rank(), !has_tagged_collectives<Comm>, "device exchange",
              options.strict_call_order && !options.static_shape)
      , layout_(options, this->placement_, comm.size())
      , allocator_(stream_allocator<Space>::space_default()) {
    D_ = comm.size();
    k_ = options.k;
    const int spd = this->placement_.slots_per_device();
    for (int l = 0; l < spd; ++l)
      local_experts_.push_back(this->placement_.expert_of_slot(this->rank_ * spd + l));
    const auto D = static_cast<std::size_t>(D_);
    uniform_counts_.assign(D, static_cast<std::int64_t>(layout_.slot_rows()));
    uniform_displs_.resize(D);
    for (std::size_t d = 0; d < D; ++d)
      uniform_displs_[d] = static_cast<std::int64_t>(d * layout_.slot_rows());
    std::size_t chunk_states = 0;
    for (const auto& s : this->slots()) {
      s->state.construct(this->placement_, options, this->rank_, layout_.chunk_tokens(),
                         layout_.advance_rows(), layout_.advance_epd_rows());
      for (chunk_state& ch : s->state.chunks) {
        status_.size_block(ch.status);
        tags_.size_block(ch.tags);
      }
      chunk_states += s->state.chunks.size();
    }
    error_words_ = host_mirror<Space, std::uint32_t>(3 * chunk_states);
    bad_tokens_ = host_mirror<Space, std::int64_t>(options.fp8_dispatch ? chunk_states : 0);
    last_forward_ = this->slots().front().get();
  }

  //! Waits for the work the layer queued (its state and workspace must outlive it); with calls
  //! in flight (half issued, or a backward due), aborts the communicator first so the peers fail
  //! at once with a `peer_error` naming it. Handles that outlive the layer are stale.
  ~basic_device_exchange() { this->shutdown(); }

  bool static_shape() const noexcept { return this->options_.static_shape; }
  //! Rows of each peer's slot per chunk (static shapes; 0 otherwise).
  std::size_t slot_rows() const noexcept { return layout_.slot_rows(); }
  //! Rows a chunk's send buffer holds (static: peers * slot rows).
  std::size_t send_rows_capacity() const noexcept { return layout_.send_cap(); }

  //! Bytes of memory of the space `initialize` needs (for `max_in_flight` calls). With dynamic
  //! shapes where host code runs at enqueue time (`cuda_space`), the receive-side buffers are not
  //! in it: each call sizes them from the counts it receives (`memory()`).
  std::size_t workspace_size() const {
    workspace_carver measure;
    return carve(*this, measure).used();
  }

  //! Carves every buffer out of `workspace` and initialises the plans on `stream`. `allocator`:
  //! where the buffers sized at call time come from (default: the space's stream-ordered
  //! allocation, CUDA's memory pool of the current device).
  void initialize(void* workspace, std::size_t bytes, stream_arg stream,
                  stream_allocator<Space> allocator = stream_allocator<Space>::space_default()) {
    WEAVE_EXPECT(workspace != nullptr, errc::invalid_argument, "null workspace");
    WEAVE_EXPECT(allocator.allocate && allocator.deallocate, errc::invalid_argument,
                 "a stream_allocator needs both allocate and deallocate");
    workspace_carver carver(workspace, bytes);
    carve(*this, carver);
    allocator_ = std::move(allocator);
    workspace_bytes_ = carver.used();
    for (const auto& s : this->slots()) {
      auto& st = s->state;
      for (chunk_state& ch : st.chunks) {
        ch.plan.initialize(ch.plan_ws, ch.plan.workspace_size(), stream);
        if (sized_at_call())
          ch.experts.initialize_fixed(ch.experts_ws, ch.experts.fixed_workspace_size(), stream);
        else
          ch.experts.initialize(ch.experts_ws, ch.experts.workspace_size(), stream);
        Space::fill(stream, ch.error, 0, sizeof(std::uint32_t));
        Space::fill(stream, ch.status.recv, 0, status_.words() * sizeof(std::int64_t));
        tags_.initialize(stream, ch.tags);
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

  //! What the layer holds now and what its next call may add, in bytes of memory of the space.
  struct memory_report {
    std::size_t workspace = 0; //!< the workspace `initialize` was given (`workspace_size()`)
    std::size_t held = 0;      //!< buffers sized at call time, held now (grow-only)
    //! The most the next call may add to `held`: every chunk receiving the most it can (each
    //! peer sending every token of a chunk) in every slot, less what is held.
    std::size_t next_call_max = 0;
  };
  memory_report memory() const {
    memory_report m{workspace_bytes_, 0, 0};
    if (!sized_at_call())
      return m;
    std::size_t most = 0;
    for (const auto& s : this->slots()) {
      for (const chunk_state& ch : s->state.chunks) {
        m.held += ch.receive.bytes();
        most += layout_.receive_bytes(ch, layout_.recv_cap(), layout_.most_epd_rows());
      }
      m.held += s->state.grads.bytes();
      if (this->options_.save_for_backward)
        most += layout_.grads_bytes(s->state, layout_.most_epd_rows());
    }
    m.next_call_max = most > m.held ? most - m.held : 0;
    return m;
  }

  //! Where the receive side is sized at call time: the bytes one chunk's receive side takes for
  //! `rows` received rows and `epd` expert (EPD) rows, and its backward's buffers for `epd`.
  //! A chunk whose call receives more than its buffers hold allocates them for
  //! `grown(rows)`, `grown(epd)` and frees the old ones (grow-only, stream-ordered).
  std::size_t receive_bytes_for(std::size_t rows, std::size_t epd) const {
    return layout_.receive_bytes(this->slots().front()->state.chunks.front(), rows, epd);
  }
  std::size_t backward_bytes_for(std::size_t epd) const {
    return layout_.grads_bytes(this->slots().front()->state, epd);
  }
  //! What a buffer outgrown by `need` rows is reallocated for: an eighth to spare.
  static constexpr std::size_t grown(std::size_t need) noexcept { return layout_type::grown(need); }

  //! Frees the buffers sized at call time (stream-ordered on `stream`: after the work queued on
  //! it, which must follow the layer's last call); the next call sizes them again.
  void trim(stream_arg stream) {
    stream_type& st = stream;
    for (const auto& s : this->slots()) {
      for (chunk_state& ch : s->state.chunks) {
        ch.receive.release(&st);
        if (sized_at_call())
          ch.rows_cap = ch.epd_cap = 0;
      }
      s->state.grads.release(&st);
      if (sized_at_call())
        s->state.grads_cap = 0;
    }
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
  //! NaN, and no other token's are affected), a peer's count outside the static slot
  //! (`errc::size_mismatch`), else a peer's failure its count exchanges reported (`peer_error`),
  //! else bad received rows. First of all, a peer that was at another call at one of this rank's
  //! count exchanges, or (communicators without tagged collectives) at the tag exchange of a
  //! combine or backward pass (`errc::call_mismatch`, naming both; the communicator is
  //! aborted). Clears the flags.
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
        tags_.take(stream, ch.tags);
        if (fp8) {
          Space::copy_to_host(stream, &bad_tokens[c++], ch.quant_status, sizeof(std::int64_t));
          Space::fill(stream, ch.quant_status, 0xff, sizeof(std::int64_t)); // -1: none
        }
      }
    wait_watched(*this->comm_, stream);
    // A call of another handle at one of this rank's count or tag exchanges explains everything
    // else (its rows were another call's): every rank finds it; the ranks are out of step, so
    // abort.
    for (const auto& s : this->slots())
      for (const chunk_state& ch : s->state.chunks)
        for (std::exception_ptr mismatch :
             {status_.call_mismatch(ch.status), tags_.mismatch(ch.tags)})
          if (mismatch) {
            abort_peers(*this->comm_, mismatch);
            std::rethrow_exception(mismatch);
          }
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
  using layout_type = detail::device_exchange_layout<Space>;

  // Throws for a sender's flags: the chunk plans' (`device_plan_error`) and this exchange's own
  // (`device_exchange_error`); used for this rank's and, through the status, for the peers'.
  void throw_sender_errors(std::uint32_t plan, std::uint32_t exchange) const {
    device_dispatch_plan<Space>::throw_plan_errors(plan, this->placement_.num_experts());
    WEAVE_EXPECT((exchange & device_exchange_slot_overflow) == 0, errc::size_overflow,
                 "a chunk sent more rows to a peer than its static slot of ", layout_.slot_rows(),
                 " rows (moe_options.static_rows_per_peer)");
    WEAVE_EXPECT((exchange & device_exchange_bad_count) == 0, errc::size_mismatch,
                 "a peer announced a row count outside the static slot of ", layout_.slot_rows(),
                 " rows (moe_options.static_rows_per_peer): its rows were not read");
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
    // After an abort the flags are read only when the streams ran every task (a peer may have
    // aborted after this rank's collectives completed with the wrong call's data: the blocks
    // still say so).
    if (!communicator_aborted(*this->comm_) || !waited) {
      try {
        check_errors(compute);
      } catch (...) {
        flagged = std::current_exception();
      }
    }
    if (is_call_mismatch(flagged)) // the ranks were at other calls: that explains the rest
      std::rethrow_exception(flagged);
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

  // Measures (const self, null base) or carves and records the workspace; one code for both.
  template <class Self>
  static workspace_carver& carve(Self& self, workspace_carver& c) {
    const auto set = carve_into<Self>(c);
    set(self.static_displs_, static_cast<std::size_t>(self.D_));
    for (const auto& s : self.slots())
      self.layout_.carve_call(s->state, set, self.status_, self.tags_);
    return c;
  }

  bool sized_at_call() const noexcept { return layout_.at_call(); }

  token_view rows_view(std::byte* p, std::size_t n) const { return layout_.rows_view(p, n); }

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
            layout_.inputs_of(ch, epd),
            rows_view(ch.epd_out, epd),
            base::arg_of(s.phase_compute[0]),
            layout_.codes_of(ch, epd),
            layout_.scales_of(ch, epd)};
  }

  device_expert_grad_batch<Space> experts_grad_of(const slot_type& s, int c) const {
    const chunk_state& ch = s.state.chunks[static_cast<std::size_t>(c)];
    const std::size_t epd = ch.experts.max_epd_rows();
    return {c,
            this->rank_,
            ch.experts.expert_offsets(),
            local_experts_,
            layout_.inputs_of(ch, epd),
            rows_view(s.state.grad_scaled, epd),
            rows_view(ch.epd_out, epd),
            base::arg_of(s.phase_compute[1]),
            layout_.codes_of(ch, epd),
            layout_.scales_of(ch, epd)};
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
    if (s.backward && sized_at_call()) // the forward's counts size the backward's buffers
      layout_.reserve_grads(s.state, allocator_, compute);
  }

  void enqueue_prepare(slot_type& s, int c, stream_type& st);

  void prepare(slot_type& s, int c, stream_type& st);

  // FP8 dispatch, ORI -> the send layout quantised (one quantisation per SFD row); a token
  // holding a NaN or an infinity is sent as NaN and lowers the chunk's status word.
  void quantize_send(chunk_state& ch, stream_type& s, const const_token_view& ori);

  // ORI -> the send layout (packed SFD rows, or fixed slots).
  void gather_send(chunk_state& ch, stream_type& s, const const_token_view& ori);

  // The dispatch of chunk c (the backward's reuses the forward's counts). Returns true when its
  // all-to-alls wait for counts on the host (dynamic shapes, when host code runs at enqueue
  // time, as on CUDA): they are issued by `complete_dispatch`, one step later (see
  // `moe_exchange_base::flush_dispatch`), so the host does not wait here for the comm stream
  // to drain through the previous chunk's combine.
  bool enqueue_dispatch(slot_type& s, int c, stream_type& st);

  // The all-to-alls of a dispatch, after its count exchange (dynamic shapes: the host reads the
  // counts first, unless host code runs later, in the stream, as on host streams).
  void complete_dispatch(slot_type& s, int c, stream_type& st);

  // The count exchange of a chunk (every path's one place), carrying this rank's status.
  // Static shapes keep the counts in memory of the space; dynamic ones copy them to the host
  // (pinned mirrors on CUDA), for `read_counts`.
  void exchange_chunk_counts(slot_type& s, chunk_state& ch, stream_type& st, call_tag tag);

  // Dynamic shapes, once the counts are on the host (a wait through the communicator where host
  // code runs at enqueue time): every rank fails alike if a rank's status says so; else the
  // receive layout is planned and uploaded.
  void read_counts(slot_type& s, chunk_state& ch, stream_type& st);

  // Sized at call time, once the counts are on the host: the chunk's receive side holds what
  // it receives (its rows, and the pairs the senders announced, each at most one per row and
  // local expert).
  void size_receive(chunk_state& ch, stream_type& st);

  // Dynamic shapes, on the host once the counts arrived: the receive layout.
  // Each peer's count is checked before it is added: a garbage count cannot overflow the sum.
  void plan_receive(chunk_state& ch);

  // Communicators without tagged collectives: the tag exchange before a stage's first
  // collective where no count exchange carries the tag (see `device_call_tags`).
  void exchange_stage_tag(chunk_state& ch, stream_type& st, call_tag tag) {
    tags_.exchange(*this->comm_, st, ch.tags, tag);
  }

  // The all-to-all back: the receive layout returns to the send layout.
  void exchange_back(chunk_state& ch, stream_type& s, std::byte* from, std::byte* to,
                     std::size_t unit, call_tag tag = {});

  const std::int64_t* receive_displs(const chunk_state& ch) const {
    return this->options_.static_shape ? static_displs_ : ch.recv_displs;
  }

  // Receive-side rows the expert plan visits: what the call received where the host knows it
  // (sized at call time), else the whole buffer (padding included).
  std::size_t built_rows(const chunk_state& ch) const {
    return sized_at_call() ? ch.rows : ch.rows_cap;
  }

  void enqueue_open_experts(slot_type& s, int c, stream_type& st);

  // FP8 dispatch: the received codes and scales into the expert layout, and their dequantised
  // values when asked for.
  void scatter_quantized(chunk_state& ch, stream_type& st, std::size_t epd);

  void enqueue_experts_callback(slot_type& s, int c, stream_type& st);

  // EPD -> one row per received row (gate-weighted in the forward), back in received order.
  void enqueue_close_experts(slot_type& s, int c, stream_type& st);

  void enqueue_combine(slot_type& s, int c, stream_type& st);

  void enqueue_finish(slot_type& s, int c, stream_type& st);

  int D_ = 0, k_ = 0;
  std::vector<std::int32_t> local_experts_;
  std::vector<std::int64_t> uniform_counts_, uniform_displs_;
  bool initialized_ = false;
  std::int64_t* static_displs_ = nullptr;
  const slot_type* last_forward_ = nullptr;
  device_counts_with_status<Space> status_; // the count exchanges, carrying each rank's status
  device_call_tags<Space> tags_;            // untagged communicators: combines' call checks
  layout_type layout_;                      // the buffers and their sizes
  stream_allocator<Space> allocator_;       // buffers sized at call time
  std::size_t workspace_bytes_ = 0;
  // Where `check_errors` and `read_stats` copy flags and counters to (pinned on CUDA).
  host_mirror<Space, std::uint32_t> error_words_;
  host_mirror<Space, std::int64_t> bad_tokens_;
  mutable host_mirror<Space, std::int64_t> counters_h_{counter_count};
};

WEAVE_NAMESPACE_END

#include "weave/overlap/device_exchange_stages.hpp" // the stages, out of the class
