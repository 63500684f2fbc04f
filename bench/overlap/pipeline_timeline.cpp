// weave-timeline: the compute stream's idle time in a chunked dynamic-shape forward on the CUDA
// path's control flow (`emulated_gpu_space`: host code at enqueue time, the host reading each
// chunk's counts), on 4 in-process ranks joined by an emulated link, the experts a fixed sleep
// per chunk on the compute stream. Static shapes (no host read) are the floor. Built twice:
// `weave-timeline` (each chunk's counts read one step after its count exchange) and
// `weave-timeline-eager` (with WEAVE_EAGER_COUNT_READS: read at once, the order before the
// deferral), so one script runs both side by side. Prints a markdown table.
#include <weave/comm/local_world.hpp>
#include <weave/core/host_matrix.hpp>
#include <weave/exec/emulated_gpu_space.hpp>
#include <weave/overlap/moe_exchange.hpp>
#include <weave/overlap/pipeline_timing.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>

namespace {

using space = weave::emulated_gpu_space;
using exchange = weave::basic_moe_exchange<space, weave::local_communicator>;

constexpr int ranks = 4, experts = 16, k = 2, iterations = 11;
constexpr std::size_t hidden = 2048, tokens = 256;
constexpr auto expert_time = std::chrono::milliseconds(80); // per call, split over the chunks

struct result {
  double makespan_ms = 0, idle_ms = 0; // medians over the calls after the first
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

result run(bool fixed, int chunks) {
  weave::local_world world(
      ranks, {std::chrono::seconds(60), weave::emulated_link{std::chrono::milliseconds(1), 1e9}});
  std::vector<double> makespans, idles;
  world.run([&](weave::local_communicator& comm) {
    weave::moe_options o;
    o.k = k;
    o.hidden = hidden;
    o.max_tokens = tokens;
    o.chunks = chunks;
    o.static_shape = fixed;
    exchange ex(comm, weave::placement::contiguous(experts, ranks), o);
    std::vector<std::byte> ws(ex.workspace_size() + 256);
    void* base = ws.data();
    std::size_t room = ws.size();
    std::align(256, ex.workspace_size(), base, room);
    weave::host_stream compute("compute"), comm_stream("comm");
    ex.initialize(base, ex.workspace_size(), compute);
    std::mt19937 rng(static_cast<unsigned>(comm.rank()) + 1);
    weave::host_matrix<float> x(tokens, hidden), y(tokens, hidden);
    std::vector<float> w(tokens * k, 0.5f);
    std::vector<std::int32_t> ids(tokens * k);
    for (std::size_t t = 0; t < tokens; ++t) {
      ids[t * k] = static_cast<std::int32_t>(rng() % experts);
      ids[t * k + 1] =
          (ids[t * k] + 1 + static_cast<std::int32_t>(rng() % (experts - 1))) % experts;
    }
    const auto sleep = expert_time / chunks;
    for (int i = 0; i < iterations; ++i) {
      ex.forward(
          x.view(), ids, w, y.view(),
          [&](const weave::basic_expert_batch<space>& b) {
            b.stream.submit([sleep] { std::this_thread::sleep_for(sleep); });
          },
          compute, comm_stream);
      ex.synchronize(compute, comm_stream);
      if (comm.rank() == 0 && i > 0) { // the first call warms up
        const weave::pipeline_timing t = weave::measure(ex.pipeline());
        makespans.push_back(t.makespan_ms);
        idles.push_back(t.exposed_comm_ms());
      }
    }
  });
  return {median(makespans), median(idles)};
}

} // namespace

int main() {
#ifdef WEAVE_EAGER_COUNT_READS
  const char* order = "counts read at once (before)";
#else
  const char* order = "counts read one step later (now)";
#endif
  std::printf(
      "| shapes | chunks | count reads | layer ms | compute idle ms |\n|---|---|---|---|---|\n");
  for (const bool fixed : {false, true})
    for (const int chunks : {1, 4}) {
      const result r = run(fixed, chunks);
      std::printf("| %s | %d | %s | %.1f | %.1f |\n", fixed ? "static" : "dynamic", chunks,
                  fixed ? "none" : order, r.makespan_ms, r.idle_ms);
    }
  return 0;
}
