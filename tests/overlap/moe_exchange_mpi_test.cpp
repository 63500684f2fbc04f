// The MoE exchange over real MPI processes (mpirun -np 2 / 4), each case written once and run in
// host_space and in emulated_gpu_space (the CUDA path's control flow on host streams): every rank
// builds the same global problem from one seed and runs its share forward and backward,
// unchunked against the dense reference, and chunked with dynamic and static shapes bitwise
// against the unchunked run; handles with 4 micro-batches in 1F1B order against the callback form
// and the reference; and the FP8 dispatch, dynamic and static, bitwise against the plain exchange
// on pre-dequantised rows (whose forward equals the dense reference).
#include <doctest/doctest.h>

#include "moe_test_support.hpp"

#include <weave/comm/mpi_communicator.hpp>
#include <weave/exec/emulated_gpu_space.hpp>
#include <weave/exec/host_space.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/overlap/moe_exchange.hpp>
#include <weave/routing/host_quant_moves.hpp>
#include <weave/routing/host_row_moves.hpp>

#include "aligned_buffer.hpp"
#include "handle_support.hpp"
#include "mpi_session.hpp"

#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <utility>

namespace {

const weave_test::mpi_session session;

struct run_output {
  weave::host_matrix<float> y, dx;
  std::vector<float> dw;
  weave::moe_stats stats;
};

// One layer in `Space` over MPI, forward and backward, on a workspace poisoned with 0xFF bytes
// (nothing may read what it did not write).
template <class Space>
run_output run(weave::mpi_communicator& comm, const weave::placement& where, int chunks, int k,
               std::size_t max_tokens, const weave::capacity_policy& capacity, bool fixed,
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
  o.static_shape = fixed;
  o.fp8_dispatch = fp8;
  std::unique_ptr<weave_test::aligned_buffer> ws; // outlives the streams' tasks
  weave::host_stream compute("compute"), stream("comm");
  weave::basic_moe_exchange<Space, weave::mpi_communicator> ex(comm, where, o);
  ws = std::make_unique<weave_test::aligned_buffer>(ex.workspace_size());
  ex.initialize(ws->ptr, ws->size, compute);
  run_output out{weave::host_matrix<float>(in.x.rows(), in.x.cols()),
                 weave::host_matrix<float>(in.x.rows(), in.x.cols()),
                 std::vector<float>(in.ids.size()),
                 {}};
  ex.forward(
      in.x.view(), in.ids, in.weights, out.y.view(),
      [&](const auto& b) { moe_test::run_experts<float>(experts, b); }, compute, stream);
  ex.backward((dy != nullptr ? *dy : in.x).view(), out.dx.view(), out.dw,
              [&](const auto& b) { moe_test::run_experts<float>(experts, b); }, compute, stream);
  ex.synchronize(compute, stream);
  out.stats = ex.stats(compute);
  return out;
}

} // namespace

TEST_CASE_TEMPLATE("moe_exchange over MPI equals the dense reference; chunking and static shapes "
                   "are bitwise neutral",
                   Space, weave::host_space, weave::emulated_gpu_space) {
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
    const auto base = run<Space>(comm, where, 1, k, max_tokens, capacity, false, mine, experts);
    moe_test::check_rank_against_dense(comm.rank(), where, k, experts_count, capacity, mine,
                                       experts, base.y, &base.dx, &base.dw, base.stats, 1e-4);
    // Chunked, and with static shapes (a whole slot per peer) unchunked and chunked. Plain
    // variables, not a structured binding: CAPTURE's lambda cannot capture a binding before
    // C++20's P1091 (clang 16).
    const std::pair<int, bool> modes[] = {{3, false}, {1, true}, {3, true}};
    for (const auto& mode : modes) {
      const int chunks = mode.first;
      const bool fixed = mode.second;
      CAPTURE(chunks);
      CAPTURE(fixed);
      const auto got =
          run<Space>(comm, where, chunks, k, max_tokens, capacity, fixed, mine, experts);
      CHECK(std::memcmp(base.y.data(), got.y.data(), base.y.rows() * hidden * 4) == 0);
      CHECK(std::memcmp(base.dx.data(), got.dx.data(), base.dx.rows() * hidden * 4) == 0);
      CHECK(std::memcmp(base.dw.data(), got.dw.data(), base.dw.size() * 4) == 0);
      CHECK(got.stats.sent_rows == base.stats.sent_rows);
      CHECK(got.stats.dropped_pairs == base.stats.dropped_pairs);
    }
  }
}

TEST_CASE_TEMPLATE("handles over MPI: 1F1B micro-batches equal the callback form one by one", Space,
                   weave::host_space, weave::emulated_gpu_space) {
  // 4 micro-batches per rank in interleaved 1F1B order through handles (2 in flight), against
  // the same micro-batches one by one through the callback form (bitwise) and the dense
  // reference; unchunked and chunked.
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
    handle_test::layer<weave::mpi_communicator, Space> one(comm, where, o, compute);
    const auto want = handle_test::run_one_by_one(one, mine, lin, compute, stream);
    o.max_in_flight = 2;
    handle_test::layer<weave::mpi_communicator, Space> two(comm, where, o, compute);
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

TEST_CASE_TEMPLATE("fp8 dispatch over MPI equals the plain exchange on pre-dequantised rows", Space,
                   weave::host_space, weave::emulated_gpu_space) {
  // With dequantised inputs the experts see T(code * scale), exactly the rows the plain exchange
  // delivers when every token was quantised and dequantised beforehand: forward and backward
  // must match it bit for bit, chunked or not, with dynamic and static shapes.
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
  const auto want =
      run<Space>(comm, where, 1, k, max_tokens, {}, false, dequantized, experts, {}, &mine.x);
  // The reference's forward (its backward's dL/dy is not its input, as the dense check assumes).
  moe_test::check_rank_against_dense<float>(comm.rank(), where, k, experts_count, {}, dequantized,
                                            experts, want.y, nullptr, nullptr, want.stats, 1e-4);
  const weave::fp8_dispatch_options fp8{weave::dtype::e4m3, {}, /*dequantized_inputs=*/true};
  const auto same = [&](const run_output& got) {
    CHECK(std::memcmp(want.y.data(), got.y.data(), want.y.rows() * hidden * 4) == 0);
    CHECK(std::memcmp(want.dx.data(), got.dx.data(), want.dx.rows() * hidden * 4) == 0);
    CHECK(std::memcmp(want.dw.data(), got.dw.data(), want.dw.size() * 4) == 0);
    CHECK(got.stats.dispatch_row_bytes == 272); // 256 codes, 2 scales, padded to 16
    CHECK(got.stats.sent_rows == want.stats.sent_rows);
  };
  for (const int chunks : {1, 3})
    for (const bool fixed : {false, true}) {
      CAPTURE(chunks);
      CAPTURE(fixed);
      same(run<Space>(comm, where, chunks, k, max_tokens, {}, fixed, mine, experts, fp8, &mine.x));
    }
}
