// Cost of running work through a host_stream, beside calling it directly and beside a
// std::thread hand-off through a promise (the simplest alternative a trainer might write).
#include <benchmark/benchmark.h>

#include <weave/exec/host_stream.hpp>

#include <future>
#include <thread>

namespace {

void direct_call(benchmark::State& state) {
  int value = 0;
  for (auto _ : state) {
    for (int i = 0; i < state.range(0); ++i)
      benchmark::DoNotOptimize(value += i);
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

void host_stream_submit_then_sync(benchmark::State& state) {
  weave::host_stream s;
  int value = 0;
  for (auto _ : state) {
    for (int i = 0; i < state.range(0); ++i)
      s.submit([&value, i] { benchmark::DoNotOptimize(value += i); });
    s.synchronize();
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

void thread_per_batch_baseline(benchmark::State& state) {
  int value = 0;
  for (auto _ : state) {
    std::thread worker([&] {
      for (int i = 0; i < state.range(0); ++i)
        benchmark::DoNotOptimize(value += i);
    });
    worker.join();
  }
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

void host_stream_event_ping_pong(benchmark::State& state) {
  weave::host_stream a("a"), b("b");
  weave::host_event ea, eb;
  for (auto _ : state) {
    a.record(ea);
    b.wait(ea);
    b.record(eb);
    a.wait(eb);
    eb.synchronize();
  }
  state.SetItemsProcessed(state.iterations());
}

} // namespace

BENCHMARK(direct_call)->Arg(1)->Arg(64)->Arg(1024);
BENCHMARK(host_stream_submit_then_sync)->Arg(1)->Arg(64)->Arg(1024);
BENCHMARK(thread_per_batch_baseline)->Arg(1)->Arg(64)->Arg(1024);
BENCHMARK(host_stream_event_ping_pong);

BENCHMARK_MAIN();
