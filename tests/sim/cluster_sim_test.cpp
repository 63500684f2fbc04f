#include <doctest/doctest.h>

#include <weave/comm/communicator.hpp>
#include <weave/comm/local_world.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/placement.hpp>
#include <weave/sim/cluster_sim.hpp>
#include <weave/sim/report.hpp>

#include <algorithm>
#include <cstdint>
#include <random>
#include <set>
#include <sstream>
#include <vector>

using weave::errc;
using weave::placement;
using weave::routing_trace;
using namespace weave::sim;

namespace {

template <class F>
errc code_of(F&& f) {
  try {
    f();
  } catch (const weave::error& e) {
    return e.code();
  }
  return errc::internal;
}

cluster small_cluster(int nodes, int gpus) {
  cluster c;
  c.nodes = nodes;
  c.gpus_per_node = gpus;
  c.intra = {1.0, 2.0};
  c.inter = {0.5, 5.0};
  c.tflops = 0.75;
  return c;
}

// Dense D×D dispatch bytes, the obvious way: every token of rank r (pool tokens r*T + i) sends
// one row to each distinct device of its experts' chosen replicas other than r.
struct naive_traffic {
  std::vector<std::vector<double>> bytes; // [src][dst]
  std::vector<double> rows;               // per device
};

naive_traffic naive(const cluster& c, const moe_model& m, const placement& p,
                    const weave::routing_trace& pool, std::int64_t T) {
  const int D = c.num_ranks();
  const double scale = static_cast<double>(m.tokens_per_gpu) / static_cast<double>(T);
  naive_traffic n{std::vector<std::vector<double>>(D, std::vector<double>(D, 0.0)),
                  std::vector<double>(D, 0.0)};
  for (int r = 0; r < D; ++r)
    for (std::int64_t i = 0; i < T; ++i) {
      const auto t = static_cast<std::size_t>((r * T + i) % std::int64_t(pool.num_tokens()));
      std::set<int> devices;
      for (const std::int32_t e : pool.token(t)) {
        if (e < 0)
          continue;
        const int d = p.device_of_slot(p.slot_for(e, static_cast<std::size_t>(i), r));
        n.rows[d] += scale;
        devices.insert(d);
      }
      for (const int d : devices)
        if (d != r)
          n.bytes[r][d] += m.row_bytes() * scale;
    }
  return n;
}

// Per-class totals and peaks of row `r` of a dense matrix (sent) or column `r` (received).
link_volume fold(const cluster& c, const std::vector<std::vector<double>>& b, int r, bool sent) {
  link_volume v;
  for (int q = 0; q < c.num_ranks(); ++q) {
    const double x = sent ? b[r][q] : b[q][r];
    if (q != r && x > 0)
      v.add(c.node_of(q) == c.node_of(r), x);
  }
  return v;
}

void check_equal(const link_volume& a, const link_volume& b) {
  CHECK(a.intra_bytes == doctest::Approx(b.intra_bytes));
  CHECK(a.inter_bytes == doctest::Approx(b.inter_bytes));
  CHECK(a.intra_peak == doctest::Approx(b.intra_peak));
  CHECK(a.inter_peak == doctest::Approx(b.inter_peak));
}

} // namespace

