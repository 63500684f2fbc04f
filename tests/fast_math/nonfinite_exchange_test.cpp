// The exchanges' checks of non-finite values over a two-rank local_world, in the MoE and decode
// exchanges (their cases written once and run in host_space and in emulated_gpu_space): a NaN or
// infinite gate weight on one rank fails the call on every rank with the documented typed
// errors; a token holding a NaN or an infinity in an FP8 dispatch fails every rank of the decode
// exchange, while the MoE exchange, in every space as on the GPU, sends its blocks as NaN and
// reports it on its rank only, the peer's outputs unaffected; finite extremes never fail; a NaN
// activation reaches the output as a NaN. Built with -ffast-math (test_fast_math) and without
// (test_fast_math_reference): the same expectations hold in both.
#include <doctest/doctest.h>

#include "aligned_buffer.hpp"
#include "nonfinite_values.hpp"

#include <weave/comm/local_world.hpp>
#include <weave/core/host_matrix.hpp>
#include <weave/exec/emulated_gpu_space.hpp>
#include <weave/exec/host_space.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/overlap/decode_exchange.hpp>
#include <weave/overlap/moe_exchange.hpp>
#include <weave/routing/host_quant_moves.hpp>
#include <weave/routing/host_row_moves.hpp>

#include <bit>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

using namespace nonfinite;
using weave::errc;

