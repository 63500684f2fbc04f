// nccl_communicator on one rank (ncclCommInitAll with one device): self-exchange of random
// layouts against the host reference, count exchange, all-reduce and barrier. Reports skipped
// without a GPU.
#include <doctest/doctest.h>

#include "a2a_cases.hpp"

#include <weave/comm/nccl_communicator.hpp>
#include <weave/overlap/expert_state_moves.hpp>
#include <weave/placement/migration.hpp>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <span>
#include <vector>

namespace {

template <class T>
T* device_copy(const std::vector<T>& host) {
  T* p = nullptr;
  WEAVE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p), host.size() * sizeof(T) + 1));
  WEAVE_CUDA_CHECK(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

template <class T>
std::vector<T> host_copy(const T* device, std::size_t n) {
  std::vector<T> out(n);
  WEAVE_CUDA_CHECK(cudaMemcpy(out.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost));
  return out;
}

} // namespace

TEST_CASE("nccl_communicator self-exchange, counts, reductions and barrier on one rank") {
  ncclComm_t raw = nullptr;
  int device = 0;
  WEAVE_NCCL_CHECK(ncclCommInitAll(&raw, 1, &device));
  cudaStream_t stream = nullptr;
  WEAVE_CUDA_CHECK(cudaStreamCreate(&stream));
  {
    weave::nccl_communicator comm(raw);
    CHECK(comm.rank() == 0);
    CHECK(comm.size() == 1);
    weave::cuda_stream_ref s(stream);
    for (std::size_t unit : {std::size_t{1}, std::size_t{16}}) {
      for (std::uint64_t seed = 1; seed <= 3; ++seed) {
        const auto c = comm_test::make_case(1, unit, seed);
        const auto& L = c.ranks[0];
        std::byte* send = device_copy(L.send);
        std::byte* recv = device_copy(std::vector<std::byte>(L.recv_bytes, comm_test::sentinel));
        comm.all_to_all_v(s, send, L.send_counts, L.send_displs, recv, L.recv_counts, L.recv_displs,
                          unit);
        comm.synchronize(s);
        CHECK(host_copy(recv, L.recv_bytes) == comm_test::expected_recv(c, 0));
        WEAVE_CUDA_CHECK(cudaFree(send));
        WEAVE_CUDA_CHECK(cudaFree(recv));
      }
    }
    std::vector<std::int64_t> counts{11, 22, 33};
    std::int64_t* dsend = device_copy(counts);
    std::int64_t* drecv = device_copy(std::vector<std::int64_t>(3, -1));
    comm.exchange_counts(s, std::span<const std::int64_t>(dsend, 3),
                         std::span<std::int64_t>(drecv, 3));
    std::vector<double> values{1.5, -2.0, 4.25};
    double* dvalues = device_copy(values);
    double* dsum = device_copy(std::vector<double>(3, 0.0));
    comm.all_reduce(s, std::span<const double>(dvalues, 3), std::span<double>(dsum, 3),
                    weave::reduce_op::sum);
    comm.barrier(s);
    comm.synchronize(s);
    CHECK(host_copy(drecv, 3) == counts);
    CHECK(host_copy(dsum, 3) == values); // one rank: the sum is the input
    WEAVE_CUDA_CHECK(cudaFree(dsend));
    WEAVE_CUDA_CHECK(cudaFree(drecv));
    WEAVE_CUDA_CHECK(cudaFree(dvalues));
    WEAVE_CUDA_CHECK(cudaFree(dsum));
    const std::vector<std::int64_t> bad{1, 2};
    CHECK_THROWS_AS(comm.all_to_all_v(s, nullptr, bad, bad, nullptr, bad, bad), weave::error);
  }
  WEAVE_CUDA_CHECK(cudaStreamDestroy(stream));
  WEAVE_NCCL_CHECK(ncclCommDestroy(raw));
}

TEST_CASE("nccl_communicator with on_failure = revoke: an abort keeps it, shrink builds the "
          "survivors' communicator, which exchanges correctly") {
  ncclComm_t raw = nullptr;
  int device = 0;
  WEAVE_NCCL_CHECK(ncclCommInitAll(&raw, 1, &device));
  cudaStream_t stream = nullptr;
  WEAVE_CUDA_CHECK(cudaStreamCreate(&stream));
  {
    weave::nccl_options o;
    o.on_failure = weave::nccl_failure_action::revoke;
    weave::nccl_communicator comm(raw, o);
    const std::vector<int> self{0};
    CHECK_THROWS_AS((void)comm.shrink(self), weave::error); // a rank cannot exclude itself
    comm.abort(std::string("a peer was lost"));
    CHECK(comm.aborted());
    CHECK(comm.revoked());
    CHECK(comm.get() == raw); // revoked, not freed
    weave::cuda_stream_ref s(stream);
    CHECK_THROWS_AS(comm.barrier(s), weave::error);
    auto next = weave::shrink(comm);
    REQUIRE(next.comm);
    CHECK(next.survivors == std::vector<int>{0});
    CHECK(next.lost.empty());
    CHECK(next.comm->size() == 1);
    const std::vector<std::int64_t> mine{41, 42};
    CHECK(next.comm->all_gather_now(mine) == mine);
    // The survivors' state moves go through the same code as on the host (nothing to move on
    // one rank: the plan's copies are all local).
    const auto p = weave::placement::contiguous(2, 1);
    const auto plan = weave::plan_migration(p, p, weave::topology::flat(1));
    weave::move_expert_state(
        *next.comm, s, plan, 16, [](int) { return std::span<const std::byte>(); },
        [](int, int) { return std::span<std::byte>(); });
  }
  WEAVE_CUDA_CHECK(cudaStreamDestroy(stream));
  WEAVE_NCCL_CHECK(ncclCommAbort(raw)); // a revoked communicator ends with an abort
}
