//! \file
//! `host_stream` and `host_event`: CUDA stream semantics on a host worker thread.
//!
//! The host path of every weave algorithm runs on these. Tasks run one at a time in FIFO order
//! on the stream's own thread. A task that throws puts the stream in a failed state (as a CUDA
//! error is sticky): later tasks are skipped (but for `submit_always` tasks, which see the
//! failure), events recorded later complete carrying the failure, a stream waiting on such an
//! event fails too, and `synchronize()` rethrows the first failure and clears it. Nothing fails
//! silently and nothing deadlocks on a failed producer.
//!
//! `begin_capture` / `end_capture` check CUDA's stream-capture rules (`host_capture.hpp`): what
//! a CUDA graph capture of the same calls would refuse throws here.
//!
//! The queue and its worker thread are defined in `detail/host_stream_queue.hpp`, the capture
//! checks in `detail/host_stream_capture.hpp` (both included at the end of this header).
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/exec/host_capture.hpp"
#include "weave/exec/stream.hpp"
#include "weave/exec/unique_task.hpp"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

WEAVE_NAMESPACE_BEGIN

class host_stream;

//! A point in a `host_stream`. Copies share the point (like a `cudaEvent_t` handle).
//! A default-constructed or never-recorded event counts as complete, as in CUDA.
class host_event {
 public:
  using clock = std::chrono::steady_clock;

  host_event()
      : state_(std::make_shared<state>()) {}

  //! True once the most recent record point has been reached. Throws `errc::invalid_state` for
  //! an event last recorded in a capture (CUDA: `cudaErrorCapturedEvent`).
  bool query() const {
    check_not_captured("query");
    std::lock_guard lock(state_->mutex);
    return state_->completed >= state_->recorded;
  }

  //! Blocks until the most recent record point is reached; rethrows the failure, if any, of the
  //! stream it was recorded on at that point. Refused for a captured event, as `query`.
  void synchronize() const {
    check_not_captured("synchronize");
    if (std::exception_ptr failure = outcome())
      std::rethrow_exception(failure);
  }

  //! Blocks until the most recent record point is reached and returns the failure it carries
  //! (null: none). How a task on a host stream waits for another stream's point (no capture rule
  //! applies: CUDA has no such wait).
  std::exception_ptr outcome() const {
    std::unique_lock lock(state_->mutex);
    const std::uint64_t target = state_->recorded;
    state_->reached.wait(lock, [&] { return state_->completed >= target; });
    return state_->failure;
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
    // The capture the last record was made in (null: none) and what it depended on there;
    // guarded by `host_capture::lock()`.
    std::shared_ptr<detail::host_capture> capture;
    detail::host_capture_clock depends;
  };

  // Refuses `call` for an event last recorded in a capture (`detail/host_stream_capture.hpp`).
  void check_not_captured(const char* call) const;

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
  ~host_stream();

  //! Enqueues `task` to run after everything submitted before it.
  void submit(unique_task task) {
    count_captured_work();
    push(std::move(task));
  }

  //! Enqueues `task(failure)`, which runs even on a failed stream: `failure` is the stream's
  //! pending failure (null when healthy), taken from the stream while the task runs; what the
  //! task returns (or throws) becomes the failure afterwards (return `failure` to keep it, null
  //! to clear it). Collectives use it to keep their place in a group's sequence, or to tell
  //! their peers about a failure, when the work before them failed.
  template <class F>
  requires std::is_invocable_r_v<std::exception_ptr, F&, std::exception_ptr>
  void submit_always(F task) {
    count_captured_work();
    push(unique_task([this, task = std::move(task)]() mutable { run_always(task); }),
         /*is_marker=*/true);
  }

  //! Runs `task` now, on the calling thread, when the stream is idle (nothing queued or running)
  //! and not capturing; otherwise enqueues it as `submit` does. Returns whether it ran here.
  //! For short tasks whose hand-off to the worker (two thread wake-ups, 5-40 us) would cost more
  //! than the task. The stream's order holds: later tasks queue behind it, and the worker starts
  //! none until it returns. A task that throws fails the stream (the caller does not see it),
  //! and on a failed stream the task is skipped, as on the worker.
  bool run_inline_or_submit(unique_task task);

