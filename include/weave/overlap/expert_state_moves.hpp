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
#include "weave/core/retain.hpp"
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
//! otherwise (MPI) they are packed into one all-to-all on the host, after a count exchange that
//! checks the ranks' plans agree. Throws
//! `errc::size_mismatch` for a plan of another device count or a span of another size,
//! `errc::out_of_range` / `errc::invalid_argument` for a move naming a device outside the plan
//! or within one device, `errc::size_overflow` when the bytes overflow, and the communicator's
//! errors; a rank that refuses its arguments aborts the communicator first, so its peers fail
//! at once with a `peer_error` naming it instead of waiting for its copies.
template <communicator C, class Source, class Dest>
void move_expert_state(C& comm, typename C::stream_type& s, const migration_plan& plan,
                       std::size_t bytes, Source&& source, Dest&& dest) {
  const int D = comm.size(), me = comm.rank();
  const auto n = static_cast<std::size_t>(D);
  // This rank's copies in plan order: what it sends (to whom) and where what it receives goes.
  struct leg {
    int peer;
    const std::byte* send;
    std::byte* recv;
  };
  std::vector<leg> legs;
  std::int64_t b = 0;
  // A bad argument here would leave the peers waiting in the transfer: they are told at once.
  abort_peers_on_failure(comm, [&] {
    WEAVE_EXPECT(plan.target.num_devices() == D, errc::size_mismatch,
                 "move_expert_state: a plan for ", plan.target.num_devices(), " devices on ", D,
                 " ranks");
    WEAVE_EXPECT(bytes > 0, errc::invalid_argument, "move_expert_state: 0 bytes per expert");
    b = checked_cast<std::int64_t>(bytes, "bytes per expert");
    const int S = plan.target.slots_per_device();
    for (const expert_move& m : plan.moves) {
      WEAVE_EXPECT(m.from_device >= 0 && m.from_device < D && m.to_device >= 0 && m.to_device < D,
                   errc::out_of_range, "move_expert_state: a move of expert ", m.expert, " from ",
                   m.from_device, " to ", m.to_device, " on ", D, " ranks");
      WEAVE_EXPECT(m.from_device != m.to_device, errc::invalid_argument,
                   "move_expert_state: a move of expert ", m.expert, " within device ",
                   m.to_device);
      if (m.from_device == me) {
        const std::span<const std::byte> src = source(static_cast<int>(m.expert));
        WEAVE_EXPECT(src.size() == bytes, errc::size_mismatch, "move_expert_state: expert ",
                     m.expert, "'s state is ", src.size(), " bytes, not ", bytes);
        legs.push_back({m.to_device, src.data(), nullptr});
      } else if (m.to_device == me) {
        const std::span<std::byte> dst = dest(m.to_slot % S, static_cast<int>(m.expert));
        WEAVE_EXPECT(dst.size() == bytes, errc::size_mismatch, "move_expert_state: slot ",
                     m.to_slot % S, " takes ", dst.size(), " bytes, not ", bytes);
        legs.push_back({m.from_device, nullptr, dst.data()});
      }
    }
  });
  if constexpr (has_send_recv<C>) {
    // Round r carries the r-th copy between each pair of ranks (a peer appears once per group);
    // every rank counts the rounds of the whole plan, so all issue as many groups.
    std::vector<int> count(n * n, 0);
    int rounds = 0;
    for (const expert_move& m : plan.moves)
      rounds = std::max(rounds, ++count[static_cast<std::size_t>(m.from_device) * n +
                                        static_cast<std::size_t>(m.to_device)]);
    // Every group's list stays alive until the stream ran it (host streams read it then).
    std::vector<std::vector<peer_transfer>> groups(static_cast<std::size_t>(rounds));
    std::vector<int> sent(n, 0), received(n, 0);
    for (const leg& l : legs) {
      const auto p = static_cast<std::size_t>(l.peer);
      auto& group = groups[static_cast<std::size_t>(l.send ? sent[p]++ : received[p]++)];
      auto at = std::find_if(group.begin(), group.end(),
                             [&](const peer_transfer& t) { return t.peer == l.peer; });
      if (at == group.end())
        at = group.insert(group.end(), peer_transfer{l.peer});
      if (l.send) {
        at->send = l.send;
        at->send_bytes = b;
      } else {
        at->recv = l.recv;
        at->recv_bytes = b;
      }
    }
    for (const auto& group : groups)
      comm.send_recv(s, std::span<const peer_transfer>(group));
    wait_watched(comm, s);
  } else {
    static_assert(host_executor<typename C::stream_type>,
                  "move_expert_state packs on the host without send_recv");
    // Everything MPI is given, in one block: kept until the process exits if MPI abandons an
    // operation (it may still read and write them until MPI_Finalize; see fail_stop.hpp).
    struct staging {
      std::vector<std::int64_t> send_counts, recv_counts, send_displs, recv_displs, announced;
      std::vector<std::byte> out, in;
    };
    const auto st = std::make_shared<staging>();
    for (auto* v :
         {&st->send_counts, &st->recv_counts, &st->send_displs, &st->recv_displs, &st->announced})
      v->assign(n, 0);
    for (const leg& l : legs)
      ++(l.send ? st->send_counts : st->recv_counts)[static_cast<std::size_t>(l.peer)];
    std::int64_t sends = 0, recvs = 0;
    for (std::size_t j = 0; j < n; ++j) {
      st->send_displs[j] = sends;
      st->recv_displs[j] = recvs;
      sends += st->send_counts[j];
      recvs += st->recv_counts[j];
    }
    const auto abandoned_after = abandoned_flag_of(comm);
    try {
      if constexpr (has_exchange_counts<C>) {
        // Every rank takes part in a count exchange (an all-to-all of zero blocks may complete
        // without a rank that failed), and the counts check that the ranks' plans agree.
        weave::exchange_counts(comm, s, std::span<const std::int64_t>(st->send_counts),
                               std::span<std::int64_t>(st->announced));
        wait_watched(comm, s);
        abort_peers_on_failure(comm, [&] {
          for (std::size_t j = 0; j < n; ++j)
            WEAVE_EXPECT(st->announced[j] == st->recv_counts[j], errc::size_mismatch,
                         "move_expert_state: rank ", j, " sends ", st->announced[j],
                         " copies to rank ", me, ", whose plan expects ", st->recv_counts[j],
                         " (the ranks' plans differ)");
        });
      }
      st->out.resize(checked_mul(static_cast<std::size_t>(sends), bytes, "sent state"));
      st->in.resize(checked_mul(static_cast<std::size_t>(recvs), bytes, "received state"));
      // Packed by peer, in plan order (each receiver walks the plan in the same order).
      std::vector<std::int64_t> at(st->send_displs);
      for (const leg& l : legs)
        if (l.send)
          std::memcpy(st->out.data() +
                          static_cast<std::size_t>(at[static_cast<std::size_t>(l.peer)]++) * bytes,
                      l.send, bytes);
      weave::all_to_all_v(comm, s, st->out.data(), st->send_counts, st->send_displs, st->in.data(),
                          st->recv_counts, st->recv_displs, bytes);
      wait_watched(comm, s);
    } catch (...) {
      if (abandoned(abandoned_after))
        detail::retain_until_exit(st);
      throw;
    }
    std::vector<std::int64_t> at(st->recv_displs);
    for (const leg& l : legs)
      if (!l.send)
        std::memcpy(l.recv,
                    st->in.data() +
                        static_cast<std::size_t>(at[static_cast<std::size_t>(l.peer)]++) * bytes,
                    bytes);
  }
}

WEAVE_NAMESPACE_END
