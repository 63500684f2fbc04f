//! \file
//! `detail::layer_life`: whether a layer (an MoE or decode exchange) is alive, shared by the
//! layer and everything that refers to it (handles, chunks, chunk ranges, expert views), so that
//! one outliving the layer finds out (`errc::invalid_state`, or a release that does nothing)
//! instead of reaching freed memory. Internal.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"

#include <atomic>
#include <memory>

WEAVE_NAMESPACE_BEGIN
namespace detail {

struct layer_life {
  std::atomic<bool> alive{true};

  //! Throws `errc::invalid_state` naming `what` once the layer was destroyed.
  static void expect_alive(const std::shared_ptr<const layer_life>& life, const char* what) {
    WEAVE_EXPECT(life && life->alive.load(std::memory_order_acquire), errc::invalid_state, what,
                 ": its layer was destroyed (it must not be used after its layer)");
  }
  static bool alive_now(const std::shared_ptr<const layer_life>& life) noexcept {
    return life && life->alive.load(std::memory_order_acquire);
  }
};

//! Waits, at a layer's end, for the work before `e` (an event of the layer's streams) to have
//! run, ignoring its failure (the layer is going; its calls already reported or aborted).
template <class Event>
void wait_at_end(Event& e) noexcept {
  try {
    if constexpr (requires { e.outcome(); })
      (void)e.outcome(); // host events: a wait no capture rule applies to
    else
      e.synchronize();
  } catch (...) {
  }
}

} // namespace detail
WEAVE_NAMESPACE_END
