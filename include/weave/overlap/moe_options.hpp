//! \file
//! Options, per-call statistics and the vocabulary of `basic_moe_exchange`'s callbacks and hooks
//! (one type per execution space; `expert_batch`, `expert_grad_batch` and `moe_chunk_hooks` are
//! the host ones).
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/dtype.hpp"
#include "weave/core/error.hpp"
#include "weave/core/tensor.hpp"
#include "weave/exec/host_space.hpp"
#include "weave/routing/capacity.hpp"
#include "weave/routing/quantize.hpp"

#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

WEAVE_NAMESPACE_BEGIN

//! The quantised forward dispatch (`moe_options::fp8_dispatch`), DeepEP's FP8 dispatch: each
//! row leaves its sender as FP8 codes with one f32 scale per block of `blocks.block` elements
//! (per token, per block amax scaling: `weave/routing/quantize.hpp`), and the expert device
//! hands both to the experts (`expert_batch::input_codes`, `input_scales`). Combine and the
//! backward keep the layer's element type.
struct fp8_dispatch_options {
  dtype format = dtype::e4m3;  //!< the codes: e4m3 (DeepSeek-V3, DeepEP) or e5m2
  block_quantization blocks{}; //!< elements per scale (128), scale rounding, amax floor
  //! Also dequantise the received rows into `expert_batch::input` (and the backward's
  //! `saved_input`) in the layer's element type; otherwise those views are empty and only the
  //! codes and scales are given (an FP8 grouped GEMM reads them directly).
  bool dequantized_inputs = false;
};

//! How a `basic_moe_exchange` is shaped. Its workspace is sized from these, once.
struct moe_options {
  int k = 1;                  //!< experts chosen per token
  std::size_t hidden = 0;     //!< elements per token row
  dtype element = dtype::f32; //!< element type of token rows (f32, f16, bf16)
  std::size_t max_tokens = 0; //!< the most tokens any rank passes to one call
  int chunks = 1;             //!< pipeline degree: token chunks in flight (1 = unpipelined)
  //! Calls in flight at once: handles (`dispatch` to `combine`, or to `dispatch_backward`
  //! for a call that has a backward) alive together, each holding one slot of buffers. 2 lets
  //! one micro-batch's forward run while another's backward is pending (1F1B, DualPipe).
  int max_in_flight = 1;
  capacity_policy capacity{};     //!< capacity factor, drop order, rounding (default: dropless)
  bool save_for_backward = false; //!< keep plans and expert rows of the last forward
  //! Every peer gets a fixed-size slot per chunk and counts stay in memory of the space, so a
  //! call never waits for the GPU and can be captured in a CUDA graph (on the host: no count is
  //! read between the steps; the price is sending whole slots).
  bool static_shape = false;
  //! Rows of each peer's slot per chunk in static mode; 0 = the worst case (every token of a
  //! chunk, or fewer when a capacity factor bounds the experts of a device). Smaller slots send
  //! fewer bytes; a chunk that overflows one fails `check_errors` with `errc::size_overflow`.
  std::size_t static_rows_per_peer = 0;
  //! Dynamic shapes where host code runs at enqueue time (CUDA), over a communicator without
  //! tagged collectives (NCCL), only: the host waits for each combine's and backward stage's
  //! call-tag exchange before it posts the stage's rows, so two handles' stages issued in another
  //! order fail every rank with `errc::call_mismatch` before any row moves, whatever the sizes
  //! (docs/faults.md). The price: one host wait per such chunk, which holds the caller until the
  //! chunk's experts ran. Off (the default), a broken order is found after the rows moved; static
  //! shapes (one message size whatever the call) and tagged communicators need no wait.
  bool strict_call_order = false;
  //! Send the forward dispatch quantised to FP8 (see `fp8_dispatch_options`); empty (the
  //! default): rows travel in `element`. Every rank must pass the same format and block.
  std::optional<fp8_dispatch_options> fp8_dispatch{};
};

