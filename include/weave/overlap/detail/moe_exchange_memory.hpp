//! \file
//! `basic_moe_exchange`'s memory: the workspace carved and initialised (given to `initialize`,
//! or taken at the first call), what is held beyond it, and its release. Included by
//! `moe_exchange.hpp`.
#pragma once

#include "weave/overlap/moe_exchange.hpp"

#include <cstddef>
#include <cstdint>
#include <utility>

WEAVE_NAMESPACE_BEGIN

template <execution_space Space, exchange_communicator<Space> Comm>
void basic_moe_exchange<Space, Comm>::initialize(void* workspace, std::size_t bytes,
                                                 stream_arg stream,
                                                 stream_allocator<Space> allocator) {
  WEAVE_EXPECT(workspace != nullptr, errc::invalid_argument, "null workspace");
  WEAVE_EXPECT(allocator.allocate && allocator.deallocate, errc::invalid_argument,
               "a stream_allocator needs both allocate and deallocate");
  allocator_ = std::move(allocator);
  if (workspace != owned_.data())
    owned_.release(&static_cast<stream_type&>(stream)); // an earlier call's, in stream order
  carve_and_initialize(workspace, bytes, stream);
}

template <execution_space Space, exchange_communicator<Space> Comm>
auto basic_moe_exchange<Space, Comm>::memory() const -> memory_report {
  memory_report m{workspace_bytes_, 0, 0};
  if (!sized_at_call() && !layout_.in_stream())
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

template <execution_space Space, exchange_communicator<Space> Comm>
void basic_moe_exchange<Space, Comm>::carve_and_initialize(void* workspace, std::size_t bytes,
                                                           stream_arg stream) {
  workspace_carver carver(workspace, bytes);
  carve(*this, carver);
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

template <execution_space Space, exchange_communicator<Space> Comm>
void basic_moe_exchange<Space, Comm>::ensure_initialized(stream_arg compute) {
  if (initialized_)
    return;
  const std::size_t bytes = workspace_size();
  owned_.replace(allocator_, bytes, compute);
  carve_and_initialize(owned_.data(), bytes, compute);
}

template <execution_space Space, exchange_communicator<Space> Comm>
void basic_moe_exchange<Space, Comm>::trim(stream_arg stream) {
  stream_type& st = stream;
  for (const auto& s : this->slots()) {
    for (chunk_state& ch : s->state.chunks) {
      ch.receive.release(&st);
      if (sized_at_call())
        ch.rows_cap = ch.epd_cap = 0;
      if (layout_.in_stream())
        ch.epd_cap = 0;
    }
    s->state.grads.release(&st);
    if (sized_at_call() || layout_.in_stream())
      s->state.grads_cap = 0;
  }
}

WEAVE_NAMESPACE_END
