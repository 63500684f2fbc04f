//! \file
//! `host_stream`'s queue, out of the class: the worker thread that runs the queued tasks in
//! order, the runs on a calling thread that holds an idle stream (`run_inline_or_submit`,
//! `claim_if_idle`), the record points and waits of events, `synchronize`, and the sticky
//! failure. Included by `host_stream.hpp`.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/exec/host_capture.hpp"
#include "weave/exec/host_stream.hpp"
#include "weave/exec/unique_task.hpp"

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>

WEAVE_NAMESPACE_BEGIN

// Drains the queue and joins the worker (see the declaration).
inline host_stream::~host_stream() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  work_ready_.notify_one();
  worker_.join();
  if (failure_) {
    try {
      std::rethrow_exception(failure_);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "weave: host_stream '%s' destroyed with an unobserved failure: %s\n",
                   name_.c_str(), e.what());
    } catch (...) {
      std::fprintf(stderr, "weave: host_stream '%s' destroyed with an unobserved failure\n",
                   name_.c_str());
    }
  }
}

inline bool host_stream::run_inline_or_submit(unique_task task) {
  const bool held = held_here(); // within this thread's `claim_if_idle`: claimed already
  if (!held && !try_begin_inline()) {
    submit(std::move(task));
    return false;
  }
  if (!current_failure()) {
    const running_guard running(this);
    try {
      task();
    } catch (...) {
      fail(std::current_exception());
    }
  }
  task.reset();
  if (!held)
    end_inline();
  return true;
}

template <class F, class Choose>
requires std::is_invocable_r_v<std::exception_ptr, F&, std::exception_ptr> &&
    std::is_invocable_r_v<bool, Choose&>
inline bool host_stream::run_inline_or_submit_always(F task, Choose choose) {
  const bool held = held_here();
  if (!held && !try_begin_inline()) {
    submit_always(std::move(task));
    return false;
  }
  bool here = false;
  try {
    here = choose();
  } catch (...) {
    if (!held)
      end_inline();
    throw;
  }
  if (!here) {
    submit_always(std::move(task)); // the worker starts it once this claim ends
    if (!held)
      end_inline();
    return false;
  }
  {
    F claimed = std::move(task); // released before the stream is idle again, as on the worker
    const running_guard running(this);
    run_always(claimed);
  }
  if (!held)
    end_inline();
  return true;
}

inline host_stream::inline_claim host_stream::claim_if_idle() {
  if (owner_.load(std::memory_order_relaxed) == std::this_thread::get_id())
    return inline_claim(this, false);
  if (!try_begin_inline())
    return {};
  owner_.store(std::this_thread::get_id(), std::memory_order_relaxed);
  return inline_claim(this, true);
}

inline void host_stream::record(host_event& e) {
  {
    std::lock_guard capture_lock(detail::host_capture::lock());
    e.state_->capture = capture_;
    e.state_->depends = capture_ ? capture_->snapshot(this) : detail::host_capture_clock{};
  }
  std::uint64_t point = 0;
  {
    std::lock_guard lock(e.state_->mutex);
    point = ++e.state_->recorded;
  }
  auto reach = [this, state = e.state_, point] {
    std::exception_ptr failure = current_failure();
    {
      std::lock_guard lock(state->mutex);
      if (state->completed < point) {
        state->completed = point;
        state->completed_at = host_event::clock::now();
        state->failure = std::move(failure);
      }
    }
    state->reached.notify_all();
  };
  if (try_begin_inline()) { // everything before the point has run: reached now
    reach();
    end_inline();
    return;
  }
  push(unique_task(std::move(reach)), /*is_marker=*/true);
}

inline void host_stream::wait(const host_event& e) {
  check_wait(e);
  std::uint64_t point = 0;
  {
    std::lock_guard lock(e.state_->mutex);
    point = e.state_->recorded;
  }
  push(unique_task([this, state = e.state_, point] {
         std::exception_ptr failure;
         {
           std::unique_lock lock(state->mutex);
           state->reached.wait(lock, [&] { return state->completed >= point; });
           failure = state->failure;
         }
         if (failure)
           fail(std::move(failure));
       }),
       /*is_marker=*/true);
}

