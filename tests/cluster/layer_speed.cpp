// layer_speed: one MoE layer per iteration on an emulated cluster, measured beside weave-sim's
// prediction for the same cluster. Run under weave-cluster (N nodes x G ranks, G >= 2).
//
// Usage: layer_speed [--tokens T] [--hidden H] [--experts E] [--k K] [--iters I]
//                    [--compute-us X] [--uplink-gbit R]
//
// Measured (median over I iterations of the slowest rank's time), fp32 rows, uniform random
// top-k unless said:
//   flat      the layer's dispatch and combine (one row per token and destination device, the
//             combine its transpose) as two flat all-to-alls (mpi_communicator)
//   2dh       the same traffic through hierarchical_all_to_all (shared-memory split)
//   limited   flat, with group-limited routing: one group per node, each token keeps 1 node
//   C=1, C=4  moe_exchange forward with experts that take X us per row, unchunked and in 4
//             chunks; the expert thread sleeps meanwhile, as a host thread waits for a GPU
//             kernel (spinning would take the cores the emulated network needs: on 2 cores a
//             spinning expert made the 4-chunk layer slower than the unchunked one); "hidden" =
//             (C=1 - C=4) / min(comm, compute), where comm is the layer with copying experts and
//             compute the busiest rank's expert time
// Predicted: weave::sim::simulate_cluster on the same routing (every rank's ids gathered), the
// `shared` link model, links calibrated in the same run: inside a node, bandwidth and latency
// of an all-to-all among its ranks; across nodes, of one among same-local-rank peers with every
// local rank sending at once (they share the uplink), per rank. --uplink-gbit only labels.
#include <weave/comm/hierarchical.hpp>
#include <weave/comm/mpi_communicator.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/overlap/moe_exchange.hpp>
#include <weave/routing/gate.hpp>
#include <weave/sim/cluster_sim.hpp>

#include "node_split.hpp"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

