// The device decode exchange (`basic_device_decode_exchange`, the algorithm of
// `cuda_decode_exchange`) run on host streams by `host_space` over a local_world of 1, 2 and 4
// ranks: bitwise equal to the naive reference and to the host decode_exchange (outputs and
// per-source counts) for f32, bf16 and f16 rows, with zero-token and full ranks, -1 ids and
// replicated experts; every bad input on one rank fails every rank through check_errors with
// NaN outputs, and the next call works; agreement at construction; misuse refused.
#include "device_decode_cases.hpp"

#include <chrono>
#include <weave/comm/local_world.hpp>
#include <weave/core/dtype.hpp>
#include <weave/exec/emulated_gpu_space.hpp>

using local = weave::local_communicator;

TEST_CASE_TEMPLATE("device decode exchange equals the reference and the host decode exchange", T,
                   float, weave::bfloat16, weave::half) {
  for (int ranks : {1, 2, 4}) {
    CAPTURE(ranks);
    weave::local_world world(ranks);
    world.run([&](local& c) {
      decode_test::check_device_against_host<T>(
          c, weave::placement::contiguous(decode_test::experts, ranks));
    });
  }
}

TEST_CASE("device decode exchange with replicated experts chooses replicas as the host does") {
  // 2 ranks of 6 slots: experts 0, 1, 4 and 5 have a replica on each rank.
  const weave::placement where(8, 2, std::vector<std::int32_t>{0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 0, 1});
  weave::local_world world(2);
  world.run([&](local& c) { decode_test::check_device_against_host<float>(c, where); });
}

TEST_CASE_TEMPLATE("device decode exchange with partial sums equals its reference and the host "
                   "exchange's",
                   T, float, weave::bfloat16) {
  for (int ranks : {1, 2, 4}) {
    CAPTURE(ranks);
    weave::local_world world(ranks);
    world.run([&](local& c) {
      decode_test::check_device_against_host<T>(
          c, weave::placement::contiguous(decode_test::experts, ranks), true);
    });
  }
  const weave::placement where(8, 2, std::vector<std::int32_t>{0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 0, 1});
  weave::local_world world(2);
  world.run([&](local& c) { decode_test::check_device_against_host<T>(c, where, true); });
}

TEST_CASE("device decode exchange: calls queued back to back, one check at the end") {
  for (int ranks : {2, 4}) {
    CAPTURE(ranks);
    weave::local_world world(ranks);
    world.run([&](local& c) { decode_test::check_device_queued_calls(c); });
  }
}

TEST_CASE("device decode exchange fail-stop: one rank's bad call fails every rank, none hangs") {
  for (int ranks : {2, 4}) {
    CAPTURE(ranks);
    weave::local_world world(ranks);
    world.run([&](local& c) { decode_test::check_device_every_fault(c); });
  }
}

