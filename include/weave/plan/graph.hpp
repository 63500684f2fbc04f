//! \file
//! `plan::graph`: the operator graph a trainer describes to the overlap planner.
//!
//! Each op has a cost that is an affine function of the batch fraction it processes
//! (`fixed_us + scaled_us * fraction`: the fixed part is paid once per chunk, which is what makes
//! partitioning cost something), dependencies on earlier ops, and a kind: compute (runs on the
//! compute stream), all-to-all (runs on the communication stream, moves `bytes` per rank at full
//! batch), or weight gradient (a backward-pass compute op nothing on the critical path waits for,
//! which the dW scheduler may move). `partitionable` says whether the op can be split along the
//! batch into independent chunks.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/float_bits.hpp"
#include "weave/plan/cost_model.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <queue>
#include <span>
#include <string>
#include <utility>
#include <vector>

WEAVE_NAMESPACE_BEGIN
namespace plan {

//! Index of an op in its graph (the order ops were added).
using op_id = std::size_t;

//! What an op is, which decides the stream it runs on.
enum class op_kind : std::uint8_t {
  compute,     //!< a kernel on the compute stream
  a2a,         //!< an all-to-all on the communication stream
  weight_grad, //!< a weight-gradient (dW) kernel on the compute stream, movable by the dW scheduler
};

//! Short name of an op kind ("compute", "a2a", "weight_grad").
constexpr const char* to_string(op_kind kind) noexcept {
  switch (kind) {
  case op_kind::compute:
    return "compute";
  case op_kind::a2a:
    return "a2a";
  case op_kind::weight_grad:
    return "weight_grad";
  }
  return "unknown";
}

//! Time of an op on a batch fraction f in (0, 1]: `fixed_us + scaled_us * f`.
struct op_cost {
  double fixed_us = 0.0;  //!< paid by every chunk (launch, a2a latency)
  double scaled_us = 0.0; //!< the full-batch cost that scales with the fraction

  //! Time of one chunk holding `fraction` of the batch.
  constexpr double at(double fraction) const noexcept { return fixed_us + scaled_us * fraction; }

  //! A kernel over `rows` rows at full batch, priced by a (fitted) per-row model.
  static op_cost from_kernel(const kernel_cost& model, double rows) noexcept {
    return {model.fixed_us, model.us_per_row * rows};
  }
  //! An all-to-all moving `bytes` per rank at full batch, priced by an alpha-beta model.
  static op_cost from_a2a(const a2a_cost& model, double bytes) noexcept {
    return {model.alpha_us, model.us_per_byte * bytes};
  }
};

//! One node of the graph.
struct op {
  std::string name;
  op_kind kind = op_kind::compute;
  op_cost cost;
  double bytes = 0.0; //!< a2a only: bytes per rank at full batch
  bool partitionable = true;
  std::vector<op_id> deps; //!< ops that must finish first
};

//! An operator DAG with costs. Ops are numbered in the order they are added; a dependency may
//! name any op (added before or after), so a graph can contain a cycle until `validate()` or
//! `topological_order()` rejects it.
class graph {
 public:
  //! Adds a compute op. Throws `errc::invalid_argument` for a negative or non-finite cost,
  //! `errc::out_of_range` for a dependency naming no op.
  op_id add_compute(std::string name, op_cost cost, std::vector<op_id> deps = {},
                    bool partitionable = true) {
    return add(std::move(name), op_kind::compute, cost, 0.0, partitionable, std::move(deps));
  }

  //! Adds a weight-gradient op. dW ops are not partitionable by default: splitting one along the
  //! batch yields partial gradients that need an extra reduction.
  op_id add_weight_grad(std::string name, op_cost cost, std::vector<op_id> deps = {},
                        bool partitionable = false) {
    return add(std::move(name), op_kind::weight_grad, cost, 0.0, partitionable, std::move(deps));
  }

  //! Adds an all-to-all moving `bytes` per rank at full batch, priced by `model`.
  op_id add_a2a(std::string name, double bytes, const a2a_cost& model, std::vector<op_id> deps = {},
                bool partitionable = true) {
    WEAVE_EXPECT(weave::detail::is_finite(bytes) && bytes >= 0.0, errc::invalid_argument, "a2a '",
                 name, "': bytes = ", bytes);
    return add(std::move(name), op_kind::a2a, op_cost::from_a2a(model, bytes), bytes, partitionable,
               std::move(deps));
  }