TEST_CASE("layer traffic matches a dense brute-force count, flat and 2DH, on random cases") {
  std::mt19937 rng(20261202);
  for (int trial = 0; trial < 24; ++trial) {
    const int nodes = 1 + static_cast<int>(rng() % 3), gpus = 1 + static_cast<int>(rng() % 4);
    const cluster c = small_cluster(nodes, gpus);
    const int D = c.num_ranks();
    moe_model m;
    m.experts = D * (1 + static_cast<int>(rng() % 3));
    m.k = 1 + static_cast<int>(rng() % std::min(4, m.experts));
    m.hidden = 16;
    m.tokens_per_gpu = 8 + static_cast<int>(rng() % 8);
    weave::trace_options to;
    to.num_experts = m.experts;
    to.k = m.k;
    to.tokens = 40 + rng() % 40;
    to.clusters = 1 + static_cast<int>(rng() % m.experts);
    to.zipf = (rng() % 3) * 0.6;
    to.seed = trial;
    weave::routing_trace pool = weave::generate_trace(to);
    if (trial % 4 == 1)
      pool.ids[3 % pool.ids.size()] = -1; // a dropped choice
    placement p = placement::contiguous(m.experts, D);
    if (trial % 3 == 2 && D > 1) { // a replicated placement: one extra slot per device
      std::vector<double> loads(static_cast<std::size_t>(m.experts), 1.0);
      loads[0] = 50;
      weave::replication_options ro;
      ro.redundant_slots = D;
      p = weave::place_replicated(loads, c.topology(), ro);
    }
    traffic_options o;
    const bool sampled = trial % 2 == 0;
    o.sample_tokens = sampled ? m.tokens_per_gpu / 2 : 0;
    const std::int64_t T = sampled ? m.tokens_per_gpu / 2 : m.tokens_per_gpu;
    CAPTURE(trial);
    const layer_traffic got = layer_traffic_of(c, m, p, pool, o);
    const naive_traffic ref = naive(c, m, p, pool, T);
    // 2DH reference: phase 1 (n,l) -> (n,l') carries everything for local rank l' (any node);
    // phase 2 (n,l') -> (n',l') carries what node n's ranks send to (n',l').
    std::vector<std::vector<double>> p1(D, std::vector<double>(D, 0.0)), p2 = p1;
    for (int s = 0; s < D; ++s)
      for (int d = 0; d < D; ++d) {
        const double b = ref.bytes[s][d];
        const int via = c.node_of(s) * gpus + c.local_of(d);
        if (via != s)
          p1[s][via] += b;
        if (via != d)
          p2[via][d] += b;
      }
    for (int r = 0; r < D; ++r) {
      CAPTURE(r);
      CHECK(got.device_rows[r] == doctest::Approx(ref.rows[r]));
      check_equal(got.flat[r].sent, fold(c, ref.bytes, r, true));
      check_equal(got.flat[r].received, fold(c, ref.bytes, r, false));
      check_equal(got.phase1[r].sent, fold(c, p1, r, true));
      check_equal(got.phase1[r].received, fold(c, p1, r, false));
      check_equal(got.phase2[r].sent, fold(c, p2, r, true));
      check_equal(got.phase2[r].received, fold(c, p2, r, false));
      CHECK(got.phase1[r].sent.inter_bytes == 0);
      CHECK(got.phase2[r].sent.intra_bytes == 0);
    }
    const double mean = std::accumulate(ref.rows.begin(), ref.rows.end(), 0.0) / D;
    CHECK(got.imbalance() ==
          doctest::Approx(*std::max_element(ref.rows.begin(), ref.rows.end()) / mean));
  }
}

TEST_CASE("device-limited routing keeps k distinct experts on at most M devices") {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 20; ++trial) {
    const int D = 2 + static_cast<int>(rng() % 7), per = 1 + static_cast<int>(rng() % 4);
    const int E = D * per, k = 1 + static_cast<int>(rng() % std::min(E, 8));
    const placement p = placement::contiguous(E, D);
    weave::trace_options to;
    to.num_experts = E;
    to.k = k;
    to.tokens = 200;
    to.clusters = std::min(E, 4);
    to.seed = 100 + trial;
    const weave::routing_trace t = weave::generate_trace(to);
    for (int M = 1; M <= D; ++M) {
      CAPTURE(trial);
      CAPTURE(M);
      std::vector<std::int32_t> ids = t.ids;
      apply_device_limit(p, ids, k, M);
      for (std::size_t tok = 0; tok < t.num_tokens(); ++tok) {
        const auto before = t.token(tok);
        std::set<int> devices, experts, first_devices;
        bool full = true;
        for (std::size_t j = 0; j < static_cast<std::size_t>(k); ++j) {
          const std::int32_t e = ids[tok * k + j];
          if (e < 0) {
            full = false;
            continue;
          }
          experts.insert(e);
          devices.insert(p.device_of(e));
          // An expert whose device is among the first M distinct devices is never replaced.
          if (first_devices.count(p.device_of(before[j])) ||
              static_cast<int>(first_devices.size()) < M) {
            first_devices.insert(p.device_of(before[j]));
            CHECK(e == before[j]);
          }
        }
        CHECK(static_cast<int>(devices.size()) <= M);
        CHECK(experts.size() == static_cast<std::size_t>(std::count_if(
                                    ids.begin() + tok * k, ids.begin() + (tok + 1) * k,
                                    [](std::int32_t e) { return e >= 0; })));
        // Drops only when the admitted devices hold fewer than k experts.
        if (!full)
          CHECK(M * per < k);
      }
    }
    std::vector<std::int32_t> ids = t.ids;
    apply_device_limit(p, ids, k, 0);
    CHECK(ids == t.ids);
  }
  std::vector<std::int32_t> bad = {0, 9};
  CHECK(code_of([&] { apply_device_limit(placement::contiguous(4, 2), bad, 2, 1); }) ==
        errc::out_of_range);
  CHECK(code_of([&] { apply_device_limit(placement::contiguous(4, 2), bad, 3, 1); }) ==
        errc::size_mismatch);
}

