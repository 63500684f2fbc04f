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

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

WEAVE_NAMESPACE_BEGIN

//! Carries the state of every copy in `plan.moves` over `comm` (ranks = the plan's devices) and
//! waits for it. `source(expert)` gives this rank's `bytes` of an expert it holds (read before
//! anything is written, so a slot may be both a source and a destination); `dest(local_slot,
//! expert)` gives the `bytes` a received copy is written to. Collective: every rank passes the
//! same plan. Throws `errc::size_mismatch` for a plan of another device count or a span of
//! another size, `errc::size_overflow` when the bytes overflow, and the communicator's errors.
template <communicator C, class Source, class Dest>
requires host_executor<typename C::stream_type>
void move_expert_state(C& comm, typename C::stream_type& s, const migration_plan& plan,
                       std::size_t bytes, Source&& source, Dest&& dest) {
  const int D = comm.size(), me = comm.rank();
  WEAVE_EXPECT(plan.target.num_devices() == D, errc::size_mismatch,
               "move_expert_state: a plan for ", plan.target.num_devices(), " devices on ", D,
               " ranks");
  WEAVE_EXPECT(bytes > 0, errc::invalid_argument, "move_expert_state: 0 bytes per expert");
  const auto n = static_cast<std::size_t>(D);
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
    if (m.from_device == me) {
      const std::span<const std::byte> src = source(static_cast<int>(m.expert));
      WEAVE_EXPECT(src.size() == bytes, errc::size_mismatch, "move_expert_state: expert ", m.expert,
                   "'s state is ", src.size(), " bytes, not ", bytes);
      std::memcpy(out.data() +
                      static_cast<std::size_t>(at[static_cast<std::size_t>(m.to_device)]++) * bytes,
                  src.data(), bytes);
    }
  weave::all_to_all_v(comm, s, out.data(), send_counts, send_displs, in.data(), recv_counts,
                      recv_displs, bytes);
  wait_watched(comm, s);
  at = recv_displs;
  const int S = plan.target.slots_per_device();
  for (const expert_move& m : plan.moves)
    if (m.to_device == me) {
      const std::span<std::byte> dst = dest(m.to_slot % S, static_cast<int>(m.expert));
      WEAVE_EXPECT(dst.size() == bytes, errc::size_mismatch, "move_expert_state: slot ",
                   m.to_slot % S, " takes ", dst.size(), " bytes, not ", bytes);
      std::memcpy(dst.data(),
                  in.data() +
                      static_cast<std::size_t>(at[static_cast<std::size_t>(m.from_device)]++) *
                          bytes,
                  bytes);
    }
}

WEAVE_NAMESPACE_END
