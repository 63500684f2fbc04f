// The handle API's failure cases (handle_faults.hpp) on local_world, 2 and 4 ranks, for the host
// exchange and the device exchange in host_space and in emulated_gpu_space: every rank ends with
// a typed error naming the cause within seconds (the world's default timeout is 60 s), or
// computes the right result; nothing crashes (ASan) or races (TSan).
#include <doctest/doctest.h>

#include "handle_faults.hpp"

#include <weave/comm/local_world.hpp>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace {

using handle_faults::fault;
using handle_faults::kind;

template <kind K>
void run_all(int ranks) {
  for (const fault f : handle_faults::all_faults) {
    const std::string layer = handle_faults::name(K), what = handle_faults::name(f);
    CAPTURE(layer);
    CAPTURE(what);
    CAPTURE(ranks);
    const int culprit = ranks - 1;
    std::vector<handle_faults::outcome> seen(static_cast<std::size_t>(ranks));
    std::vector<std::shared_ptr<void>> kept;
    std::mutex kept_mutex;
    weave::local_world world(ranks); // the default timeouts
    world.run([&](weave::local_communicator& comm) {
      seen[static_cast<std::size_t>(comm.rank())] =
          handle_faults::run_case<K>(comm, f, culprit, [&](std::shared_ptr<void> p) {
            std::lock_guard lock(kept_mutex);
            kept.push_back(std::move(p));
          });
    });
    for (int r = 0; r < ranks; ++r) {
      CAPTURE(r);
      const auto& o = seen[static_cast<std::size_t>(r)];
      CHECK(o.seconds < 5.0); // well inside the world's 60 s timeout
      const bool guilty = r == culprit;
      switch (f) {
      case fault::swapped_equal_sizes:
      case fault::swapped_other_sizes:
        // Its own finding, or a peer's that failed the world first (naming both calls).
        CHECK(
            (o.code == weave::errc::call_mismatch ||
             (o.code == weave::errc::peer_failure && o.origin_code == weave::errc::call_mismatch)));
        break;
      case fault::destroyed_in_flight:
      case fault::destroyed_after_sync:
      case fault::destroyed_before_handle:
        if (guilty) {
          CHECK(o.code == weave::errc{});
        } else {
          CHECK(o.code == weave::errc::peer_failure);
          CHECK(o.origin == culprit);
          CHECK(o.origin_code == weave::errc::invalid_state);
        }
        break;
      case fault::combine_twice:
        if (guilty) {
          CHECK(o.code == weave::errc::invalid_state);
        } else if (o.code == weave::errc{}) {
          // The culprit had issued every collective of both calls (iterating past a handle's
          // last chunk issues its combine): a peer may finish both, right, before the abort.
          CHECK(o.outputs_right);
        } else {
          CHECK(o.code == weave::errc::peer_failure);
          CHECK(o.origin == culprit);
          CHECK(o.origin_code == weave::errc::invalid_state);
        }
        break;
      case fault::recovery:
        if (guilty) {
          CHECK(o.code == weave::errc::out_of_range);
        } else {
          CHECK(o.code == weave::errc::peer_failure);
          CHECK(o.origin == culprit);
          CHECK(o.origin_code == weave::errc::out_of_range);
        }
        CHECK(o.handles_stale);
        CHECK(o.outputs_right);
        break;
      }
    }
  }
}

} // namespace

TEST_CASE("handle faults: moe_exchange on local_world") {
  for (const int ranks : {2, 4})
    run_all<kind::host>(ranks);
}

TEST_CASE("handle faults: device exchange (host_space) on local_world") {
  for (const int ranks : {2, 4})
    run_all<kind::device>(ranks);
}

TEST_CASE("handle faults: device exchange (emulated GPU) on local_world") {
  for (const int ranks : {2, 4})
    run_all<kind::emulated>(ranks);
}
