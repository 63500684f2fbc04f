//! \file
//! `decode_handle` and `decode_experts`: a decode exchange's call between its dispatch and its
//! combine, and the view of its expert rows (one type in every execution space).
#pragma once

#include "weave/comm/communicator.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/memory.hpp"
#include "weave/core/tensor.hpp"
#include "weave/exec/stream.hpp"
#include "weave/overlap/detail/layer_life.hpp"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>

WEAVE_NAMESPACE_BEGIN

//! The expert rows of a decode call, per local expert slot: what the caller's experts read and
//! write between `dispatch` and `combine`. A copyable view. Local slot `l`'s rows are source
//! 0's, then source 1's, ... (each source's in its token order): `rows(l)` rows of `hidden`
//! elements, pool rows [first(l), first(l) + rows(l)) of `input_pool()` / `output_pool()`.
//!
//! In every space the arrays (`slot_rows()`, `slot_first()`, ...) are memory of the exchange's
//! space, valid in stream order after the dispatch and before the combine: a CUDA grouped GEMM
//! reads them on the stream. Where that memory is host memory the per-slot accessors (`busy`,
//! `rows`, `input`, `output`, ...) read them: on host streams in a task enqueued after the
//! dispatch, or after synchronizing its stream (before the dispatch has run, after it failed, or
//! once a later dispatch ran they throw `errc::invalid_state`).
template <class Exchange>
class decode_experts {
 public:
  using element_type = typename Exchange::element_type;
  using space = typename Exchange::space;
  static constexpr bool host_memory = space::memory == memory_space::host;

  //! Local expert slots of this rank.
  int local_experts() const { return alive().where().slots_per_device(); }
  //! The logical expert held by local slot `l`.
  int expert(int l) const { return alive().expert_of_local(l); }
  //! Elements per row.
  std::size_t hidden() const { return alive().options().hidden; }

  // --- the arrays (memory of the space) --------------------------------------------------

  //! Rows per local slot [local_experts], their first pool row [local_experts + 1], rows per
  //! (slot, source) [local_experts][ranks], each source's first row in its slot (same shape).
  const std::int64_t* slot_rows() const { return alive().arrays().slot_rows; }
  const std::int64_t* slot_first() const { return alive().arrays().first; }
  const std::int64_t* source_rows() const { return alive().arrays().source_rows; }
  const std::int64_t* source_first() const { return alive().arrays().source_first; }
  //! The fed slots, ascending, then at index `local_experts()` their count.
  const std::int64_t* busy_slots() const { return alive().arrays().busy; }
  //! The pools: input rows (null with an FP8 dispatch without `dequantized_inputs`), outputs.
  const element_type* input_pool() const { return alive().pool_in(); }
  element_type* output_pool() const { return alive().pool_out(); }
  //! Per slot, where its input rows are when not in the pool (a block of one row a peer sent,
  //! read where it arrived), or null [local_experts].
  const std::byte* const* input_blocks() const { return alive().arrays().block; }
  //! With `gathered_inputs`: each pool row's input where it arrived [pool rows].
  const std::byte* const* input_row_pointers() const { return alive().arrays().row_ptr; }

  // --- per slot, where the arrays are host memory ------------------------------------------

