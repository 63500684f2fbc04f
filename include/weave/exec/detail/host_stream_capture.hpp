//! \file
//! `host_stream`'s and `host_event`'s checks of CUDA's stream-capture rules, out of the classes:
//! beginning and ending a capture, the calls refused while capturing, and the rules of a wait
//! for an event (isolation, merges, joining a capture). The rules themselves are in
//! `host_capture.hpp`. Included by `host_stream.hpp`.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/exec/host_capture.hpp"
#include "weave/exec/host_stream.hpp"

#include <memory>
#include <mutex>
#include <string>

WEAVE_NAMESPACE_BEGIN

inline void host_event::check_not_captured(const char* call) const {
  std::lock_guard lock(detail::host_capture::lock());
  if (state_->capture)
    state_->capture->refuse(detail::concat("cudaErrorCapturedEvent: ", call,
                                           " of an event last recorded in a stream capture"));
}

inline void host_stream::begin_capture() {
  std::lock_guard lock(detail::host_capture::lock());
  WEAVE_EXPECT(!capture_, errc::invalid_state, "host_stream '", name_,
               "': begin_capture on a stream that is already capturing");
  capture_ = std::make_shared<detail::host_capture>(this, name_);
  capturing_ = true;
}

inline void host_stream::end_capture() {
  std::lock_guard lock(detail::host_capture::lock());
  WEAVE_EXPECT(capture_ && capture_->origin == this, errc::invalid_state, "host_stream '", name_,
               "': end_capture on a stream that did not begin a capture");
  const std::shared_ptr<detail::host_capture> c = capture_;
  for (auto& [member, _] : c->members) {
    auto* s = static_cast<host_stream*>(const_cast<void*>(member));
    s->capture_.reset();
    s->capturing_ = false;
  }
  c->ended = true;
  WEAVE_EXPECT(c->invalid.empty(), errc::invalid_state, "host_stream '", name_,
               "': the capture was invalidated: ", c->invalid);
  if (const void* open = c->unjoined())
    WEAVE_THROW(errc::invalid_state, "cudaErrorStreamCaptureUnjoined: stream '",
                static_cast<const host_stream*>(open)->name_, "' joined the capture of '", name_,
                "' and its work was not joined back before end_capture");
}

inline void host_stream::refuse_while_capturing(const char* cuda_error, const std::string& what) {
  if (!capturing_)
    return;
  std::lock_guard lock(detail::host_capture::lock());
  if (capture_)
    capture_->refuse(detail::concat(cuda_error, ": ", what, " on capturing stream '", name_, "'"));
}

inline void host_stream::count_captured_work() {
  if (!capturing_)
    return;
  std::lock_guard lock(detail::host_capture::lock());
  if (capture_)
    ++capture_->members[this].work;
}

inline void host_stream::check_not_capturing(const char* call) const {
  if (!capturing_)
    return;
  std::lock_guard lock(detail::host_capture::lock());
  if (capture_)
    capture_->refuse(detail::concat("cudaErrorStreamCaptureUnsupported: ", call,
                                    " of capturing stream '", name_, "'"));
}

// The capture rules of a wait for `e` (see host_capture.hpp); joins its capture if this stream
// captures nothing and `e` was recorded in one that is still open.
inline void host_stream::check_wait(const host_event& e) {
  std::lock_guard lock(detail::host_capture::lock());
  const std::shared_ptr<detail::host_capture>& theirs = e.state_->capture;
  if (capture_) {
    if (!theirs)
      capture_->refuse(detail::concat("cudaErrorStreamCaptureIsolation: capturing stream '", name_,
                                      "' waits for an event recorded outside the capture"));
    if (theirs != capture_)
      capture_->refuse(detail::concat("cudaErrorStreamCaptureMerge: capturing stream '", name_,
                                      "' waits for an event of another capture"));
    capture_->merge(this, e.state_->depends);
  } else if (theirs && !theirs->ended) {
    capture_ = theirs; // joins
    capturing_ = true;
    capture_->merge(this, e.state_->depends);
  } else if (theirs) {
    WEAVE_THROW(errc::invalid_state, "cudaErrorCapturedEvent: stream '", name_,
                "' waits for an event last recorded in a capture that has ended");
  }
}

WEAVE_NAMESPACE_END
