//! \file
//! What a rank of a `local_world` posts for one operation (`detail::local_post`): the
//! operation, its buffers, counts and layouts, and its place in its communicator's order.
//! Internal: `local_world.hpp` makes the posts, `local_world_state.hpp` matches them.
#pragma once

#include "weave/comm/call_tag.hpp"
#include "weave/comm/communicator.hpp"
#include "weave/core/config.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>

WEAVE_NAMESPACE_BEGIN

namespace detail {

enum class local_op : int {
  none,
  all_to_all_v,
  all_to_all_v_bounded,
  send_recv,
  exchange_counts,
  all_reduce,
  barrier
};

constexpr const char* to_string(local_op op) noexcept {
  switch (op) {
  case local_op::all_to_all_v:
    return "all_to_all_v";
  case local_op::all_to_all_v_bounded:
    return "all_to_all_v_bounded";
  case local_op::send_recv:
    return "send_recv";
  case local_op::exchange_counts:
    return "exchange_counts";
  case local_op::all_reduce:
    return "all_reduce";
  case local_op::barrier:
    return "barrier";
  case local_op::none:
    break;
  }
  return "none";
}

template <class T>
constexpr int reduce_type_id() noexcept {
  if constexpr (std::is_same_v<T, float>)
    return 1;
  else if constexpr (std::is_same_v<T, double>)
    return 2;
  else if constexpr (std::is_same_v<T, std::int32_t>)
    return 3;
  else
    return 4;
}

//! What one rank posts for one operation; every pointer stays valid until all ranks finished.
struct local_post {
  std::uint64_t order = 0; // place in the enqueue order of its communicator (from 1)
  std::uint64_t seq = 0;   // place in the order operations ran on its rank (0: none yet)
  local_op op = local_op::none;
  const std::byte* send = nullptr;
  std::byte* recv = nullptr;
  std::span<const std::int64_t> send_counts, send_displs, recv_counts, recv_displs;
  std::span<std::int64_t> received;         // all_to_all_v_bounded: each block's length (units)
  std::size_t unit = 1;                     // all_to_all_v unit; exchange_counts: counts per peer
  std::span<const peer_transfer> transfers; // send_recv
  std::size_t count = 0;                    // all_reduce elements
  int type = 0;                             // all_reduce element type
  reduce_op reduction = reduce_op::sum;
  call_tag tag{}; // the call it belongs to (every rank's must be equal)
};

} // namespace detail

WEAVE_NAMESPACE_END
