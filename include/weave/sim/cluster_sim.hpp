//! \file
//! Cluster-scale simulation of an MoE model's forward pass: for each layer, the dispatch and
//! combine all-to-alls priced on the cluster's links (`layer_traffic_of` volumes), the expert
//! compute of every device, pipelined in `pipeline_degree` chunks on two streams per rank by the
//! overlap planner's schedule and `plan::simulate`; the step time is the sum of the layer
//! makespans (layers run one after another, attention and the rest are not modelled).
//!
//! Link models (the time of rank r's part of one all-to-all of fraction f of the volume):
//! - `per_peer`: every peer pair has its own wire, as `local_world`'s emulated links:
//!   t_r = max over link classes with a peer of (latency + f · largest message received from
//!   one peer of that class / bandwidth).
//! - `shared`: a GPU's NVLink and its NIC are each shared by all its peers of that class:
//!   t_r = max over link classes with traffic of (latency + f · max(bytes sent, bytes received)
//!   on that class / bandwidth).
//! An all-to-all is a collective: it ends when its slowest rank's part ends. The hierarchical
//! (2DH) all-to-all is two collectives: phase 1 inside nodes, then phase 2 across nodes between
//! GPUs of the same local index; the combine runs them in reverse.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/placement/placement.hpp"
#include "weave/placement/trace.hpp"
#include "weave/plan/graph.hpp"
#include "weave/plan/schedule.hpp"
#include "weave/plan/timeline.hpp"
#include "weave/sim/cluster.hpp"
#include "weave/sim/moe_model.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