//! One chunk's rows on one expert device, grouped by local expert (the EPD layout): rows
//! `[expert_offsets[l], expert_offsets[l + 1])` belong to local slot `l`, which holds logical
//! expert `experts[l]`. A grouped GEMM runs one contiguous range per local expert. An empty
//! slot (`experts[l] == placement::empty_slot`) never receives rows: its range is empty, so a
//! callback that skips empty ranges never looks its expert up.
//!
//! In `host_space` (`expert_batch`) the batch is read when the chunk's rows are ready (in a task
//! of the compute stream, which is where the callback runs): the views hold exactly
//! `expert_offsets[local experts]` rows, the offsets are host memory. Where host code runs at
//! enqueue time (`cuda_space`: `cuda_expert_batch`) the row count is known only in memory of the
//! space: the offsets live there, the views hold the chunk's capacity, and the caller's work,
//! enqueued on `stream`, reads them in stream order (a grouped GEMM with device-side sizes).
template <class Space>
struct basic_expert_batch {
  int chunk = 0;                                //!< chunk index within the call
  int device = 0;                               //!< this rank
  std::span<const std::int64_t> expert_offsets; //!< local experts + 1 row offsets
  std::span<const std::int32_t> experts;        //!< logical expert of each local slot, or -1
  const_token_view input;                       //!< expert inputs (one row per token and expert)
  token_view output;                            //!< expert outputs, to be written
  typename Space::stream_arg stream;            //!< the compute stream (where the work goes)
  //! With `moe_options::fp8_dispatch`: the inputs as they arrived, FP8 codes (e4m3 / e5m2), and
  //! their f32 scales (hidden / block per row), in the same rows as `input`; empty otherwise.
  //! `input` then holds their dequantised values only with `dequantized_inputs` (else empty).
  const_token_view input_codes{};
  const_token_view input_scales{}; //!< see `input_codes`
};

//! The backward of one chunk's experts: given the gradient of the loss with respect to the
//! expert outputs (`grad_output`, already multiplied by the gate weight), write the gradient with
//! respect to the expert inputs (`grad_input`). `saved_input` holds the forward's inputs. Rows,
//! offsets and the stream as in `basic_expert_batch`.
template <class Space>
struct basic_expert_grad_batch {
  int chunk = 0;
  int device = 0;
  std::span<const std::int64_t> expert_offsets;
  std::span<const std::int32_t> experts;
  const_token_view saved_input; //!< forward inputs of these rows
  const_token_view grad_output; //!< dL/d(expert output) per row
  token_view grad_input;        //!< dL/d(expert input) per row, to be written
  typename Space::stream_arg stream;
  //! With `moe_options::fp8_dispatch`: the forward inputs' FP8 codes and scales (as
  //! `basic_expert_batch::input_codes`); `saved_input` is their dequantised values only with
  //! `dequantized_inputs` (else empty).
  const_token_view saved_codes{};
  const_token_view saved_scales{}; //!< see `saved_codes`
};

//! A chunk hook (see `basic_chunk_hooks`): called with the chunk's token range and the compute
//! stream; built from a callable taking `(first, count, stream)` or `(first, count)`.
template <class Space>
class chunk_hook {
 public:
  using stream_arg = typename Space::stream_arg;

  chunk_hook() = default;
  template <class F>
  requires std::is_invocable_v<F&, std::size_t, std::size_t, stream_arg>
  chunk_hook(F f) // NOLINT(google-explicit-constructor): a hook is written as a lambda
      : f_(std::move(f)) {}
  template <class F>
  requires(!std::is_invocable_v<F&, std::size_t, std::size_t, stream_arg> &&
           std::is_invocable_v<F&, std::size_t, std::size_t>)
      chunk_hook(F f) // NOLINT(google-explicit-constructor)
      : f_([f = std::move(f)](std::size_t first, std::size_t count, stream_arg) mutable {
        f(first, count);
      }) {}

  explicit operator bool() const noexcept { return static_cast<bool>(f_); }
  void operator()(std::size_t first, std::size_t count, stream_arg s) const { f_(first, count, s); }

 private:
  std::function<void(std::size_t, std::size_t, stream_arg)> f_;
};