TEST_CASE("device decode exchange: ranks built differently fail construction on every rank") {
  weave::local_world world(2);
  std::vector<weave::errc> codes(2);
  std::vector<std::string> messages(2);
  world.run([&](local& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    try {
      decode_test::device_decode<local, float> ex(c, weave::placement::contiguous(4, 2),
                                                  {2, 4, c.rank() == 1 ? 3u : 2u});
    } catch (const weave::error& e) {
      codes[r] = e.code();
      messages[r] = e.message();
    }
  });
  for (std::size_t r = 0; r < 2; ++r) {
    CHECK(codes[r] == weave::errc::config_mismatch);
    CHECK(messages[r].find("max_tokens_per_rank") != std::string::npos);
  }
  // Either exchange built on both ranks with `options_of(rank)`: every rank's error code and
  // whether its message names `field`.
  const auto refusal = [&world](bool device, auto options_of, weave::errc code, const char* field) {
    CAPTURE(device);
    CAPTURE(field);
    std::vector<decode_test::outcome> got(2);
    world.run([&](local& c) {
      const weave::decode_options o = options_of(c.rank());
      const auto where = weave::placement::contiguous(4, 2);
      got[static_cast<std::size_t>(c.rank())] = decode_test::outcome_of([&] {
        if (device)
          decode_test::device_decode<local, float> ex(c, where, o);
        else
          weave::decode_exchange<local, float> ex(c, where, o);
      });
    });
    for (const auto& g : got) {
      CHECK(g.code == code);
      CHECK(g.message.find(field) != std::string::npos);
    }
  };
  for (const bool device : {true, false}) {
    // An FP8 dispatch on one rank only: both exchanges refuse it on every rank, naming it.
    refusal(
        device,
        [](int rank) {
          weave::decode_options o = decode_test::fp8_options(true);
          if (rank == 1)
            o.fp8_dispatch.reset();
          return o;
        },
        weave::errc::config_mismatch, "fp8_dispatch");
    // Gathered inputs are the host exchange's: the device one refuses them on every rank, and
    // so does the host one beside an FP8 dispatch.
    refusal(
        device,
        [device](int) {
          weave::decode_options o =
              device ? weave::decode_options{2, 4, 2} : decode_test::fp8_options(true);
          o.gathered_inputs = true;
          return o;
        },
        weave::errc::invalid_argument, "gathered_inputs");
  }
}

TEST_CASE("device decode exchange refuses calls before initialize, a second handle, another "
          "stream") {
  weave::local_world world(1);
  world.run([&](local& c) {
    decode_test::device_decode<local, float> ex(c, weave::placement::contiguous(4, 1), {2, 4, 2});
    weave::host_stream s("decode");
    std::vector<float> x(8, 1.0f), w(4, 0.5f), y(8);
    std::vector<std::int32_t> ids{0, 1, 2, 3};
    CHECK(moe_test::error_code_of([&] { (void)ex.dispatch(x, ids, w, s); }) ==
          weave::errc::invalid_state);
    weave_test::aligned_buffer ws(ex.workspace_size());
    CHECK(moe_test::error_code_of([&] { ex.initialize(ws.ptr, ws.size - 1, s); }) ==
          weave::errc::size_mismatch);
    ex.initialize(ws.ptr, ws.size, s);
    auto h = ex.dispatch(x, ids, w, s);
    CHECK(moe_test::error_code_of([&] { (void)ex.dispatch(x, ids, w, s); }) ==
          weave::errc::invalid_state);
    weave::host_stream other("other");
    CHECK(moe_test::error_code_of([&] { ex.combine(h, std::span<float>(y), other); }) ==
          weave::errc::invalid_argument);
    decltype(h) empty;
    CHECK(moe_test::error_code_of([&] { ex.combine(empty, std::span<float>(y), s); }) ==
          weave::errc::invalid_argument);
    s.submit([xs = h.experts()] {
      for (int l = 0; l < xs.local_experts; ++l)
        std::copy(xs.input_of(l), xs.input_of(l) + xs.rows[l] * 4, xs.output_of(l)); // hidden 4
    });
    ex.combine(h, std::span<float>(y), s);
    ex.check_errors(s);
    CHECK(y == std::vector<float>(8, 1.0f)); // 0.5 * x + 0.5 * x
    CHECK(!h.valid());
  });
}

