// The example of docs/routing.md, compiled and checked: one rank's side of a dispatch and
// combine with every destination served in-process, on weave's plans in host_space.
#include <doctest/doctest.h>

#include <weave/core/host_matrix.hpp>
#include <weave/routing.hpp>

#include <cstddef>
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

  // The plans run in an execution space: host_space runs their steps on a host stream (in
  // cuda_space the same calls take a CUDA stream and device memory). Each takes one workspace
  // of memory of the space (here host memory), 256-byte aligned, of `workspace_size()` bytes.
  using space = weave::host_space;
  weave::host_stream stream("routing");
  struct alignas(256) block {
    std::byte bytes[256];
  };
  const auto workspace = [](std::size_t bytes) { return std::vector<block>(bytes / 256 + 1); };

  // 2. Capacity as Tutel's batch-prioritized routing with factor 1.25 and Tutel's rounding;
  // decided once for the whole batch.
  weave::device_capacity_filter<space> filter(
      E, k, T, {1.25, weave::drop_order::batch_prioritized, weave::capacity_rounding::tutel});
  auto filter_ws = workspace(filter.workspace_size());
  filter.initialize(filter_ws.data(), filter_ws.size() * sizeof(block), stream);
  std::vector<std::uint8_t> keep(T * k);
  filter.decide(stream, ids, weights, keep, priority);

  // 3. Sender plan: one SFD row per (token, device), and the rows themselves.
  const auto where = weave::placement::contiguous(E, D);
  weave::device_dispatch_plan<space> plan(where, k, /*source_device=*/0, /*max_tokens=*/T);
  auto plan_ws = workspace(plan.workspace_size());
  plan.initialize(plan_ws.data(), plan_ws.size() * sizeof(block), stream);
  plan.build(stream, ids, weights, keep);
  plan.check_errors(stream); // waits for the stream: the plan's results are ready
  const std::int64_t dropped = *filter.dropped_count();
  const auto rows = static_cast<std::size_t>(plan.send_offsets()[D]);
  weave::host_matrix<float> sfd(rows, hidden);
  // ORI -> SFD by its map (`row_token`) or its inverse (`token_rows`): host_space scatters.
  weave::layout_move<space>(stream, x.view(), sfd.view(), plan.row_token().data(), nullptr, nullptr,
                            plan.token_rows().data(), k, nullptr, nullptr);
  // all_to_all_v(sfd, plan.send_counts()) and (plan.row_routes(), k * send_counts) go here.

  // 4. Receiver plan on device d, from what arrived (here: only this rank's rows for d).
  const int d = 1;
  const auto first = static_cast<std::size_t>(plan.send_offsets()[d]);
  const std::int64_t counts[] = {plan.send_counts()[d]}, displs[] = {0}; // one source
  const auto received = sfd.view().subrows(first, static_cast<std::size_t>(counts[0]));
  weave::device_expert_plan<space> experts(where.slots_per_device(), k, /*sources=*/1,
                                           /*max_rows=*/received.rows());
  auto experts_ws = workspace(experts.workspace_size());
  experts.initialize(experts_ws.data(), experts_ws.size() * sizeof(block), stream);
  experts.build(stream, plan.row_routes().subspan(first * k, received.rows() * k), counts, displs);
  experts.check_errors(stream);
  const auto L = static_cast<std::size_t>(where.slots_per_device());
  weave::host_matrix<float> epd(static_cast<std::size_t>(experts.expert_offsets()[L]), hidden);
  weave::layout_move<space>(stream, received, epd.view(), experts.epd_row_source().data(), nullptr,
                            experts.epd_rows_count(), experts.row_epd().data(), k, nullptr,
                            nullptr);
  // Local expert l owns EPD rows [expert_offsets()[l], expert_offsets()[l + 1]): run it there.
  weave::host_matrix<float> back(received.rows(), hidden); // sum of gate-weighted expert outputs
  weave::row_moves<space>::merge(stream, epd.view(), back.view(), experts.row_epd().data(), k,
                                 experts.row_weight().data(), nullptr, false);
  stream.synchronize();
  //! [dispatch]

  CHECK(summary.aux_loss > 0.0);
  std::int64_t routed = 0, kept = 0;
  for (std::size_t q = 0; q < ids.size(); ++q) {
    routed += ids[q] >= 0 ? 1 : 0;
    kept += plan.kept_experts()[q] >= 0 ? 1 : 0;
  }
  CHECK(kept + dropped == routed); // every routed pair is kept or dropped
  CHECK(static_cast<double>(rows) / static_cast<double>(T) <= 2.0); // copies per token
  // Identity experts: each returned row is x times the sum of the weights kept on device d.
  for (std::size_t r = 0; r < back.rows(); ++r) {
    float sum = 0;
    for (int i = 0; i < k; ++i)
      sum += experts.row_weight()[r * k + static_cast<std::size_t>(i)];
    CHECK(back(r, 0) == doctest::Approx(sum));
  }
}
