//! \file
//! `moe_exchange_base`: the public API of `basic_moe_exchange` and how it issues a call. It owns
//! the `max_in_flight` slots a handle leases, issues a call's chunk stages in pipeline order
//! (`chunk_pipeline`'s events order them across the two streams), and offers the public API on
//! top of the exchange's stages:
//! - handles: `dispatch` -> `chunks` -> `combine`, and `combine_backward` -> `chunks` ->
//!   `dispatch_backward` (DeepEP's dispatch/combine, Megatron's token_permutation /
//!   token_unpermutation), with the caller computing the experts on its stream;
//! - the callback form, a thin layer on top: `forward` / `backward` run an expert callback per
//!   chunk and keep the last forward's handle for the backward;
//! - overloads of all of them for any tensor type with `tensor_traits` (temporaries that would
//!   dangle are deleted overloads).
//!
//! Issue order of one phase with C chunks (P prepare, D dispatch, X experts, B combine, F
//! finish; X is opened by the library when the caller asks for the chunk, filled by the caller,
//! closed by the library when the caller steps past it):
//!   dispatch: P0 D0 P1 D1;   each chunk c of `chunks`: X(c) B(c) P(c+2) D(c+2) [F(c-1)];
//!   combine: the finishes not issued yet
//! so the streams run compute: P0 P1 X0 P2 X1 F0 P3 X2 F1 ... X(C-1) F(C-2) F(C-1), comm: D0 D1
//! B0 D2 B1 ... B(C-1): chunk c + 1's dispatch under chunk c's experts, chunk c's combine under
//! chunk c + 1's experts (Tutel's overlap degree). F(c-1) is issued during the iteration when
//! the output was given to `chunks` (the callback form does); otherwise all finishes run at
//! `combine`, under the last combine. Calls of different handles interleave freely:
//! issuing handle B's dispatch before handle A's experts puts B's communication under A's
//! computation (DeepSeek-V3's DualPipe overlap of two micro-batches).
//!
//! Fail-stop (docs/faults.md): the ranks agree on the layer's configuration at construction
//! (`agree_on_layer`); a rank's failure before a chunk's dispatch (bad ids or weights, a call
//! rejected for its arguments) travels in-band with that chunk's count exchange, so every rank
//! fails at the same step and the layer stays usable; failures after a dispatch (an expert
//! callback throwing, a half-issued handle released) abort the communicator. `synchronize` is
//! the one wait that reports the root cause; `usable()` says whether the layer can go on.
#pragma once

#include "weave/comm/call_tag.hpp"
#include "weave/comm/communicator.hpp"
#include "weave/comm/fail_stop.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/retain.hpp"
#include "weave/core/tensor.hpp"
#include "weave/core/tensor_args.hpp"
#include "weave/exec/stream.hpp"
#include "weave/overlap/detail/layer_agreement.hpp"
#include "weave/overlap/detail/layer_life.hpp"
#include "weave/overlap/detail/moe_slot.hpp"
#include "weave/overlap/moe_handle.hpp"
#include "weave/overlap/moe_options.hpp"
#include "weave/overlap/pipeline.hpp"
#include "weave/placement/placement.hpp"

#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

WEAVE_NAMESPACE_BEGIN

//! The handle API, the callback form and the tensor-generic overloads of an MoE exchange
//! (`Derived` is `basic_moe_exchange<Space, Comm>`; see the file comment). All calls only enqueue:
//! tensors, spans, hooks and callbacks are borrowed until the streams of the call are synchronized
//! (or, on CUDA, until the streams have run the work).
template <class Derived, class Traits>
class moe_exchange_base {
 public:
  using stream_type = typename Traits::stream_type;
  //! How streams are passed (`stream_type&` on the host, `cuda_stream_ref` by value on CUDA).
  using stream_arg = typename Traits::stream_arg;
  using hooks_type = typename Traits::hooks_type;
  using experts_fn = typename Traits::experts_fn;
  using experts_grad_fn = typename Traits::experts_grad_fn;
  //! A call in flight (see `moe_handle`).
  using handle = moe_handle<Derived>;
  //! One chunk of a call (see `moe_chunk`).
  using chunk = moe_chunk<Derived>;

