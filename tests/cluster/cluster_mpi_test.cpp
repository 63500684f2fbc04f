// Tests that need real nodes, run by weave-cluster (tests/cluster/weave-cluster) with its
// WEAVE_CLUSTER_NODES x WEAVE_CLUSTER_RANKS_PER_NODE ranks: MPI's view of the nodes matches the
// cluster's (so the other cluster tests really crossed nodes), the 2DH all-to-all over the nodes
// MPI reports equals MPI_Alltoallv, and group-limited routing with one group per node keeps every
// token on at most top_groups nodes while the exchange equals the dense reference.
#include <doctest/doctest.h>

#include "../comm/a2a_cases.hpp"
#include "../comm/a2a_mpi_reference.hpp"
#include "../overlap/moe_test_support.hpp"

#include <weave/comm/hierarchical.hpp>
#include <weave/comm/local_world.hpp>
#include <weave/comm/mpi_communicator.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/overlap/moe_exchange.hpp>
#include <weave/routing/gate.hpp>

#include "mpi_session.hpp"
#include "node_split.hpp"

#include <cstdlib>
#include <cstring>
#include <random>
#include <set>
#include <string>

namespace {

const weave_test::mpi_session session;

int env_count(const char* name) {
  const char* v = std::getenv(name);
  REQUIRE_MESSAGE(v != nullptr, name, " is not set: run this test under weave-cluster");
  return std::atoi(v);
}

} // namespace

TEST_CASE("MPI sees the cluster's nodes: one hostname and one shared-memory domain per node") {
  const int nodes = env_count("WEAVE_CLUSTER_NODES");
  const int per_node = env_count("WEAVE_CLUSTER_RANKS_PER_NODE");
  const cluster_test::node_split split;
  const int n = split.ranks;
  REQUIRE(n == nodes * per_node);
  CHECK(split.local == per_node);
  CHECK(split.nodes == nodes);
  CHECK(split.rank == split.node * per_node + split.local_rank); // mpirun --map-by slot
  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int length = 0;
  MPI_Get_processor_name(name, &length);
  std::vector<char> all(std::size_t(n) * MPI_MAX_PROCESSOR_NAME);
  MPI_Allgather(name, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, all.data(), MPI_MAX_PROCESSOR_NAME,
                MPI_CHAR, MPI_COMM_WORLD);
  std::set<std::string> names;
  for (int r = 0; r < n; ++r) {
    const std::string other(&all[std::size_t(r) * MPI_MAX_PROCESSOR_NAME]);
    names.insert(other);
    CHECK((other == name) == (r / per_node == split.rank / per_node));
  }
  CHECK(names.size() == std::size_t(nodes));
}

TEST_CASE("2DH over the nodes MPI reports equals MPI_Alltoallv") {
  const cluster_test::node_split split;
  weave::mpi_communicator intra(split.intra), inter(split.inter);
  weave::hierarchical_all_to_all<weave::mpi_communicator, weave::mpi_communicator> plan(
      intra, inter, 1 << 20);
  REQUIRE(plan.rank() == split.rank);
  REQUIRE(plan.nodes() == split.nodes);
  for (std::size_t unit : {std::size_t{1}, std::size_t{16}}) {
    CAPTURE(unit);
    const auto c = comm_test::make_case(plan.size(), unit, 40 + unit, 20000);
    const auto& L = c.ranks[std::size_t(split.rank)];
    for (int round = 0; round < 3; ++round) { // the staging buffers are reused
      std::vector<std::byte> out(L.recv_bytes, comm_test::sentinel);
      weave::host_stream s;
      plan.all_to_all_v(s, L.send.data(), L.send_counts, L.send_displs, out.data(), L.recv_counts,
                        L.recv_displs, unit);
      s.synchronize();
      CHECK(out == comm_test::mpi_alltoallv_reference(c, MPI_COMM_WORLD));
      CHECK(out == comm_test::expected_recv(c, split.rank));
    }
  }
}

