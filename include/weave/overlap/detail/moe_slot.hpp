//! \file
//! `detail::moe_slot`: one in-flight call of an MoE exchange (what a handle leases), and
//! `detail::wait_or_abort`, the comm stream's wait on caller work that tells the communicator
//! when that work failed. Internal to `moe_exchange_base`.
#pragma once

#include "weave/comm/call_tag.hpp"
#include "weave/comm/communicator.hpp"
#include "weave/comm/fail_stop.hpp"
#include "weave/core/config.hpp"
#include "weave/core/tensor.hpp"
#include "weave/exec/stream.hpp"
#include "weave/overlap/moe_handle.hpp"
#include "weave/overlap/moe_options.hpp"
#include "weave/overlap/pipeline.hpp"

#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <type_traits>
#include <vector>

WEAVE_NAMESPACE_BEGIN

namespace detail {

// One in-flight call: its arguments, the stage events of each direction, where its phase
// stands and the derived exchange's per-call state.
template <class Traits>
struct moe_slot {
  using stream_type = typename Traits::stream_type;
  using stream_arg = typename Traits::stream_arg;
  // Streams are kept by address (host streams) or by value (CUDA stream references, which
  // have no empty state); `*store` is the stream either way.
  using stream_store =
      std::conditional_t<std::is_reference_v<stream_arg>, std::remove_reference_t<stream_arg>*,
                         std::optional<stream_type>>;

  explicit moe_slot(int chunks)
      : pipelines{chunk_pipeline<stream_type>(chunks), chunk_pipeline<stream_type>(chunks)} {}

  chunk_pipeline<stream_type>& pipeline() noexcept { return pipelines[backward ? 1 : 0]; }

  struct arguments {
    const_token_view x; // forward input
    std::span<const std::int32_t> ids;
    std::span<const float> weights;
    const typename Traits::hooks_type* hooks = nullptr;
    token_view y;        // forward output
    const_token_view dy; // backward: gradient of the output
    token_view dx;       // backward: gradient of the input
    std::span<float> dw; // backward: gate-weight gradients
    typename Traits::experts_fn experts;
    typename Traits::experts_grad_fn experts_grad;
  };

  typename Traits::state_type state;
  arguments args;
  chunk_pipeline<stream_type> pipelines[2]; // forward, backward: each phase records its own
  typename stream_type::event_type compute_done, comm_done; // the slot's last work per stream
  // The end of what the slot's latest call step enqueued, per stream (what the layer's
  // destruction waits for when a phase is half issued).
  typename stream_type::event_type compute_last, comm_last;
  stream_store compute{}, comm{}; // of the phase being issued
  // The compute stream of each direction's last phase: read by its chunks' work when it runs,
  // while the issuing thread may already start the next phase.
  stream_store phase_compute[2]{};
  moe_phase phase = moe_phase::finished;
  bool held = false;
  bool backward = false;     // direction of the phase being issued
  int current = 0;           // the phase's next chunk to compute (chunks: every chunk closed)
  bool opened = false;       // its experts stage is open (its rows will be ready in stream order)
  int prepared = 0;          // chunks whose prepare and dispatch are issued
  int finished = 0;          // chunks whose finish is issued
  bool output_known = false; // the phase's output was given before its chunks were iterated
  // Issuing the phase threw a failure every rank raises at the same step (a status-carrying
  // count exchange read on the host): the phase ends there on every rank, nothing to abort.
  bool failed_together = false;
  std::size_t tokens = 0;
  std::uint64_t call = 0; // the layer's call this slot holds (1, 2, ...: one per dispatch)
};

// A comm-stream stage waits for a compute-stream stage that may include the caller's work (its
// producer, its expert tasks). On host streams a failure there would skip this rank's
// collective and leave the peers waiting in it: wait in a task that tells the communicator.
template <class Comm, class Stream, class Event>
void wait_or_abort(Comm& comm, Stream& s, const Event& e) {
  if constexpr (host_executor<Stream> && has_abort<Comm>) {
    s.submit([&comm, e] {
      if (std::exception_ptr failure = e.outcome()) {
        abort_peers(comm, failure);
        std::rethrow_exception(failure);
      }
    });
  }
}

} // namespace detail

WEAVE_NAMESPACE_END