  moe_exchange_base(const moe_exchange_base&) = delete;
  moe_exchange_base& operator=(const moe_exchange_base&) = delete;

  const moe_options& options() const noexcept { return options_; }
  const placement& where() const noexcept { return placement_; }
  //! Handles that may be alive at once (`moe_options::max_in_flight`).
  int max_in_flight() const noexcept { return static_cast<int>(slots_.size()); }
  //! Handles alive now (the callback form's kept forward counts as one).
  int handles_in_flight() const noexcept {
    int n = 0;
    for (const auto& s : slots_)
      n += s->held ? 1 : 0;
    return n;
  }
  //! The stage events of the most recently issued phase (forward or backward of any handle),
  //! for timings (`measure`, `add_to_trace`) once its streams are synchronized.
  const chunk_pipeline<stream_type>& pipeline() const noexcept { return *last_pipeline_; }
  //! The stage events of `h`'s forward (`backward = false`) or backward.
  const chunk_pipeline<stream_type>& pipeline(const handle& h, bool backward = false) const {
    return slots_[static_cast<std::size_t>(slot_of(h))]->pipelines[backward ? 1 : 0];
  }

  // --- the handle API ---------------------------------------------------------------------

  //! Enqueues the dispatch of `x` (T rows) routed by `ids` / `weights` (k per token, id -1 =
  //! none) and returns its handle: the prepare and dispatch of the first two chunks are issued;
  //! iterate `chunks(h)` to compute the experts, then `combine`. `hooks`
  //! (optional, borrowed) partitions the operators around the layer into the same chunks (see
  //! `moe_chunk_hooks`). Throws `errc::size_mismatch` / `errc::invalid_argument` for shapes or
  //! memory that disagree with the options, `errc::invalid_state` when `max_in_flight`
  //! handles are alive. A slot whose last call is still queued on host streams is first waited
  //! for (with several slots, a free one whose work is done is preferred). A call rejected
  //! here still takes its turn in the collective schedule, carrying the error to the peers
  //! (they fail at its first count exchange with a `peer_error` naming this rank).
  handle dispatch(const_token_view x, std::span<const std::int32_t> ids,
                  std::span<const float> weights, stream_arg compute, stream_arg comm,
                  const hooks_type* hooks = nullptr);

  //! The expert chunks of `h`'s current phase, in pipeline order (see `moe_chunk_range`):
  //! `for (auto chunk : layer.chunks(h)) enqueue the experts of chunk.experts() on compute`.
  moe_chunk_range<Derived> chunks(handle& h) {
    return detail::moe_access::make_range(self(), slot_for_call(h));
  }

  //! `chunks(h)` of a forward whose output `y` is given now: chunk c's finish (its rows of `y`,
  //! and a chunk hook's consumer) is issued after chunk c + 1's experts, so it runs under the
  //! next combine instead of after the last chunk (what Lancet's partitioning of the consumer
  //! needs). `combine(h, y, ...)` must then name the same `y`.
  moe_chunk_range<Derived> chunks(handle& h, token_view y);

  //! `chunks(h)` of a backward whose outputs `dx`, `dw` are given now (see the forward form);
  //! `dispatch_backward` must then name the same ones.
  moe_chunk_range<Derived> chunks(handle& h, token_view dx, std::span<float> dw);

  //! Enqueues the combine of `h`'s forward into `y` (T rows): y[t] = sum over kept choices j
  //! of weights[t, j] * expert(ids[t, j])(x[t]), from the expert outputs the caller wrote.
  //! Every chunk must have been iterated (the last one at least opened). Throws
  //! `errc::invalid_state` otherwise or in another phase, `errc::size_mismatch` for a `y` of
  //! other rows.
  void combine(handle& h, token_view y, stream_arg compute, stream_arg comm);

  //! Enqueues the backward's dispatch of `dy` (T rows, the gradient of `combine`'s output) to
  //! the expert devices (the backward of `combine`). Each chunk's `experts_grad()` then holds
  //! the saved expert inputs and the gate-scaled output gradients; the caller writes the input
  //! gradients. Needs `save_for_backward` and a combined handle (`errc::invalid_state`). Bad
  //! arguments abort the communicator (no count exchange carries them).
  void combine_backward(handle& h, const_token_view dy, stream_arg compute, stream_arg comm);