  //! The local slots that received at least one row in this call, ascending: the experts a
  //! call has work for (at decode batch sizes most slots receive nothing).
  std::span<const std::int64_t> busy() const requires host_memory {
    const Exchange& ex = arrived();
    const std::int64_t* b = ex.arrays().busy;
    return {b, static_cast<std::size_t>(b[ex.where().slots_per_device()])};
  }
  //! Rows local slot `l` received from `source` (the count in that message's header).
  std::int64_t rows(int l, int source) const requires host_memory {
    const Exchange& ex = arrived();
    ex.check_local(l);
    ex.check_source(source);
    return ex.arrays().source_rows[l * ex.world() + source];
  }
  //! Rows local slot `l` received from all sources.
  std::int64_t rows(int l) const requires host_memory {
    const Exchange& ex = arrived();
    ex.check_local(l);
    return ex.arrays().slot_rows[l];
  }
  //! Local slot `l`'s input rows (`rows(l)` rows of `hidden` elements). With an FP8 dispatch
  //! these are the dequantised rows, given when `dequantized_inputs` is set; with
  //! `gathered_inputs` they are where they arrived (`input_rows`): `errc::invalid_state`.
  std::span<const element_type> input(int l) const requires host_memory {
    return arrived().expert_input(l);
  }
  //! With `decode_options::gathered_inputs`: local slot `l`'s input rows where they arrived, one
  //! pointer per row, in the order of `input(l)`; `errc::invalid_state` without that option.
  std::span<const element_type* const> input_rows(int l) const requires host_memory {
    return arrived().expert_input_rows(l);
  }
  //! With an FP8 dispatch: local slot `l`'s inputs as they arrived, FP8 codes (`rows(l)` x
  //! hidden) and their f32 scales (`rows(l)` x hidden / block), as two strided views of one
  //! packed buffer. `errc::invalid_state` without an FP8 dispatch.
  const_token_view input_codes(int l) const requires host_memory {
    return arrived().expert_wire(l).first;
  }
  const_token_view input_scales(int l) const requires host_memory {
    return arrived().expert_wire(l).second;
  }
  //! Where the caller writes local slot `l`'s outputs, one row per input row, before `combine`.
  std::span<element_type> output(int l) const requires host_memory {
    return arrived().expert_output(l);
  }

 private:
  friend Exchange;
  decode_experts(const Exchange* ex, std::uint64_t call,
                 std::shared_ptr<const detail::layer_life> life) noexcept
      : ex_(ex)
      , call_(call)
      , life_(std::move(life)) {}
  const Exchange& alive() const {
    detail::layer_life::expect_alive(life_, "a decode_experts view");
    return *ex_;
  }
  const Exchange& arrived() const {
    const Exchange& ex = alive();
    ex.expect_arrived(call_);
    return ex;
  }
  const Exchange* ex_;
  std::uint64_t call_;
  std::shared_ptr<const detail::layer_life> life_;
};

//! A decode call between its dispatch and its combine (`combine` releases it). Move-only.
//! Dropping a dispatched handle without its combine aborts the communicator where it can be
//! aborted (the peers would wait in that combine otherwise); on host streams nothing is aborted
//! after a dispatch that failed (on every rank alike).
template <class Exchange>
class decode_handle {
 public:
  decode_handle() = default;
  decode_handle(decode_handle&& o) noexcept { *this = std::move(o); }
  decode_handle& operator=(decode_handle&& o) noexcept {
    if (this != &o) {
      reset();
      ex_ = std::exchange(o.ex_, nullptr);
      call_ = o.call_;
      life_ = std::move(o.life_);
    }
    return *this;
  }
  ~decode_handle() { reset(); }

  //! True while the handle holds a dispatched call.
  bool valid() const noexcept { return ex_ != nullptr; }
  //! The call's expert rows (`errc::invalid_state` for an empty handle, or one whose exchange
  //! was destroyed): a `decode_experts` view.
  auto experts() const {
    WEAVE_EXPECT(ex_ != nullptr, errc::invalid_state, "an empty decode_handle");
    detail::layer_life::expect_alive(life_, "a decode_handle");
    return ex_->experts_of(call_);
  }
  //! Releases the call (see the class comment); does nothing once the exchange was destroyed.
  void reset() noexcept {
    if (ex_ != nullptr && detail::layer_life::alive_now(life_))
      std::exchange(ex_, nullptr)->release_handle(call_);
    ex_ = nullptr;
  }

 private:
  friend Exchange;
  decode_handle(Exchange* ex, std::uint64_t call,
                std::shared_ptr<const detail::layer_life> life) noexcept
      : ex_(ex)
      , call_(call)
      , life_(std::move(life)) {}
  Exchange* ex_ = nullptr;
  std::uint64_t call_ = 0;
  std::shared_ptr<const detail::layer_life> life_;
};

WEAVE_NAMESPACE_END
