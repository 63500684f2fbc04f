//! \file
//! `decode_handle`, `decode_experts` and `device_decode_experts`: a decode exchange's call
//! between its dispatch and its combine, and the views of its expert rows (of the host
//! `decode_exchange`, and of the device exchange).
#pragma once

#include "weave/comm/communicator.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
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
//! write between `dispatch` and `combine`. A copyable view: valid from when the stream has run
//! the dispatch (in a task enqueued after it, or after synchronizing it) until the stream runs
//! the call's combine; the row accessors throw `errc::invalid_state` before the dispatch has
//! run, after it failed, and once a later dispatch has run.
template <class Exchange>
class decode_experts {
 public:
  using element_type = typename Exchange::element_type;

  //! Local expert slots of this rank.
  int local_experts() const { return alive().where().slots_per_device(); }
  //! The logical expert held by local slot `l`.
  int expert(int l) const { return alive().expert_of_local(l); }
  //! The local slots that received at least one row in this call, ascending: the experts a
  //! call has work for (at decode batch sizes most slots receive nothing, and walking all of
  //! them costs more than the few rows; e.g. 128 slots per rank at E = 256 on 2 ranks).
  std::span<const int> busy() const {
    alive().expect_arrived(call_);
    return ex_->busy_slots();
  }
  //! Rows local slot `l` received from `source` (the count in that message's header).
  std::int64_t rows(int l, int source) const {
    alive().expect_arrived(call_);
    return ex_->received_rows(l, source);
  }
  //! Rows local slot `l` received from all sources.
  std::int64_t rows(int l) const {
    alive().expect_arrived(call_);
    return ex_->received_rows(l);
  }
  //! Local slot `l`'s input rows: source 0's, then source 1's, ... (`rows(l)` rows of
  //! `hidden` elements; each source's in its token order). With an FP8 dispatch these are the
  //! dequantised rows, given when `dequantized_inputs` is set (`errc::invalid_state` otherwise).
  std::span<const element_type> input(int l) const {
    alive().expect_arrived(call_);
    return ex_->expert_input(l);
  }
  //! With `decode_options::gathered_inputs` (host exchange): local slot `l`'s input rows where
  //! they arrived, one pointer per row (`hidden` elements each), in the order of `input(l)`;
  //! `errc::invalid_state` without that option. The rows are read-only and stay valid as long
  //! as this view.
  std::span<const element_type* const> input_rows(int l) const {
    alive().expect_arrived(call_);
    return ex_->expert_input_rows(l);
  }
  //! With an FP8 dispatch (`decode_options::fp8_dispatch`): local slot `l`'s inputs as they
  //! arrived, FP8 codes (`rows(l)` x hidden) and their f32 scales (`rows(l)` x hidden / block),
  //! as two strided views of one packed buffer. `errc::invalid_state` without an FP8 dispatch.
  const_token_view input_codes(int l) const {
    alive().expect_arrived(call_);
    return ex_->expert_wire(l).first;
  }
  const_token_view input_scales(int l) const {
    alive().expect_arrived(call_);
    return ex_->expert_wire(l).second;
  }
  //! Where the caller writes local slot `l`'s outputs, one row per input row, before `combine`.
  std::span<element_type> output(int l) const {
    alive().expect_arrived(call_);
    return ex_->expert_output(l);
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
  const Exchange* ex_;
  std::uint64_t call_;
  std::shared_ptr<const detail::layer_life> life_;
};

//! The expert rows of a device decode call: pointers into memory of the space, whose contents
//! are valid in stream order, after the dispatch and before the combine. Local slot l's inputs
//! are `rows_per_expert` rows of `hidden` elements at `input + l * rows_per_expert * hidden`,
//! of which the first `rows[l]` are valid (source 0's, then source 1's, ...); its outputs go to
//! the same rows of `output`. A failed call has no valid rows.
template <class T>
struct device_decode_experts {
  int local_experts = 0;           //!< local expert slots of this rank
  int sources = 0;                 //!< ranks (each sends at most `max_tokens_per_rank` rows)
  std::size_t hidden = 0;          //!< elements per row
  std::size_t rows_per_expert = 0; //!< room per slot: sources * max_tokens_per_rank rows
  //! [local_experts][rows_per_expert][hidden]; null with an FP8 dispatch that does not ask for
  //! `dequantized_inputs`
  const T* input = nullptr;
  T* output = nullptr; //!< [local_experts][rows_per_expert][hidden]
  //! FP8 dispatch: the rows as they arrived, codes [local_experts][rows_per_expert][hidden]
  //! (e4m3 / e5m2 bytes) and f32 scales [local_experts][rows_per_expert][scales_per_row]
  const std::byte* codes = nullptr;
  const float* scales = nullptr;
  std::size_t scales_per_row = 0;            //!< FP8 dispatch: hidden / block
  const std::int64_t* rows = nullptr;        //!< valid rows per slot [local_experts]
  const std::int64_t* source_rows = nullptr; //!< rows per (slot, source) [local_experts][sources]
  const std::int64_t* source_offsets = nullptr; //!< first row of each (slot, source), same shape
  std::span<const std::int32_t> experts; //!< (host memory) logical expert of each slot, -1 empty

  //! Local slot `l`'s input and output rows (and, with an FP8 dispatch, codes and scales).
  const T* input_of(int l) const noexcept { return input + offset(l); }
  const std::byte* codes_of(int l) const noexcept { return codes + offset(l); }
  const float* scales_of(int l) const noexcept {
    return scales + static_cast<std::size_t>(l) * rows_per_expert * scales_per_row;
  }
  T* output_of(int l) const noexcept { return output + offset(l); }

 private:
  std::size_t offset(int l) const noexcept {
    return static_cast<std::size_t>(l) * rows_per_expert * hidden;
  }
};

//! A decode call between its dispatch and its combine (`combine` releases it). Move-only.
//! Dropping a dispatched handle without its combine aborts the communicator where it can be
//! aborted (the peers would wait in that combine otherwise); `decode_exchange` aborts nothing
//! after a dispatch that failed (on every rank alike).
template <class Exchange>
class decode_handle {
 public:
  decode_handle() = default;
  decode_handle(decode_handle&& o) noexcept
      : ex_(std::exchange(o.ex_, nullptr))
      , call_(o.call_)
      , life_(std::move(o.life_)) {}
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
  //! was destroyed): a `decode_experts` view for `decode_exchange`, a `device_decode_experts`
  //! for the device exchange.
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
