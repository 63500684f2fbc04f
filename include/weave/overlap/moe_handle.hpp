//! \file
//! `moe_handle`: one MoE layer call in flight (DeepEP's dispatch handle, Megatron's token
//! dispatcher state), its per-chunk expert rows (`moe_chunk`) and the chunk iteration that
//! pipelines them (`moe_chunk_range`), for `basic_moe_exchange` in every execution space
//! (`moe_exchange` on host streams, `cuda_moe_exchange` on CUDA).
//!
//! A handle is a move-only lease of one of the exchange's `moe_options::max_in_flight` slots:
//! everything its call needs (plans, received rows, expert offsets, the (token, choice) -> expert
//! row map, what the backward needs) lives in that slot until the handle is released. Its life:
//! ```
//! auto h = layer.dispatch(x, ids, weights, compute, comm);     // moe_phase::dispatched
//! for (auto chunk : layer.chunks(h))                           // chunk c's rows, in stream order
//!   my_grouped_gemm(chunk.experts(), compute);                 //   the caller's expert compute
//! layer.combine(h, y, compute, comm);                          // moe_phase::combined
//! layer.combine_backward(h, dy, compute, comm);                // moe_phase::gradients_dispatched
//! for (auto chunk : layer.chunks(h))
//!   my_grouped_gemm_backward(chunk.experts_grad(), compute);
//! layer.dispatch_backward(h, dx, dw, compute, comm);           // moe_phase::finished
//! ```
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/overlap/detail/layer_life.hpp"

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <memory>
#include <span>
#include <utility>

WEAVE_NAMESPACE_BEGIN

//! Where a handle's call stands (in enqueue order; the streams run it later).
enum class moe_phase : std::uint8_t {
  dispatched,           //!< `dispatch` enqueued; the forward's expert chunks are being iterated
  combined,             //!< `combine` enqueued: the forward is complete in stream order
  gradients_dispatched, //!< `combine_backward` enqueued; the backward's chunks are iterated
  finished,             //!< `dispatch_backward` enqueued: the backward is complete too
};

//! Short name of a phase ("dispatched", ...).
constexpr const char* to_string(moe_phase p) noexcept {
  switch (p) {
  case moe_phase::dispatched:
    return "dispatched";
  case moe_phase::combined:
    return "combined";
  case moe_phase::gradients_dispatched:
    return "gradients_dispatched";
  case moe_phase::finished:
    return "finished";
  }
  return "?";
}

//! Values of the (token, choice) -> expert row map (`moe_chunk::expert_rows`) other than a row.
enum expert_row_mark : std::int64_t {
  expert_row_none = -1,    //!< the choice names no expert (id -1)
  expert_row_dropped = -2, //!< capacity dropped the pair
  expert_row_remote = -3,  //!< the pair's expert is on another device (its row is there)
};

template <class Exchange>
class moe_chunk;
template <class Exchange>
class moe_handle;
template <class Exchange>
class moe_chunk_range;

namespace detail {

template <class Ex>
struct moe_ref;

// The exchanges' internals a handle, a chunk and a chunk range reach, and their private
// constructors (the exchanges and these classes befriend it; nothing here is public API).
struct moe_access {
  template <class Ex>
  static moe_ref<Ex> ref(Ex& ex, int slot) {
    return {&ex, slot, ex.slot_call(slot), ex.life_};
  }
  template <class Ex>
  static bool holds(const Ex& ex, int slot, std::uint64_t call) {
    return ex.slot_holds(slot, call);
  }
  template <class Ex>
  static moe_handle<Ex> make_handle(Ex& ex, int slot) {
    return moe_handle<Ex>(ref(ex, slot));
  }
  template <class Ex>
  static moe_chunk<Ex> make_chunk(const moe_ref<Ex>& r, int c) {
    return moe_chunk<Ex>(r, c);
  }
  template <class Ex>
  static moe_chunk_range<Ex> make_range(Ex& ex, int slot) {
    return moe_chunk_range<Ex>(ref(ex, slot));
  }
  // The slot `h` holds, checking that it is a live handle of `ex` (the exchange alive, the
  // slot still holding its call).
  template <class Ex>
  static int slot_of(const moe_handle<Ex>& h, const Ex& ex) {
    WEAVE_EXPECT(h.ref_.owner == nullptr || h.ref_.owner == &ex, errc::invalid_argument,
                 "the moe handle belongs to another exchange");
    h.ref_.checked();
    return h.ref_.slot;
  }
  // True when `h` is `ex`'s and its call ended in a failure that released its slot.
  template <class Ex>
  static bool stale(const moe_handle<Ex>& h, const Ex& ex) {
    const moe_ref<Ex>& r = h.ref_;
    return r.owner == &ex && layer_life::alive_now(r.life) && !holds(ex, r.slot, r.call);
  }
  template <class Ex>
  static void release(const moe_ref<Ex>& r) noexcept {
    if (layer_life::alive_now(r.life) && holds(*r.owner, r.slot, r.call))
      r.owner->release_slot(r.slot);
  }
  template <class Ex>
  static void advance(Ex& ex, int slot) {
    ex.advance_slot(slot);
  }
  template <class Ex>
  static int current(const Ex& ex, int slot) {
    return ex.current_chunk(slot);
  }
  template <class Ex>
  static void open(Ex& ex, int slot) {
    ex.open_slot(slot);
  }
  template <class Ex>
  static auto experts(const Ex& ex, int slot, int c) {
    return ex.chunk_experts(slot, c);
  }
  template <class Ex>
  static auto experts_grad(const Ex& ex, int slot, int c) {
    return ex.chunk_experts_grad(slot, c);
  }
  template <class Ex>
  static auto expert_rows(const Ex& ex, int slot, int c) {
    return ex.chunk_expert_rows(slot, c);
  }
  template <class Ex>
  static moe_phase phase(const Ex& ex, int slot) {
    return ex.slot_phase(slot);
  }
  template <class Ex>
  static std::size_t tokens(const Ex& ex, int slot) {
    return ex.slot_tokens(slot);
  }
};

// Where a handle, a chunk or a chunk range points: the exchange, its slot, and the call that
// held the slot when it was made (a slot freed after its call failed serves later calls).
template <class Ex>
struct moe_ref {
  Ex* owner = nullptr;
  int slot = -1;
  std::uint64_t call = 0;
  std::shared_ptr<const layer_life> life;