  //! `submit_always` with `run_inline_or_submit`'s choice: `task(failure)` runs now on the
  //! calling thread when the stream is idle, not capturing, and `choose()` agrees. `choose` is
  //! asked only once everything before the task has run, so it may read what that work wrote
  //! (the counts a queued exchange fills, for instance).
  template <class F, class Choose = bool (*)()>
  requires std::is_invocable_r_v<std::exception_ptr, F&, std::exception_ptr> &&
      std::is_invocable_r_v<bool, Choose&>
  bool run_inline_or_submit_always(
      F task, Choose choose = [] { return true; });

  //! The calling thread's hold on an idle stream (`claim_if_idle`); empty when the stream was
  //! busy or capturing. The claim that took the stream ends the hold (the worker may start
  //! queued work) when destroyed; one that joined this thread's hold leaves it.
  class inline_claim {
   public:
    inline_claim() = default;
    inline_claim(inline_claim&& other) noexcept
        : stream_(std::exchange(other.stream_, nullptr))
        , took_(other.took_) {}
    inline_claim& operator=(inline_claim&&) = delete;
    ~inline_claim() {
      if (stream_ != nullptr && took_)
        stream_->end_claim();
    }
    //! Whether the stream is held.
    explicit operator bool() const noexcept { return stream_ != nullptr; }
    //! Held, and every step issued under it so far ran here: nothing is queued on the stream
    //! (the worker starts nothing while it is held), so none of those steps is left to wait for.
    bool all_ran_here() const noexcept {
      return stream_ != nullptr && stream_->queued_.load(std::memory_order_acquire) == 0;
    }

   private:
    friend class host_stream;
    inline_claim(host_stream* s, bool took) noexcept
        : stream_(s)
        , took_(took) {}
    host_stream* stream_ = nullptr;
    bool took_ = false; // this claim took the stream (else it joined this thread's hold)
  };

  //! Holds the stream for the calling thread when it is idle (as `run_inline_or_submit` does
  //! for one task): until the claim ends, this thread's `run_inline_or_submit` calls on the
  //! stream run at once without claiming it again each (an uncontended lock and unlock less
  //! per step). The stream's order holds: once any task is queued (another thread's, or a step
  //! submitted), this thread's later steps queue too, and the worker starts nothing before the
  //! claim ends. Synchronizing the stream while holding it is `errc::invalid_state` (it would
  //! wait for itself). Within this thread's own hold it joins it (a layer called inside a
  //! caller's claim: its `all_ran_here` still says whether anything was queued). Empty (every
  //! step claims or queues as usual) when the stream is busy or capturing.
  inline_claim claim_if_idle();

  //! A new event at the current end of the queue.
  host_event record() {
    host_event e;
    record(e);
    return e;
  }

  //! Moves `e` to the current end of the queue (earlier waits on `e` keep their point).
  void record(host_event& e);

  //! Makes every later task wait until `e`'s current record point is reached. If the producer
  //! failed before that point, this stream takes on the failure.
  void wait(const host_event& e);

  //! Blocks until every task submitted so far has finished, then rethrows the first failure
  //! (clearing it, so the stream is usable again).
  void synchronize();

  //! True when every submitted task has finished.
  bool query() const {
    check_not_capturing("query");
    std::lock_guard lock(mutex_);
    return pending_ == 0;
  }

  //! `query()` for a layer that records an event only when work is left: true when nothing is
  //! queued or running and no capture is on (false, not an error, while capturing).
  bool idle() const noexcept {
    if (capturing_)
      return false;
    std::lock_guard lock(mutex_);
    return pending_ == 0;
  }