  //! Adds an all-to-all with an explicit cost (measured, or from another model).
  op_id add_a2a(std::string name, double bytes, op_cost cost, std::vector<op_id> deps = {},
                bool partitionable = true) {
    WEAVE_EXPECT(weave::detail::is_finite(bytes) && bytes >= 0.0, errc::invalid_argument, "a2a '",
                 name, "': bytes = ", bytes);
    return add(std::move(name), op_kind::a2a, cost, bytes, partitionable, std::move(deps));
  }

  //! Makes `to` wait for `from`. Both must exist (`errc::out_of_range`).
  void add_dependency(op_id from, op_id to) {
    check_id(from, "dependency source");
    check_id(to, "dependency target");
    ops_[to].deps.push_back(from);
  }

  std::size_t size() const noexcept { return ops_.size(); }
  bool empty() const noexcept { return ops_.empty(); }
  std::span<const op> ops() const noexcept { return ops_; }

  //! The op with id `id` (`errc::out_of_range` if none).
  const op& at(op_id id) const {
    check_id(id, "op id");
    return ops_[id];
  }

  //! The successors of every op, indexed by op id, each list in increasing id order.
  std::vector<std::vector<op_id>> successors() const {
    std::vector<std::vector<op_id>> out(ops_.size());
    for (op_id v = 0; v < ops_.size(); ++v)
      for (op_id u : ops_[v].deps)
        out[u].push_back(v);
    return out;
  }

  //! A topological order, preferring the smallest ready id (so a graph whose ops were added in
  //! dependency order keeps that order). Throws `errc::invalid_argument` naming an op on a cycle.
  std::vector<op_id> topological_order() const {
    const auto succ = successors();
    std::vector<std::size_t> missing(ops_.size());
    std::priority_queue<op_id, std::vector<op_id>, std::greater<>> ready;
    for (op_id v = 0; v < ops_.size(); ++v) {
      missing[v] = ops_[v].deps.size();
      if (missing[v] == 0)
        ready.push(v);
    }
    std::vector<op_id> order;
    order.reserve(ops_.size());
    while (!ready.empty()) {
      const op_id u = ready.top();
      ready.pop();
      order.push_back(u);
      for (op_id v : succ[u])
        if (--missing[v] == 0)
          ready.push(v);
    }
    if (order.size() != ops_.size()) {
      for (op_id v = 0; v < ops_.size(); ++v)
        WEAVE_EXPECT(missing[v] == 0, errc::invalid_argument, "the graph has a cycle through op ",
                     v, " '", ops_[v].name, "'");
    }
    return order;
  }

  //! Checks the whole graph: ids and costs were checked when added, this finds cycles.
  void validate() const { (void)topological_order(); }

 private:
  void check_id(op_id id, const char* what) const {
    WEAVE_EXPECT(id < ops_.size(), errc::out_of_range, what, " ", id, " names no op (graph has ",
                 ops_.size(), " ops)");
  }

  op_id add(std::string name, op_kind kind, op_cost cost, double bytes, bool partitionable,
            std::vector<op_id> deps) {
    WEAVE_EXPECT(weave::detail::is_finite(cost.fixed_us) && cost.fixed_us >= 0.0,
                 errc::invalid_argument, "op '", name, "': fixed cost ", cost.fixed_us,
                 " us is negative or not finite");
    WEAVE_EXPECT(weave::detail::is_finite(cost.scaled_us) && cost.scaled_us >= 0.0,
                 errc::invalid_argument, "op '", name, "': scaled cost ", cost.scaled_us,
                 " us is negative or not finite");
    const op_id id = ops_.size();
    for (op_id d : deps)
      WEAVE_EXPECT(d < id, errc::out_of_range, "op '", name, "' depends on op ", d,
                   ", which does not exist yet (", id, " ops so far)");
    ops_.push_back(op{std::move(name), kind, cost, bytes, partitionable, std::move(deps)});
    return id;
  }

  std::vector<op> ops_;
};

} // namespace plan
WEAVE_NAMESPACE_END