// The docs' example: one device decode layer per rank in host_space, the experts queued on the
// stream after the dispatch, one check at the end; checked against the naive reference.
TEST_CASE("device decode exchange example: experts queued, one check at the end") {
  constexpr int experts = 8, k = 2;
  constexpr std::size_t hidden = 32;
  const moe_test::linear_experts f(experts, hidden, 3);
  weave::local_world world(2);
  world.run([&](local& comm) {
    std::mt19937 rng(static_cast<std::uint32_t>(comm.rank()));
    const auto in =
        moe_test::random_input<float>(comm.rank() == 0 ? 5 : 0, hidden, experts, k, rng);
    std::vector<float> y(in.x.rows() * hidden);
    //! [device_decode]
    weave::basic_device_decode_exchange<weave::host_space, weave::local_communicator, float> layer(
        comm, weave::placement::contiguous(experts, comm.size()), {k, hidden, 16});
    weave_test::aligned_buffer ws(layer.workspace_size()); // memory of the space, once
    weave::host_stream stream("decode");
    layer.initialize(ws.ptr, ws.size, stream);
    auto h = layer.dispatch(in.x.elements(), in.ids, in.weights, stream); // never waits
    stream.submit([&f, xs = h.experts()] { // on a GPU: kernels reading xs.rows on the device
      for (int l = 0; l < xs.local_experts; ++l)
        for (std::int64_t r = 0; r < xs.rows[l]; ++r) // rows of xs.hidden elements
          f.apply(xs.experts[static_cast<std::size_t>(l)], xs.input_of(l) + r * xs.hidden,
                  xs.output_of(l) + r * xs.hidden);
    });
    layer.combine(h, std::span<float>(y), stream);
    layer.check_errors(stream); // the one wait: this rank's failure, else a peer's
    //! [device_decode]
    CHECK(decode_test::bitwise_equal(
        y, decode_test::expected(in, {k, hidden, 16}, f,
                                 weave::placement::contiguous(experts, comm.size()), comm.rank())));
  });
}

TEST_CASE("a decode handle dropped without its combine aborts the world: the peer fails, never "
          "hangs") {
  const auto check = [](auto make, auto finish) {
    weave::local_world world(2);
    std::vector<decode_test::outcome> got(2);
    world.run([&](local& c) {
      got[static_cast<std::size_t>(c.rank())] = decode_test::check_dropped_handle(c, make, finish);
    });
    CHECK(got[0].message.empty()); // dropping is not an error of its own rank
    CHECK(got[1].code == weave::errc::peer_failure);
    CHECK(got[1].message.find("without its combine") != std::string::npos);
  };
  SUBCASE("decode_exchange") {
    check(
        [](local& c, weave::host_stream&) {
          return std::make_unique<weave::decode_exchange<local, float>>(
              c, weave::placement::contiguous(decode_test::experts, c.size()),
              decode_test::options());
        },
        [](auto&, weave::host_stream& s) { s.synchronize(); });
  }
  SUBCASE("device decode exchange") {
    check(
        [](local& c, weave::host_stream& s) {
          return std::make_unique<decode_test::device_layer<local, float>>(
              c, weave::placement::contiguous(decode_test::experts, c.size()), s);
        },
        [](auto& ex, weave::host_stream& s) { ex.check_errors(s); });
  }
}

TEST_CASE("a decode layer destroyed between a dispatch and its combine aborts the world: the "
          "peer fails at once, the handle goes stale") {
  const auto check = [](auto make, auto finish) {
    weave::local_world world(2); // the default timeout: 60 s
    std::vector<decode_test::outcome> got(2);
    bool stale = false;
    const auto start = std::chrono::steady_clock::now();
    world.run([&](local& c) {
      got[static_cast<std::size_t>(c.rank())] =
          decode_test::check_destroyed_layer(c, make, finish, stale);
    });
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
    CHECK(got[0].message.empty());
    CHECK(stale);
    CHECK(got[1].code == weave::errc::peer_failure);
    CHECK(got[1].message.find("destroyed between a dispatch and its combine") != std::string::npos);
  };
  SUBCASE("decode_exchange") {
    check(
        [](local& c, weave::host_stream&) {
          return std::make_unique<weave::decode_exchange<local, float>>(
              c, weave::placement::contiguous(decode_test::experts, c.size()),
              decode_test::options());
        },
        [](auto&, weave::host_stream& s) { s.synchronize(); });
  }
  SUBCASE("device decode exchange") {
    check(
        [](local& c, weave::host_stream& s) {
          return std::make_unique<decode_test::device_layer<local, float>>(
              c, weave::placement::contiguous(decode_test::experts, c.size()), s);
        },
        [](auto& ex, weave::host_stream& s) { ex.check_errors(s); });
  }
}

