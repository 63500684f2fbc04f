// moe_exchange over real MPI processes (mpirun -np 2 / 4): every rank builds the same global
// problem from one seed, runs its share forward and backward unchunked and chunked, checks its
// results against the dense reference, and checks the chunked run bitwise against the
// unchunked one; then the device exchange's algorithm (host_space) over the same MPI
// communicator, dynamic and static shapes, bitwise against moe_exchange; and both exchanges'
// handles with 4 micro-batches in 1F1B order against the callback form and the reference.
#include <doctest/doctest.h>

#include "moe_test_support.hpp"

#include <weave/comm/mpi_communicator.hpp>
#include <weave/exec/host_space.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/overlap/device_exchange.hpp>
#include <weave/overlap/moe_exchange.hpp>
#include <weave/routing/host_quant_moves.hpp>
#include <weave/routing/host_row_moves.hpp>

#include "aligned_buffer.hpp"
#include "handle_support.hpp"
#include "mpi_session.hpp"

#include <cstring>
#include <optional>
#include <random>

namespace {

const weave_test::mpi_session session;

using exchange = weave::moe_exchange<weave::mpi_communicator>;

struct run_output {
  weave::host_matrix<float> y, dx;
  std::vector<float> dw;
  weave::moe_stats stats;
};

run_output run(weave::mpi_communicator& comm, const weave::placement& where, int chunks, int k,
               std::size_t max_tokens, const weave::capacity_policy& capacity,
               const moe_test::rank_input<float>& in, const moe_test::linear_experts& experts,
               const std::optional<weave::fp8_dispatch_options>& fp8 = {},
               const weave::host_matrix<float>* dy = nullptr) { // dL/dy; null: x
  weave::moe_options o;
  o.k = k;
  o.hidden = in.x.cols();
  o.max_tokens = max_tokens;
  o.chunks = chunks;
  o.capacity = capacity;
  o.save_for_backward = true;
  o.fp8_dispatch = fp8;
  exchange ex(comm, where, o);
  weave::host_stream compute("compute"), stream("comm");
  run_output out{weave::host_matrix<float>(in.x.rows(), in.x.cols()),
                 weave::host_matrix<float>(in.x.rows(), in.x.cols()),
                 std::vector<float>(in.ids.size()),
                 {}};
  ex.forward(
      in.x.view(), in.ids, in.weights, out.y.view(),
      [&](const weave::expert_batch& b) { experts.operator()<float>(b); }, compute, stream);
  ex.backward((dy != nullptr ? *dy : in.x).view(), out.dx.view(), out.dw,
              [&](const weave::expert_grad_batch& b) { experts.backward<float>(b); }, compute,
              stream);
  compute.synchronize();
  stream.synchronize();
  out.stats = ex.stats();
  return out;
}

// The device exchange's algorithm on host streams over MPI, forward and backward.
run_output run_device(weave::mpi_communicator& comm, const weave::placement& where, int chunks,
                      int k, std::size_t max_tokens, const weave::capacity_policy& capacity,
                      bool fixed, const moe_test::rank_input<float>& in,
                      const moe_test::linear_experts& experts,
                      const std::optional<weave::fp8_dispatch_options>& fp8 = {},
                      const weave::host_matrix<float>* dy = nullptr) { // dL/dy; null: x
  weave::moe_options o;
  o.k = k;
  o.hidden = in.x.cols();
  o.max_tokens = max_tokens;
  o.chunks = chunks;
  o.capacity = capacity;
  o.save_for_backward = true;
  o.static_shape = fixed;
  o.fp8_dispatch = fp8;
  weave::basic_device_exchange<weave::host_space, weave::mpi_communicator> ex(comm, where, o);
  weave::host_stream compute("compute"), stream("comm");
  weave_test::aligned_buffer ws(ex.workspace_size());
  ex.initialize(ws.ptr, ws.size, compute);
  run_output out{weave::host_matrix<float>(in.x.rows(), in.x.cols()),
                 weave::host_matrix<float>(in.x.rows(), in.x.cols()),
                 std::vector<float>(in.ids.size()),
                 {}};
  using batch = weave::device_expert_batch<weave::host_space>;
  using grad_batch = weave::device_expert_grad_batch<weave::host_space>;
  ex.forward(
      in.x.view(), in.ids, in.weights, out.y.view(),
      [&](const batch& b) {
        experts.operator()<float>(
            {b.chunk, b.device, b.expert_offsets, b.experts, b.input, b.output});
      },
      compute, stream);
  ex.backward((dy != nullptr ? *dy : in.x).view(), out.dx.view(), out.dw,
              [&](const grad_batch& b) {
                experts.backward<float>({b.chunk, b.device, b.expert_offsets, b.experts,
                                         b.saved_input, b.grad_output, b.grad_input});
              },
              compute, stream);
  compute.synchronize();
  stream.synchronize();
  ex.check_errors(compute);
  out.stats = ex.read_stats(compute);
  return out;
}

} // namespace