  //! True when the calling thread is running one of this stream's tasks (on the worker, or
  //! inline): work it enqueues on the stream from there is at the stream's current point, so
  //! `host_space` runs it at once rather than behind the tasks queued since.
  bool runs_here() const noexcept { return running_ == this; }
  //! True within the calling thread's `claim_if_idle` of this stream, with nothing queued since
  //! it began: a step run now is in order (`run_inline_or_submit` runs it here).
  bool claimed_here() const noexcept { return held_here(); }

  const std::string& name() const noexcept { return name_; }

  //! Begins checking CUDA's stream-capture rules on this stream and the streams that join it
  //! (`cudaStreamBeginCapture` in global mode; see `host_capture.hpp`). Work still runs.
  void begin_capture();

  //! Ends the capture begun on this stream; throws `errc::invalid_state` if it was invalidated,
  //! if a stream that joined it was not joined back, or if this stream did not begin it. Every
  //! stream of the capture leaves it.
  void end_capture();

  //! True while this stream belongs to a capture (`cudaStreamIsCapturing`).
  bool capturing() const noexcept { return capturing_; }

  //! Refuses `what` (a copy from pageable memory, an allocation) while this stream captures,
  //! as the CUDA runtime does: throws `errc::invalid_state` naming `cuda_error`.
  void refuse_while_capturing(const char* cuda_error, const std::string& what);

 private:
  // Marks the calling thread as running a task of `s` (see `runs_here`) while it lives.
  class running_guard {
   public:
    explicit running_guard(const host_stream* s) noexcept
        : previous_(std::exchange(running_, s)) {}
    running_guard(const running_guard&) = delete;
    running_guard& operator=(const running_guard&) = delete;
    ~running_guard() { running_ = previous_; }

   private:
    const host_stream* previous_;
  };
  static inline thread_local const host_stream* running_ = nullptr;

  struct entry {
    unique_task task;
    bool is_marker; // events and waits run even on a failed stream, so nothing deadlocks
  };

  // The capture rules (detail/host_stream_capture.hpp).
  void count_captured_work();
  void check_not_capturing(const char* call) const;
  void check_wait(const host_event& e);

  // The queue, its worker and the runs on a calling thread (detail/host_stream_queue.hpp).
  template <class F>
  void run_always(F& task);
  bool try_begin_inline();
  void end_inline();

  // Inside this thread's claim, with nothing queued since it began (`claim_if_idle`).
  bool held_here() const noexcept {
    return owner_.load(std::memory_order_relaxed) == std::this_thread::get_id() &&
           queued_.load(std::memory_order_acquire) == 0 && !capturing_;
  }
  void end_claim() noexcept {
    owner_.store(std::thread::id(), std::memory_order_relaxed);
    end_inline();
  }

  void push(unique_task task, bool is_marker = false);
  std::exception_ptr current_failure() const;
  std::exception_ptr take_failure();
  void fail(std::exception_ptr failure);
  void run();

  std::string name_;
  mutable std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable drained_;
  std::deque<entry> queue_;
  std::size_t pending_ = 0;
  bool stopping_ = false;
  bool inline_running_ = false;          // a task runs on a caller's thread (see try_begin_inline)
  std::atomic<std::size_t> queued_{0};   // queue_.size() (written under mutex_)
  std::atomic<std::thread::id> owner_{}; // the thread holding a `claim_if_idle`, if any
  std::exception_ptr failure_;           // first failure since the last synchronize(); under mutex_
  std::atomic<bool> has_failure_{false}; // failure_ is set (written under mutex_)
  // The capture this stream belongs to (under `host_capture::lock()`), and whether it has one.
  std::shared_ptr<detail::host_capture> capture_;
  std::atomic<bool> capturing_{false};
  std::thread worker_; // last: starts after every other member is constructed
};

static_assert(stream<host_stream> && host_executor<host_stream>);

WEAVE_NAMESPACE_END

#include "weave/exec/detail/host_stream_capture.hpp" // the capture rules, out of the class
#include "weave/exec/detail/host_stream_queue.hpp"   // the queue and its worker, out of the class
