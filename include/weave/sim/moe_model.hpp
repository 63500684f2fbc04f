//! \file
//! The MoE model a cluster simulation runs, and the traffic of one MoE layer: for every rank,
//! the dispatch bytes it sends to and receives from peers of its node and of other nodes (flat
//! all-to-all) or in each phase of the hierarchical (2DH) all-to-all, and the expert rows each
//! device computes. Volumes follow the Occult exchange: a token sends one row to each distinct
//! device holding one of its experts (none to its own device); the combine is the transpose.
//!
//! Memory is linear in ranks (plus one routing pool): per-(rank, rank) volumes are never stored,
//! each source rank's sends are accumulated in one reused dense row and folded into per-rank
//! totals and per-peer maxima at once.
#pragma once

#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/placement/placement.hpp"
#include "weave/placement/replica_choice.hpp"
#include "weave/placement/trace.hpp"
#include "weave/sim/cluster.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

WEAVE_NAMESPACE_BEGIN
namespace sim {

//! Shape of an MoE model's expert layers.
struct moe_model {
  std::string name = "custom";        //!< shown in reports
  int layers = 16;                    //!< MoE layers
  int hidden = 2048;                  //!< model (token row) width
  int ffn_hidden = 1024;              //!< hidden width of one expert
  int experts = 64;                   //!< E
  int k = 8;                          //!< experts per token
  std::int64_t tokens_per_gpu = 4096; //!< tokens each rank routes per layer
  int bytes_per_element = 2;          //!< activation element size on the wire (bf16 = 2)
  int matrices = 3;                   //!< weight matrices per expert (gated FFN: 3)

  //! Bytes of one token row.
  double row_bytes() const noexcept { return static_cast<double>(hidden) * bytes_per_element; }
  //! Forward FLOPs of one (token, expert) row: 2 per multiply-add per matrix.
  double flops_per_row() const noexcept {
    return 2.0 * matrices * static_cast<double>(hidden) * static_cast<double>(ffn_hidden);
  }

  //! Throws `errc::invalid_argument` for a non-positive size or k outside [1, experts].
  const moe_model& validated() const {
    WEAVE_EXPECT(layers > 0 && hidden > 0 && ffn_hidden > 0 && experts > 0 && matrices > 0 &&
                     bytes_per_element > 0 && tokens_per_gpu > 0,
                 errc::invalid_argument, "model '", name, "': layers ", layers, ", hidden ", hidden,
                 ", ffn_hidden ", ffn_hidden, ", experts ", experts, ", tokens_per_gpu ",
                 tokens_per_gpu, ", bytes_per_element ", bytes_per_element, ", matrices ", matrices,
                 " must all be positive");
    WEAVE_EXPECT(k > 0 && k <= experts, errc::invalid_argument, "model '", name, "': k = ", k,
                 " outside [1, ", experts, "]");
    return *this;
  }
};

//! One direction's bytes of a rank, split by link class, with the largest single-peer message.
struct link_volume {
  double intra_bytes = 0; //!< to/from peers on the same node
  double inter_bytes = 0; //!< to/from peers on other nodes
  double intra_peak = 0;  //!< largest message with one same-node peer
  double inter_peak = 0;  //!< largest message with one other-node peer

  void add(bool same_node, double bytes) noexcept {
    (same_node ? intra_bytes : inter_bytes) += bytes;
    double& peak = same_node ? intra_peak : inter_peak;
    peak = std::max(peak, bytes);
  }
};

//! What one rank sends and receives in one all-to-all (or one phase of it).
struct rank_volume {
  link_volume sent;
  link_volume received;
};

//! The traffic of one MoE layer's dispatch on every rank (the combine is its transpose).
struct layer_traffic {
  std::vector<rank_volume> flat;   //!< flat all-to-all, per rank
  std::vector<rank_volume> phase1; //!< 2DH phase 1 (inside nodes), per rank
  std::vector<rank_volume> phase2; //!< 2DH phase 2 (same local rank, across nodes), per rank
  std::vector<double> device_rows; //!< (token, expert) rows each device computes
  double tokens_per_rank = 0;      //!< tokens each rank routes (after scaling)