  //! Enqueues the return of the experts' input gradients (the backward of `dispatch`): `dx`
  //! (T rows) and the gate-weight gradients `dw` (k per token; 0 for dropped or absent
  //! choices). Every chunk must have been iterated, as for `combine`.
  void dispatch_backward(handle& h, token_view dx, std::span<float> dw, stream_arg compute,
                         stream_arg comm);

  // --- the callback form ------------------------------------------------------------------

  //! Enqueues a whole forward: `dispatch`, `experts` on every chunk (run as `Derived`
  //! documents: on the compute stream's thread on the host, at enqueue time with a stream on
  //! CUDA), `combine` into `y`. With `save_for_backward` it keeps the handle for `backward`
  //! (so it holds one of the `max_in_flight` slots until the next `forward`). Results equal the
  //! handle form's bitwise.
  void forward(const_token_view x, std::span<const std::int32_t> ids,
               std::span<const float> weights, token_view y, experts_fn experts, stream_arg compute,
               stream_arg comm, const hooks_type* hooks = nullptr);

  //! Enqueues the backward of the last `forward` (needs `save_for_backward`): `experts_grad`
  //! computes each chunk's input gradients; writes `dx` and the gate gradients `dw`.
  void backward(const_token_view dy, token_view dx, std::span<float> dw,
                experts_grad_fn experts_grad, stream_arg compute, stream_arg comm);

  // --- waiting and failures ---------------------------------------------------------------

  //! The one wait: waits for both streams (through the communicator, see `wait_watched`) and
  //! rethrows the root cause of a failure: this rank's own error, else a peer's failure naming
  //! its rank, code and message. Observes the failures of both streams and the flags the
  //! layer's steps set (`check_errors`), in every space.
  //! After a failure that left the layer usable (an in-band one), every call that was in flight
  //! is over on every rank: their slots are free and their handles stale (their uses throw
  //! `errc::invalid_state`, releasing them does nothing), so the next call works at once.
  void synchronize(stream_arg compute, stream_arg comm);

  //! False once the communicator was aborted (a failure after a dispatch, a timeout, a
  //! half-issued handle released): every later call fails; rebuild the communicator and the
  //! layer. Failures that travelled in-band (bad input found before a dispatch, a rejected call)
  //! leave it true: after `synchronize` reported them, the layer can be called again.
  bool usable() const { return !communicator_aborted(*comm_); }

  // --- any tensor type --------------------------------------------------------------------

  //! `dispatch` for any tensor type with `tensor_traits` (`x`), and any span, contiguous range
  //! or packed 2-D int32 / f32 tensor (`ids`, `weights`). Temporaries that own their memory are
  //! rejected at compile time (the deleted overload below): name them, or pass a view.
  template <class X, class Ids, class W>
  requires(!dangling_tensor_arg<X> && !dangling_tensor_arg<Ids> && !dangling_tensor_arg<W>) handle
      dispatch(X&& x, Ids&& ids, W&& weights, stream_arg compute, stream_arg comm,
               const hooks_type* hooks = nullptr) {
    return dispatch(detail::as_const_rows(x), detail::as_elements<const std::int32_t>(ids, "ids"),
                    detail::as_elements<const float>(weights, "weights"), compute, comm, hooks);
  }
  //! Deleted: an argument is a temporary owning its memory, which would dangle while the call's
  //! work is queued. Keep the tensor in a named variable (or pass a view of it).
  template <class X, class Ids, class W>
  requires(dangling_tensor_arg<X> || dangling_tensor_arg<Ids> || dangling_tensor_arg<W>) handle
      dispatch(X&& x, Ids&& ids, W&& weights, stream_arg compute, stream_arg comm,
               const hooks_type* hooks = nullptr)
  = delete;