namespace {

// 2 nodes × 2 GPUs, expert e on device e, k = 1, each rank's one token goes to the next rank:
// 0->1 and 2->3 on NVLink-class links, 1->2 and 3->0 across nodes. 1000-byte rows.
struct ring_case {
  cluster c = small_cluster(2, 2); // intra 1 GB/s + 2 us, inter 0.5 GB/s + 5 us
  moe_model m;
  placement p = placement::contiguous(4, 4);
  routing_source src;
  ring_case() {
    m.layers = 2;
    m.hidden = 500;
    m.ffn_hidden = 1000; // 3e6 FLOPs per row at 0.75 TFLOP/s = 4 us
    m.experts = 4;
    m.k = 1;
    m.tokens_per_gpu = 1;
    src.trace.num_experts = 4;
    src.trace.k = 1;
    src.trace.ids = {1, 2, 3, 0};
  }
};

} // namespace

TEST_CASE("a hand-computed ring: flat and 2DH times, both link models, degree 1 and 2") {
  ring_case rc;
  sim_options o;
  o.kernel_fixed_us = 1.0;
  for (const link_model lm : {link_model::per_peer, link_model::shared}) {
    CAPTURE(to_string(lm));
    o.links = lm;
    o.pipeline_degree = 1;
    const sim_result r = simulate_cluster(rc.c, rc.m, rc.p, rc.src, o);
    // Dispatch: the cross-node message, 5 + 1000 B / 0.5 GB/s = 7 us; compute 1 + 4 = 5 us.
    REQUIRE(r.layers.size() == 2);
    CHECK(r.layers[0].dispatch_us == doctest::Approx(7.0));
    CHECK(r.layers[0].combine_us == doctest::Approx(7.0));
    CHECK(r.layers[0].compute_us == doctest::Approx(5.0));
    CHECK(r.layers[0].makespan_us == doctest::Approx(19.0));
    CHECK(r.step_us == doctest::Approx(38.0));
    CHECK(r.exposed_comm_us == doctest::Approx(28.0));
    CHECK(r.imbalance_max == doctest::Approx(1.0));
    CHECK(r.layers[0].inter_bytes == doctest::Approx(2000.0));
    // Degree 2: chunks of 500 B: a2a 6 us, compute 1 + 2 = 3 us. Comm stream: D0 [0,6],
    // D1 [6,12], K0 [12,18], K1 [18,24]; compute C0 [6,9], C1 [12,15]. 6 us of comm hidden.
    o.pipeline_degree = 2;
    const sim_result r2 = simulate_cluster(rc.c, rc.m, rc.p, rc.src, o);
    CHECK(r2.layers[0].makespan_us == doctest::Approx(24.0));
    CHECK(r2.layers[0].exposed_comm_us == doctest::Approx(18.0));
    // 2DH: 3->0 goes 3->2 (NVLink, 3 us) then 2->0 (7 us); phases are separate collectives.
    o.pipeline_degree = 1;
    o.algorithm = a2a_algorithm::hierarchical;
    const sim_result h = simulate_cluster(rc.c, rc.m, rc.p, rc.src, o);
    CHECK(h.layers[0].dispatch_us == doctest::Approx(10.0));
    CHECK(h.layers[0].makespan_us == doctest::Approx(25.0));
    o.algorithm = a2a_algorithm::flat;
  }
}

