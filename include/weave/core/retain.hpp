//! \file
//! `detail::retain_until_exit`: keeps memory alive for the rest of the process. For buffers that
//! an abandoned MPI collective may still write into after an abort: MPI cannot cancel a
//! non-blocking collective, and progresses it until `MPI_Finalize`, so memory it names must not
//! be freed (or reused) before then. Retained memory stays reachable, so leak checkers do not
//! report it.
#pragma once

#include "weave/core/config.hpp"

#include <memory>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

WEAVE_NAMESPACE_BEGIN

namespace detail {

struct retained_objects {
  std::mutex mutex;
  std::vector<std::shared_ptr<void>> objects;
};

// Never destroyed: MPI may write into what it holds during static destruction too.
inline retained_objects& retained() {
  static auto* const objects = new retained_objects;
  return *objects;
}

//! Keeps `object` (and what it owns) alive until the process exits.
inline void retain_until_exit(std::shared_ptr<void> object) {
  if (!object)
    return;
  retained_objects& r = retained();
  const std::lock_guard<std::mutex> lock(r.mutex);
  r.objects.push_back(std::move(object));
}

//! Moves `value` to memory kept until the process exits. A moved `std::vector` keeps its
//! buffer, so what was written into `value.data()` stays valid.
template <class T>
void retain_value_until_exit(T&& value) {
  retain_until_exit(std::make_shared<std::decay_t<T>>(std::forward<T>(value)));
}

} // namespace detail

WEAVE_NAMESPACE_END
