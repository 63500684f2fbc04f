// move_expert_state against the plan it carries: between random placements on 4 in-process
// ranks, every destination slot must end up holding the bytes of its expert, as every holder
// has them, through grouped send/recv (local_world, as NCCL) and through the packed all-to-all
// (a communicator without send_recv, as MPI).
#include <doctest/doctest.h>

#include <weave/comm/local_world.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/overlap/expert_state_moves.hpp>
#include <weave/placement/migration.hpp>
#include <weave/placement/replication.hpp>

#include <cstdint>
#include <random>
#include <span>
#include <vector>

namespace {

// local_world without send_recv: move_expert_state must pack into one all-to-all.
struct alltoall_only {
  using stream_type = weave::host_stream;
  weave::local_communicator* c;
  int rank() const { return c->rank(); }
  int size() const { return c->size(); }
  void all_to_all_v(weave::host_stream& s, const void* send, std::span<const std::int64_t> sc,
                    std::span<const std::int64_t> sd, void* recv, std::span<const std::int64_t> rc,
                    std::span<const std::int64_t> rd, std::size_t unit) {
    c->all_to_all_v(s, send, sc, sd, recv, rc, rd, unit);
  }
};
static_assert(!weave::has_send_recv<alltoall_only> && weave::has_all_to_all_v<alltoall_only>);

constexpr std::size_t state_bytes = 40;

std::vector<std::byte> state_of(int expert) {
  std::vector<std::byte> b(state_bytes);
  for (std::size_t i = 0; i < b.size(); ++i)
    b[i] = static_cast<std::byte>(expert * 37 + static_cast<int>(i));
  return b;
}

template <class Comm>
void check_moves(Comm& comm, const weave::migration_plan& plan, const weave::placement& current) {
  weave::host_stream s("moves");
  const int S = plan.target.slots_per_device();
  std::vector<std::vector<std::byte>> held, slots(static_cast<std::size_t>(S));
  for (int e = 0; e < current.num_experts(); ++e)
    held.push_back(state_of(e));
  int received = 0;
  weave::move_expert_state(
      comm, s, plan, state_bytes,
      [&](int e) {
        bool mine = false;
        for (const std::int32_t slot : current.slots_of(e))
          mine = mine || current.device_of_slot(slot) == comm.rank();
        REQUIRE(mine); // only experts this rank holds are read
        return std::span<const std::byte>(held[static_cast<std::size_t>(e)]);
      },
      [&](int slot, int e) {
        CHECK(plan.target.expert_of_slot(comm.rank() * S + slot) == e);
        ++received;
        slots[static_cast<std::size_t>(slot)].assign(state_bytes, std::byte{0});
        return std::span<std::byte>(slots[static_cast<std::size_t>(slot)]);
      });
  int expected = 0;
  for (const weave::expert_move& m : plan.moves)
    if (m.to_device == comm.rank()) {
      ++expected;
      CHECK(slots[static_cast<std::size_t>(m.to_slot % S)] == state_of(m.expert));
    }
  CHECK(received == expected);
}

} // namespace

TEST_CASE("move_expert_state carries every copy of a plan, with and without send_recv") {
  std::mt19937 rng(9);
  for (int trial = 0; trial < 6; ++trial) {
    const int ranks = 4, experts = 12;
    std::vector<double> a(experts), b(experts);
    std::lognormal_distribution<double> d(0.0, 1.5);
    for (int e = 0; e < experts; ++e) {
      a[static_cast<std::size_t>(e)] = d(rng);
      b[static_cast<std::size_t>(e)] = d(rng);
    }
    weave::replication_options o;
    o.redundant_slots = 8;
    const auto topo = weave::topology::flat(ranks);
    const weave::placement current = weave::place_replicated(a, topo, o);
    const weave::placement next = weave::place_replicated(b, topo, o);
    const weave::migration_plan plan = weave::plan_migration(current, next, topo);
    CAPTURE(trial);
    REQUIRE_FALSE(plan.moves.empty());
    weave::local_world world(ranks);
    world.run([&](weave::local_communicator& c) {
      check_moves(c, plan, current);
      alltoall_only packed{&c};
      check_moves(packed, plan, current);
    });
  }
}

TEST_CASE("move_expert_state refuses a plan of another size and states of another size") {
  const auto topo = weave::topology::flat(2);
  const weave::placement p = weave::placement::contiguous(4, 2);
  const weave::placement q(4, 2, {2, 3, 0, 1});
  const auto plan = weave::plan_migration(p, q, weave::topology::flat(2));
  weave::local_world one(1);
  one.run([&](weave::local_communicator& c) {
    weave::host_stream s("moves");
    CHECK_THROWS_AS(weave::move_expert_state(
                        c, s, plan, 8, [](int) { return std::span<const std::byte>(); },
                        [](int, int) { return std::span<std::byte>(); }),
                    weave::error);
  });
  // q relabelled back onto p needs no move; a swap of two experts does.
  const weave::placement r(4, 2, {1, 0, 2, 3});
  const weave::placement swapped(4, 2, {2, 1, 0, 3});
  const auto swap_plan = weave::plan_migration(r, swapped, weave::topology::flat(2));
  REQUIRE_FALSE(swap_plan.moves.empty());
  weave::local_world two(2);
  const auto failures = two.run_collect([&](weave::local_communicator& c) {
    weave::host_stream s("moves");
    std::vector<std::byte> small(4), big(8);
    weave::move_expert_state(
        c, s, swap_plan, 8, [&](int) { return std::span<const std::byte>(small); },
        [&](int, int) { return std::span<std::byte>(big); });
  });
  bool sized = false;
  for (const auto& f : failures)
    if (f)
      try {
        std::rethrow_exception(f);
      } catch (const weave::error& e) {
        sized = sized || e.code() == weave::errc::size_mismatch;
      }
  CHECK(sized);
  (void)topo;
}