namespace {

constexpr int ranks = 2, experts = 4, k = 2;
constexpr std::size_t tokens = 6, hidden = 256; // two FP8 blocks of 128

using comm_type = weave::local_communicator;

// One rank's tokens: random activations, token t choosing experts t % 4 and (t + 1) % 4 with
// weights 0.75 and 0.25.
struct rank_input {
  weave::host_matrix<float> x{tokens, hidden};
  std::vector<std::int32_t> ids;
  std::vector<float> weights;
};

rank_input input_of(int rank) {
  rank_input in;
  std::mt19937 rng(static_cast<std::uint32_t>(rank + 1));
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (float& v : in.x.elements())
    v = n(rng);
  for (std::size_t t = 0; t < tokens; ++t) {
    in.ids.push_back(static_cast<std::int32_t>(t % experts));
    in.ids.push_back(static_cast<std::int32_t>((t + 1) % experts));
    in.weights.push_back(0.75f);
    in.weights.push_back(0.25f);
  }
  return in;
}

weave::moe_options moe_options_of(bool fp8, const weave::capacity_policy& capacity) {
  weave::moe_options o;
  o.k = k;
  o.hidden = hidden;
  o.element = weave::dtype::f32;
  o.max_tokens = tokens;
  o.chunks = 2;
  o.capacity = capacity;
  if (fp8)
    o.fp8_dispatch = weave::fp8_dispatch_options{weave::dtype::e4m3, {}, true};
  return o;
}

weave::decode_options decode_options_of(bool fp8) {
  weave::decode_options o;
  o.k = k;
  o.hidden = hidden;
  o.max_tokens_per_rank = tokens;
  if (fp8)
    o.fp8_dispatch = weave::fp8_dispatch_options{weave::dtype::e4m3, {}, true};
  return o;
}

// Copies every input row to its output row (on the device: the capacity's rows, the unused ones
// are not read).
void identity(const weave::const_token_view& in, const weave::token_view& out) {
  for (std::size_t i = 0; i < in.rows(); ++i)
    std::memcpy(out.row(i), in.row(i), in.row_bytes());
}

// One forward of the MoE exchange in `Space`, the experts the identity (in stream order: the
// callback's task on host streams, a task it enqueues where host code runs at enqueue time), and
// the one wait that reports a failure's root cause.
template <class Space>
void moe_forward(comm_type& comm, const weave::moe_options& o, const rank_input& in,
                 weave::host_matrix<float>& y, weave::host_stream& compute,
                 weave::host_stream& comm_stream) {
  const auto where = weave::placement::contiguous(experts, ranks);
  weave::basic_moe_exchange<Space, comm_type> ex(comm, where, o);
  weave_test::aligned_buffer ws(ex.workspace_size());
  ex.initialize(ws.ptr, ws.size, compute);
  ex.forward(
      in.x.view(), in.ids, in.weights, y.view(),
      [](const weave::basic_expert_batch<Space>& b) {
        weave::host_space::enqueue(b.stream, [b] { identity(b.input, b.output); });
      },
      compute, comm_stream);
  ex.synchronize(compute, comm_stream);
}

// One decode call in `Space`, the experts the identity (a task queued after the dispatch), and the
// one wait that reports a failure's root cause.
template <class Space>
void decode_call(comm_type& comm, bool fp8, const rank_input& in, weave::host_matrix<float>& y,
                 weave::host_stream& s) {
  weave::basic_decode_exchange<Space, comm_type, float> ex(
      comm, weave::placement::contiguous(experts, ranks), decode_options_of(fp8));
  auto h = ex.dispatch(in.x.elements(), in.ids, in.weights, s);
  s.submit([xs = h.experts()] {
    for (const std::int64_t l : xs.busy()) {
      const auto input = xs.input(static_cast<int>(l));
      std::memcpy(xs.output(static_cast<int>(l)).data(), input.data(),
                  input.size() * sizeof(float));
    }
  });
  ex.combine(h, y.elements(), s);
  ex.synchronize(s);
}

enum class layer { moe_host, moe_emulated_gpu, decode_host, decode_emulated_gpu };
constexpr layer every_layer[] = {layer::moe_host, layer::moe_emulated_gpu, layer::decode_host,
                                 layer::decode_emulated_gpu};
// The MoE exchange in each space.
constexpr layer moe_layers[] = {layer::moe_host, layer::moe_emulated_gpu};

bool is_moe(layer l) {
  return l == layer::moe_host || l == layer::moe_emulated_gpu;
}

const char* name_of(layer l) {
  switch (l) {
  case layer::moe_host:
    return "moe_exchange in host_space";
  case layer::moe_emulated_gpu:
    return "moe_exchange in emulated_gpu_space";
  case layer::decode_host:
    return "decode_exchange in host_space";
  default:
    return "decode_exchange in emulated_gpu_space";
  }
}

// One call of `which` on every rank, rank 1's input changed by `poison`: each rank's outcome
// and output.
struct call_result {
  std::vector<outcome> got = std::vector<outcome>(ranks);
  std::vector<weave::host_matrix<float>> y =
      std::vector<weave::host_matrix<float>>(ranks, weave::host_matrix<float>(tokens, hidden));
};

template <class Poison>
call_result call(layer which, bool fp8, Poison&& poison, weave::capacity_policy capacity = {}) {
  call_result out;
  weave::local_world world(ranks, {std::chrono::seconds(20), {}});
  world.run([&](comm_type& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    auto in = input_of(comm.rank());
    if (r == 1)
      poison(in);
    weave::host_matrix<float>& y = out.y[r];
    weave::host_stream compute("compute"), comm_stream("comm");
    out.got[r] = outcome_of([&] {
      switch (which) {
      case layer::moe_host:
        moe_forward<weave::host_space>(comm, moe_options_of(fp8, capacity), in, y, compute,
                                       comm_stream);
        break;
      case layer::moe_emulated_gpu:
        moe_forward<weave::emulated_gpu_space>(comm, moe_options_of(fp8, capacity), in, y, compute,
                                               comm_stream);
        break;
      case layer::decode_host:
        decode_call<weave::host_space>(comm, fp8, in, y, compute);
        break;
      case layer::decode_emulated_gpu:
        decode_call<weave::emulated_gpu_space>(comm, fp8, in, y, compute);
        break;
      }
    });
  });
  return out;
}

// Rank 1 failed with `own`, rank 0 with a peer_failure naming rank 1 (`message` in both).
void check_fail_stop(const call_result& r, errc own, const std::string& message) {
  INFO("rank 0: ", r.got[0].message);
  INFO("rank 1: ", r.got[1].message);
  CHECK(r.got[1].code == own);
  CHECK(r.got[0].code == errc::peer_failure);
  CHECK(r.got[0].message.find("rank 1") != std::string::npos);
  CHECK(r.got[1].message.find(message) != std::string::npos);
}

} // namespace