TEST_CASE("moe_exchange over MPI equals the dense reference; chunking is bitwise neutral") {
  weave::mpi_communicator comm(MPI_COMM_WORLD);
  const int ranks = comm.size();
  const int experts_count = 4 * ranks, k = 3;
  const std::size_t hidden = 8;
  for (const double factor : {0.0, 0.75}) {
    CAPTURE(factor);
    const weave::capacity_policy capacity{factor, weave::drop_order::batch_prioritized};
    std::mt19937 rng(99);
    std::vector<moe_test::rank_input<float>> all;
    for (int r = 0; r < ranks; ++r)
      all.push_back(moe_test::random_input<float>(static_cast<std::size_t>(20 + 7 * r), hidden,
                                                  experts_count, k, rng));
    const std::size_t max_tokens = 20 + 7 * static_cast<std::size_t>(ranks - 1);
    const moe_test::linear_experts experts(experts_count, hidden, 5);
    const auto where = weave::placement::contiguous(experts_count, ranks);
    const auto& mine = all[static_cast<std::size_t>(comm.rank())];
    const auto base = run(comm, where, 1, k, max_tokens, capacity, mine, experts);
    moe_test::check_rank_against_dense(comm.rank(), where, k, experts_count, capacity, mine,
                                       experts, base.y, &base.dx, &base.dw, base.stats, 1e-4);
    const auto piped = run(comm, where, 3, k, max_tokens, capacity, mine, experts);
    CHECK(std::memcmp(base.y.data(), piped.y.data(), base.y.rows() * hidden * 4) == 0);
    CHECK(std::memcmp(base.dx.data(), piped.dx.data(), base.dx.rows() * hidden * 4) == 0);
    CHECK(std::memcmp(base.dw.data(), piped.dw.data(), base.dw.size() * 4) == 0);
    for (const bool fixed : {false, true}) {
      CAPTURE(fixed);
      const auto dev = run_device(comm, where, 3, k, max_tokens, capacity, fixed, mine, experts);
      CHECK(std::memcmp(base.y.data(), dev.y.data(), base.y.rows() * hidden * 4) == 0);
      CHECK(std::memcmp(base.dx.data(), dev.dx.data(), base.dx.rows() * hidden * 4) == 0);
      CHECK(std::memcmp(base.dw.data(), dev.dw.data(), base.dw.size() * 4) == 0);
      CHECK(dev.stats.sent_rows == base.stats.sent_rows);
      CHECK(dev.stats.dropped_pairs == base.stats.dropped_pairs);
    }
  }
}

