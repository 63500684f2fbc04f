//! \file
//! The communicator concept, its capability checks, and the generic forms of every operation
//! (with fallbacks where a backend lacks a primitive).
//!
//! A communicator is a borrowed handle to one rank of a group. Its operations are asynchronous:
//! they are enqueued on a stream of the communicator's `stream_type` (`host_stream` for the
//! in-process world and MPI, `cuda_stream_ref` for NCCL), return at once, and complete in
//! stream order; callers order them against compute with events. (A small MPI operation on an
//! idle stream runs on the calling thread and returns complete: `mpi_options::inline_max_bytes`.)
//! As in CUDA and NCCL, every buffer *and every count/displacement array* an operation names is
//! borrowed until the stream reaches the operation: host backends read the arrays when the
//! operation runs, which is what lets a count exchange fill the receive counts of an all-to-all
//! enqueued right after it. All ranks must enqueue the same collectives in the same order.
#pragma once

#include "weave/comm/call_tag.hpp"
#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/exec/stream.hpp"

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <type_traits>
#include <vector>

WEAVE_NAMESPACE_BEGIN

//! Reduction of `all_reduce`.
enum class reduce_op : int {
  sum = 0, //!< element-wise sum, accumulated in rank order 0..n-1 (deterministic)
  max = 1, //!< element-wise maximum
};

//! Short name of a reduction ("sum", "max").
constexpr const char* to_string(reduce_op op) noexcept {
  return op == reduce_op::sum ? "sum" : op == reduce_op::max ? "max" : "unknown";
}

//! One leg of a grouped point-to-point exchange: `send_bytes` from `send` go to `peer`, and
//! `recv_bytes` from `peer` land at `recv`. A peer appears at most once in a group.
struct peer_transfer {
  int peer = 0;
  const void* send = nullptr;
  std::int64_t send_bytes = 0;
  void* recv = nullptr;
  std::int64_t recv_bytes = 0;
};

//! The element types `all_reduce` supports on every backend.
template <class T>
concept reducible = std::same_as<T, float> || std::same_as<T, double> ||
    std::same_as<T, std::int32_t> || std::same_as<T, std::int64_t>;

//! The minimum every communicator has: its group, and the stream type its operations run on.
template <class C>
concept communicator = requires(const C& c) {
  typename C::stream_type;
  requires stream<typename C::stream_type>;
  { c.rank() } -> std::convertible_to<int>;
  { c.size() } -> std::convertible_to<int>;
};

//! Variable all-to-all over bytes: counts and displacements per peer, in units of `unit` bytes.
template <class C>
concept has_all_to_all_v = communicator<C> &&
    requires(C& c, typename C::stream_type& s, const void* send, void* recv,
             std::span<const std::int64_t> v, std::size_t unit) {
  c.all_to_all_v(s, send, v, v, recv, v, v, unit);
};

//! An all-to-all whose receive counts are room: each block may be shorter, and its length (in
//! units) is written to `received` when the operation has run (`local_world`, MPI).
template <class C>
concept has_bounded_all_to_all = has_all_to_all_v<C> &&
    requires(C& c, typename C::stream_type& s, const void* send, void* recv,
             std::span<const std::int64_t> v, std::span<std::int64_t> received, std::size_t unit) {
  c.all_to_all_v_bounded(s, send, v, v, recv, v, v, received, unit);
};

//! Grouped point-to-point transfers (the primitive NCCL offers; all_to_all_v is built on it).
template <class C>
concept has_send_recv = communicator<C> &&
    requires(C& c, typename C::stream_type& s, std::span<const peer_transfer> transfers) {
  c.send_recv(s, transfers);
};

//! Each rank sends k 64-bit counts to every peer (the first step of counts-then-all_to_all_v).
template <class C>
concept has_exchange_counts = communicator<C> &&
    requires(C& c, typename C::stream_type& s, std::span<const std::int64_t> in,
             std::span<std::int64_t> out) {
  c.exchange_counts(s, in, out);
};

//! A count exchange taken now and run later (host backends): `c.deferred_exchange_counts(in,
//! out)` takes the exchange's place in the communicator's order and returns a task `t` that a
//! stream task calls on the stream thread, in stream order: `t(nullptr)` runs the exchange
//! (throwing on failure), `t(failure)` skips it as on a failed stream and returns `failure`.
//! Lets a task wrap the exchange (weave's status-carrying count exchange) without extra tasks.
template <class C>
concept has_deferred_exchange_counts = has_exchange_counts<C> &&
    requires(C& c, std::span<const std::int64_t> in, std::span<std::int64_t> out,
             std::exception_ptr failure) {
  { c.deferred_exchange_counts(in, out)(failure) } -> std::same_as<std::exception_ptr>;
};

