// The fault matrix (fault_matrix.hpp) on local_world, 2 and 4 ranks: the MoE exchange in every
// execution space CI has (host_space, emulated_gpu_space), dynamic and static shapes; the culprit
// is the last rank.
#include <doctest/doctest.h>

#include "fault_matrix.hpp"

#include <weave/comm/local_world.hpp>

namespace {

template <class Space>
void run_matrix(bool fixed) {
  for (const int ranks : {2, 4})
    for (const fault_matrix::fault f : fault_matrix::all_faults) {
      CAPTURE(ranks);
      const std::string what = fault_matrix::name(f);
      CAPTURE(what);
      fault_matrix::watchdog dog(fault_matrix::layer_name<Space>(fixed) + ", " +
                                 fault_matrix::name(f));
      weave::local_world world(ranks, {fault_matrix::timeout, {}});
      const auto escaped = world.run_collect([&](weave::local_communicator& comm) {
        fault_matrix::run_case<Space>(comm, f, ranks - 1, fixed, [](auto&&) {});
      });
      for (const std::exception_ptr& e : escaped)
        CHECK_FALSE(fault_matrix::outcome_of(e).failed); // run_case catches what it expects
    }
}

} // namespace

TEST_CASE_TEMPLATE("fault matrix: the MoE exchange on local_world", Space, weave::host_space,
                   weave::emulated_gpu_space) {
  SUBCASE("dynamic shapes") {
    run_matrix<Space>(false);
  }
  SUBCASE("static shapes") {
    run_matrix<Space>(true);
  }
}
