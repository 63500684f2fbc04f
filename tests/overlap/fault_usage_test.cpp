// The usage docs/faults.md shows, compiled and checked in every execution space CI has
// (host_space; emulated_gpu_space, the CUDA path's control flow): a training loop on 2 in-process
// ranks where rank 1 feeds a NaN gate weight in step 1. Every rank learns it at the same step
// (rank 1 its own invalid_argument, rank 0 a peer_error naming rank 1), both skip the batch
// together, and the next step's output equals a per-token reference computed here.
#include <doctest/doctest.h>

#include <weave/comm/local_world.hpp>
#include <weave/core/failure.hpp>
#include <weave/exec/emulated_gpu_space.hpp>
#include <weave/exec/host_space.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/overlap/moe_exchange.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <limits>
#include <string>
#include <utility>
#include <vector>

TEST_CASE_TEMPLATE("docs/faults.md usage: a failed step is skipped by every rank, the next one is "
                   "exact",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  constexpr int ranks = 2, experts = 4, k = 2;
  constexpr std::size_t tokens = 8, hidden = 4;
  weave::local_world world(ranks);
  world.run([&](weave::local_communicator& comm) {
    weave::moe_options o;
    o.k = k;
    o.hidden = hidden;
    o.max_tokens = tokens;
    o.chunks = 2;
    o.save_for_backward = true;
    weave::basic_moe_exchange<Space, weave::local_communicator> layer(
        comm, weave::placement::contiguous(experts, ranks), o);
    weave::host_stream compute("compute"), comm_stream("comm");
    std::vector<float> x(tokens * hidden), y(x.size()), dx(x.size()), dw(tokens * k);
    for (std::size_t i = 0; i < x.size(); ++i)
      x[i] = static_cast<float>(i % 7) - 3.0f + 0.5f * static_cast<float>(comm.rank());
    std::vector<std::int32_t> ids(tokens * k);
    std::vector<float> weights(tokens * k, 0.5f);
    for (std::size_t t = 0; t < tokens; ++t) {
      ids[t * k] = static_cast<std::int32_t>(t % experts);
      ids[t * k + 1] = static_cast<std::int32_t>((t + 1) % experts);
    }
    // Expert e scales its rows by (e + 1), forward and backward.
    const auto scale = [](const weave::const_token_view& in, const weave::token_view& out,
                          std::span<const std::int64_t> offsets,
                          std::span<const std::int32_t> held) {
      for (std::size_t l = 0; l + 1 < offsets.size(); ++l)
        for (auto r = offsets[l]; r < offsets[l + 1]; ++r)
          for (std::size_t h = 0; h < in.cols(); ++h)
            out.row_as<float>(static_cast<std::size_t>(r))[h] =
                static_cast<float>(held[l] + 1) * in.row_as<float>(static_cast<std::size_t>(r))[h];
    };
    // A step of the batch's stream: in host_space the callback runs in a task of the compute
    // stream, so the step runs at once; where host code runs at enqueue time (the emulated GPU)
    // it runs once the stream has the chunk's rows.
    const auto experts_fn = [&](const weave::basic_expert_batch<Space>& b) {
      weave::host_space::enqueue(b.stream,
                                 [=] { scale(b.input, b.output, b.expert_offsets, b.experts); });
    };
    const auto experts_grad = [&](const weave::basic_expert_grad_batch<Space>& b) {
      weave::host_space::enqueue(
          b.stream, [=] { scale(b.grad_output, b.grad_input, b.expert_offsets, b.experts); });
    };
    const auto xv = weave::make_token_view(std::as_const(x), hidden);
    const auto yv = weave::make_token_view(y, hidden), dxv = weave::make_token_view(dx, hidden);
    std::string log;
    //! [usage]
    // One training step. forward/backward throw what they reject at the call; synchronize() is
    // the one wait, and rethrows the root cause of anything that failed later, on any rank.
    const auto step = [&]() -> bool {
      std::exception_ptr failure;
      try {
        layer.forward(xv, ids, weights, yv, experts_fn, compute, comm_stream);
        layer.backward(xv, dxv, dw, experts_grad, compute, comm_stream);
      } catch (...) {
        failure = std::current_exception();
      }
      try {
        layer.synchronize(compute, comm_stream);
      } catch (...) {
        failure = failure ? failure : std::current_exception();
      }
      if (!failure)
        return true;
      try {
        std::rethrow_exception(failure);
      } catch (const weave::peer_error& e) { // another rank failed: origin() names it
        log += "rank " + std::to_string(e.origin().rank) + ": " + e.origin().message;
      } catch (const weave::error& e) { // this rank's own error
        log += std::string("here: ") + e.what();
      }
      if (!layer.usable()) // the communicator was aborted: rebuild it and the layer
        std::rethrow_exception(failure);
      return false; // every rank skipped this batch together; the layer carries on
    };
    //! [usage]
    CHECK(step());
    if (comm.rank() == 1)
      weights[5] = std::numeric_limits<float>::quiet_NaN();
    CHECK_FALSE(step());
    INFO(log);
    // On host streams the plan's check on the host names the weight; where host code runs at
    // enqueue time the culprit's error comes from its plan's flags, which name no pair.
    const std::string cause = Space::runs_later ? "weight nan" : "non-finite gate weight";
    if (comm.rank() == 0)
      CHECK(log.rfind("rank 1: " + cause, 0) == 0);
    else
      CHECK(log.find("here: weave invalid_argument: " + cause) == 0);
    weights[5] = 0.5f;
    std::fill(y.begin(), y.end(), -1.0f);
    REQUIRE(step());
    for (std::size_t t = 0; t < tokens; ++t)
      for (std::size_t h = 0; h < hidden; ++h) {
        const float expected = 0.5f * static_cast<float>(ids[t * k] + 1) * x[t * hidden + h] +
                               0.5f * static_cast<float>(ids[t * k + 1] + 1) * x[t * hidden + h];
        CHECK(y[t * hidden + h] == doctest::Approx(expected));
      }
  });
}