// Median over `iters` of the slowest rank's time of `op` (after a barrier each), in us.
double time_us(int iters, const std::function<void()>& op) {
  std::vector<double> v;
  for (int i = 0; i < iters; ++i) {
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t = clock_type::now();
    op();
    double mine = seconds_since(t), slowest = 0;
    MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    v.push_back(slowest * 1e6);
  }
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct a2a_layout {
  std::vector<std::int64_t> send_counts, send_displs, recv_counts, recv_displs;
  std::int64_t send_total = 0, recv_total = 0;
};

// Rows this rank sends each device: one per (token, device holding one of its experts).
a2a_layout layout_of(const std::vector<std::int32_t>& ids, int k, const weave::placement& p,
                     int ranks) {
  a2a_layout L;
  L.send_counts.assign(std::size_t(ranks), 0);
  for (std::size_t t = 0; t < ids.size() / std::size_t(k); ++t) {
    std::set<int> devices;
    for (int j = 0; j < k; ++j)
      if (ids[t * std::size_t(k) + std::size_t(j)] >= 0)
        devices.insert(p.device_of(ids[t * std::size_t(k) + std::size_t(j)]));
    for (int d : devices)
      ++L.send_counts[std::size_t(d)];
  }
  L.recv_counts.assign(std::size_t(ranks), 0);
  MPI_Alltoall(L.send_counts.data(), 1, MPI_INT64_T, L.recv_counts.data(), 1, MPI_INT64_T,
               MPI_COMM_WORLD);
  L.send_displs.assign(std::size_t(ranks), 0);
  L.recv_displs.assign(std::size_t(ranks), 0);
  for (int r = 1; r < ranks; ++r) {
    L.send_displs[std::size_t(r)] =
        L.send_displs[std::size_t(r - 1)] + L.send_counts[std::size_t(r - 1)];
    L.recv_displs[std::size_t(r)] =
        L.recv_displs[std::size_t(r - 1)] + L.recv_counts[std::size_t(r - 1)];
  }
  L.send_total = std::accumulate(L.send_counts.begin(), L.send_counts.end(), std::int64_t{0});
  L.recv_total = std::accumulate(L.recv_counts.begin(), L.recv_counts.end(), std::int64_t{0});
  return L;
}

// Uniform all-to-all of `bytes` per peer on `comm`: (GB/s per rank from the big one, latency
// in us from the small one), slowest rank of the world.
template <class Comm>
weave::sim::link_spec calibrate(Comm& comm, std::int64_t bytes, int iters) {
  const int n = comm.size();
  const auto run = [&](std::int64_t per_peer) {
    std::vector<std::int64_t> counts(static_cast<std::size_t>(n), per_peer),
        displs(static_cast<std::size_t>(n));
    for (int j = 0; j < n; ++j)
      displs[std::size_t(j)] = per_peer * j;
    std::vector<std::byte> send(std::size_t(per_peer * n)), recv(send.size());
    weave::host_stream s("calibration");
    return time_us(iters, [&] {
      comm.all_to_all_v(s, send.data(), counts, displs, recv.data(), counts, displs);
      s.synchronize();
    });
  };
  const double small = run(64), big = run(bytes);
  // A rank sends (n - 1) blocks to peers; the latency is paid once per all-to-all in the model.
  const double gbps = double(bytes) * double(n - 1) / std::max(1.0, big - small) * 1e-3;
  return weave::sim::link_spec{gbps, small};
}

} // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  std::int64_t tokens = 512;
  int hidden = 512, experts = 32, k = 4, iters = 7;
  double compute_us = 20, uplink = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string key = argv[i];
    const double v = std::stod(argv[i + 1]);
    if (key == "--tokens")
      tokens = std::int64_t(v);
    else if (key == "--hidden")
      hidden = int(v);
    else if (key == "--experts")
      experts = int(v);
    else if (key == "--k")
      k = int(v);
    else if (key == "--iters")
      iters = int(v);
    else if (key == "--compute-us")
      compute_us = v;
    else if (key == "--uplink-gbit")
      uplink = v;
  }
  const std::size_t row = std::size_t(hidden) * sizeof(float);
  {
    const cluster_test::node_split split; // freed before MPI_Finalize
    const int rank = split.rank, ranks = split.ranks, local = split.local, nodes = split.nodes;
    weave::mpi_communicator world(MPI_COMM_WORLD), intra(split.intra), inter(split.inter);
    const auto where = weave::placement::contiguous(experts, ranks);

    // Routing: uniform random top-k, and group-limited to one node per token.
    std::mt19937 rng(static_cast<std::uint32_t>(17 + rank));
    std::vector<std::int32_t> ids(std::size_t(tokens) * std::size_t(k)), limited_ids(ids.size());
    std::vector<float> weights(ids.size()), limited_weights(ids.size());
    {
      std::vector<float> logits(std::size_t(tokens) * std::size_t(experts));
      std::normal_distribution<float> z(0.0f, 1.0f);
      for (float& v : logits)
        v = z(rng);
      weave::gate_options g;
      g.k = k;
      weave::top_k_gate(weave::make_token_view(logits, std::size_t(experts)), g, ids, weights);
      const weave::group_limit one_node{nodes, 1};
      g.groups = &one_node;
      weave::top_k_gate(weave::make_token_view(logits, std::size_t(experts)), g, limited_ids,
                        limited_weights);
    }
    const auto flat_layout = layout_of(ids, k, where, ranks);
    const auto limited_layout = layout_of(limited_ids, k, where, ranks);
    std::vector<std::byte> send(
        std::size_t(std::max(flat_layout.send_total, flat_layout.recv_total) + 1) * row),
        recv(send.size());

    const auto layer = [&](auto& comm, const a2a_layout& L) {
      return [&comm, &L, &send, &recv, row] {
        weave::host_stream s("comm");
        comm.all_to_all_v(s, send.data(), L.send_counts, L.send_displs, recv.data(), L.recv_counts,
                          L.recv_displs, row); // dispatch
        comm.all_to_all_v(s, recv.data(), L.recv_counts, L.recv_displs, send.data(), L.send_counts,
                          L.send_displs, row); // combine: the transpose
        s.synchronize();
      };
    };
    std::size_t staging =
        std::size_t(local) *
        std::size_t(std::max(flat_layout.send_total, flat_layout.recv_total) + 16) * row * 2;
    std::size_t staging_max = 0;
    MPI_Allreduce(&staging, &staging_max, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
    weave::hierarchical_all_to_all<weave::mpi_communicator, weave::mpi_communicator> two_level(
        intra, inter, staging_max);

    const weave::sim::link_spec intra_link = calibrate(intra, 1 << 20, iters);
    const weave::sim::link_spec inter_link = calibrate(inter, 1 << 20, iters);

    const double flat_us = time_us(iters, layer(world, flat_layout));
    const double two_level_us = time_us(iters, layer(two_level, flat_layout));
    const double limited_us = time_us(iters, layer(world, limited_layout));

    // The pipelined layer: moe_exchange forward, experts spinning compute_us per row.
    std::vector<float> x(std::size_t(tokens) * std::size_t(hidden), 1.0f), y(x.size());
    double compute_total = 0;
    const auto spin = [&](const weave::expert_batch& b) {
      const auto t = clock_type::now();
      std::this_thread::sleep_for(std::chrono::duration<double, std::micro>(
          compute_us * static_cast<double>(b.input.rows())));
      for (std::size_t r = 0; r < b.input.rows(); ++r)
        std::copy_n(b.input.row_as<float>(r).data(), hidden, b.output.row_as<float>(r).data());
      compute_total += seconds_since(t);
    };
    const auto copy = [&](const weave::expert_batch& b) {
      for (std::size_t r = 0; r < b.input.rows(); ++r)
        std::copy_n(b.input.row_as<float>(r).data(), hidden, b.output.row_as<float>(r).data());
    };
    const auto moe_layer = [&](int chunks, bool computing) {
      weave::moe_options o;
      o.k = k;
      o.hidden = std::size_t(hidden);
      o.max_tokens = std::size_t(tokens);
      o.chunks = chunks;
      auto ex = std::make_shared<weave::moe_exchange<weave::mpi_communicator>>(world, where, o);
      return [ex, computing, &x, &y, &ids, &weights, &spin, &copy, hidden] {
        weave::host_stream compute("compute"), stream("comm");
        ex->forward(
            weave::make_token_view(x, std::size_t(hidden)), ids, weights,
            weave::make_token_view(y, std::size_t(hidden)),
            [&](const weave::expert_batch& b) { computing ? spin(b) : copy(b); }, compute, stream);
        ex->synchronize(compute, stream);
      };
    };
    const double comm_us = time_us(iters, moe_layer(1, false));
    compute_total = 0;
    const double c1_us = time_us(iters, moe_layer(1, true));
    double mine = compute_total / iters * 1e6, busiest = 0;
    MPI_Allreduce(&mine, &busiest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    const double c4_us = time_us(iters, moe_layer(4, true));

    // The simulator on the same routing and calibrated links.
    std::vector<std::int32_t> pool(std::size_t(ranks) * ids.size()), limited_pool(pool.size());
    MPI_Allgather(ids.data(), int(ids.size()), MPI_INT32_T, pool.data(), int(ids.size()),
                  MPI_INT32_T, MPI_COMM_WORLD);
    MPI_Allgather(limited_ids.data(), int(ids.size()), MPI_INT32_T, limited_pool.data(),
                  int(ids.size()), MPI_INT32_T, MPI_COMM_WORLD);
    if (rank == 0) {
      weave::sim::cluster c;
      c.name = "emulated";
      c.nodes = nodes;
      c.gpus_per_node = local;
      c.intra = intra_link;
      c.inter = inter_link;
      weave::sim::moe_model m;
      m.layers = 1;
      m.hidden = hidden;
      m.experts = experts;
      m.k = k;
      m.tokens_per_gpu = tokens;
      m.bytes_per_element = 4;
      m.ffn_hidden = 1;
      m.matrices = 1;
      c.tflops = m.flops_per_row() / (compute_us * 1e6); // compute_us per row
      const auto simulate = [&](const std::vector<std::int32_t>& p, weave::sim::a2a_algorithm a,
                                std::int64_t chunks) {
        weave::sim::routing_source src;
        src.trace = weave::routing_trace{experts, k, p};
        weave::sim::sim_options o;
        o.algorithm = a;
        o.pipeline_degree = chunks;
        o.kernel_fixed_us = 0;
        return weave::sim::simulate_cluster(c, m, where, src, o);
      };
      using weave::sim::a2a_algorithm;
      const auto flat = simulate(pool, a2a_algorithm::flat, 1);
      const auto two = simulate(pool, a2a_algorithm::hierarchical, 1);
      const auto lim = simulate(limited_pool, a2a_algorithm::flat, 1);
      const auto piped = simulate(pool, a2a_algorithm::flat, 4);
      const double hidden_measured = (c1_us - c4_us) / std::min(comm_us, busiest);
      const double hidden_predicted =
          (flat.step_us - piped.step_us) / std::min(flat.comm_us, flat.compute_us);
      std::printf(
          "# %d nodes x %d ranks, uplink %g Gbit/s; T = %lld, hidden %d fp32, E = %d, k = %d,"
          " %g us per row; links calibrated: intra %.3f GB/s %.0f us, inter %.3f GB/s %.0f us"
          " per rank\n",
          nodes, local, uplink, static_cast<long long>(tokens), hidden, experts, k, compute_us,
          intra_link.gbytes_per_s, intra_link.latency_us, inter_link.gbytes_per_s,
          inter_link.latency_us);
      std::printf("case\tmeasured_ms\tpredicted_ms\tmeasured/predicted\n");
      const auto line = [](const char* name, double measured, double predicted) {
        std::printf("%s\t%.2f\t%.2f\t%.2f\n", name, measured * 1e-3, predicted * 1e-3,
                    measured / predicted);
      };
      line("flat", flat_us, flat.comm_us);
      line("2dh", two_level_us, two.comm_us);
      line("limited", limited_us, lim.comm_us);
      line("comm (copy experts)", comm_us, flat.comm_us);
      line("compute (busiest)", busiest, flat.compute_us);
      line("C=1", c1_us, flat.step_us);
      line("C=4", c4_us, piped.step_us);
      std::printf("hidden\t%.2f\t%.2f\t-\n", hidden_measured, hidden_predicted);
    }
  }
  MPI_Finalize();
  return 0;
}
