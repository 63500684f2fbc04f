// The example of docs/routing.md, compiled and checked: one rank's side of a dispatch and
// combine with every destination served in-process.
#include <doctest/doctest.h>

#include <weave/core/host_matrix.hpp>
#include <weave/routing.hpp>

#include <vector>

TEST_CASE("docs/routing.md example: gate, capacity, plan, dispatch and combine") {
  const int E = 8, D = 4, k = 2;
  const std::size_t T = 64, hidden = 16;
  weave::host_matrix<float> logits(T, E), x(T, hidden, 1.0f);
  for (std::size_t t = 0; t < T; ++t)
    for (int e = 0; e < E; ++e)
      logits(t, static_cast<std::size_t>(e)) =
          static_cast<float>((t * 7 + static_cast<std::size_t>(e) * 3) % 11);

  //! [dispatch]
  // 1. Gate: top-2 of a softmax, renormalized; each token's top score is its priority.
  std::vector<std::int32_t> ids(T * k);
  std::vector<float> weights(T * k), priority(T);
  weave::gate_options gate;
  gate.k = k;
  gate.renormalize = true;
  const weave::gate_summary summary =
      weave::top_k_gate(logits.view(), gate, ids, weights, priority);

  // 2. Capacity as Tutel's batch-prioritized routing with factor 1.25 and Tutel's rounding;
  // decided once for the whole batch.
  weave::capacity_filter filter(
      E, k, T, {1.25, weave::drop_order::batch_prioritized, weave::capacity_rounding::tutel});
  std::vector<std::uint8_t> keep(T * k);
  const std::int64_t dropped = filter.decide(ids, priority, keep);

  // 3. Sender plan: one SFD row per (token, device), and the rows themselves.
  const auto where = weave::placement::contiguous(E, D);
  weave::dispatch_plan plan(where, k, /*source_device=*/0);
  plan.build(ids, weights, keep);
  weave::host_matrix<float> sfd(static_cast<std::size_t>(plan.rows()), hidden);
  weave::dispatch_gather(plan, x.view(), sfd.view());
  // all_to_all_v(sfd, plan.send_counts()) and (plan.row_routes(), k * send_counts) go here.

  // 4. Receiver plan on device d, from what arrived (here: only this rank's rows for d).
  const int d = 1;
  const auto first = static_cast<std::size_t>(plan.send_offsets()[d]);
  const std::vector<std::int64_t> recv_counts = {plan.send_counts()[d]};
  weave::expert_plan experts(where.slots_per_device(), k);
  experts.build(plan.row_routes().subspan(first * k, static_cast<std::size_t>(recv_counts[0]) * k),
                recv_counts);
  const auto received = sfd.view().subrows(first, static_cast<std::size_t>(recv_counts[0]));
  weave::host_matrix<float> epd(static_cast<std::size_t>(experts.epd_rows()), hidden);
  weave::expert_scatter(experts, received, epd.view());
  // Local expert l owns EPD rows [expert_offsets()[l], expert_offsets()[l + 1]): run it there.
  weave::host_matrix<float> back(received.rows(), hidden);
  weave::expert_merge(experts, epd.view(), back.view()); // sum of gate-weighted expert outputs
  //! [dispatch]

  CHECK(summary.aux_loss > 0.0);
  CHECK(dropped == static_cast<std::int64_t>(plan.dropped().size()));
  CHECK(plan.copies_per_token() <= 2.0);
  // Identity experts: each returned row is x times the sum of the weights kept on device d.
  for (std::size_t r = 0; r < back.rows(); ++r) {
    float sum = 0;
    for (int i = 0; i < k; ++i)
      sum += experts.row_weight()[r * k + static_cast<std::size_t>(i)];
    CHECK(back(r, 0) == doctest::Approx(sum));
  }
}