//! Collectives that carry a `call_tag` (see `call_tag.hpp`): ranks that meet at one with
//! different tags fail with `errc::call_mismatch`, before any data of it is delivered.
template <class C>
concept has_tagged_collectives = has_all_to_all_v<C> && has_exchange_counts<C> &&
    requires(C& c, typename C::stream_type& s, const void* send, void* recv,
             std::span<const std::int64_t> v, std::span<const std::int64_t> in,
             std::span<std::int64_t> out, std::size_t unit, call_tag tag) {
  c.all_to_all_v(s, send, v, v, recv, v, v, unit, tag);
  c.exchange_counts(s, in, out, tag);
};

//! Element-wise reduction of `T` across ranks, result on every rank.
template <class C, class T>
concept has_all_reduce = communicator<C> && reducible<T> &&
    requires(C& c, typename C::stream_type& s, std::span<const T> in, std::span<T> out,
             reduce_op op) {
  c.all_reduce(s, in, out, op);
};

//! A stream-ordered barrier.
template <class C>
concept has_barrier = communicator<C> && requires(C& c, typename C::stream_type& s) {
  c.barrier(s);
};

namespace detail {

//! Bytes an all-to-all moves on one rank (sent plus received), saturating at SIZE_MAX; bad
//! (negative) counts count as SIZE_MAX, so the operation that rejects them is never "small".
inline std::size_t moved_bytes(std::span<const std::int64_t> send_counts,
                               std::span<const std::int64_t> recv_counts, std::size_t unit) {
  constexpr std::size_t all = static_cast<std::size_t>(-1);
  std::size_t units = 0;
  for (std::span<const std::int64_t> counts : {send_counts, recv_counts})
    for (const std::int64_t c : counts)
      units = c < 0 || units + static_cast<std::size_t>(c) < units
                  ? all
                  : units + static_cast<std::size_t>(c);
  return unit != 0 && units > all / unit ? all : units * unit;
}

//! Validates one side of an all_to_all_v layout: one count and displacement per rank, none
//! negative, and every block's end representable in bytes. Returns the bytes spanned.
inline std::int64_t check_layout(int size, std::span<const std::int64_t> counts,
                                 std::span<const std::int64_t> displs, std::size_t unit,
                                 const char* side) {
  WEAVE_EXPECT(unit > 0, errc::invalid_argument, "all_to_all_v: unit must be positive");
  WEAVE_EXPECT(counts.size() == static_cast<std::size_t>(size), errc::size_mismatch,
               "all_to_all_v: ", side, " counts has ", counts.size(), " entries for ", size,
               " ranks");
  WEAVE_EXPECT(displs.size() == static_cast<std::size_t>(size), errc::size_mismatch,
               "all_to_all_v: ", side, " displacements has ", displs.size(), " entries for ", size,
               " ranks");
  std::size_t extent = 0;
  for (int peer = 0; peer < size; ++peer) {
    const auto p = static_cast<std::size_t>(peer);
    WEAVE_EXPECT(counts[p] >= 0, errc::invalid_argument, "all_to_all_v: ", side, " count for rank ",
                 peer, " is negative (", counts[p], ")");
    WEAVE_EXPECT(displs[p] >= 0, errc::invalid_argument, "all_to_all_v: ", side,
                 " displacement for rank ", peer, " is negative (", displs[p], ")");
    const std::size_t end =
        checked_mul(checked_add(static_cast<std::size_t>(displs[p]),
                                static_cast<std::size_t>(counts[p]), "block end"),
                    unit, "block end in bytes");
    if (counts[p] > 0 && end > extent)
      extent = end;
  }
  return checked_cast<std::int64_t>(extent, "all_to_all_v extent in bytes");
}

inline void fill_transfers(int size, const void* send, std::span<const std::int64_t> send_counts,
                           std::span<const std::int64_t> send_displs, void* recv,
                           std::span<const std::int64_t> recv_counts,
                           std::span<const std::int64_t> recv_displs, std::size_t unit,
                           std::span<peer_transfer> out) {
  check_layout(size, send_counts, send_displs, unit, "send");
  check_layout(size, recv_counts, recv_displs, unit, "receive");
  const auto bytes = static_cast<std::int64_t>(unit);
  for (int peer = 0; peer < size; ++peer) {
    const auto p = static_cast<std::size_t>(peer);
    out[p] = {peer, static_cast<const std::byte*>(send) + send_displs[p] * bytes,
              send_counts[p] * bytes, static_cast<std::byte*>(recv) + recv_displs[p] * bytes,
              recv_counts[p] * bytes};
  }
}

} // namespace detail

