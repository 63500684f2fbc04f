//! \file
//! `schedule_executor`: runs a schedule for real on a compute and a communication stream per
//! rank, and records when every task began and ended.
//!
//! Generic over what an op does: the caller passes two callables, `compute(rank, op, task)` and
//! `comm(rank, op, task)`, invoked on the rank's compute and communication stream with the op and
//! the task (its chunk and batch fraction). They run concurrently on the streams' threads, so
//! they must be safe to call from several threads at once; a comm callable implementing a
//! collective must not leave its peers blocked when it throws. Tasks are issued in schedule
//! order; a task on one stream waits (through events) for its dependencies on the other, and
//! same-stream dependencies hold by stream order. All streams start together from a gate released
//! after issue, so issue cost does not show up in the measured timeline.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/exec/stream.hpp"
#include "weave/plan/graph.hpp"
#include "weave/plan/schedule.hpp"
#include "weave/plan/timeline.hpp"

#include <chrono>
#include <cstddef>
#include <exception>
#include <latch>
#include <limits>
#include <utility>
#include <vector>

WEAVE_NAMESPACE_BEGIN
namespace plan {

//! The two streams of one rank (borrowed).
template <class S>
struct rank_streams {
  S* compute = nullptr;
  S* comm = nullptr;
};

//! Executes one schedule, as often as asked, on borrowed streams. The graph, schedule and
//! streams must outlive it. Events are allocated once, at construction.
template <host_executor S>
class schedule_executor {
 public:
  using clock = std::chrono::steady_clock;

  //! Throws `errc::invalid_argument` for no ranks or a null stream, `errc::size_mismatch` when
  //! the schedule was not made from `g`.
  schedule_executor(const graph& g, const schedule& s, std::vector<rank_streams<S>> streams)
      : graph_(&g)
      , schedule_(&s)
      , streams_(std::move(streams))
      , measured_(streams_.size(), s.size()) {
    WEAVE_EXPECT(!streams_.empty(), errc::invalid_argument, "no ranks to execute on");
    for (std::size_t r = 0; r < streams_.size(); ++r)
      WEAVE_EXPECT(streams_[r].compute && streams_[r].comm, errc::invalid_argument, "rank ", r,
                   " has a null stream");
    WEAVE_EXPECT(s.num_ops() == g.size(), errc::size_mismatch, "schedule of ", s.num_ops(),
                 " ops for a graph of ", g.size());
    // Only tasks another stream waits for need an event; of several dependencies on one other
    // stream the latest suffices, since a stream's events complete in order.
    constexpr std::size_t none = std::numeric_limits<std::size_t>::max();
    waits_.assign(s.size(), none);
    std::vector<char> needed(s.size(), 0);
    for (std::size_t i = 0; i < s.size(); ++i) {
      std::size_t latest = none;
      for (std::size_t d : s[i].deps)
        if (s[d].stream != s[i].stream && (latest == none || d > latest))
          latest = d;
      waits_[i] = latest;
      if (latest != none)
        needed[latest] = 1;
    }
    event_of_.assign(s.size(), none);
    std::size_t count = 0;
    for (std::size_t i = 0; i < s.size(); ++i)
      if (needed[i])
        event_of_[i] = count++;
    events_.resize(streams_.size() * count);
    events_per_rank_ = count;
  }

  std::size_t ranks() const noexcept { return streams_.size(); }

  //! Runs the schedule once and blocks until every stream is drained. Returns the measured
  //! timeline (microseconds from the common start); rethrows the first failure of any stream.
  template <class Compute, class Comm>
  const timeline& run(Compute&& compute, Comm&& comm) {
    context<std::remove_reference_t<Compute>, std::remove_reference_t<Comm>> ctx{
        this, &compute, &comm, {}, std::latch(1)};
    constexpr std::size_t none = std::numeric_limits<std::size_t>::max();
    for (auto& rs : streams_) {
      rs.compute->submit([&ctx] { ctx.gate.wait(); });
      rs.comm->submit([&ctx] { ctx.gate.wait(); });
    }
    // Opens the gate even if issuing throws, so the streams drain instead of blocking forever.
    struct gate_guard {
      std::latch* gate;
      bool open = false;
      ~gate_guard() {
        if (!open)
          gate->count_down();
      }
    } guard{&ctx.gate};
    const schedule& s = *schedule_;
    for (std::size_t r = 0; r < streams_.size(); ++r) {
      std::size_t waited[2] = {none, none}; // latest event waited for, per producing stream
      for (std::size_t i = 0; i < s.size(); ++i) {
        const task& k = s[i];
        S& target = stream(r, k.stream);
        const std::size_t w = waits_[i];
        if (w != none) {
          std::size_t& last = waited[static_cast<std::size_t>(s[w].stream)];
          if (last == none || w > last) {
            target.wait(events_[r * events_per_rank_ + event_of_[w]]);
            last = w;
          }
        }
        auto* c = &ctx;
        target.submit([c, r, i] { c->run_task(r, i); });
        if (event_of_[i] != none)
          target.record(events_[r * events_per_rank_ + event_of_[i]]);
      }
    }
    ctx.start = clock::now();
    guard.open = true;
    ctx.gate.count_down();
    std::exception_ptr failure;
    for (auto& rs : streams_)
      for (S* st : {rs.compute, rs.comm}) {
        try {
          st->synchronize();
        } catch (...) {
          if (!failure)
            failure = std::current_exception();
        }
      }
    if (failure)
      std::rethrow_exception(failure);
    return measured_;
  }

  //! The timeline of the last `run`.
  const timeline& measured() const noexcept { return measured_; }

 private:
  template <class Compute, class Comm>
  struct context {
    schedule_executor* self;
    Compute* compute;
    Comm* comm;
    clock::time_point start; // written before the gate opens, read after
    std::latch gate;

    void run_task(std::size_t r, std::size_t i) {
      const task& k = (*self->schedule_)[i];
      const op& o = self->graph_->ops()[k.op];
      const auto begin = clock::now();
      if (k.stream == stream_kind::comm)
        (*comm)(r, o, k);
      else
        (*compute)(r, o, k);
      const auto end = clock::now();
      self->measured_.at(r, i) = {micros(begin - start), micros(end - start)};
    }
  };

  static double micros(clock::duration d) {
    return std::chrono::duration<double, std::micro>(d).count();
  }

  S& stream(std::size_t r, stream_kind k) {
    return k == stream_kind::comm ? *streams_[r].comm : *streams_[r].compute;
  }

  const graph* graph_;
  const schedule* schedule_;
  std::vector<rank_streams<S>> streams_;
  timeline measured_;
  std::vector<std::size_t> waits_;    // per task: the other-stream dependency to wait for
  std::vector<std::size_t> event_of_; // per task: its event slot, if another stream waits for it
  std::vector<typename S::event_type> events_; // [rank][slot]
  std::size_t events_per_rank_ = 0;
};

} // namespace plan
WEAVE_NAMESPACE_END