namespace {

struct layer_result {
  weave::host_matrix<float> y, dx;
  std::vector<float> dw;
  weave::moe_stats stats;
};

// One layer, forward and backward, on any communicator.
template <class Comm>
layer_result run_layer(Comm& comm, const weave::placement& where, const weave::moe_options& o,
                       const moe_test::rank_input<float>& in,
                       const moe_test::linear_experts& experts) {
  weave::moe_exchange<Comm> ex(comm, where, o);
  weave::host_stream compute("compute"), stream("comm");
  const std::size_t T = in.x.rows(), H = in.x.cols();
  layer_result r{weave::host_matrix<float>(T, H),
                 weave::host_matrix<float>(T, H),
                 std::vector<float>(in.ids.size()),
                 {}};
  ex.forward(
      in.x.view(), in.ids, in.weights, r.y.view(),
      [&](const weave::expert_batch& b) { experts.operator()<float>(b); }, compute, stream);
  ex.backward(
      in.x.view(), r.dx.view(), r.dw,
      [&](const weave::expert_grad_batch& b) { experts.backward<float>(b); }, compute, stream);
  ex.synchronize(compute, stream);
  r.stats = ex.stats(compute);
  return r;
}

// Rank r's tokens, routed by the group-limited gate (every rank can build every rank's).
moe_test::rank_input<float> group_limited_input(int r, int experts_count, int k, int nodes,
                                                int top_groups, std::size_t tokens,
                                                std::size_t hidden) {
  std::mt19937 rng(static_cast<std::uint32_t>(7 + 31 * r + top_groups));
  auto in = moe_test::random_input<float>(tokens, hidden, experts_count, k, rng);
  weave::host_matrix<float> logits(tokens, std::size_t(experts_count));
  std::normal_distribution<float> z(0.0f, 2.0f);
  for (float& v : logits.elements())
    v = z(rng);
  const weave::group_limit limit{nodes, top_groups};
  weave::gate_options gate;
  gate.k = k;
  gate.groups = &limit;
  weave::top_k_gate(logits.view(), gate, in.ids, in.weights);
  return in;
}

} // namespace

TEST_CASE("group-limited routing, one group per node: tokens reach at most top_groups nodes; the "
          "chunked exchange across nodes equals the dense reference and, bitwise, one process") {
  const cluster_test::node_split split;
  weave::mpi_communicator comm(MPI_COMM_WORLD);
  const int ranks = comm.size(), nodes = split.nodes, per_node = split.local;
  const int experts_count = 4 * ranks, k = 4;
  const std::size_t hidden = 16, tokens = 64;
  // Contiguous placement: node g's ranks hold experts [g E / nodes, (g + 1) E / nodes), which is
  // group g.
  const auto where = weave::placement::contiguous(experts_count, ranks);
  const moe_test::linear_experts experts(experts_count, hidden, 11);
  for (int top_groups = 1; top_groups <= std::min(2, nodes); ++top_groups) {
    CAPTURE(top_groups);
    std::vector<moe_test::rank_input<float>> all;
    for (int r = 0; r < ranks; ++r)
      all.push_back(group_limited_input(r, experts_count, k, nodes, top_groups, tokens, hidden));
    const auto& in = all[std::size_t(comm.rank())];
    for (std::size_t t = 0; t < tokens; ++t) {
      std::set<int> reached;
      for (int j = 0; j < k; ++j)
        reached.insert(where.device_of(in.ids[t * k + std::size_t(j)]) / per_node);
      CHECK(reached.size() <= std::size_t(top_groups));
    }
    for (int chunks : {1, 3}) {
      CAPTURE(chunks);
      weave::moe_options o;
      o.k = k;
      o.hidden = hidden;
      o.max_tokens = tokens;
      o.chunks = chunks;
      o.save_for_backward = true;
      const layer_result got = run_layer(comm, where, o, in, experts);
      moe_test::check_rank_against_dense(comm.rank(), where, k, experts_count, o.capacity, in,
                                         experts, got.y, &got.dx, &got.dw, got.stats, 1e-4);
      // The whole problem in this process (local_world, one thread per rank).
      std::vector<layer_result> local(static_cast<std::size_t>(ranks));
      weave::local_world world(ranks);
      world.run([&](weave::local_communicator& c) {
        local[std::size_t(c.rank())] = run_layer(c, where, o, all[std::size_t(c.rank())], experts);
      });
      const layer_result& want = local[std::size_t(comm.rank())];
      CHECK(moe_test::bitwise_equal(got.y, want.y));
      CHECK(moe_test::bitwise_equal(got.dx, want.dx));
      CHECK(std::memcmp(got.dw.data(), want.dw.data(), got.dw.size() * sizeof(float)) == 0);
    }
  }
}