  //! `combine` into any mutable tensor with `tensor_traits`.
  template <class Y>
  requires(!dangling_tensor_arg<Y>) void combine(handle& h, Y&& y, stream_arg compute,
                                                 stream_arg comm) {
    combine(h, detail::as_mutable_rows(y), compute, comm);
  }
  //! Deleted: a temporary output tensor would dangle (and its result be lost).
  template <class Y>
  requires dangling_tensor_arg<Y>
  void combine(handle& h, Y&& y, stream_arg compute, stream_arg comm) = delete;

  //! `chunks(h, y)` with any mutable tensor with `tensor_traits`.
  template <class Y>
  requires(!dangling_tensor_arg<Y>) moe_chunk_range<Derived> chunks(handle& h, Y&& y) {
    return chunks(h, detail::as_mutable_rows(y));
  }
  //! Deleted: a temporary output tensor would dangle.
  template <class Y>
  requires dangling_tensor_arg<Y> moe_chunk_range<Derived> chunks(handle& h, Y&& y)
  = delete;

  //! `chunks(h, dx, dw)` with any mutable tensors with `tensor_traits`.
  template <class Dx, class Dw>
  requires(!dangling_tensor_arg<Dx> &&
           !dangling_tensor_arg<Dw>) moe_chunk_range<Derived> chunks(handle& h, Dx&& dx, Dw&& dw) {
    return chunks(h, detail::as_mutable_rows(dx), detail::as_elements<float>(dw, "dw"));
  }
  //! Deleted: a temporary output tensor would dangle.
  template <class Dx, class Dw>
  requires(dangling_tensor_arg<Dx> ||
           dangling_tensor_arg<Dw>) moe_chunk_range<Derived> chunks(handle& h, Dx&& dx, Dw&& dw)
  = delete;

  //! `combine_backward` from any tensor with `tensor_traits`.
  template <class Dy>
  requires(!dangling_tensor_arg<Dy>) void combine_backward(handle& h, Dy&& dy, stream_arg compute,
                                                           stream_arg comm) {
    combine_backward(h, detail::as_const_rows(dy), compute, comm);
  }
  //! Deleted: a temporary gradient tensor would dangle.
  template <class Dy>
  requires dangling_tensor_arg<Dy>
  void combine_backward(handle& h, Dy&& dy, stream_arg compute, stream_arg comm) = delete;

  //! `dispatch_backward` into any mutable tensors with `tensor_traits` (`dw`: a span, a
  //! contiguous range or a packed f32 tensor).
  template <class Dx, class Dw>
  requires(!dangling_tensor_arg<Dx> &&
           !dangling_tensor_arg<Dw>) void dispatch_backward(handle& h, Dx&& dx, Dw&& dw,
                                                            stream_arg compute, stream_arg comm) {
    dispatch_backward(h, detail::as_mutable_rows(dx), detail::as_elements<float>(dw, "dw"), compute,
                      comm);
  }
  //! Deleted: a temporary output tensor would dangle (and its result be lost).
  template <class Dx, class Dw>
  requires(dangling_tensor_arg<Dx> || dangling_tensor_arg<Dw>) void dispatch_backward(
      handle& h, Dx&& dx, Dw&& dw, stream_arg compute, stream_arg comm) = delete;

 protected:
  using slot_type = detail::moe_slot<Traits>;
  using comm_type = typename Traits::comm_type;

  //! Checks the options and the placement against the communicator (`validate`: the derived
  //! exchange's own checks), agrees on them with every rank (`agree_on_layer`, collective) and
  //! creates the slots.
  template <class Validate>
  moe_exchange_base(comm_type& comm, placement where, moe_options options, const std::string& kind,
                    Validate&& validate)
      : comm_(&comm)
      , layer_serial_(agree_on_layer(comm, kind, where, options, std::forward<Validate>(validate)))
      , placement_(std::move(where))
      , options_(options) {
    rank_ = comm.rank();
    abandoned_ = abandoned_flag_of(comm);
    for (int i = 0; i < options_.max_in_flight; ++i)
      slots_.push_back(std::make_unique<slot_type>(options_.chunks));
    last_pipeline_ = &slots_.front()->pipelines[0];
  }

  ~moe_exchange_base() = default;

