// The checks of non-finite numbers outside the data path: the planner's cost models and graph,
// the simulator's cluster and JSON report, placement's trace options, loads, assignment
// weights and trace files, the trace writer and the emulated link. Each is fed NaNs and
// infinities (refused with errc::invalid_argument) and finite values (accepted). Built with
// -ffast-math (test_fast_math) and without (test_fast_math_reference).
#include <doctest/doctest.h>

#include "nonfinite_values.hpp"

#include <weave/comm/emulated_link.hpp>
#include <weave/core/trace_writer.hpp>
#include <weave/placement/hungarian.hpp>
#include <weave/placement/policies.hpp>
#include <weave/placement/trace.hpp>
#include <weave/placement/trace_io.hpp>
#include <weave/plan/cost_model.hpp>
#include <weave/plan/graph.hpp>
#include <weave/sim/cluster.hpp>
#include <weave/sim/report.hpp>

#include <sstream>
#include <string>
#include <vector>

using namespace nonfinite;
using weave::errc;

TEST_CASE("non-finite: planner, simulator, placement and tracing options refuse NaN and inf") {
  for (const auto& s : f64_nonfinite) {
    INFO("value: ", std::string(s.name));
    const double v = value(s);
    const auto refused = [](auto&& f) { return outcome_of(f).code == errc::invalid_argument; };
    CHECK(refused([&] { weave::plan::a2a_cost::from_bandwidth(1.0, v); }));
    CHECK(refused([&] { weave::plan::a2a_cost::from_bandwidth(v, 10.0); }));
    const std::vector<double> x = {1.0, 2.0, 3.0}, y = {1.0, v, 3.0};
    CHECK(refused([&] { weave::plan::fit_line(x, y); }));
    weave::plan::graph g;
    CHECK(refused([&] { g.add_a2a("a2a", v, weave::plan::a2a_cost{1.0, 1e-3}); }));
    CHECK(refused([&] { g.add_compute("op", weave::plan::op_cost{v, 0.0}); }));
    weave::sim::cluster c;
    c.inter.gbytes_per_s = v;
    CHECK(refused([&] { c.validated(); }));
    c = {};
    c.tflops = v;
    CHECK(refused([&] { c.validated(); }));
    weave::trace_options o;
    o.zipf = v;
    CHECK(refused([&] { weave::generate_trace(o); }));
    const std::vector<double> loads = {1.0, v, 2.0, 3.0};
    CHECK(refused([&] { weave::detail::expect_loads(loads); }));
    const std::vector<double> weights = {1.0, 2.0, v, 4.0};
    CHECK(refused([&] { weave::max_weight_assignment(weights, 2); }));
    weave::trace_writer w;
    CHECK(refused([&] { w.add({"event", "compute", 0, 0, v, 1.0, {}}); }));
    CHECK(refused([&] { w.add({"event", "compute", 0, 0, 1.0, v, {}}); }));
    const weave::emulated_link link{std::chrono::nanoseconds(0), v};
    CHECK(refused([&] { (void)link.transfer_time(64); }));
    // A JSON report writes a non-finite number as 0 (JSON has no NaN or infinity).
    std::ostringstream json;
    weave::sim::detail::json_number(json, v);
    CHECK(json.str() == "0");
  }
  // Trace files: "nan" and "inf" parse as floats, and are refused as scores.
  for (const char* field : {"nan", "-nan", "inf", "-inf", "infinity"}) {
    INFO("field: ", std::string(field));
    CHECK(outcome_of([&] { weave::detail::trace_score(field, 3); }).code == errc::invalid_argument);
  }
  // Finite extremes pass (negative ones are refused by the sign checks, not here).
  CHECK(outcome_of([&] { weave::plan::a2a_cost::from_bandwidth(0.0, 1.7e308); }).code == errc{});
  CHECK(outcome_of([&] { weave::detail::trace_score("3.4e38", 3); }).code == errc{});
  std::ostringstream json;
  weave::sim::detail::json_number(json, 1.5e300);
  CHECK(json.str() == "1.5e+300");
}