TEST_CASE("non-finite: a NaN or infinite gate weight fails every rank of every exchange") {
  for (const layer which : every_layer)
    for (const auto& s : f32_nonfinite) {
      INFO("layer: ", std::string(name_of(which)));
      INFO("value: ", std::string(s.name));
      const auto r = call(which, false, [&](rank_input& in) { in.weights[5] = value(s); });
      check_fail_stop(r, errc::invalid_argument, "weight");
    }
  // Prioritized capacity ranks tokens by their weights before the plan checks them.
  for (const layer which : moe_layers)
    for (const auto order :
         {weave::drop_order::batch_prioritized, weave::drop_order::priority_token_major})
      for (const auto& s : f32_nonfinite) {
        INFO("layer: ", std::string(name_of(which)));
        INFO("value: ", std::string(s.name));
        const auto r = call(which, false, [&](rank_input& in) { in.weights[5] = value(s); },
                            {1.0, order, weave::capacity_rounding::ceil});
        check_fail_stop(r, errc::invalid_argument, "weight");
      }
}

TEST_CASE("non-finite: finite extreme gate weights pass every exchange") {
  for (const layer which : every_layer)
    for (const auto& s : f32_extremes) {
      INFO("layer: ", std::string(name_of(which)));
      INFO("value: ", std::string(s.name));
      const auto r = call(which, false, [&](rank_input& in) { in.weights[5] = value(s); });
      CHECK(r.got[0].code == errc{});
      CHECK(r.got[1].code == errc{});
    }
}

TEST_CASE("non-finite: an FP8 dispatch of a NaN or infinite token fails every rank") {
  for (const layer which : every_layer)
    for (const auto& s : f32_nonfinite) {
      INFO("layer: ", std::string(name_of(which)));
      INFO("value: ", std::string(s.name));
      const auto r = call(which, true, [&](rank_input& in) { in.x(4, 200) = value(s); });
      if (!is_moe(which)) {
        check_fail_stop(r, errc::invalid_argument, "NaN or an infinity");
        continue;
      }
      // The MoE exchange sends the token's block as NaN and reports it on the sender, naming the
      // token; the peer's outputs are unaffected.
      INFO("rank 1: ", r.got[1].message);
      CHECK(r.got[1].code == errc::invalid_argument);
      CHECK(r.got[1].message.find("token 4 ") != std::string::npos);
      CHECK(r.got[1].message.find("NaN or an infinity") != std::string::npos);
      CHECK(r.got[0].code == errc{});
      for (std::size_t c = 0; c < hidden; ++c)
        CHECK(nan_bits(bits(r.y[1](4, c))) == (c >= 128));
      const auto clean = call(which, true, [](rank_input&) {});
      REQUIRE(clean.got[0].code == errc{});
      REQUIRE(clean.got[1].code == errc{});
      for (std::size_t rank = 0; rank < ranks; ++rank)
        for (std::size_t t = 0; t < tokens; ++t)
          if (rank == 0 || t != 4)
            CHECK(std::memcmp(r.y[rank].row(t).data(), clean.y[rank].row(t).data(),
                              hidden * sizeof(float)) == 0);
    }
  for (const layer which : every_layer)
    for (const auto& s : f32_extremes) {
      INFO("layer: ", std::string(name_of(which)));
      INFO("value: ", std::string(s.name));
      const auto r = call(which, true, [&](rank_input& in) { in.x(4, 200) = value(s); });
      CHECK(r.got[0].code == errc{});
      CHECK(r.got[1].code == errc{});
    }
}

TEST_CASE("non-finite: a NaN activation reaches the combined output as a NaN") {
  // Activations are the experts' business (no check), but a NaN is never combined into a
  // finite number: token 4's element 200 is NaN in every output, its other elements finite.
  for (const layer which : every_layer)
    for (const auto& s : f32_nonfinite) {
      if (!nan_bits(s.bits))
        continue;
      INFO("layer: ", std::string(name_of(which)));
      INFO("value: ", std::string(s.name));
      const auto r = call(which, false, [&](rank_input& in) { in.x(4, 200) = value(s); });
      REQUIRE(r.got[1].code == errc{});
      for (std::size_t c = 0; c < hidden; ++c)
        CHECK(nan_bits(bits(r.y[1](4, c))) == (c == 200));
    }
}