  // The exchange, checking that it is alive.
  Ex& alive() const {
    WEAVE_EXPECT(owner != nullptr, errc::invalid_state,
                 "empty moe handle (moved from, reset, or never dispatched)");
    layer_life::expect_alive(life, "a moe handle, chunk or chunk range");
    return *owner;
  }
  // The exchange, checking that it is alive and that the slot still holds this call (on the
  // thread that issues the layer's calls).
  Ex& checked() const {
    alive();
    WEAVE_EXPECT(moe_access::holds(*owner, slot, call), errc::invalid_state,
                 "the moe handle's call ", call,
                 " ended in a failure and its slot was released: the handle is stale (drop it; "
                 "the layer's next call works if the layer is usable())");
    return *owner;
  }
};
} // namespace detail

//! Chunk `index()` of a handle's call: the expert-major rows one grouped GEMM computes.
//! On host streams (`host_space`) `experts()` / `experts_grad()` are valid once the compute
//! stream has reached the chunk (call them in a task enqueued on it, or after synchronizing it)
//! and throw `errc::invalid_state` before. Where host code runs at enqueue time (CUDA) they are
//! views of the chunk's capacity whose contents are valid in stream order, so work enqueued on
//! `batch.stream` may read them.
template <class Exchange>
class moe_chunk {
 public:
  moe_chunk() = default;

  //! Chunk index within the call.
  int index() const noexcept { return chunk_; }
  //! The forward's expert rows of the chunk (input to read, output to write), grouped by local
  //! expert: `basic_expert_batch<Space>` (`expert_batch` on host streams, `cuda_expert_batch`).
  auto experts() const {
    return detail::moe_access::experts(std::as_const(ref_.alive()), ref_.slot, chunk_);
  }
  //! The backward's rows of the chunk: saved inputs, gate-scaled output gradients to read and
  //! input gradients to write.
  auto experts_grad() const {
    return detail::moe_access::experts_grad(std::as_const(ref_.alive()), ref_.slot, chunk_);
  }
  //! For each (token, choice) of the chunk (k per token, token-major): the pair's row in this
  //! device's expert layout (`experts().input`), or an `expert_row_mark`. On one device every
  //! kept pair has its row (Megatron's permutation map). Valid as `experts()`.
  auto expert_rows() const {
    return detail::moe_access::expert_rows(std::as_const(ref_.alive()), ref_.slot, chunk_);
  }

 private:
  friend struct detail::moe_access;
  moe_chunk(detail::moe_ref<Exchange> ref, int chunk)
      : ref_(std::move(ref))
      , chunk_(chunk) {}
  detail::moe_ref<Exchange> ref_;
  int chunk_ = 0;
};