//! Enqueues a variable all-to-all on `s`: `send_counts[j]` units of `unit` bytes starting at
//! unit `send_displs[j]` of `send` go to rank j, and `recv_counts[j]` units from rank j land at
//! unit `recv_displs[j]` of `recv`. Uses the communicator's own all_to_all_v, or else builds
//! it from grouped send/recv (that fallback allocates one transfer list per call).
//! `tag` names the call it belongs to where the communicator checks tags
//! (`has_tagged_collectives`); elsewhere it is ignored.
template <communicator C>
void all_to_all_v(C& c, typename C::stream_type& s, const void* send,
                  std::span<const std::int64_t> send_counts,
                  std::span<const std::int64_t> send_displs, void* recv,
                  std::span<const std::int64_t> recv_counts,
                  std::span<const std::int64_t> recv_displs, std::size_t unit = 1,
                  call_tag tag = {}) {
  if constexpr (has_tagged_collectives<C>) {
    c.all_to_all_v(s, send, send_counts, send_displs, recv, recv_counts, recv_displs, unit, tag);
  } else if constexpr (has_all_to_all_v<C>) {
    c.all_to_all_v(s, send, send_counts, send_displs, recv, recv_counts, recv_displs, unit);
  } else {
    static_assert(has_send_recv<C>, "all_to_all_v needs a communicator with all_to_all_v or "
                                    "send_recv");
    const int size = c.size();
    auto transfers = std::make_shared<std::vector<peer_transfer>>(static_cast<std::size_t>(size));
    auto fill = [=] {
      detail::fill_transfers(size, send, send_counts, send_displs, recv, recv_counts, recv_displs,
                             unit, *transfers);
    };
    if constexpr (host_executor<typename C::stream_type>) {
      s.submit(fill); // the counts are read when the stream gets here, as the backends do
      c.send_recv(s, std::span<const peer_transfer>(*transfers));
      s.submit([transfers] {}); // keeps the list alive until the exchange has run
    } else {
      fill(); // device streams take host counts at enqueue time
      c.send_recv(s, std::span<const peer_transfer>(*transfers));
    }
  }
}

//! `c.exchange_counts(s, send, recv)`, carrying `tag` where the communicator checks tags.
template <communicator C>
requires has_exchange_counts<C>
void exchange_counts(C& c, typename C::stream_type& s, std::span<const std::int64_t> send,
                     std::span<std::int64_t> recv, call_tag tag = {}) {
  if constexpr (has_tagged_collectives<C>)
    c.exchange_counts(s, send, recv, tag);
  else
    c.exchange_counts(s, send, recv);
}

//! Typed-rows form: counts and displacements are in rows of `row_elems` elements of `T`.
template <communicator C, class T>
requires std::is_trivially_copyable_v<T>
void all_to_all_rows(C& c, typename C::stream_type& s, const T* send,
                     std::span<const std::int64_t> send_rows,
                     std::span<const std::int64_t> send_row_displs, T* recv,
                     std::span<const std::int64_t> recv_rows,
                     std::span<const std::int64_t> recv_row_displs, std::size_t row_elems) {
  WEAVE_EXPECT(row_elems > 0, errc::invalid_argument, "all_to_all_rows: row_elems must be > 0");
  weave::all_to_all_v(c, s, send, send_rows, send_row_displs, recv, recv_rows, recv_row_displs,
                      checked_mul(row_elems, sizeof(T), "row bytes"));
}

//! Enqueues a check that the `k` counts per rank received by a count exchange equal what this
//! rank expected (`received[j*k+i]` against `expected[j*k+i]`); a difference fails the stream
//! with `errc::size_mismatch` naming the rank, the slot and both values.
template <host_executor S>
void expect_counts(S& s, std::span<const std::int64_t> received,
                   std::span<const std::int64_t> expected, std::size_t k) {
  WEAVE_EXPECT(k > 0 && received.size() == expected.size() && received.size() % k == 0,
               errc::size_mismatch, "expect_counts: ", received.size(), " received and ",
               expected.size(), " expected counts with ", k, " per rank");
  s.submit([received, expected, k] {
    for (std::size_t i = 0; i < received.size(); ++i)
      WEAVE_EXPECT(received[i] == expected[i], errc::size_mismatch, "count exchange: rank ", i / k,
                   " announced ", received[i], " (slot ", i % k, ") but this rank expected ",
                   expected[i]);
  });
}

WEAVE_NAMESPACE_END