  //! What the derived exchange's destructor calls first (its state must outlive the work queued
  //! on it): a call whose collectives are half issued (or whose backward is expected) aborts the
  //! communicator, so the peers fail at once with a `peer_error` naming this cause instead of
  //! waiting out their timeout; then it waits for everything the layer queued, on streams alive
  //! or not (through events), and marks the layer dead for the handles that outlive it.
  void shutdown() noexcept;

  slot_type& slot(int i) noexcept { return *slots_[static_cast<std::size_t>(i)]; }
  const slot_type& slot(int i) const noexcept { return *slots_[static_cast<std::size_t>(i)]; }
  std::span<const std::unique_ptr<slot_type>> slots() const noexcept { return slots_; }

  int slot_of(const handle& h) const { return detail::moe_access::slot_of(h, self()); }

  // The slot of a call that is about to issue work. A handle whose call failed together on
  // every rank (stale) throws and aborts nothing: every rank's call failed alike. Any other
  // misuse (an empty handle, another exchange's) aborts the communicator: the peers would wait
  // for this rank's collectives.
  int slot_for_call(const handle& h) {
    if (detail::moe_access::stale(h, self()))
      return slot_of(h); // throws
    int i = -1;
    abort_peers_on_failure(*comm_, [&] { i = slot_of(h); });
    return i;
  }

  //! True while slot `i` holds call `call` (a handle's call: see `moe_handle`).
  bool slot_holds(int i, std::uint64_t call) const noexcept {
    return i >= 0 && i < max_in_flight() && slot(i).held && slot(i).call == call;
  }
  std::uint64_t slot_call(int i) const noexcept { return slot(i).call; }

  static stream_type& load(typename slot_type::stream_store& s) { return *s; }
  //! A stored stream as it is passed (a reference to a host stream, a CUDA stream by value).
  static stream_arg arg_of(const typename slot_type::stream_store& s) { return *s; }

  //! Token range [first, first + count) of chunk `c` of a call of `tokens` tokens.
  std::pair<std::size_t, std::size_t> chunk_range(std::size_t tokens, int c) const noexcept {
    const auto C = static_cast<std::size_t>(options_.chunks), i = static_cast<std::size_t>(c);
    return {tokens * i / C, tokens * (i + 1) / C - tokens * i / C};
  }

  //! The tag of chunk `c`'s dispatch (`combine` false) or combine of `s`'s current phase: every
  //! collective of the stage carries it, so ranks at different calls fail with
  //! `errc::call_mismatch` instead of exchanging one call's rows for another's.
  call_tag tag_of(const slot_type& s, int c, bool combine) const noexcept {
    const call_stage stage =
        s.backward ? (combine ? call_stage::backward_combine : call_stage::backward_dispatch)
                   : (combine ? call_stage::combine : call_stage::dispatch);
    return call_tag::of(layer_serial_, s.call, stage, c);
  }

  comm_type* comm_;
  std::shared_ptr<const std::atomic<bool>> abandoned_; // the communicator's (abandoned_flag_of)
  std::uint32_t layer_serial_ = 0; // this layer on `comm_`, the same on every rank
  placement placement_;
  moe_options options_;
  int rank_ = 0;

 private:
  friend struct detail::moe_access;

  Derived& self() noexcept { return static_cast<Derived&>(*this); }
  const Derived& self() const noexcept { return static_cast<const Derived&>(*this); }

  // The checks of a call's arguments and of a handle's state (moe_exchange_checks.hpp).
  void check_rows(const const_token_view& v, const char* what, std::size_t tokens) const;
  void check_dispatch(const const_token_view& x, std::span<const std::int32_t> ids,
                      std::span<const float> weights, const hooks_type* hooks,
                      const stream_type& compute, const stream_type& comm) const;
  // The comm stream of a phase carries its collectives in the order every rank issues them:
  // a phase ends on the stream it started on.
  void check_comm(const slot_type& s, const stream_type& comm, const char* call) const;
  void check_backward_outputs(const slot_type& s, const token_view& dx, std::span<float> dw) const;
  // An output given early (to `chunks`) is already being written: the end of the phase must
  // name the same rows.
  void check_same_output(const slot_type& s, const token_view& early, const token_view& now,
                         const char* call) const;
  void expect_phase(const slot_type& s, moe_phase want, const char* call) const;

