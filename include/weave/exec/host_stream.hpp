//! \file
//! `host_stream` and `host_event`: CUDA stream semantics on a host worker thread.
//!
//! The host path of every weave algorithm runs on these. Tasks run one at a time in FIFO order
//! on the stream's own thread. A task that throws puts the stream in a failed state (as a CUDA
//! error is sticky): later tasks are skipped (but for `submit_always` tasks, which see the
//! failure), events recorded later complete carrying the failure, a stream waiting on such an
//! event fails too, and `synchronize()` rethrows the first failure and clears it. Nothing fails
//! silently and nothing deadlocks on a failed producer.
#pragma once

#include "weave/core/config.hpp"
#include "weave/exec/stream.hpp"
#include "weave/exec/unique_task.hpp"

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>

WEAVE_NAMESPACE_BEGIN

class host_stream;

//! A point in a `host_stream`. Copies share the point (like a `cudaEvent_t` handle).
//! A default-constructed or never-recorded event counts as complete, as in CUDA.
class host_event {
 public:
  using clock = std::chrono::steady_clock;

  host_event()
      : state_(std::make_shared<state>()) {}

  //! True once the most recent record point has been reached.
  bool query() const {
    std::lock_guard lock(state_->mutex);
    return state_->completed >= state_->recorded;
  }

  //! Blocks until the most recent record point is reached; rethrows the failure, if any, of the
  //! stream it was recorded on at that point.
  void synchronize() const {
    std::exception_ptr failure;
    {
      std::unique_lock lock(state_->mutex);
      const std::uint64_t target = state_->recorded;
      state_->reached.wait(lock, [&] { return state_->completed >= target; });
      failure = state_->failure;
    }
    if (failure)
      std::rethrow_exception(failure);
  }

  //! When the most recent record point was reached (valid once `query()` is true).
  clock::time_point completed_at() const {
    std::lock_guard lock(state_->mutex);
    return state_->completed_at;
  }

  //! Milliseconds between two reached events, as `cudaEventElapsedTime`.
  static double elapsed_ms(const host_event& start, const host_event& end) {
    return std::chrono::duration<double, std::milli>(end.completed_at() - start.completed_at())
        .count();
  }

 private:
  friend class host_stream;

  struct state {
    std::mutex mutex;
    std::condition_variable reached;
    std::uint64_t recorded = 0;  // record calls so far
    std::uint64_t completed = 0; // record points reached so far
    clock::time_point completed_at{};
    std::exception_ptr failure;
  };

  std::shared_ptr<state> state_;
};

//! An ordered host work queue with CUDA stream semantics, backed by one worker thread.
//! Not copyable or movable (its thread refers to it). Thread-safe: any thread may submit.
class host_stream {
 public:
  using event_type = host_event;

  explicit host_stream(std::string name = "host_stream")
      : name_(std::move(name))
      , worker_([this] { run(); }) {}

  host_stream(const host_stream&) = delete;
  host_stream& operator=(const host_stream&) = delete;

  //! Drains the queue and joins the worker. Never throws: a failure nobody synchronized on is
  //! reported on stderr rather than lost.
  ~host_stream() {
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

  //! Enqueues `task` to run after everything submitted before it.
  void submit(unique_task task) { push(std::move(task)); }

  //! Enqueues `task(failure)`, which runs even on a failed stream: `failure` is the stream's
  //! pending failure (null when healthy), taken from the stream while the task runs; what the
  //! task returns (or throws) becomes the failure afterwards (return `failure` to keep it, null
  //! to clear it). Collectives use it to keep their place in a group's sequence, or to tell
  //! their peers about a failure, when the work before them failed.
  template <class F>
  requires std::is_invocable_r_v<std::exception_ptr, F&, std::exception_ptr>
  void submit_always(F task) {
    push(unique_task([this, task = std::move(task)]() mutable {
           std::exception_ptr after;
           try {
             after = task(take_failure());
           } catch (...) {
             after = std::current_exception();
           }
           if (after)
             fail(std::move(after));
         }),
         /*is_marker=*/true);
  }

  //! A new event at the current end of the queue.
  host_event record() {
    host_event e;
    record(e);
    return e;
  }

  //! Moves `e` to the current end of the queue (earlier waits on `e` keep their point).
  void record(host_event& e) {
    std::uint64_t point = 0;
    {
      std::lock_guard lock(e.state_->mutex);
      point = ++e.state_->recorded;
    }
    push(unique_task([this, state = e.state_, point] {
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
         }),
         /*is_marker=*/true);
  }

  //! Makes every later task wait until `e`'s current record point is reached. If the producer
  //! failed before that point, this stream takes on the failure.
  void wait(const host_event& e) {
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

  //! Blocks until every task submitted so far has finished, then rethrows the first failure
  //! (clearing it, so the stream is usable again).
  void synchronize() {
    std::unique_lock lock(mutex_);
    drained_.wait(lock, [&] { return pending_ == 0; });
    if (failure_) {
      std::exception_ptr failure = std::exchange(failure_, nullptr);
      lock.unlock();
      std::rethrow_exception(failure);
    }
  }

  //! True when every submitted task has finished.
  bool query() const {
    std::lock_guard lock(mutex_);
    return pending_ == 0;
  }

  const std::string& name() const noexcept { return name_; }

 private:
  struct entry {
    unique_task task;
    bool is_marker; // events and waits run even on a failed stream, so nothing deadlocks
  };

  void push(unique_task task, bool is_marker = false) {
    {
      std::lock_guard lock(mutex_);
      queue_.push_back({std::move(task), is_marker});
      ++pending_;
    }
    work_ready_.notify_one();
  }

  std::exception_ptr current_failure() const {
    std::lock_guard lock(mutex_);
    return failure_;
  }

  std::exception_ptr take_failure() {
    std::lock_guard lock(mutex_);
    return std::exchange(failure_, nullptr);
  }

  void fail(std::exception_ptr failure) {
    std::lock_guard lock(mutex_);
    if (!failure_)
      failure_ = std::move(failure);
  }

  void run() {
    std::unique_lock lock(mutex_);
    for (;;) {
      work_ready_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty())
        return; // stopping and drained
      entry next = std::move(queue_.front());
      queue_.pop_front();
      const bool skip = failure_ && !next.is_marker;
      lock.unlock();
      if (!skip) {
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

  std::string name_;
  mutable std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable drained_;
  std::deque<entry> queue_;
  std::size_t pending_ = 0;
  bool stopping_ = false;
  std::exception_ptr failure_; // first failure since the last synchronize(); under mutex_
  std::thread worker_;         // last: starts after every other member is constructed
};

static_assert(stream<host_stream> && host_executor<host_stream>);

WEAVE_NAMESPACE_END