inline void host_stream::synchronize() {
  check_not_capturing("synchronize");
  WEAVE_EXPECT(owner_.load(std::memory_order_relaxed) != std::this_thread::get_id(),
               errc::invalid_state, "host_stream '", name_,
               "': synchronize while this thread holds the stream (claim_if_idle)");
  std::unique_lock lock(mutex_);
  drained_.wait(lock, [&] { return pending_ == 0; });
  if (failure_) {
    std::exception_ptr failure = std::exchange(failure_, nullptr);
    has_failure_.store(false, std::memory_order_relaxed);
    lock.unlock();
    std::rethrow_exception(failure);
  }
}

// Runs a `submit_always` task with the stream's pending failure; what it returns or throws
// becomes the failure.
template <class F>
void host_stream::run_always(F& task) {
  std::exception_ptr after;
  try {
    after = task(take_failure());
  } catch (...) {
    after = std::current_exception();
  }
  if (after)
    fail(std::move(after));
}

// Claims an idle stream (nothing queued or running, not capturing) for work on the calling
// thread: until `end_inline`, the worker starts nothing and later tasks queue behind it.
inline bool host_stream::try_begin_inline() {
  if (capturing_)
    return false;
  std::lock_guard lock(mutex_);
  if (pending_ != 0 || stopping_)
    return false;
  pending_ = 1;
  inline_running_ = true;
  return true;
}

inline void host_stream::end_inline() {
  bool queued = false;
  bool drained = false;
  {
    std::lock_guard lock(mutex_);
    inline_running_ = false;
    queued = !queue_.empty();
    drained = --pending_ == 0;
  }
  if (queued)
    work_ready_.notify_one();
  if (drained)
    drained_.notify_all();
}

inline void host_stream::push(unique_task task, bool is_marker) {
  {
    std::lock_guard lock(mutex_);
    queue_.push_back({std::move(task), is_marker});
    queued_.store(queue_.size(), std::memory_order_release);
    ++pending_;
  }
  work_ready_.notify_one();
}

// The failure reads skip the lock while the stream has none (the common case): a failure is
// set by this stream's own tasks, which run one at a time, so the task reading it next was
// ordered after the set by the claim or the queue (both under `mutex_`).
inline std::exception_ptr host_stream::current_failure() const {
  if (!has_failure_.load(std::memory_order_acquire))
    return nullptr;
  std::lock_guard lock(mutex_);
  return failure_;
}

inline std::exception_ptr host_stream::take_failure() {
  if (!has_failure_.load(std::memory_order_acquire))
    return nullptr;
  std::lock_guard lock(mutex_);
  has_failure_.store(false, std::memory_order_relaxed);
  return std::exchange(failure_, nullptr);
}

inline void host_stream::fail(std::exception_ptr failure) {
  std::lock_guard lock(mutex_);
  if (!failure_) {
    failure_ = std::move(failure);
    has_failure_.store(true, std::memory_order_release);
  }
}

inline void host_stream::run() {
  std::unique_lock lock(mutex_);
  for (;;) {
    work_ready_.wait(lock, [&] { return !inline_running_ && (stopping_ || !queue_.empty()); });
    if (queue_.empty())
      return; // stopping and drained
    entry next = std::move(queue_.front());
    queue_.pop_front();
    queued_.store(queue_.size(), std::memory_order_release);
    const bool skip = failure_ && !next.is_marker;
    lock.unlock();
    if (!skip) {
      const running_guard running(this);
      try {
        next.task();
      } catch (...) {
        fail(std::current_exception());
      }
    }
    next.task.reset(); // release captures before reporting completion
    lock.lock();
    if (--pending_ == 0)
      drained_.notify_all();
  }
}

WEAVE_NAMESPACE_END