  // A free slot, preferring one whose last work has completed; on host streams a slot's last
  // call must have run before its arguments and buffers are reused.
  handle acquire(std::size_t tokens);

  // A call rejected on the host (bad arguments) takes its turn in the collective schedule: a
  // call of no tokens is issued on a free slot with `failure` carried by its count exchanges
  // (`Derived::enqueue_rejected`), so the peers fail at the same step and the layer stays
  // usable. With no free slot (or one stream given twice) the communicator is aborted instead.
  void reject(const std::exception_ptr& failure, stream_arg compute, stream_arg comm);

  // Issues `f` (a step of slot `s`'s phase that enqueues collectives); if it throws, the phase
  // ends here: a failure every rank raises alike (`failed_together`) leaves the communicator
  // as it is, any other one aborts it, since the peers would wait for this rank's collectives.
  template <class F>
  void issue_or_end(slot_type& s, F&& f);

  void release_slot(int i) noexcept;
  void end_calls_in_flight() noexcept;
  void note_enqueued(slot_type& s);

  // Opens a phase: waits for the slot's earlier work on the other stream, issues the
  // prepare and dispatch of the first two chunks and opens chunk 0's experts.
  void start(int i, bool backward, stream_arg compute, stream_arg comm);

  void prepare_next(slot_type& s);

  // Opens the next chunk's experts stage (its wait for the chunk's dispatch, the scatter to
  // the expert layout) when the caller first asks for the chunk: issued then, it does not hold
  // the compute stream back from work issued earlier (another micro-batch's producer).
  void open_slot(int i);

  void comm_stage(slot_type& s, pipeline_stage stage, int c);

  // Issues the rest of a deferred dispatch (see `enqueue_dispatch`): the host waits for its
  // counts, which were exchanged when the dispatch was issued, at the latest step that needs
  // them: before the layer's next collective, or when the chunk's experts open. So the host
  // blocks one step later than the count exchange, while the compute stream has the experts
  // issued in between (with dynamic shapes on CUDA, a combine overlaps the next chunk's
  // experts). A failure the counts carry ends the pending slot's phase on every rank alike.
  void flush_dispatch();

  // Closes the current chunk (merge, then its combine all-to-all; opened first if the caller did
  // not ask for it) and dispatches the chunk after next.
  void advance_slot(int i);

  void finish_chunk(slot_type& s, int c, stream_type& compute);

  // Ends a phase: closes the last chunk if it is still open, then issues every chunk's finish
  // on `compute`.
  void finish_phase(int i, stream_arg compute, moe_phase next);

  // Marks the end of the slot's work on both streams for its next phase and for `acquire`. Not in
  // a capture: those events would be captured ones, which CUDA refuses to query or to wait for
  // from outside the capture; a captured phase ends with its comm work joined into the compute
  // stream (its last finish waits for its last combine).
  void mark_done(slot_type& s, stream_arg compute);

  int current_chunk(int i) const { return slot(i).current; }
  moe_phase slot_phase(int i) const { return slot(i).phase; }
  std::size_t slot_tokens(int i) const { return slot(i).tokens; }

  std::vector<std::unique_ptr<slot_type>> slots_;
  const chunk_pipeline<stream_type>* last_pipeline_ = nullptr;
  std::uint64_t calls_ = 0; // dispatches so far (the call of a slot's `call_tag`s)
  // Whether this exchange is alive, for handles, chunks and ranges that outlive it.
  std::shared_ptr<detail::layer_life> life_ = std::make_shared<detail::layer_life>();
  // A dispatch whose data all-to-all waits for its counts on the host (`flush_dispatch`).
  struct pending_dispatch {
    slot_type* slot = nullptr;
    int chunk = -1;
  };
  pending_dispatch pending_;
  handle last_; // the callback form's last forward (declared after the slots it holds)
};

WEAVE_NAMESPACE_END

#include "weave/overlap/detail/moe_exchange_calls.hpp"  // the calls, out of the class
#include "weave/overlap/detail/moe_exchange_checks.hpp" // the checks, out of the class
#include "weave/overlap/detail/moe_exchange_issue.hpp"  // how a phase is issued, out of the class
