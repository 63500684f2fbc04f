// chunk_pipeline on host streams: every chunk's stages run in dependency order on the right
// stream, each stream runs its queue in the documented order, results equal a direct
// (unstreamed) evaluation for every chunk count, and a failing stage surfaces.
#include <doctest/doctest.h>

#include <weave/exec/host_stream.hpp>
#include <weave/overlap/pipeline.hpp>

#include <chrono>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

using weave::pipeline_stage;

struct log_entry {
  pipeline_stage stage;
  int chunk;
  const weave::host_stream* stream;
};

// Each stage transforms a per-chunk value; the direct evaluation is f(c) below.
struct recording_stages {
  weave::host_stream* compute;
  weave::host_stream* comm;
  std::vector<long> value;
  std::vector<long> output;
  std::mutex mutex;
  std::vector<log_entry> log;
  std::mt19937 rng{3};
  pipeline_stage fail_at = pipeline_stage::prepare;
  int fail_chunk = -1;

  explicit recording_stages(int chunks)
      : value(chunks, 0)
      , output(chunks, 0) {}

  void enqueue(pipeline_stage s, int c, weave::host_stream& stream) {
    const auto pause = std::chrono::microseconds(rng() % 300); // random interleavings
    stream.submit([this, s, c, pause, &stream] {
      std::this_thread::sleep_for(pause);
      if (s == fail_at && c == fail_chunk)
        throw std::runtime_error("stage failed");
      auto& v = value[static_cast<std::size_t>(c)];
      switch (s) {
      case pipeline_stage::prepare:
        v = c + 1;
        break;
      case pipeline_stage::dispatch:
        v *= 10;
        break;
      case pipeline_stage::experts:
        v += 7;
        break;
      case pipeline_stage::combine:
        v *= 3;
        break;
      case pipeline_stage::finish:
        output[static_cast<std::size_t>(c)] = v - 1;
        break;
      }
      std::lock_guard lock(mutex);
      log.push_back({s, c, &stream});
    });
  }
};

long direct(int c) {
  return ((c + 1) * 10 + 7) * 3 - 1;
}

} // namespace

TEST_CASE("chunk_pipeline runs every stage once, in dependency order, on the right stream") {
  for (int chunks : {1, 2, 3, 4, 7}) {
    CAPTURE(chunks);
    weave::host_stream compute("compute"), comm("comm");
    weave::chunk_pipeline<weave::host_stream> pipeline(chunks);
    recording_stages stages(chunks);
    for (int repeat = 0; repeat < 2; ++repeat) { // events are re-recorded on reuse
      pipeline.run(compute, comm, stages);
      compute.synchronize();
      comm.synchronize();
      for (int c = 0; c < chunks; ++c)
        REQUIRE(stages.output[static_cast<std::size_t>(c)] == direct(c));
    }
    REQUIRE(stages.log.size() == static_cast<std::size_t>(2 * 5 * chunks));
    // Within one run: each chunk's stages in order, each on its stream.
    for (int c = 0; c < chunks; ++c) {
      int next = 0;
      for (std::size_t i = stages.log.size() / 2; i < stages.log.size(); ++i) {
        const auto& e = stages.log[i];
        if (e.chunk != c)
          continue;
        CHECK(static_cast<int>(e.stage) == next++);
        CHECK(e.stream == (weave::on_comm_stream(e.stage) ? &comm : &compute));
      }
      CHECK(next == 5);
    }
    // Stage timestamps agree with the dependencies.
    for (int c = 0; c < chunks; ++c)
      for (int s = 1; s < 5; ++s) {
        const auto before = static_cast<pipeline_stage>(s - 1),
                   after = static_cast<pipeline_stage>(s);
        CHECK(pipeline.ended(before, c).completed_at() <= pipeline.began(after, c).completed_at());
      }
  }
}

TEST_CASE("chunk_pipeline keeps the documented queue order on each stream") {
  const int chunks = 4;
  weave::host_stream compute("compute"), comm("comm");
  weave::chunk_pipeline<weave::host_stream> pipeline(chunks);
  recording_stages stages(chunks);
  pipeline.run(compute, comm, stages);
  compute.synchronize();
  comm.synchronize();
  std::string compute_order, comm_order;
  for (const auto& e : stages.log) {
    std::string& order = e.stream == &comm ? comm_order : compute_order;
    order += weave::to_string(e.stage)[0];
    order += std::to_string(e.chunk);
    order += ' ';
  }
  // p = prepare, e = experts, f = finish; d = dispatch, c = combine.
  CHECK(compute_order == "p0 p1 e0 p2 e1 f0 p3 e2 f1 e3 f2 f3 ");
  CHECK(comm_order == "d0 d1 c0 d2 c1 d3 c2 c3 ");
}

TEST_CASE("a failing stage fails both streams instead of hanging") {
  weave::host_stream compute("compute"), comm("comm");
  weave::chunk_pipeline<weave::host_stream> pipeline(3);
  recording_stages stages(3);
  stages.fail_at = pipeline_stage::dispatch;
  stages.fail_chunk = 1;
  pipeline.run(compute, comm, stages);
  CHECK_THROWS_WITH_AS(comm.synchronize(), "stage failed", std::runtime_error);
  CHECK_THROWS_WITH_AS(compute.synchronize(), "stage failed", std::runtime_error);
  // compute's queue is p0 p1 e0 p2 e1 f0 ...: e1 waits on the failed d1, so no finish ran.
  for (long out : stages.output)
    CHECK(out == 0);
}

TEST_CASE("chunk_pipeline rejects bad arguments") {
  CHECK_THROWS_AS(weave::chunk_pipeline<weave::host_stream>(0), weave::error);
  weave::host_stream s;
  weave::chunk_pipeline<weave::host_stream> p(2);
  recording_stages stages(2);
  CHECK_THROWS_AS(p.run(s, s, stages), weave::error);
  CHECK_THROWS_AS((void)p.began(pipeline_stage::prepare, 2), weave::error);
}