TEST_CASE("per_peer and shared link models differ as documented") {
  // One node of 3 GPUs; rank 0's token goes to experts on ranks 1 and 2, the others stay home.
  cluster c = small_cluster(1, 3);
  moe_model m;
  m.layers = 1;
  m.hidden = 500;
  m.experts = 3;
  m.k = 2;
  m.tokens_per_gpu = 1;
  routing_source src;
  src.trace = {3, 2, {1, 2, 1, 0, 2, 0}}; // ranks 1, 2 stay partly home and send to 0
  // rank 0 sends 1000 B to 1 and 2; rank 1 sends to 0; rank 2 sends to 0.
  sim_options o;
  o.links = link_model::per_peer;
  const placement p = placement::contiguous(3, 3);
  CHECK(simulate_cluster(c, m, p, src, o).layers[0].dispatch_us == doctest::Approx(3.0));
  o.links = link_model::shared; // rank 0 moves 2000 B through its one port: 2 + 2 = 4 us
  CHECK(simulate_cluster(c, m, p, src, o).layers[0].dispatch_us == doctest::Approx(4.0));
}

TEST_CASE("the simulated volumes are what local_world's all_to_all_v delivers") {
  // Per-peer bytes from the brute-force count are exchanged for real; what each rank receives
  // per link class (totals and largest peer message) must equal the simulator's volumes.
  const cluster c = small_cluster(2, 2);
  moe_model m;
  m.experts = 8;
  m.k = 3;
  m.hidden = 8;
  m.tokens_per_gpu = 16;
  weave::trace_options to;
  to.num_experts = 8;
  to.k = 3;
  to.tokens = 64;
  const weave::routing_trace pool = weave::generate_trace(to);
  const placement p = placement::contiguous(8, 4);
  const layer_traffic got = layer_traffic_of(c, m, p, pool);
  const naive_traffic ref = naive(c, m, p, pool, m.tokens_per_gpu);
  weave::local_world world(4);
  std::vector<std::vector<std::int64_t>> recv_counts(4, std::vector<std::int64_t>(4, 0));
  world.run([&](weave::local_communicator& comm) {
    const int r = comm.rank();
    std::vector<std::int64_t> sc(4), sd(4), rc(4), rd(4);
    std::int64_t so = 0, ro = 0;
    for (int q = 0; q < 4; ++q) {
      sc[q] = static_cast<std::int64_t>(ref.bytes[r][q]);
      sd[q] = so;
      so += sc[q];
    }
    weave::host_stream s;
    comm.exchange_counts(s, sc, rc); // receive counts come from the senders
    s.synchronize();
    for (int q = 0; q < 4; ++q) {
      rd[q] = ro;
      ro += rc[q];
    }
    std::vector<std::byte> send(static_cast<std::size_t>(so), std::byte{1}),
        recv(static_cast<std::size_t>(ro));
    weave::all_to_all_v(comm, s, send.data(), sc, sd, recv.data(), rc, rd, 1);
    s.synchronize();
    recv_counts[r] = rc;
  });
  for (int r = 0; r < 4; ++r) {
    link_volume v;
    for (int q = 0; q < 4; ++q)
      if (q != r && recv_counts[r][q] > 0)
        v.add(c.node_of(q) == c.node_of(r), static_cast<double>(recv_counts[r][q]));
    check_equal(got.flat[r].received, v);
  }
}