WEAVE_NAMESPACE_BEGIN
namespace sim {

//! All-to-all algorithm.
enum class a2a_algorithm {
  flat,         //!< one all-to-all over every rank
  hierarchical, //!< 2DH: inside nodes, then across nodes among same-local-rank GPUs
};

//! How concurrent messages of a rank share its links (see the file comment).
enum class link_model {
  per_peer, //!< independent wires per pair (the emulated links of `local_world`)
  shared,   //!< one NVLink port and one NIC per GPU, shared by all peers
};

//! "flat" / "hierarchical".
constexpr const char* to_string(a2a_algorithm a) noexcept {
  return a == a2a_algorithm::flat ? "flat" : "hierarchical";
}
//! "per_peer" / "shared".
constexpr const char* to_string(link_model m) noexcept {
  return m == link_model::per_peer ? "per_peer" : "shared";
}

//! Knobs of `simulate_cluster`.
struct sim_options {
  a2a_algorithm algorithm = a2a_algorithm::flat;
  link_model links = link_model::shared;
  std::int64_t pipeline_degree = 1; //!< C: chunks of the dispatch/compute/combine pipeline
  int device_limit = 0;             //!< M of `apply_device_limit` (0 = unlimited)
  double kernel_fixed_us = 10.0;    //!< launch overhead of each expert-compute chunk
  traffic_options traffic{};        //!< token sampling and replica choice
  //! Ranks whose timelines are kept for the Chrome trace (ids outside the cluster are ignored).
  std::vector<int> trace_ranks{0};
};

//! One layer's result.
struct layer_result {
  double makespan_us = 0;     //!< the layer's time
  double dispatch_us = 0;     //!< unchunked dispatch collective time (sum of phases)
  double combine_us = 0;      //!< unchunked combine collective time
  double compute_us = 0;      //!< expert compute of the busiest device, unchunked
  double exposed_comm_us = 0; //!< worst rank's communication not under its compute
  double imbalance = 0;       //!< max/mean device rows
  double max_sent_bytes = 0;  //!< largest per-rank dispatch send (flat, both classes)
  double inter_bytes = 0;     //!< dispatch bytes crossing nodes, summed over ranks
};

//! What `simulate_cluster` returns.
struct sim_result {
  double step_us = 0;         //!< sum of the layer makespans
  double exposed_comm_us = 0; //!< sum over layers of the worst rank's exposed communication
  double comm_us = 0;         //!< sum over layers of dispatch + combine (unchunked, unhidden)
  double compute_us = 0;      //!< sum over layers of the busiest device's expert compute
  double imbalance_max = 0;   //!< worst layer's max/mean device load
  double imbalance_mean = 0;  //!< mean over layers of max/mean device load
  std::vector<layer_result> layers;
  //! Tasks of one layer's schedule (streams and chunks for the trace).
  plan::schedule schedule;
  std::vector<std::string> schedule_names; //!< name of each op of `schedule`
  //! For each layer, for each kept trace rank, every task's interval (task-major).
  std::vector<std::vector<std::vector<plan::interval>>> traced;
  std::vector<int> trace_ranks; //!< the ranks of `traced`, in order
};

namespace detail {

inline double class_time(const link_spec& l, bool has_peer, double bytes) noexcept {
  return has_peer ? l.time_us(bytes) : 0.0;
}

//! Rank time of one collective (or phase) of fraction `f` of `v` (dispatch direction, or the
//! transpose when `transpose`).
inline double rank_a2a_us(const cluster& c, link_model m, const rank_volume& v, double f,
                          bool transpose, bool intra_phase, bool inter_phase) {
  const bool intra_peer = intra_phase && c.gpus_per_node > 1;
  const bool inter_peer = inter_phase && c.nodes > 1;
  const link_volume& in = transpose ? v.sent : v.received;
  const link_volume& out = transpose ? v.received : v.sent;
  if (m == link_model::per_peer)
    return std::max(class_time(c.intra, intra_peer, f * in.intra_peak),
                    class_time(c.inter, inter_peer, f * in.inter_peak));
  const double intra = std::max(in.intra_bytes, out.intra_bytes);
  const double inter = std::max(in.inter_bytes, out.inter_bytes);
  return std::max(class_time(c.intra, intra_peer && intra > 0, f * intra),
                  class_time(c.inter, inter_peer && inter > 0, f * inter));
}

} // namespace detail

//! Names of the ops of `layer_schedule(algorithm, ...)`, by op id.
inline std::vector<std::string> layer_op_names(a2a_algorithm algorithm) {
  if (algorithm == a2a_algorithm::flat)
    return {"dispatch", "experts", "combine"};
  return {"dispatch.intra", "dispatch.inter", "experts", "combine.inter", "combine.intra"};
}

//! The schedule of one layer: dispatch (one or two phases), expert compute, combine, each split
//! into `degree` chunks and pipelined. Op ids: dispatch phases first, then compute, then the
//! combine phases. Throws `errc::invalid_argument` for a degree below 1.
inline plan::schedule layer_schedule(a2a_algorithm algorithm, std::int64_t degree) {
  WEAVE_EXPECT(degree >= 1, errc::invalid_argument, "pipeline degree ", degree, " < 1");
  plan::graph g;
  std::vector<plan::op_id> order;
  const plan::op_cost unit{0.0, 1.0}; // durations come from the simulation, not the graph
  const auto names = layer_op_names(algorithm);
  for (std::size_t i = 0; i < names.size(); ++i) {
    std::vector<plan::op_id> deps;
    if (i > 0)
      deps.push_back(order.back());
    const bool compute = names[i] == "experts";
    order.push_back(compute ? g.add_compute(names[i], unit, std::move(deps))
                            : g.add_a2a(names[i], 0.0, unit, std::move(deps)));
  }
  plan::partition_plan pl;
  pl.ranges.push_back({0, order.size(), degree});
  pl.order = std::move(order);
  return plan::make_schedule(g, pl);
}

//! Where each layer's routing comes from.
struct routing_source {
  //! A trace replayed on every layer (non-empty ids), else the synthetic generator.
  routing_trace trace{};
  //! Per-layer traces (a recorded model's layers, `read_trace_layers_file`): layer l replays
  //! `layer_traces[l % size]`. Takes precedence over `trace` when non-empty.
  std::vector<routing_trace> layer_traces{};
  //! Generator settings (experts and k are taken from the model); layer l uses seed + l.
  trace_options synthetic{};
  //! Synthetic tokens per layer; 0: ranks × sampled tokens per rank, at most 65536.
  std::size_t pool_tokens = 0;
  //! Distinct synthetic layers; layer l uses pool l % this (0: one per layer).
  int distinct_layers = 0;
};

//! Distinct routing pools of `src` for a model of `layers` layers: the per-layer traces (at
//! most `layers`), 1 for a replayed trace, else `distinct_layers` (at most `layers`; 0 =
//! `layers`).
inline int routing_pool_count(const routing_source& src, int layers) noexcept {
  if (!src.layer_traces.empty())
    return std::min(static_cast<int>(src.layer_traces.size()), layers);
  if (!src.trace.ids.empty())
    return 1;
  return src.distinct_layers > 0 ? std::min(src.distinct_layers, layers) : layers;
}

//! The routing pool of layer `layer`: its per-layer trace (`layer_traces[layer % size]`), the
//! replayed trace, or the synthetic trace of seed `synthetic.seed + layer %
//! routing_pool_count` with the model's experts and k. `ranks` and `sampled_tokens` size the
//! default pool. Throws `errc::size_mismatch` for a trace whose k or experts differ from the
//! model's.
inline routing_trace routing_pool(const routing_source& src, const moe_model& m, int ranks,
                                  std::int64_t sampled_tokens, int layer) {
  m.validated();
  const routing_trace* replayed =
      !src.layer_traces.empty()
          ? &src.layer_traces[static_cast<std::size_t>(layer) % src.layer_traces.size()]
          : (src.trace.ids.empty() ? nullptr : &src.trace);
  if (replayed != nullptr) {
    WEAVE_EXPECT(replayed->k == m.k && replayed->num_experts == m.experts, errc::size_mismatch,
                 "trace of k = ", replayed->k, " over ", replayed->num_experts,
                 " experts for a model of k = ", m.k, " over ", m.experts);
    return *replayed;
  }
  trace_options t = src.synthetic;
  t.num_experts = m.experts;
  t.k = m.k;
  t.seed =
      src.synthetic.seed + static_cast<std::uint64_t>(layer % routing_pool_count(src, m.layers));
  const std::int64_t sampled =
      sampled_tokens > 0 ? std::min(sampled_tokens, m.tokens_per_gpu) : m.tokens_per_gpu;
  t.tokens = src.pool_tokens > 0
                 ? src.pool_tokens
                 : std::min<std::size_t>(65536, static_cast<std::size_t>(ranks) *
                                                    static_cast<std::size_t>(sampled));
  synthetic_trace g = generate_trace(t);
  routing_trace pool;
  pool.num_experts = g.num_experts;
  pool.k = g.k;
  pool.ids = std::move(g.ids);
  return pool;
}

//! Simulates one forward step of `m` on `c`, layer `l` under placement `placements[l % size]`
//! and routing pool `routing_pool(..., l)`. Throws what `routing_pool`, `layer_traffic_of` and
//! `layer_schedule` throw, and `errc::invalid_argument` for no placement.
inline sim_result simulate_cluster(const cluster& c, const moe_model& m,
                                   std::span<const placement> placements, const routing_source& src,
                                   const sim_options& o = {}) {
  c.validated();
  m.validated();
  WEAVE_EXPECT(!placements.empty(), errc::invalid_argument, "no placement to simulate");
  const int D = c.num_ranks();
  const bool flat = o.algorithm == a2a_algorithm::flat;
  sim_result res;
  res.schedule = layer_schedule(o.algorithm, o.pipeline_degree);
  res.schedule_names = layer_op_names(o.algorithm);
  const plan::schedule& s = res.schedule;
  for (const int r : o.trace_ranks)
    if (r >= 0 && r < D)
      res.trace_ranks.push_back(r);

  // Layers sharing a pool and a placement share their traffic: computed once, kept in memory.
  const auto pools = static_cast<std::size_t>(routing_pool_count(src, m.layers));
  const std::size_t P = placements.size();
  std::vector<layer_traffic> traffic(std::min(pools * P, static_cast<std::size_t>(m.layers) * P));
  auto traffic_of_layer = [&](int layer) -> const layer_traffic& {
    const std::size_t pool_index = static_cast<std::size_t>(layer) % pools;
    const std::size_t place_index = static_cast<std::size_t>(layer) % P;
    layer_traffic& slot = traffic[pool_index * P + place_index];
    if (slot.device_rows.empty()) {
      routing_trace pool = routing_pool(src, m, D, o.traffic.sample_tokens, layer);
      apply_device_limit(placements[place_index], pool.ids, pool.k, o.device_limit);
      slot = layer_traffic_of(c, m, placements[place_index], pool, o.traffic);
    }
    return slot;
  };

  const double us_per_row = m.flops_per_row() / (c.tflops * 1e6);
  double imbalance_sum = 0;
  for (int layer = 0; layer < m.layers; ++layer) {
    const layer_traffic& tr = traffic_of_layer(layer);
    auto a2a_us = [&](std::size_t r, plan::op_id op, double f) {
      if (flat)
        return detail::rank_a2a_us(c, o.links, tr.flat[r], f, op == 2, true, true);
      // ops: 0 dispatch.intra, 1 dispatch.inter, 3 combine.inter, 4 combine.intra
      const bool intra = op == 0 || op == 4;
      return detail::rank_a2a_us(c, o.links, intra ? tr.phase1[r] : tr.phase2[r], f, op >= 3, intra,
                                 !intra);
    };
    const plan::op_id compute_op = flat ? 1 : 2;
    const plan::timeline t =
        plan::simulate(s, static_cast<std::size_t>(D), [&](std::size_t r, std::size_t i) {
          const plan::task& task = s[i];
          if (task.op == compute_op)
            return o.kernel_fixed_us + us_per_row * tr.device_rows[r] * task.fraction;
          return a2a_us(r, task.op, task.fraction);
        });
    layer_result lr;
    lr.makespan_us = t.makespan_us();
    lr.imbalance = tr.imbalance();
    for (std::size_t r = 0; r < static_cast<std::size_t>(D); ++r) {
      lr.compute_us = std::max(lr.compute_us, o.kernel_fixed_us + us_per_row * tr.device_rows[r]);
      lr.max_sent_bytes =
          std::max(lr.max_sent_bytes, tr.flat[r].sent.intra_bytes + tr.flat[r].sent.inter_bytes);
      lr.inter_bytes += tr.flat[r].sent.inter_bytes;
      lr.exposed_comm_us = std::max(lr.exposed_comm_us, plan::analyze(s, t, r).exposed_comm_us);
    }
    const std::vector<plan::op_id> dispatch_ops =
        flat ? std::vector<plan::op_id>{0} : std::vector<plan::op_id>{0, 1};
    const std::vector<plan::op_id> combine_ops =
        flat ? std::vector<plan::op_id>{2} : std::vector<plan::op_id>{3, 4};
    for (const auto* ops : {&dispatch_ops, &combine_ops})
      for (const plan::op_id op : *ops) {
        double worst = 0;
        for (std::size_t r = 0; r < static_cast<std::size_t>(D); ++r)
          worst = std::max(worst, a2a_us(r, op, 1.0));
        (ops == &dispatch_ops ? lr.dispatch_us : lr.combine_us) += worst;
      }
    res.traced.emplace_back();
    for (const int r : res.trace_ranks) {
      std::vector<plan::interval> iv(s.size());
      for (std::size_t i = 0; i < s.size(); ++i)
        iv[i] = t.at(static_cast<std::size_t>(r), i);
      res.traced.back().push_back(std::move(iv));
    }
    res.step_us += lr.makespan_us;
    res.exposed_comm_us += lr.exposed_comm_us;
    res.comm_us += lr.dispatch_us + lr.combine_us;
    res.compute_us += lr.compute_us;
    res.imbalance_max = std::max(res.imbalance_max, lr.imbalance);
    imbalance_sum += lr.imbalance;
    res.layers.push_back(lr);
  }
  res.imbalance_mean = imbalance_sum / m.layers;
  return res;
}

//! `simulate_cluster` with one placement for every layer.
inline sim_result simulate_cluster(const cluster& c, const moe_model& m, const placement& p,
                                   const routing_source& src, const sim_options& o = {}) {
  return simulate_cluster(c, m, std::span<const placement>(&p, 1), src, o);
}

} // namespace sim
WEAVE_NAMESPACE_END
