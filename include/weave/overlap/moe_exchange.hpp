//! \file
//! `basic_moe_exchange<Space, Comm>`: an MoE layer's communication around the caller's experts,
//! exact and pipelined, written once for every execution space. `moe_exchange<Comm>` is this
//! class on host streams (`host_space`: local_world, MPI), `cuda_moe_exchange<Comm>` on CUDA
//! streams (`cuda_space`: NCCL; `weave/overlap/cuda_exchange.cuh`).
//!
//! Per chunk of tokens (Occult's exact mode, one row per (token, device) both ways): prepare
//! (capacity, replicas, the SFD plan, ORI -> SFD), dispatch (counts carrying every rank's status,
//! then the rows and their routes), experts (the EPD plan and layout, the caller's experts, the
//! gate-weighted merge of each row's local experts), combine (the merged rows back), finish
//! (each token's rows summed in ascending device order). The backward mirrors it. Chunks are
//! pipelined as `moe_exchange_base` describes; results are bitwise identical for every chunk
//! count and every space, and capacity fills cumulatively across chunks.
//!
//! Dynamic shapes (default) pack the rows; static ones (`moe_options::static_shape`) give every
//! peer a slot of `slot_rows()` rows per chunk, so no call waits for the GPU and a call can be
//! captured in a CUDA graph. The workspace (`workspace_size()`) holds what a chunk sends, from
//! `initialize` or taken at the first call; what it receives is sized to what arrives
//! (`memory()`, `detail/moe_exchange_layout.hpp`). On host streams each compute stage runs as
//! one task and a chunk's expert views hold its rows exactly; where host code runs at enqueue
//! time (CUDA) they hold its capacity (docs/exchange.md has the table of what each space does).
//!
//! Fail-stop (docs/faults.md): the ranks agree on the configuration at construction; each
//! chunk's count exchange carries every rank's status, so a failure before a dispatch fails
//! every rank there; a failure after one aborts the communicator; every stage's first
//! collective carries its call's tag. `synchronize` is the one wait that reports the root cause.
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
#include "weave/exec/host_space.hpp"
#include "weave/exec/space.hpp"
#include "weave/exec/stream_allocator.hpp"
#include "weave/overlap/detail/moe_exchange_base.hpp"
#include "weave/overlap/detail/moe_exchange_layout.hpp"
#include "weave/overlap/detail/moe_exchange_state.hpp"
#include "weave/overlap/detail/moe_exchange_steps.hpp"
#include "weave/overlap/moe_options.hpp"
#include "weave/placement/placement.hpp"
#include "weave/routing/host_quant_moves.hpp"
#include "weave/routing/host_row_moves.hpp"
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
struct exchange_traits {
  using comm_type = Comm;
  using stream_type = typename Space::stream_type;
  using stream_arg = typename Space::stream_arg;
  using hooks_type = basic_chunk_hooks<Space>;
  using experts_fn = std::function<void(const basic_expert_batch<Space>&)>;
  using experts_grad_fn = std::function<void(const basic_expert_grad_batch<Space>&)>;
  using state_type = exchange_call_state<Space>;
  static constexpr bool runs_later = Space::runs_later;
};
} // namespace detail

//! A communicator an MoE exchange in `Space` runs over: its streams are the space's, and it
//! exchanges counts and all-to-alls of variable sizes.
template <class Comm, class Space>
concept exchange_communicator =
    communicator<Comm> && std::same_as<typename Comm::stream_type, typename Space::stream_type> &&
    has_exchange_counts<Comm> && has_all_to_all_v<Comm>;