//! Per-chunk hooks of a forward: Lancet's partitioning of the operators around the layer.
//! `produce(first, count)` runs first in the prepare stage of the chunk of tokens
//! [first, first + count), on the compute stream, and must write those tokens' rows, ids and
//! weights (e.g. run attention and the gate on them); `consume(first, count)` runs once their
//! output rows are final (e.g. the residual add and the next operator). Chunk c + 1's producer
//! then runs while chunk c is dispatched, and chunk c's consumer while chunk c + 1 is combined,
//! so the layer's first and last all-to-alls are no longer exposed. Capacity must be dropless
//! or `drop_order::position` (the other orders need every token's choices before the first
//! chunk). In `host_space` a hook runs on the compute stream's thread (and computes directly);
//! where host code runs at enqueue time it runs then and enqueues its work on the stream it is
//! given. Borrowed until the call's streams are synchronized.
template <class Space>
struct basic_chunk_hooks {
  chunk_hook<Space> produce;
  chunk_hook<Space> consume;
};

//! The host spellings (`host_space`): what `moe_exchange` hands its callbacks and takes.
using expert_batch = basic_expert_batch<host_space>;
using expert_grad_batch = basic_expert_grad_batch<host_space>;
using moe_chunk_hooks = basic_chunk_hooks<host_space>;

//! What one call moved, for this rank (valid once the call's streams are synchronized).
struct moe_stats {
  std::size_t tokens = 0;         //!< tokens of this rank
  std::int64_t routed_pairs = 0;  //!< (token, expert) pairs kept
  std::int64_t dropped_pairs = 0; //!< (token, expert) pairs dropped by capacity
  std::int64_t sent_rows = 0;     //!< rows sent by the dispatch (one per token and device)
  std::int64_t received_rows = 0; //!< rows received by the dispatch
  std::int64_t local_rows = 0;    //!< sent rows whose destination is this rank
  std::int64_t expert_rows = 0;   //!< rows the local experts computed (EPD rows)
  std::size_t row_bytes = 0;      //!< bytes of one token row
  //! Bytes of one row of the forward dispatch on the wire: `row_bytes`, or with an FP8 dispatch
  //! the packed codes and scales (`quantized_row_layout::stride`).
  std::size_t dispatch_row_bytes = 0;
  //! Copies per token (CT): sent rows per token.
  double copies_per_token() const noexcept {
    return tokens == 0 ? 0.0 : static_cast<double>(sent_rows) / static_cast<double>(tokens);
  }
  //! Rows a naive per-(token, expert) dispatch would send.
  std::int64_t naive_rows() const noexcept { return routed_pairs; }
};

namespace detail {

inline void check_moe_options(const moe_options& o) {
  WEAVE_EXPECT(o.k >= 1, errc::invalid_argument, "moe_options.k = ", o.k);
  WEAVE_EXPECT(o.hidden >= 1, errc::invalid_argument, "moe_options.hidden = ", o.hidden);
  WEAVE_EXPECT(o.chunks >= 1, errc::invalid_argument, "moe_options.chunks = ", o.chunks);
  WEAVE_EXPECT(o.max_in_flight >= 1, errc::invalid_argument,
               "moe_options.max_in_flight = ", o.max_in_flight);
  WEAVE_EXPECT(o.element == dtype::f32 || o.element == dtype::f16 || o.element == dtype::bf16,
               errc::not_supported, "moe_exchange rows of ", o.element,
               " (f32, f16 and bf16 are supported)");
  if (o.fp8_dispatch)
    check_quantization(o.hidden, o.fp8_dispatch->format, o.fp8_dispatch->blocks,
                       "moe_options.fp8_dispatch");
}

// Bytes of one forward dispatch row on the wire.
inline std::size_t dispatch_row_bytes(const moe_options& o) {
  return o.fp8_dispatch ? quantized_row_layout::of(o.hidden, o.fp8_dispatch->blocks.block).stride
                        : o.hidden * size_of(o.element);
}

// Producers write a chunk's choices only when its prepare stage runs: the batch-wide drop orders
// cannot be decided before the first chunk.
template <class Hooks>
void check_hooks(const Hooks* hooks, const moe_options& o) {
  WEAVE_EXPECT(hooks == nullptr || !hooks->produce || o.capacity.factor == 0.0 ||
                   o.capacity.order == drop_order::position,
               errc::invalid_argument,
               "a chunk producer needs dropless capacity or drop_order::position");
}

} // namespace detail

WEAVE_NAMESPACE_END
