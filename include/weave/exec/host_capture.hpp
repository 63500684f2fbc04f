//! \file
//! The bookkeeping behind `host_stream::begin_capture`: CUDA's stream-capture rules checked on
//! host streams, so CI catches code that a CUDA graph capture would refuse without a GPU.
//!
//! A capture starts on one stream (its origin). Another stream joins it by waiting for an event
//! recorded in it, and must be joined back (the origin waits for an event recorded after the
//! stream's last captured work) before `end_capture`. What the CUDA runtime refuses, in its
//! global capture mode, is refused here with `errc::invalid_state` naming the CUDA error and
//! invalidates the capture:
//! - a capturing stream waiting for an event recorded outside its capture
//!   (`cudaErrorStreamCaptureIsolation`), or in another capture
//!   (`cudaErrorStreamCaptureMerge`);
//! - querying or synchronizing a capturing stream, or an event last recorded in a capture
//!   (`cudaErrorStreamCaptureUnsupported`, `cudaErrorCapturedEvent`); a stream outside any
//!   capture waiting for such an event once its capture ended;
//! - ending a capture that a stream joined and was not joined back from
//!   (`cudaErrorStreamCaptureUnjoined`), or ending it on another stream than its origin;
//! - whatever a space or an allocator reports through `host_capture_violation` (a pageable
//!   copy, an allocation).
//! Work submitted while capturing still runs: a host capture checks the rules, it records no
//! graph to replay.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

WEAVE_NAMESPACE_BEGIN
namespace detail {

// Work counts per stream: what a stream (or an event) depends on, by stream, as a vector clock.
using host_capture_clock = std::map<const void*, std::uint64_t>;

// One capture: its members' work and dependencies. Guarded by `host_capture::lock()`.
struct host_capture {
  struct member {
    std::uint64_t work = 0;   // tasks submitted while a member
    host_capture_clock knows; // the work of each member this one's next task depends on
  };

  host_capture(const void* origin_stream, std::string name)
      : origin(origin_stream)
      , origin_name(std::move(name)) {
    members[origin];
  }

  // One mutex for every capture: captures are rare, and a wait can touch two of them.
  static std::mutex& lock() {
    static std::mutex m;
    return m;
  }

  // Throws `what`; while the capture is open, it is invalidated (its first violation kept).
  [[noreturn]] void refuse(const std::string& what) {
    if (ended)
      WEAVE_THROW(errc::invalid_state, what);
    if (invalid.empty())
      invalid = what;
    WEAVE_THROW(errc::invalid_state, what, " (the capture begun on stream '", origin_name,
                "' is invalidated)");
  }

  // The clock an event recorded now on member `s` carries.
  host_capture_clock snapshot(const void* s) {
    member& m = members[s];
    host_capture_clock c = m.knows;
    c[s] = m.work;
    return c;
  }

  // Member `s` now depends on everything `c` names.
  void merge(const void* s, const host_capture_clock& c) {
    host_capture_clock& k = members[s].knows;
    for (const auto& [stream, work] : c)
      if (k[stream] < work)
        k[stream] = work;
  }

  // The first member whose captured work the origin does not depend on, or null.
  const void* unjoined() {
    const host_capture_clock& k = members[origin].knows;
    for (const auto& [stream, m] : members) {
      if (stream == origin || m.work == 0)
        continue;
      const auto it = k.find(stream);
      if (it == k.end() || it->second < m.work)
        return stream;
    }
    return nullptr;
  }

  const void* origin;
  std::string origin_name;
  std::map<const void*, member> members;
  bool ended = false;
  std::string invalid; // the first violation, if any
};

} // namespace detail
WEAVE_NAMESPACE_END
