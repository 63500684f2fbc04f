// The usage docs/faults.md shows for handles, compiled and checked: two micro-batches in flight
// on 2 in-process ranks, rank 1 feeding a bad expert id in step 1. Every rank's step 1 fails
// (rank 1 its own out_of_range, rank 0 a peer_error naming rank 1), the failed calls' handles go
// stale and free their slots, and step 2 runs without releasing them and equals y = 2x times
// each token's kept weights. On host streams (`moe_exchange`) only: the snippet names its handle
// type `decltype(layer)::handle`, which a test templated over the space makes a dependent name
// (clang 14 wants `typename` there); handle_faults.hpp's recovery case runs the same scenario in
// every space.
#include <doctest/doctest.h>

#include <weave/comm/local_world.hpp>
#include <weave/core/host_matrix.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/overlap/moe_exchange.hpp>

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// The caller's experts: y = 2x on every row of the chunk.
void double_rows(const weave::expert_batch& b) {
  for (std::int64_t r = 0; r < b.expert_offsets.back(); ++r) {
    const auto in = b.input.row_as<float>(static_cast<std::size_t>(r));
    const auto out = b.output.row_as<float>(static_cast<std::size_t>(r));
    for (std::size_t i = 0; i < in.size(); ++i)
      out[i] = 2.0f * in[i];
  }
}

} // namespace

TEST_CASE("docs/faults.md handles: a failed step ends its calls on every rank, the next works") {
  constexpr int ranks = 2, experts = 4, k = 2;
  constexpr std::size_t tokens = 8, hidden = 4;
  weave::local_world world(ranks);
  world.run([&](weave::local_communicator& comm) {
    weave::moe_options o;
    o.k = k;
    o.hidden = hidden;
    o.max_tokens = tokens;
    o.chunks = 2;
    o.max_in_flight = 2; // two micro-batches in flight
    weave::moe_exchange<weave::local_communicator> layer(
        comm, weave::placement::contiguous(experts, ranks), o);
    weave::host_stream compute("compute"), comm_stream("comm");
    weave::host_matrix<float> xa(tokens, hidden), xb(tokens, hidden), ya(tokens, hidden),
        yb(tokens, hidden);
    for (std::size_t t = 0; t < tokens; ++t)
      for (std::size_t i = 0; i < hidden; ++i) {
        xa(t, i) = static_cast<float>(t + i) + 0.5f * float(comm.rank());
        xb(t, i) = static_cast<float>(t) - static_cast<float>(i);
      }
    std::vector<std::int32_t> good(tokens * k), bad;
    for (std::size_t p = 0; p < good.size(); ++p)
      good[p] = static_cast<std::int32_t>((p + p / k) % experts);
    bad = good;
    bad[3] = experts; // out of range
    const std::vector<float> wa(tokens * k, 0.25f), wb(tokens * k, 0.5f);
    std::vector<std::string> log;

    //! [recovery]
    // One step: two micro-batches in flight (their communication under each other's experts).
    // Any failure ends every call in flight, on every rank alike: synchronize() rethrows the
    // root cause, and if the layer is still usable() the failed calls' handles are stale (their
    // slots are free; using one throws invalid_state, dropping one does nothing).
    const auto step = [&](const std::vector<std::int32_t>& ids_a) -> bool {
      using handle = decltype(layer)::handle;
      try {
        handle a = layer.dispatch(xa, ids_a, wa, compute, comm_stream);
        handle b = layer.dispatch(xb, good, wb, compute, comm_stream);
        for (auto* h : {&a, &b}) {
          for (const auto chunk : layer.chunks(*h)) // the experts, on the compute stream
            compute.submit([chunk] { double_rows(chunk.experts()); });
          layer.combine(*h, h == &a ? ya : yb, compute, comm_stream);
        }
        layer.synchronize(compute, comm_stream); // the one wait: rethrows the root cause
        return true;
      } catch (const weave::peer_error& e) { // another rank failed: origin() names it
        log.push_back("rank " + std::to_string(e.origin().rank) + ": " + e.origin().message);
      } catch (const weave::error& e) { // this rank's own error
        log.push_back(std::string("here: ") + e.what());
      }
      if (!layer.usable()) // aborted: tear down (handles, layer, streams, then communicator)
        throw weave::error(weave::errc::invalid_state, "rebuild the communicator and the layer");
      return false; // every rank skipped this step together; the layer carries on
    };
    //! [recovery]

    CHECK(step(good));
    const bool guilty = comm.rank() == 1;
    CHECK_FALSE(step(guilty ? bad : good)); // rank 1's bad id fails step 1 on both ranks
    REQUIRE(log.size() == 1);
    CHECK(log[0].find(guilty ? "here: weave out_of_range" : "rank 1: ") == 0);
    CHECK(layer.handles_in_flight() == 0); // the failed calls released their slots
    CHECK(step(good));
    for (std::size_t t = 0; t < tokens; ++t)
      for (std::size_t i = 0; i < hidden; ++i) {
        CHECK(ya(t, i) == doctest::Approx(2.0f * 0.5f * xa(t, i)));
        CHECK(yb(t, i) == doctest::Approx(2.0f * 1.0f * xb(t, i)));
      }
  });
}
