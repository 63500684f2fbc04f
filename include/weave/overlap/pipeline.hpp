//! \file
//! `chunk_pipeline`: the stream/event choreography of a chunked MoE layer (Tutel's overlap
//! degree), independent of what each stage does.
//!
//! A layer's tokens are split into C chunks; each chunk passes five stages:
//!   prepare  (compute stream: plan the chunk, gather its rows into the send layout)
//!   dispatch (comm stream: all-to-all to the expert devices)
//!   experts  (compute stream: scatter, run the experts, merge locally)
//!   combine  (comm stream: all-to-all back)
//!   finish   (compute stream: merge the returned rows into the output)
//! The pipeline enqueues them so that chunk c+1's dispatch overlaps chunk c's experts and chunk
//! c's combine overlaps chunk c+1's experts, each stage waiting on events of the stages it
//! depends on. Queue orders (dependencies always point backwards, so it cannot deadlock):
//!   compute: P0 P1 X0 M- P2 X1 M0 ... X(C-1) M(C-2) M(C-1)
//!   comm:    D0 D1 B0 D2 B1 ... D(C-1) B(C-2) B(C-1)
//! With C = 1 this is the unpipelined layer, run by the same code.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/exec/stream.hpp"

#include <cstddef>
#include <vector>

WEAVE_NAMESPACE_BEGIN

//! The five stages of a chunk, in dependency order.
enum class pipeline_stage : int { prepare = 0, dispatch = 1, experts = 2, combine = 3, finish = 4 };

inline constexpr int pipeline_stage_count = 5;

constexpr const char* to_string(pipeline_stage s) noexcept {
  switch (s) {
  case pipeline_stage::prepare:
    return "prepare";
  case pipeline_stage::dispatch:
    return "dispatch";
  case pipeline_stage::experts:
    return "experts";
  case pipeline_stage::combine:
    return "combine";
  case pipeline_stage::finish:
    return "finish";
  }
  return "?";
}

//! True for the stages that run on the communication stream.
constexpr bool on_comm_stream(pipeline_stage s) noexcept {
  return s == pipeline_stage::dispatch || s == pipeline_stage::combine;
}

//! What a stage set must provide: `enqueue(stage, chunk, stream)` puts the stage's work for
//! `chunk` on `stream` (the compute or the comm stream, by `on_comm_stream`).
template <class Stages, class Stream>
concept pipeline_stages = requires(Stages& s, pipeline_stage st, int chunk, Stream& stream) {
  s.enqueue(st, chunk, stream);
};

//! Runs chunked stage sets on a (compute, comm) stream pair. Events are created once, at
//! construction, and re-recorded on every run: `run` allocates nothing.
template <stream Stream>
class chunk_pipeline {
 public:
  using event_type = typename Stream::event_type;

  //! A pipeline of `chunks` >= 1 chunks.
  explicit chunk_pipeline(int chunks)
      : chunks_(chunks) {
    WEAVE_EXPECT(chunks >= 1, errc::invalid_argument, "pipeline chunks = ", chunks,
                 " (must be >= 1)");
    begin_.reserve(static_cast<std::size_t>(chunks) * pipeline_stage_count);
    end_.reserve(static_cast<std::size_t>(chunks) * pipeline_stage_count);
    for (int i = 0; i < chunks * pipeline_stage_count; ++i) {
      begin_.emplace_back(make_event());
      end_.emplace_back(make_event());
    }
  }

  int chunks() const noexcept { return chunks_; }

  //! Marks the stages issued from now on as captured into a CUDA graph, or not: the events of
  //! a captured run carry no times, so timings read none (`measure` returns zeros).
  void set_captured(bool captured) noexcept { captured_ = captured; }
  //! True when the last run was issued while its streams were being captured.
  bool captured() const noexcept { return captured_; }