TEST_CASE("simulate_cluster scales volumes with sampling and reports consistent totals") {
  //! [simulate]
  const cluster c = cluster::h100(2);
  moe_model m;
  m.layers = 3;
  m.experts = 32;
  m.tokens_per_gpu = 512;
  routing_source src;
  src.synthetic.zipf = 1.0;
  sim_options o;
  o.pipeline_degree = 4;
  o.trace_ranks = {0, 15, 99};
  const placement p = placement::contiguous(32, 16);
  const sim_result r = simulate_cluster(c, m, p, src, o);
  std::ostringstream json;
  write_json(json, r);            // step_us, exposed_comm_us, imbalance, per-layer results
  const auto w = chrome_trace(r); // ranks 0 and 15 (99 is past the end); w.write_file(path)
  //! [simulate]
  double step = 0, exposed = 0;
  for (const auto& l : r.layers) {
    step += l.makespan_us;
    exposed += l.exposed_comm_us;
    CHECK(l.makespan_us >= l.compute_us);
    CHECK(l.makespan_us <= l.compute_us + l.dispatch_us + l.combine_us + 1e-9);
    CHECK(l.imbalance >= 1.0);
  }
  CHECK(r.step_us == doctest::Approx(step));
  CHECK(r.exposed_comm_us == doctest::Approx(exposed));
  CHECK(r.trace_ranks == std::vector<int>{0, 15});
  // Chrome trace: every task of every kept rank and layer, valid JSON shape.
  CHECK(w.size() == 3 * 2 * r.schedule.size());
  const std::string doc = json.str();
  CHECK(doc.find("\"step_us\":") != std::string::npos);
  CHECK(std::count(doc.begin(), doc.end(), '{') == 4); // the summary and 3 layers
  // Sampling half the tokens scales rows back to the full count.
  o.traffic.sample_tokens = 256;
  src.pool_tokens = 16 * 512;
  const sim_result half = simulate_cluster(c, m, p, src, o);
  CHECK(half.compute_us > 0);
  // Bad input.
  o.pipeline_degree = 0;
  CHECK(code_of([&] { simulate_cluster(c, m, p, src, o); }) == errc::invalid_argument);
  o.pipeline_degree = 1;
  CHECK(code_of([&] { simulate_cluster(c, m, placement::contiguous(32, 8), src, o); }) ==
        errc::size_mismatch);
  routing_source wrong;
  wrong.trace = {16, 8, std::vector<std::int32_t>(8, 0)};
  CHECK(code_of([&] { simulate_cluster(c, m, p, wrong, o); }) == errc::size_mismatch);
  moe_model bad = m;
  bad.k = 40;
  CHECK(code_of([&] { simulate_cluster(c, bad, p, src, o); }) == errc::invalid_argument);
}

TEST_CASE("per-layer traces: layer l replays trace l mod count, each as that trace alone") {
  ring_case rc;
  sim_options o;
  o.kernel_fixed_us = 1.0;
  const routing_trace ring = rc.src.trace;
  const routing_trace home{4, 1, {0, 1, 2, 3}}; // every rank routes to its own expert
  routing_source layered;
  layered.layer_traces = {home, ring};
  rc.m.layers = 3;
  CHECK(routing_pool_count(layered, rc.m.layers) == 2);
  CHECK(routing_pool_count(layered, 1) == 1);
  CHECK(routing_pool(layered, rc.m, 4, 0, 0) == home);
  CHECK(routing_pool(layered, rc.m, 4, 0, 1) == ring);
  CHECK(routing_pool(layered, rc.m, 4, 0, 2) == home);
  const sim_result got = simulate_cluster(rc.c, rc.m, rc.p, layered, o);
  REQUIRE(got.layers.size() == 3);
  rc.m.layers = 1;
  routing_source alone;
  for (const auto& layer : {std::pair{0, home}, std::pair{1, ring}, std::pair{2, home}}) {
    // Plain variables, not a structured binding: CAPTURE's lambda cannot capture a binding
    // before clang 16 (P1091).
    const int l = layer.first;
    CAPTURE(l);
    alone.trace = layer.second;
    const layer_result want = simulate_cluster(rc.c, rc.m, rc.p, alone, o).layers[0];
    const layer_result& have = got.layers[static_cast<std::size_t>(l)];
    CHECK(have.makespan_us == doctest::Approx(want.makespan_us));
    CHECK(have.max_sent_bytes == doctest::Approx(want.max_sent_bytes));
    CHECK(have.inter_bytes == doctest::Approx(want.inter_bytes));
  }
  CHECK(got.layers[0].max_sent_bytes == 0.0); // the home layer sends nothing
  CHECK(got.layers[1].max_sent_bytes > 0.0);
  routing_source wrong;
  wrong.layer_traces = {ring, routing_trace{8, 1, {0, 1, 2, 3}}};
  rc.m.layers = 2;
  CHECK(code_of([&] { simulate_cluster(rc.c, rc.m, rc.p, wrong, o); }) == errc::size_mismatch);
}