TEST_CASE_TEMPLATE("handles over MPI: 1F1B micro-batches equal the callback form one by one", T,
                   std::false_type, std::true_type) {
  // 4 micro-batches per rank in interleaved 1F1B order through handles (2 in flight), against
  // the same micro-batches one by one through the callback form (bitwise) and the dense
  // reference; both exchanges, unchunked and chunked.
  constexpr bool device = T::value;
  weave::mpi_communicator comm(MPI_COMM_WORLD);
  const int ranks = comm.size(), experts_count = 4 * ranks, k = 2;
  const std::size_t hidden = 8, max_tokens = 20;
  const auto where = weave::placement::contiguous(experts_count, ranks);
  const moe_test::linear_experts lin(experts_count, hidden, 17);
  std::mt19937 rng(42);
  std::vector<moe_test::rank_input<float>> mine;
  for (int r = 0; r < ranks; ++r)
    for (int i = 0; i < 4; ++i) {
      auto in = moe_test::random_input<float>(max_tokens - 2 * static_cast<std::size_t>(i + r),
                                              hidden, experts_count, k, rng);
      if (r == comm.rank())
        mine.push_back(std::move(in));
    }
  for (const int chunks : {1, 3}) {
    CAPTURE(chunks);
    weave::moe_options o;
    o.k = k;
    o.hidden = hidden;
    o.max_tokens = max_tokens;
    o.chunks = chunks;
    o.save_for_backward = true;
    weave::host_stream compute("compute"), stream("comm");
    handle_test::layer<weave::mpi_communicator, device> one(comm, where, o, compute);
    const auto want = handle_test::run_one_by_one(one, mine, lin, compute, stream);
    o.max_in_flight = 2;
    handle_test::layer<weave::mpi_communicator, device> two(comm, where, o, compute);
    const auto got =
        handle_test::run_schedule(two, mine, handle_test::one_f_one_b, lin, compute, stream);
    for (std::size_t i = 0; i < mine.size(); ++i) {
      CAPTURE(i);
      CHECK(handle_test::same(got[i], want[i]));
      moe_test::check_rank_against_dense(comm.rank(), where, k, experts_count, {}, mine[i], lin,
                                         got[i].y, &got[i].dx, &got[i].dw, got[i].stats, 1e-4);
    }
  }
}

TEST_CASE("fp8 dispatch over MPI equals the plain exchange on pre-dequantised rows") {
  // With dequantised inputs the experts see T(code * scale), exactly the rows the plain exchange
  // delivers when every token was quantised and dequantised beforehand: forward and backward
  // must match it bit for bit, for both exchanges, chunked or not.
  weave::mpi_communicator comm(MPI_COMM_WORLD);
  const int ranks = comm.size(), experts_count = 4 * ranks, k = 2;
  const std::size_t hidden = 256, max_tokens = 24;
  std::mt19937 rng(31);
  std::vector<moe_test::rank_input<float>> all;
  for (int r = 0; r < ranks; ++r)
    all.push_back(moe_test::random_input<float>(max_tokens - 3 * static_cast<std::size_t>(r),
                                                hidden, experts_count, k, rng));
  const auto& mine = all[static_cast<std::size_t>(comm.rank())];
  auto dequantized = mine;
  weave::host_matrix<weave::fp8_e4m3> codes(mine.x.rows(), hidden);
  weave::host_matrix<float> scales(mine.x.rows(), hidden / 128);
  weave::quantize_rows(mine.x.view(), codes.view(), scales.view());
  weave::dequantize_rows(codes.view(), scales.view(), dequantized.x.view());
  const moe_test::linear_experts experts(experts_count, hidden, 5);
  const auto where = weave::placement::contiguous(experts_count, ranks);
  const auto want = run(comm, where, 1, k, max_tokens, {}, dequantized, experts, {}, &mine.x);
  const weave::fp8_dispatch_options fp8{weave::dtype::e4m3, {}, /*dequantized_inputs=*/true};
  const auto same = [&](const run_output& got) {
    CHECK(std::memcmp(want.y.data(), got.y.data(), want.y.rows() * hidden * 4) == 0);
    CHECK(std::memcmp(want.dx.data(), got.dx.data(), want.dx.rows() * hidden * 4) == 0);
    CHECK(std::memcmp(want.dw.data(), got.dw.data(), want.dw.size() * 4) == 0);
    CHECK(got.stats.dispatch_row_bytes == 272); // 256 codes, 2 scales, padded to 16
    CHECK(got.stats.sent_rows == want.stats.sent_rows);
  };
  for (const int chunks : {1, 3}) {
    CAPTURE(chunks);
    same(run(comm, where, chunks, k, max_tokens, {}, mine, experts, fp8, &mine.x));
    same(run_device(comm, where, chunks, k, max_tokens, {}, false, mine, experts, fp8, &mine.x));
  }
}