//! The MoE exchange of rank `comm.rank()` in `Space` over `Comm` (see the file comment); its
//! handle API and callback form are `moe_exchange_base`'s.
template <execution_space Space, exchange_communicator<Space> Comm>
class basic_moe_exchange : public moe_exchange_base<basic_moe_exchange<Space, Comm>,
                                                    detail::exchange_traits<Space, Comm>> {
  using base =
      moe_exchange_base<basic_moe_exchange<Space, Comm>, detail::exchange_traits<Space, Comm>>;

 public:
  using space = Space;
  using typename base::handle;
  using typename base::stream_arg;
  using typename base::stream_type;

  //! An exchange for rank `comm.rank()` of `comm.size()` devices placed by `where`. Collective:
  //! checks that every rank builds the layer alike (`agree_on_layer`: `errc::config_mismatch`
  //! on every rank otherwise). Throws `errc::invalid_argument` for bad options (among them an
  //! `fp8_dispatch` block that does not divide `hidden`) or a placement of another size (and its
  //! peers a `peer_error` naming this rank). Allocates no memory of the space: the workspace
  //! comes with `initialize`, or from the layer's allocator at its first call. With `cuda_space`
  //! it needs a current device (it sizes CUB's scratch).
  basic_moe_exchange(Comm& comm, placement where, moe_options options)
      : base(comm, std::move(where), options, "moe_exchange", [] {})
      , status_(
            comm.size(), comm.rank(), !options.static_shape, "moe exchange",
            [this](int rank, std::uint32_t flags) {
              return record_of_call(rank,
                                    [&] { throw_sender_errors(flags & 0xFFFFu, flags >> 16); });
            },
            layout_type::sized_at_call(options) ? 2 : 1,
            device_plan_bad_expert | device_plan_duplicate | device_plan_bad_weight |
                (device_exchange_slot_overflow | device_exchange_bad_count) << 16)
      , tags_(comm.size(), comm.rank(), !has_tagged_collectives<Comm>, "moe exchange",
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
        if (layout_.in_stream())
          ch.epd_cap = 0; // the expert rows grow when a chunk opens
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
  ~basic_moe_exchange() {
    this->shutdown();
    if (abandoned(this->abandoned_)) // MPI may still write into the buffers (until finalize)
      detail::retain_value_until_exit(std::move(owned_));
  }

  bool static_shape() const noexcept { return this->options_.static_shape; }
  //! Rows of each peer's slot per chunk (static shapes; 0 otherwise).
  std::size_t slot_rows() const noexcept { return layout_.slot_rows(); }
  //! Rows a chunk's send buffer holds (static: peers * slot rows).
  std::size_t send_rows_capacity() const noexcept { return layout_.send_cap(); }

  //! Bytes of memory of the space the workspace takes (for `max_in_flight` calls). With dynamic
  //! shapes the buffers sized from each call's counts are not in it (`memory()`).
  std::size_t workspace_size() const {
    workspace_carver measure;
    return carve(*this, measure).used();
  }

  //! Optional: carves every buffer out of the caller's `workspace` (`workspace_size()` bytes,
  //! 256-byte aligned) and initialises the plans on `stream`, before the first call. `allocator`:
  //! where the buffers sized from each call's counts come from (default: the space's
  //! stream-ordered allocation: CUDA's memory pool of the current device, the heap on the host).
  //! Without it the first call takes the workspace from the default allocator, on its compute
  //! stream.
  void initialize(void* workspace, std::size_t bytes, stream_arg stream,
                  stream_allocator<Space> allocator = stream_allocator<Space>::space_default());

  //! What the layer holds now and what its next call may add, in bytes of memory of the space.
  struct memory_report {
    std::size_t workspace = 0; //!< the workspace (`workspace_size()`)
    //! Buffers sized from the calls' counts, held now (grow-only): the receive side at call time
    //! (CUDA), the expert rows (host streams).
    std::size_t held = 0;
    //! The most the next call may add to `held`: every chunk receiving the most it can (each
    //! peer sending every token of a chunk) in every slot, less what is held.
    std::size_t next_call_max = 0;
    //! Everything held now.
    std::size_t total() const noexcept { return workspace + held; }
  };
  memory_report memory() const;

  //! Bytes one chunk's buffers sized from its counts take for `rows` received rows and `epd`
  //! expert (EPD) rows (at call time: its receive side; in the stream: its expert rows), and its
  //! backward's buffers for `epd`. A chunk whose call receives more than its buffers hold
  //! allocates them for `grown(rows)`, `grown(epd)` and frees the old ones (grow-only,
  //! stream-ordered).
  std::size_t receive_bytes_for(std::size_t rows, std::size_t epd) const {
    return layout_.receive_bytes(this->slots().front()->state.chunks.front(), rows, epd);
  }
  std::size_t backward_bytes_for(std::size_t epd) const {
    return layout_.grads_bytes(this->slots().front()->state, epd);
  }
  //! What a buffer outgrown by `need` rows is reallocated for: an eighth to spare.
  static constexpr std::size_t grown(std::size_t need) noexcept { return layout_type::grown(need); }

 private:
  friend base;
  friend struct detail::moe_access;

  // The workspace carved and the plans initialised on `stream` (`initialize`, or the first call).
  void carve_and_initialize(void* workspace, std::size_t bytes, stream_arg stream);

  // The first call of a layer no workspace was given to takes one from its allocator.
  void ensure_initialized(stream_arg compute);

 public:
  //! Frees the buffers sized from the calls' counts (stream-ordered on `stream`: after the work
  //! queued on it, which must follow the layer's last call); the next call sizes them again.
  void trim(stream_arg stream);

  //! What the last forward moved; waits for `stream` (call it after the forward's work was
  //! enqueued on it: its compute stream, or one ordered after it). Throws
  //! `errc::invalid_state` when that forward has not run its combine, or failed (a failed call
  //! returns no numbers).
  moe_stats stats(stream_arg stream) const { return read_counters(*last_forward_, stream); }
  //! What `h`'s forward moved; waits for `stream` (as above, and for `h`'s call).
  moe_stats stats(const handle& h, stream_arg stream) const {
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
  void check_errors(stream_arg stream);

 private:
  friend base;
  friend struct detail::moe_access;
  using moves = row_moves<Space>;
  using quant = quant_moves<Space>;
  using slot_type = typename base::slot_type;
  using chunk_state = detail::exchange_chunk<Space>;
  using call_state = detail::exchange_call_state<Space>;
  using layout_type = detail::exchange_layout<Space>;

  // Throws for a sender's flags: the chunk plans' (`device_plan_error`) and this exchange's own
  // (`device_exchange_error`); used for this rank's and, through the status, for the peers'.
  void throw_sender_errors(std::uint32_t plan, std::uint32_t exchange) const;

  // The one wait (`moe_exchange_base::synchronize`): both streams through the communicator,
  // then the device flags unless the communicator was aborted; rethrows the root cause.
  void synchronize_layer(stream_arg compute, stream_arg comm);

  // A rejected call's turn (see `moe_exchange_base::reject`): on host streams both streams
  // carry `failure` while `issue` enqueues it; on CUDA its record is copied to the device and
  // sent by the call's count exchanges instead of the flags.
  template <class Issue>
  void enqueue_rejected(slot_type& s, const std::exception_ptr& failure, stream_arg compute,
                        stream_arg comm, Issue&& issue);

  // Space::launch for the caller's code. A failure before the dispatch on host streams travels
  // with the count exchange; any other one aborts the communicator, as the peers would
  // otherwise wait for this rank in a collective that carries no status.
  template <class F>
  void launch_fail_stop(stream_type& s, bool before_dispatch, F f);

  // A compute stage after the dispatch (`f(stream)` enqueues its steps): on host streams one
  // task, whose failure aborts the communicator (the peers wait in this chunk's combine);
  // elsewhere `f` runs now and a failure reaches the issuing code, which aborts.
  template <class F>
  void compute_stage(stream_type& s, F f);

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

  moe_stats read_counters(const slot_type& s, stream_arg stream) const;

  // --- checks and accessors (called by the base and by moe_chunk) ---------------------------

  void check_rows(const const_token_view& v, const char* what) const;

  // The rows of chunk c's expert layout the caller sees: on host streams exactly those built,
  // read once the task that opened the chunk (in `direction`: 0 forward, 1 backward) ran;
  // elsewhere the capacity, valid in stream order.
  std::size_t visible_rows(const chunk_state& ch, int c, int direction) const;

  basic_expert_batch<Space> experts_of(const slot_type& s, int c) const;

  basic_expert_grad_batch<Space> experts_grad_of(const slot_type& s, int c) const;

  basic_expert_batch<Space> chunk_experts(int slot, int c) const {
    return experts_of(this->slot(slot), c);
  }
  basic_expert_grad_batch<Space> chunk_experts_grad(int slot, int c) const {
    return experts_grad_of(this->slot(slot), c);
  }
  std::span<const std::int64_t> chunk_expert_rows(int slot, int c) const;

  // --- stages (issued by the base) ----------------------------------------------------------

  void on_dispatch(slot_type& s) {
    last_forward_ = &s;
    for (chunk_state& ch : s.state.chunks)
      for (auto& r : ch.ready)
        r.set(false);
  }

  // Dynamic shapes wait for the GPU once per chunk, which a CUDA graph cannot hold.
  void on_start(slot_type& s, stream_type& compute);

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

  // The counts and displacements the all-to-alls read on the host: on host streams (whose tasks
  // read them when they run) the arrays the steps fill, elsewhere their copies in host memory.
  std::span<std::int64_t> send_counts(chunk_state& ch) const;
  std::span<std::int64_t> send_displs(chunk_state& ch) const;
  std::span<std::int64_t> recv_counts(chunk_state& ch) const;
  std::span<std::int64_t> recv_displs(chunk_state& ch) const;

  const std::int64_t* receive_displs(const chunk_state& ch) const {
    return this->options_.static_shape ? static_displs_ : ch.recv_displs;
  }

  // Receive-side rows the expert plan visits: what the call received where the host knows it
  // (at call time, or in the stream), else the whole buffer (padding included).
  std::size_t built_rows(const chunk_state& ch) const {
    return sized_at_call() || layout_.in_stream() ? ch.rows : ch.rows_cap;
  }

  // Opens chunk c's experts: one task on host streams, the steps enqueued now elsewhere.
  void enqueue_open_experts(slot_type& s, int c, stream_type& st);
  // The forward's: the expert plan, the rows into its layout, the (token, choice) -> expert row
  // map. On host streams the expert rows are sized here, once the plan says how many.
  void open_forward(slot_type& s, int c, stream_type& st);
  // The backward's: the output gradients into the expert layout, plain and gate-scaled, and the
  // gate gradients against the saved outputs.
  void open_backward(slot_type& s, int c, stream_type& st);

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
  stream_allocator<Space> allocator_;       // buffers sized from the calls' counts
  stream_block<Space> owned_; // the workspace, when the layer took it (after `allocator_`)
  std::size_t workspace_bytes_ = 0;
  // Where `check_errors` and `stats` copy flags and counters to (pinned on CUDA).
  host_mirror<Space, std::uint32_t> error_words_;
  host_mirror<Space, std::int64_t> bad_tokens_;
  mutable host_mirror<Space, std::int64_t> counters_h_{counter_count};
};

//! The MoE exchange on host streams (`host_space`): over `local_world`'s communicators or MPI.
template <communicator Comm>
using moe_exchange = basic_moe_exchange<host_space, Comm>;

WEAVE_NAMESPACE_END

// Out of the class: the sending stages, the receiving ones, memory, waits and errors.
#include "weave/overlap/detail/moe_exchange_dispatch.hpp"
#include "weave/overlap/detail/moe_exchange_memory.hpp"
#include "weave/overlap/detail/moe_exchange_stages.hpp"
#include "weave/overlap/detail/moe_exchange_waits.hpp"