  //! max/mean of `device_rows` (1 = even; 0 when nothing is computed).
  double imbalance() const noexcept {
    double total = 0, peak = 0;
    for (const double r : device_rows) {
      total += r;
      peak = std::max(peak, r);
    }
    return total > 0 ? peak * static_cast<double>(device_rows.size()) / total : 0.0;
  }
};

//! Device-limited routing (DeepSeek-V2 style, simplified for traces without gate scores): a
//! token's expert ids are taken in order of preference (position 0 best); the devices of its
//! first choices are admitted until `limit` distinct devices are admitted, and every later
//! expert on another device is replaced by an unchosen expert held by an admitted device
//! (admitted devices in turn, the expert picked by token and position), so each token keeps
//! `k` experts on at most `limit` devices. Devices are the experts' first replicas. `limit` <= 0
//! disables the limit. Throws `errc::out_of_range` for an expert id outside the placement.
inline void apply_device_limit(const placement& p, std::span<std::int32_t> ids, int k, int limit) {
  WEAVE_EXPECT(k > 0 && ids.size() % static_cast<std::size_t>(k) == 0, errc::size_mismatch,
               ids.size(), " ids are not a whole number of tokens with k = ", k);
  for (const std::int32_t e : ids)
    WEAVE_EXPECT(e >= -1 && e < p.num_experts(), errc::out_of_range, "expert id ", e,
                 " outside [-1, ", p.num_experts(), ")");
  if (limit <= 0)
    return;
  const auto kk = static_cast<std::size_t>(k);
  const int spd = p.slots_per_device();
  std::vector<int> admitted;
  for (std::size_t t = 0; t < ids.size() / kk; ++t) {
    std::span<std::int32_t> tok = ids.subspan(t * kk, kk);
    admitted.clear();
    auto is_admitted = [&](int d) {
      return std::find(admitted.begin(), admitted.end(), d) != admitted.end();
    };
    for (std::size_t j = 0; j < kk; ++j) {
      if (tok[j] < 0)
        continue;
      const int d = p.device_of(tok[j]);
      if (is_admitted(d))
        continue;
      if (static_cast<int>(admitted.size()) < limit)
        admitted.push_back(d);
      else
        tok[j] = -2; // to replace once every admitted device is known
    }
    for (std::size_t j = 0; j < kk; ++j) {
      if (tok[j] != -2)
        continue;
      tok[j] = -1; // stays dropped only when the admitted devices have no expert left
      const std::size_t cap = admitted.size() * static_cast<std::size_t>(spd);
      for (std::size_t probe = 0; probe < cap && tok[j] == -1; ++probe) {
        const std::size_t x = (t * 31 + j * 7 + probe) % cap;
        const int d = admitted[x % admitted.size()];
        const int e = p.expert_of_slot(d * spd + static_cast<int>(x / admitted.size()));
        if (e != placement::empty_slot && std::find(tok.begin(), tok.end(), e) == tok.end())
          tok[j] = e;
      }
    }
  }
}

//! How `layer_traffic_of` reads a routing pool.
struct traffic_options {
  //! Tokens per rank actually routed; volumes and rows are scaled by tokens_per_gpu / sampled.
  //! 0 or >= tokens_per_gpu: every token.
  std::int64_t sample_tokens = 0;
  replica_options replicas{}; //!< replica choice for replicated placements
};

//! The dispatch traffic of one layer: rank `r` routes pool tokens `r * T + i` (modulo the pool
//! size) for i < T, T = the sampled tokens per rank. Throws `errc::size_mismatch` when the
//! placement does not span the cluster or the pool's experts differ from the placement's,
//! `errc::invalid_argument` for an empty pool.
inline layer_traffic layer_traffic_of(const cluster& c, const moe_model& m, const placement& p,
                                      const routing_trace& pool, const traffic_options& o = {}) {
  c.validated();
  m.validated();
  const int D = c.num_ranks();
  WEAVE_EXPECT(p.num_devices() == D, errc::size_mismatch, "placement over ", p.num_devices(),
               " devices for a cluster of ", D, " ranks");
  WEAVE_EXPECT(pool.num_experts == p.num_experts(), errc::size_mismatch, "routing pool of ",
               pool.num_experts, " experts for a placement of ", p.num_experts());
  WEAVE_EXPECT(pool.num_tokens() > 0, errc::invalid_argument, "empty routing pool");
  const std::int64_t T =
      o.sample_tokens > 0 ? std::min(o.sample_tokens, m.tokens_per_gpu) : m.tokens_per_gpu;
  const double scale = static_cast<double>(m.tokens_per_gpu) / static_cast<double>(T);
  const double row = m.row_bytes() * scale;
  const auto Du = static_cast<std::size_t>(D);
  const int G = c.gpus_per_node;
  const std::size_t n_pool = pool.num_tokens();
  const auto kk = static_cast<std::size_t>(pool.k);

  layer_traffic out;
  out.flat.assign(Du, {});
  out.phase1.assign(Du, {});
  out.phase2.assign(Du, {});
  out.device_rows.assign(Du, 0.0);
  out.tokens_per_rank = static_cast<double>(m.tokens_per_gpu);

  replica_router router(p, c.topology(), o.replicas);
  const bool replicated = p.replicated();
  std::vector<std::int32_t> slots(kk);
  std::vector<double> to_dev(Du, 0.0), node_to_dev(Du, 0.0), to_local(static_cast<std::size_t>(G));
  std::vector<std::int64_t> stamp(Du, -1);
  std::vector<std::size_t> touched, node_touched;
  std::vector<char> node_seen(Du, 0);
  std::int64_t token_serial = 0;
  for (int n = 0; n < c.nodes; ++n) {
    for (int l = 0; l < G; ++l) {
      const int r = n * G + l;
      touched.clear();
      for (std::int64_t i = 0; i < T; ++i, ++token_serial) {
        const std::size_t t = static_cast<std::size_t>(
            (static_cast<std::uint64_t>(r) * static_cast<std::uint64_t>(T) +
             static_cast<std::uint64_t>(i)) %
            n_pool);
        if (replicated) {
          router.route(pool.token(t), static_cast<std::size_t>(i), r, slots);
        } else { // one replica each: the router's answer without its bookkeeping
          const auto ids = pool.token(t);
          for (std::size_t j = 0; j < kk; ++j) {
            WEAVE_EXPECT(ids[j] < p.num_experts(), errc::out_of_range, "expert id ", ids[j],
                         " of pool token ", t, " >= num_experts ", p.num_experts());
            slots[j] = ids[j] < 0 ? -1 : p.slots_of(ids[j])[0];
          }
        }
        for (const std::int32_t s : slots) {
          if (s < 0)
            continue;
          const auto d = static_cast<std::size_t>(p.device_of_slot(s));
          out.device_rows[d] += scale;
          if (stamp[d] == token_serial)
            continue; // one row per distinct device
          stamp[d] = token_serial;
          if (static_cast<int>(d) == r)
            continue; // stays on the rank
          if (to_dev[d] == 0.0)
            touched.push_back(d);
          to_dev[d] += row;
        }
      }
      // `touched` is in first-touch order, itself deterministic, so the sums are too.
      std::fill(to_local.begin(), to_local.end(), 0.0);
      for (const std::size_t d : touched) {
        const double b = to_dev[d];
        const bool same = c.node_of(static_cast<int>(d)) == n;
        out.flat[static_cast<std::size_t>(r)].sent.add(same, b);
        out.flat[d].received.add(same, b);
        // 2DH phase 1 gathers everything for local rank l' at (n, l') (same-node traffic is
        // then delivered); phase 2 forwards the rest to (n', l'), summed over the node.
        to_local[static_cast<std::size_t>(c.local_of(static_cast<int>(d)))] += b;
        if (!same) {
          if (!node_seen[d]) {
            node_seen[d] = 1;
            node_touched.push_back(d);
          }
          node_to_dev[d] += b;
        }
        to_dev[d] = 0.0;
      }
      for (int lp = 0; lp < G; ++lp) {
        const double b = to_local[static_cast<std::size_t>(lp)];
        if (lp == l || b == 0.0)
          continue;
        out.phase1[static_cast<std::size_t>(r)].sent.add(true, b);
        out.phase1[static_cast<std::size_t>(n * G + lp)].received.add(true, b);
      }
    }
    for (const std::size_t d : node_touched) {
      const auto from = static_cast<std::size_t>(n * G + c.local_of(static_cast<int>(d)));
      out.phase2[from].sent.add(false, node_to_dev[d]);
      out.phase2[d].received.add(false, node_to_dev[d]);
      node_to_dev[d] = 0.0;
      node_seen[d] = 0;
    }
    node_touched.clear();
  }
  return out;
}

} // namespace sim
WEAVE_NAMESPACE_END
