// The fault matrix (fault_matrix.hpp) on local_world, 2 and 4 ranks: moe_exchange and the device
// exchange on host streams, dynamic and static shapes; the culprit is the last rank.
#include <doctest/doctest.h>

#include "fault_matrix.hpp"

#include <weave/comm/local_world.hpp>

namespace {

template <template <class> class Layer>
void run_matrix() {
  for (const int ranks : {2, 4})
    for (const fault_matrix::fault f : fault_matrix::all_faults) {
      CAPTURE(ranks);
      CAPTURE(fault_matrix::name(f));
      fault_matrix::watchdog dog(std::string(Layer<weave::local_communicator>::name) + ", " +
                                 fault_matrix::name(f));
      weave::local_world world(ranks, {fault_matrix::timeout, {}});
      const auto escaped = world.run_collect([&](weave::local_communicator& comm) {
        fault_matrix::run_case<Layer>(comm, f, ranks - 1, [](auto&&) {});
      });
      for (const std::exception_ptr& e : escaped)
        CHECK_FALSE(fault_matrix::outcome_of(e).failed); // run_case catches what it expects
    }
}

} // namespace

TEST_CASE("fault matrix: moe_exchange on local_world") {
  run_matrix<fault_matrix::host_layer>();
}

TEST_CASE("fault matrix: device exchange (host streams, dynamic shapes) on local_world") {
  run_matrix<fault_matrix::device_dynamic>();
}

TEST_CASE("fault matrix: device exchange (host streams, static shapes) on local_world") {
  run_matrix<fault_matrix::device_static>();
}