TEST_CASE_TEMPLATE("FP8 decode: both exchanges equal the reference on brute-force quantised rows",
                   T, float, weave::bfloat16) {
  for (int ranks : {1, 2, 4})
    for (bool dequantized : {true, false})
      for (bool partial_sums : {true, false}) {
        CAPTURE(ranks);
        CAPTURE(dequantized);
        CAPTURE(partial_sums);
        weave::local_world world(ranks);
        world.run(
            [&](local& c) { decode_test::check_fp8_decode<T>(c, dequantized, {}, partial_sums); });
      }
}

// Hidden sizes that are not a multiple of 4: the wire rows keep their scales aligned (under
// UBSan a misaligned float access fails this test), the outputs equal the reference.
TEST_CASE("FP8 decode at hidden sizes that are not a multiple of 4") {
  for (const auto shape : {decode_test::fp8_shape{6, 3}, decode_test::fp8_shape{130, 2}})
    for (int ranks : {1, 2}) {
      CAPTURE(shape.hidden);
      CAPTURE(ranks);
      weave::local_world world(ranks);
      world.run([&](local& c) {
        decode_test::check_fp8_decode<weave::bfloat16>(c, true, shape);
        decode_test::check_fp8_decode<float>(c, false, shape);
      });
    }
}

TEST_CASE("FP8 decode: a NaN token on one rank fails the call on every rank, in both exchanges") {
  for (int ranks : {2, 4}) {
    CAPTURE(ranks);
    weave::local_world world(ranks);
    world.run([&](local& c) { decode_test::check_fp8_nonfinite(c); });
  }
}

// A decode call issues nothing a CUDA graph capture refuses (host_capture.hpp): no host wait, no
// pageable copy (emulated_gpu_space), no wait for an event recorded outside the capture. Eager,
// captured and eager calls give the naive reference's outputs (host streams run a captured call
// as it is issued).
TEST_CASE_TEMPLATE("device decode calls pass the CUDA capture rules", Space, weave::host_space,
                   weave::emulated_gpu_space) {
  weave::local_world world(2);
  world.run([&](local& c) {
    const auto where = weave::placement::contiguous(decode_test::experts, 2);
    weave::basic_device_decode_exchange<Space, local, float> ex(c, where, decode_test::options());
    weave_test::aligned_buffer ws(ex.workspace_size());
    weave::host_stream s("decode");
    ex.initialize(ws.ptr, ws.size, s);
    const moe_test::linear_experts f(decode_test::experts, decode_test::hidden, 5);
    std::mt19937 rng(static_cast<std::uint32_t>(c.rank()) + 3);
    const auto in = moe_test::random_input<float>(decode_test::max_tokens, decode_test::hidden,
                                                  decode_test::experts, decode_test::k, rng);
    const auto want = decode_test::expected(in, decode_test::options(), f, where, c.rank());
    for (const bool captured : {false, true, false}) {
      CAPTURE(captured);
      std::vector<float> y(in.x.rows() * decode_test::hidden, -7.0f);
      if (captured)
        s.begin_capture();
      auto h = ex.dispatch(in.x.elements(), in.ids, in.weights, s);
      s.submit([&f, xs = h.experts()] {
        const auto H = static_cast<std::int64_t>(xs.hidden);
        for (int l = 0; l < xs.local_experts; ++l)
          for (std::int64_t r = 0; r < xs.rows[l]; ++r)
            f.apply(xs.experts[static_cast<std::size_t>(l)], xs.input_of(l) + r * H,
                    xs.output_of(l) + r * H);
      });
      ex.combine(h, std::span<float>(y), s);
      if (captured)
        s.end_capture();
      ex.check_errors(s);
      CHECK(decode_test::bitwise_equal(y, want));
    }
  });
}
