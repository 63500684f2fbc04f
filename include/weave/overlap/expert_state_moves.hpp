//! \file
//! `move_expert_state`: the copies of a migration plan (weights, optimizer state: any fixed
//! number of bytes per expert) carried between the ranks of a host communicator in one
//! all-to-all. The trainer's side of re-placing: after `plan_migration` or `plan_after_loss`,
//! every rank sends the experts it is the source of and receives those its slots take.
#pragma once

#include "weave/comm/communicator.hpp"
#include "weave/comm/fail_stop.hpp"
#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/exec/stream.hpp"
#include "weave/placement/migration.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

WEAVE_NAMESPACE_BEGIN

//! Carries the state of every copy in `plan.moves` over `comm` (ranks = the plan's devices) and
//! waits for it. `source(expert)` gives the `bytes` of an expert this rank holds and
//! `dest(local_slot, expert)` the `bytes` a received copy is written to, as spans of `std::byte` in
//! the memory the communicator moves (host memory on host streams, device memory for NCCL). Sources
//! must stay unchanged until the call returns and no destination may overlap a source: a slot whose
//! expert leaves may be the source of a copy elsewhere (keep the old state aside, as
//! `examples/elastic_moe.cpp` does). Collective: every rank passes the same plan. With grouped
//! point-to-point transfers (`has_send_recv`: local_world, NCCL) the copies go straight from
//! source to destination, in as many groups as the most copies between one pair of ranks;
//! otherwise (MPI) they are packed into one all-to-all on the host. Throws
//! `errc::size_mismatch` for a plan of another device count or a span of another size,
//! `errc::size_overflow` when the bytes overflow, and the communicator's errors.
template <communicator C, class Source, class Dest>
void move_expert_state(C& comm, typename C::stream_type& s, const migration_plan& plan,
                       std::size_t bytes, Source&& source, Dest&& dest) {
  const int D = comm.size(), me = comm.rank();
  WEAVE_EXPECT(plan.target.num_devices() == D, errc::size_mismatch,
               "move_expert_state: a plan for ", plan.target.num_devices(), " devices on ", D,
               " ranks");
  WEAVE_EXPECT(bytes > 0, errc::invalid_argument, "move_expert_state: 0 bytes per expert");
  const int S = plan.target.slots_per_device();
  const auto from_here = [&](const expert_move& m) {
    const std::span<const std::byte> src = source(static_cast<int>(m.expert));
    WEAVE_EXPECT(src.size() == bytes, errc::size_mismatch, "move_expert_state: expert ", m.expert,
                 "'s state is ", src.size(), " bytes, not ", bytes);
    return src;
  };
  const auto to_here = [&](const expert_move& m) {
    const std::span<std::byte> dst = dest(m.to_slot % S, static_cast<int>(m.expert));
    WEAVE_EXPECT(dst.size() == bytes, errc::size_mismatch, "move_expert_state: slot ",
                 m.to_slot % S, " takes ", dst.size(), " bytes, not ", bytes);
    return dst;
  };
  const auto n = static_cast<std::size_t>(D);
  const auto b = checked_cast<std::int64_t>(bytes, "bytes per expert");
  if constexpr (has_send_recv<C>) {
    // Round r carries the r-th copy between each pair of ranks (a peer appears once per group).
    std::vector<int> count(n * n, 0), round(plan.moves.size());
    int rounds = 0;
    for (std::size_t i = 0; i < plan.moves.size(); ++i) {
      const expert_move& m = plan.moves[i];
      round[i] = count[static_cast<std::size_t>(m.from_device) * n +
                       static_cast<std::size_t>(m.to_device)]++;
      rounds = std::max(rounds, round[i] + 1);
    }
    // Every group's list stays alive until the stream ran it (host streams read it then).
    std::vector<std::vector<peer_transfer>> groups(static_cast<std::size_t>(rounds));
    for (std::size_t i = 0; i < plan.moves.size(); ++i) {
      const expert_move& m = plan.moves[i];
      if (m.from_device != me && m.to_device != me)
        continue;
      auto& group = groups[static_cast<std::size_t>(round[i])];
      const int peer = m.from_device == me ? m.to_device : m.from_device;
      auto at = std::find_if(group.begin(), group.end(),
                             [&](const peer_transfer& t) { return t.peer == peer; });
      if (at == group.end())
        at = group.insert(group.end(), peer_transfer{peer});
      if (m.from_device == me) {
        at->send = from_here(m).data();
        at->send_bytes = b;
      } else {
        at->recv = to_here(m).data();
        at->recv_bytes = b;
      }
    }
    for (const auto& group : groups)
      comm.send_recv(s, std::span<const peer_transfer>(group));
    wait_watched(comm, s);
  } else {
    static_assert(host_executor<typename C::stream_type>,
                  "move_expert_state packs on the host without send_recv");
    std::vector<std::int64_t> send_counts(n, 0), recv_counts(n, 0), send_displs(n, 0),
        recv_displs(n, 0);
    for (const expert_move& m : plan.moves) {
      if (m.from_device == me)
        ++send_counts[static_cast<std::size_t>(m.to_device)];
      if (m.to_device == me)
        ++recv_counts[static_cast<std::size_t>(m.from_device)];
    }
    std::int64_t sends = 0, recvs = 0;
    for (std::size_t j = 0; j < n; ++j) {
      send_displs[j] = sends;
      recv_displs[j] = recvs;
      sends += send_counts[j];
      recvs += recv_counts[j];
    }
    std::vector<std::byte> out(checked_mul(static_cast<std::size_t>(sends), bytes, "sent state")),
        in(checked_mul(static_cast<std::size_t>(recvs), bytes, "received state"));
    // Packed by destination, in plan order (each receiver walks the plan in the same order).
    std::vector<std::int64_t> at(send_displs);
    for (const expert_move& m : plan.moves)
      if (m.from_device == me)
        std::memcpy(out.data() +
                        static_cast<std::size_t>(at[static_cast<std::size_t>(m.to_device)]++) *
                            bytes,
                    from_here(m).data(), bytes);
    weave::all_to_all_v(comm, s, out.data(), send_counts, send_displs, in.data(), recv_counts,
                        recv_displs, bytes);
    wait_watched(comm, s);
    at = recv_displs;
    for (const expert_move& m : plan.moves)
      if (m.to_device == me)
        std::memcpy(to_here(m).data(),
                    in.data() +
                        static_cast<std::size_t>(at[static_cast<std::size_t>(m.from_device)]++) *
                            bytes,
                    bytes);
  }
}

WEAVE_NAMESPACE_END