  //! Enqueues every stage of every chunk; returns once enqueued (work runs on the streams).
  //! `compute` and `comm` must be different streams.
  template <class Stages>
  requires pipeline_stages<Stages, Stream>
  void run(Stream& compute, Stream& comm, Stages& stages) {
    const int n = chunks_;
    WEAVE_EXPECT(&compute != &comm, errc::invalid_argument,
                 "the compute and comm streams must differ");
    auto step_compute = [&](pipeline_stage s, int c) { launch(s, c, compute, stages); };
    auto step_comm = [&](pipeline_stage s, int c) { launch(s, c, comm, stages); };
    // Interleave exactly as the queue orders in the file comment; `launch` adds the waits.
    step_compute(pipeline_stage::prepare, 0);
    step_comm(pipeline_stage::dispatch, 0);
    for (int c = 0; c < n; ++c) {
      if (c + 1 < n) {
        step_compute(pipeline_stage::prepare, c + 1);
        step_comm(pipeline_stage::dispatch, c + 1);
      }
      step_compute(pipeline_stage::experts, c);
      step_comm(pipeline_stage::combine, c);
      if (c >= 1)
        step_compute(pipeline_stage::finish, c - 1);
    }
    step_compute(pipeline_stage::finish, n - 1);
  }

  //! Enqueues one stage of one chunk on `own`: waits for the stage it depends on (the one
  //! before it in the chunk, on the other stream), records the stage's begin event, lets
  //! `enqueue(own)` put the stage's work on `own`, and records its end event. `run` is these
  //! calls in the queue orders of the file comment; callers that interleave other work (the
  //! caller's own expert compute, another micro-batch) issue them one by one.
  template <class Enqueue>
  void stage(pipeline_stage s, int c, Stream& own, Enqueue&& enqueue) {
    begin_stage(s, c, own);
    enqueue(own);
    end_stage(s, c, own);
  }

  //! The first half of `stage`: the dependency wait and the begin event. Work enqueued on `own`
  //! until `end_stage` belongs to the stage (and to its timing).
  void begin_stage(pipeline_stage s, int c, Stream& own) {
    if (has_dependency(s))
      own.wait(end_[index(dependency(s), c)]);
    own.record(begin_[index(s, c)]);
  }

  //! The second half of `stage`: records the end event the next stage of the chunk waits for.
  void end_stage(pipeline_stage s, int c, Stream& own) { own.record(end_[index(s, c)]); }

  //! True for the stages that wait for another stage of their chunk (all but prepare).
  static constexpr bool has_dependency(pipeline_stage s) noexcept {
    return s != pipeline_stage::prepare;
  }
  //! The stage `s` waits for (the one before it in the chunk).
  static constexpr pipeline_stage dependency(pipeline_stage s) noexcept {
    return static_cast<pipeline_stage>(static_cast<int>(s) - 1);
  }

  //! The event recorded just before / after `stage` of `chunk` ran in the last run, for
  //! timing (host events carry timestamps; CUDA events need timing enabled at construction).
  const event_type& began(pipeline_stage stage, int chunk) const {
    return begin_[index(stage, chunk)];
  }
  const event_type& ended(pipeline_stage stage, int chunk) const {
    return end_[index(stage, chunk)];
  }

 private:
  static event_type make_event() {
    if constexpr (requires { event_type(0u); })
      return event_type(0u); // CUDA: cudaEventDefault, so stages can be timed
    else
      return event_type();
  }

  std::size_t index(pipeline_stage stage, int chunk) const {
    WEAVE_EXPECT(chunk >= 0 && chunk < chunks_, errc::out_of_range, "chunk ", chunk, " of ",
                 chunks_);
    return static_cast<std::size_t>(chunk) * pipeline_stage_count + static_cast<std::size_t>(stage);
  }

  template <class Stages>
  void launch(pipeline_stage s, int c, Stream& own, Stages& stages) {
    stage(s, c, own, [&](Stream& st) { stages.enqueue(s, c, st); });
  }

  int chunks_;
  bool captured_ = false;
  std::vector<event_type> begin_;
  std::vector<event_type> end_;
};

WEAVE_NAMESPACE_END
