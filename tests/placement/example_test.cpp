// The example of docs/placement.md, compiled and checked.
#include <doctest/doctest.h>

#include <weave/placement.hpp>

#include <span>

TEST_CASE("docs example: profile, place, replicate, migrate, evaluate") {
  //! [example]
  // A synthetic OLMoE-like trace: 64 experts, top-8, clusters of 8 that fire together.
  weave::trace_options o;
  o.num_experts = 64;
  o.k = 8;
  o.clusters = 8;
  o.affinity = 0.8;
  o.zipf = 0.6;
  o.tokens = 8000;
  const weave::synthetic_trace trace = weave::generate_trace(o);

  // Profile routing on this rank; sum over ranks with any all-reduce (here: one rank).
  weave::coactivation_profiler profiler(64, /*decay=*/0.9);
  profiler.record(trace.ids, o.k);
  const weave::expert_statistics stats =
      profiler.synchronize([](std::span<double>) { /* MPI_Allreduce(MPI_IN_PLACE, ...) */ });

  // 16 devices as 2 nodes x 8: collaboration-aware (two-level) with a load term, then one
  // redundant slot per device for the hottest experts, grown from the collaborative layout.
  const auto topo = weave::topology::grid(2, 8);
  weave::collaboration_options co;
  co.load_weight = 4.0;
  const weave::placement collab = weave::place_collaborative(stats, topo, co);
  weave::replication_options ro;
  ro.redundant_slots = 16;
  ro.current = &collab;
  const weave::placement replicated = weave::place_replicated(stats, topo, ro);

  // What the trainer must copy to go from the default layout to the collaborative one.
  const weave::placement current = weave::place_contiguous(64, topo);
  const weave::migration_plan plan = weave::plan_migration(current, collab, topo);

  // Copies per token and load on the trace (bf16 rows of hidden size 2048).
  const auto before = weave::evaluate_placement(current, topo, trace.ids, o.k, 2.0 * 2048);
  const auto after = weave::evaluate_placement(replicated, topo, trace.ids, o.k, 2.0 * 2048);
  //! [example]
  CHECK(after.copies_per_token < 0.8 * before.copies_per_token);
  CHECK(after.max_mean_load < 1.15);
  CHECK(replicated.num_slots() == 80);
  CHECK(plan.moves.size() <= 64);
  CHECK(plan.target.num_slots() == 64);
}