//! One call in flight: a move-only lease of an exchange slot. Released (the slot returns to the
//! exchange) on destruction or `reset()`. Releasing a handle whose collectives are half
//! enqueued (dispatched but not combined, or gradients dispatched but not dispatched back)
//! aborts the communicator where it can be aborted, since the peers would wait for them forever.
//! A handle is stale once its call ended in a failure the layer recovered from (its slot was
//! released, see docs/faults.md) or its exchange was destroyed: every use then throws
//! `errc::invalid_state`, and releasing it does nothing.
template <class Exchange>
class moe_handle {
 public:
  moe_handle() = default;
  moe_handle(const moe_handle&) = delete;
  moe_handle& operator=(const moe_handle&) = delete;
  moe_handle(moe_handle&& other) noexcept
      : ref_(std::exchange(other.ref_, {})) {}
  moe_handle& operator=(moe_handle&& other) noexcept {
    if (this != &other) {
      reset();
      ref_ = std::exchange(other.ref_, {});
    }
    return *this;
  }
  ~moe_handle() { reset(); }

  //! True while the handle refers to a call (it may be stale: see the class comment).
  bool valid() const noexcept { return ref_.owner != nullptr; }
  explicit operator bool() const noexcept { return valid(); }

  //! Releases the slot (see the class comment); a no-op on an empty or stale handle.
  void reset() noexcept {
    if (ref_.owner != nullptr)
      detail::moe_access::release(std::exchange(ref_, {}));
  }

  //! Where the call stands. Throws `errc::invalid_state` on an empty or stale handle.
  moe_phase phase() const { return detail::moe_access::phase(std::as_const(owner()), ref_.slot); }
  //! Tokens of the call on this rank.
  std::size_t tokens() const {
    return detail::moe_access::tokens(std::as_const(owner()), ref_.slot);
  }
  //! Chunks of the call (`moe_options::chunks`).
  int chunks() const { return owner().options().chunks; }
  //! Chunk `c` of the call (`errc::out_of_range` outside [0, chunks())).
  moe_chunk<Exchange> chunk(int c) const {
    WEAVE_EXPECT(c >= 0 && c < chunks(), errc::out_of_range, "chunk ", c, " of ", chunks());
    return detail::moe_access::make_chunk(ref_, c);
  }
  //! The slot the handle holds (for diagnostics).
  int slot() const noexcept { return ref_.slot; }
  //! The layer's call it is (1 for the layer's first dispatch; for diagnostics).
  std::uint64_t call() const noexcept { return ref_.call; }

 private:
  friend struct detail::moe_access;
  explicit moe_handle(detail::moe_ref<Exchange> ref)
      : ref_(std::move(ref)) {}
  Exchange& owner() const { return ref_.checked(); }
  detail::moe_ref<Exchange> ref_;
};

//! The expert chunks of a handle's current phase, in pipeline order (`exchange.chunks(h)`).
//! Dereferencing gives the current chunk and opens it (its wait for its dispatch and its scatter
//! to the expert layout are issued on the compute stream); stepping closes it (its merge and its
//! combine all-to-all are issued) and dispatches the chunk after next. The caller's expert work
//! of chunk c, issued in the loop body, so overlaps chunk c + 1's dispatch and chunk c - 1's
//! combine; and since a chunk is opened only when asked for, work issued before (another
//! micro-batch's producer or experts) is not held back behind its dispatch.
template <class Exchange>
class moe_chunk_range {
 public:
  //! The end of the range.
  struct sentinel {};

  class iterator {
   public:
    using value_type = moe_chunk<Exchange>;
    using difference_type = std::ptrdiff_t;
    iterator() = default;
    //! The current chunk, its experts stage opened (issued) on first access.
    value_type operator*() const {
      Exchange& ex = ref_.checked();
      detail::moe_access::open(ex, ref_.slot);
      return detail::moe_access::make_chunk(ref_, detail::moe_access::current(ex, ref_.slot));
    }
    iterator& operator++() {
      detail::moe_access::advance(ref_.checked(), ref_.slot);
      return *this;
    }
    void operator++(int) { ++*this; }
    //! The end once every chunk is closed, or once the call ended otherwise (a failure).
    friend bool operator==(const iterator& it, sentinel) {
      const detail::moe_ref<Exchange>& r = it.ref_;
      if (!detail::layer_life::alive_now(r.life) ||
          !detail::moe_access::holds(*r.owner, r.slot, r.call))
        return true;
      return detail::moe_access::current(*r.owner, r.slot) >= r.owner->options().chunks;
    }

   private:
    friend moe_chunk_range;
    explicit iterator(detail::moe_ref<Exchange> ref)
        : ref_(std::move(ref)) {}
    detail::moe_ref<Exchange> ref_;
  };

  iterator begin() const { return iterator(ref_); }
  sentinel end() const { return {}; }

 private:
  friend struct detail::moe_access;
  explicit moe_chunk_range(detail::moe_ref<Exchange> ref)
      : ref_(std::move(ref)) {}
  detail::moe_ref<Exchange> ref_;
};

WEAVE_NAMESPACE_END
