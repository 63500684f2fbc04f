// Routing layer costs beside naive references in one binary. weave's side is the library's
// own plans and moves in `host_space`: `device_capacity_filter<host_space>`,
// `device_dispatch_plan<host_space>`, `device_expert_plan<host_space>` and the row moves of
// `row_moves<host_space>` / `layout_move<host_space>`, on a `host_stream` the calling thread
// holds (`claim_if_idle`) around the timed calls, so every step runs inline on the calling
// thread (no hand-off to the stream's worker) as in a layer that computes on its own stream;
// each benchmark fails if a step was queued instead.
// - gating: top_k_gate over [T, E] fp32 logits;
// - plan: the capacity decision (position order, whole batch) + the dispatch plan (counting sort
//   by destination device, one row per (token, device)) beside a Tutel/GShard-style plan from
//   one-hot [T, E] masks and cumulative sums per rank;
// - gather: ORI -> SFD (de-duplicated per device) and SFD -> EPD beside the mask-based
//   dispatch that copies one row per (token, expert) into expert-major order, and beside a
//   memcpy of the same ORI bytes (the bandwidth ceiling).
// - layout moves at memory speed: the encode moves (ORI -> SFD, SFD -> EPD: scatters through
//   the inverse maps on the host) and the decode merges (EPD -> SFD weighted, SFD -> ORI) of f32
//   and bf16 rows, each iteration timed beside a memcpy of the same traffic (bytes read +
//   written), so `vs_memcpy` is a ratio measured side by side under the same load;
//   `copy/stream` does the same for a plain streaming copy.
// Counters: rows/s (rows written), GB/s (bytes written; for the layout moves, read + written),
// CT (copies per token).
// The default run skips the cases named "long" (hidden 4096, bigger batches); run them with
// --benchmark_filter=long.
#include <benchmark/benchmark.h>

#include <weave/core/host_matrix.hpp>
#include <weave/routing.hpp>

#include <chrono>
#include <cstddef>
#include <cstring>
#include <map>
#include <memory>
#include <new>
#include <random>
#include <string>
#include <tuple>
#include <vector>

namespace {

constexpr int devices = 8;
constexpr double capacity_factor = 1.25;

using space = weave::host_space;

// A plan's workspace: memory of host_space, 256-byte aligned, freed at scope exit.
struct workspace {
  explicit workspace(std::size_t n)
      : bytes(n)
      , data(static_cast<std::byte*>(::operator new (n == 0 ? 1 : n, std::align_val_t{256}))) {}
  ~workspace() { ::operator delete (data, std::align_val_t{256}); }
  workspace(const workspace&) = delete;
  workspace& operator=(const workspace&) = delete;
  std::size_t bytes;
  std::byte* data;
};

// A dispatch plan of weave in host_space with its workspace, initialized on `stream`.
struct dispatch_planner {
  weave::device_dispatch_plan<space> plan;
  workspace ws;
  dispatch_planner(const weave::placement& where, int k, std::size_t T, weave::host_stream& stream)
      : plan(where, k, 0, T)
      , ws(plan.workspace_size()) {
    plan.initialize(ws.data, ws.bytes, stream);
  }
};

// The receiver plan of all of `sender`'s rows, as one device holding every local slot index
// receives them (one source per destination device), with its workspace; built and checked.
struct expert_planner {
  weave::device_expert_plan<space> plan;
  workspace ws;
  expert_planner(const weave::placement& where, int k,
                 const weave::device_dispatch_plan<space>& sender, std::size_t rows,
                 weave::host_stream& stream)
      : plan(where.slots_per_device(), k, where.num_devices(), rows)
      , ws(plan.workspace_size()) {
    plan.initialize(ws.data, ws.bytes, stream);
    plan.build(stream, sender.row_routes().first(rows * static_cast<std::size_t>(k)),
               sender.send_counts().data(), sender.send_offsets().data());
    plan.check_errors(stream);
  }
  std::size_t epd_rows() const {
    return static_cast<std::size_t>(plan.expert_offsets()[plan.expert_offsets().size() - 1]);
  }
};

// Holds `stream` for the calling thread while it lives, so host_space steps run inline; reports
// an error for the benchmark if one was queued instead (or the stream was busy).
struct inline_steps {
  benchmark::State& state;
  weave::host_stream::inline_claim claim;
  inline_steps(benchmark::State& s, weave::host_stream& stream)
      : state(s)
      , claim(stream.claim_if_idle()) {}
  ~inline_steps() {
    if (!claim.all_ran_here())
      state.SkipWithError("a host_space step was queued instead of running inline");
  }
};

struct routed {
  weave::host_matrix<float> logits;
  std::vector<std::int32_t> ids;
  std::vector<float> weights;
};

// Inputs are generated once per (T, E, k) and shared by every benchmark of that shape.
const routed& inputs(std::size_t T, int E, int k) {
  static std::map<std::tuple<std::size_t, int, int>, std::unique_ptr<routed>> cache;
  auto& slot = cache[{T, E, k}];
  if (!slot) {
    slot = std::make_unique<routed>();
    slot->logits = weave::host_matrix<float>(T, static_cast<std::size_t>(E));
    std::mt19937 rng(static_cast<unsigned>(T * 131 + static_cast<std::size_t>(E) * 7 +
                                           static_cast<std::size_t>(k)));
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (float& v : slot->logits.elements())
      v = normal(rng);
    slot->ids.resize(T * static_cast<std::size_t>(k));
    slot->weights.resize(slot->ids.size());
    weave::gate_options options;
    options.k = k;
    weave::top_k_gate(slot->logits.view(), options, slot->ids, slot->weights);
  }
  return *slot;
}

const weave::host_matrix<weave::bfloat16>& tokens(std::size_t T, std::size_t hidden) {
  static std::map<std::pair<std::size_t, std::size_t>,
                  std::unique_ptr<weave::host_matrix<weave::bfloat16>>>
      cache;
  auto& slot = cache[{T, hidden}];
  if (!slot) {
    slot = std::make_unique<weave::host_matrix<weave::bfloat16>>(T, hidden);
    for (std::size_t i = 0; i < slot->elements().size(); ++i)
      slot->elements()[i] = weave::bfloat16(static_cast<float>(i % 251) / 64.0f);
  }
  return *slot;
}

// Tutel/GShard mask dispatch: per rank a one-hot [T, E] mask, a cumsum down each expert column
// for locations (offset by earlier ranks' counts), keep where location < capacity.
struct mask_plan {
  std::vector<std::int32_t> mask, cumsum;
  std::vector<std::int64_t> location, base;
  std::int64_t kept = 0;
  void build(const std::vector<std::int32_t>& ids, std::size_t T, int E, int k, std::int64_t cap) {
    const auto EE = static_cast<std::size_t>(E);
    mask.assign(T * EE, 0);
    cumsum.resize(T * EE);
    location.assign(ids.size(), -1);
    base.assign(EE, 0);
    kept = 0;
    for (int r = 0; r < k; ++r) {
      std::fill(mask.begin(), mask.end(), 0);
      for (std::size_t t = 0; t < T; ++t)
        mask[t * EE + static_cast<std::size_t>(
                          ids[t * static_cast<std::size_t>(k) + static_cast<std::size_t>(r)])] = 1;
      for (std::size_t e = 0; e < EE; ++e) {
        std::int32_t run = 0;
        for (std::size_t t = 0; t < T; ++t) {
          run += mask[t * EE + e];
          cumsum[t * EE + e] = run;
        }
      }
      for (std::size_t t = 0; t < T; ++t) {
        const std::size_t q = t * static_cast<std::size_t>(k) + static_cast<std::size_t>(r);
        const auto e = static_cast<std::size_t>(ids[q]);
        const std::int64_t loc = base[e] + cumsum[t * EE + e] - 1;
        if (cap < 0 || loc < cap) {
          location[q] = loc;
          ++kept;
        }
      }
      for (std::size_t e = 0; e < EE; ++e)
        base[e] += cumsum[(T - 1) * EE + e];
    }
  }
};

void set_row_counters(benchmark::State& state, double rows, double row_bytes) {
  state.counters["rows/s"] =
      benchmark::Counter(rows, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GB/s"] =
      benchmark::Counter(rows * row_bytes / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}

std::size_t arg(const benchmark::State& s, int i) {
  return static_cast<std::size_t>(s.range(i));
}

void gate(benchmark::State& state) {
  const std::size_t T = arg(state, 0);
  const int E = static_cast<int>(state.range(1)), k = static_cast<int>(state.range(2));
  const auto& in = inputs(T, E, k);
  std::vector<std::int32_t> ids(in.ids.size());
  std::vector<float> w(ids.size());
  weave::gate_scratch scratch;
  weave::gate_options options;
  options.k = k;
  for (auto _ : state) {
    const auto s = weave::top_k_gate(in.logits.view(), options, ids, w, scratch);
    benchmark::DoNotOptimize(s.aux_loss);
  }
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(T), benchmark::Counter::kIsIterationInvariantRate);
}

void plan_weave(benchmark::State& state) {
  const std::size_t T = arg(state, 0);
  const int E = static_cast<int>(state.range(1)), k = static_cast<int>(state.range(2));
  const auto& in = inputs(T, E, k);
  weave::host_stream stream("plan");
  weave::device_capacity_filter<space> filter(E, k, T,
                                              {capacity_factor, weave::drop_order::position});
  workspace filter_ws(filter.workspace_size());
  filter.initialize(filter_ws.data, filter_ws.bytes, stream);
  dispatch_planner p(weave::placement::contiguous(E, devices < E ? devices : E), k, T, stream);
  std::vector<std::uint8_t> keep(in.ids.size());
  stream.synchronize();
  {
    const inline_steps held(state, stream);
    for (auto _ : state) {
      filter.decide(stream, in.ids, in.weights, keep);
      p.plan.build(stream, in.ids, in.weights, keep);
      benchmark::ClobberMemory();
    }
  }
  p.plan.check_errors(stream);
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(T), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["CT"] = static_cast<double>(p.plan.read_rows(stream)) / static_cast<double>(T);
}

void plan_naive_mask(benchmark::State& state) {
  const std::size_t T = arg(state, 0);
  const int E = static_cast<int>(state.range(1)), k = static_cast<int>(state.range(2));
  const auto& in = inputs(T, E, k);
  const auto cap = weave::expert_capacity(capacity_factor, T, k, E);
  mask_plan plan;
  for (auto _ : state) {
    plan.build(in.ids, T, E, k, cap);
    benchmark::DoNotOptimize(plan.kept);
  }
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(T), benchmark::Counter::kIsIterationInvariantRate);
}

// ORI -> SFD: one row per (token, device), dropless.
void gather_weave(benchmark::State& state) {
  const std::size_t T = arg(state, 0), H = arg(state, 3);
  const int E = static_cast<int>(state.range(1)), k = static_cast<int>(state.range(2));
  const auto& in = inputs(T, E, k);
  const auto& x = tokens(T, H);
  weave::host_stream stream("gather");
  dispatch_planner p(weave::placement::contiguous(E, devices < E ? devices : E), k, T, stream);
  p.plan.build(stream, in.ids, in.weights);
  p.plan.check_errors(stream);
  const auto rows = static_cast<std::size_t>(p.plan.read_rows(stream));
  weave::host_matrix<weave::bfloat16> sfd(rows, H);
  {
    const inline_steps held(state, stream);
    for (auto _ : state) {
      weave::layout_move<space>(stream, x.view(), sfd.view(), p.plan.row_token().data(), nullptr,
                                nullptr, p.plan.token_rows().data(), k, nullptr, nullptr);
      benchmark::ClobberMemory();
    }
  }
  set_row_counters(state, static_cast<double>(rows), static_cast<double>(H * 2));
  state.counters["CT"] = static_cast<double>(rows) / static_cast<double>(T);
}

// SFD -> EPD on the receiving side: one row per (token, local expert), grouped by expert.
void scatter_weave(benchmark::State& state) {
  const std::size_t T = arg(state, 0), H = arg(state, 3);
  const int E = static_cast<int>(state.range(1)), k = static_cast<int>(state.range(2));
  const auto& in = inputs(T, E, k);
  const auto& x = tokens(T, H);
  const auto where = weave::placement::contiguous(E, devices < E ? devices : E);
  weave::host_stream stream("scatter");
  dispatch_planner p(where, k, T, stream);
  p.plan.build(stream, in.ids, in.weights);
  p.plan.check_errors(stream);
  const auto rows = static_cast<std::size_t>(p.plan.read_rows(stream));
  weave::host_matrix<weave::bfloat16> sfd(rows, H);
  weave::layout_move<space>(stream, x.view(), sfd.view(), p.plan.row_token().data(), nullptr,
                            nullptr, p.plan.token_rows().data(), k, nullptr, nullptr);
  // All devices' rows received by one device that holds every local slot index.
  const expert_planner e(where, k, p.plan, rows, stream);
  weave::host_matrix<weave::bfloat16> epd(e.epd_rows(), H);
  {
    const inline_steps held(state, stream);
    for (auto _ : state) {
      weave::layout_move<space>(stream, sfd.view(), epd.view(), e.plan.epd_row_source().data(),
                                nullptr, e.plan.epd_rows_count(), e.plan.row_epd().data(), k,
                                nullptr, nullptr);
      benchmark::ClobberMemory();
    }
  }
  set_row_counters(state, static_cast<double>(e.epd_rows()), static_cast<double>(H * 2));
}

// The mask-based dispatch: each kept (token, expert) pair copied to expert-major order.
void gather_naive_mask(benchmark::State& state) {
  const std::size_t T = arg(state, 0), H = arg(state, 3);
  const int E = static_cast<int>(state.range(1)), k = static_cast<int>(state.range(2));
  const auto& in = inputs(T, E, k);
  const auto& x = tokens(T, H);
  mask_plan plan;
  plan.build(in.ids, T, E, k, -1);
  std::vector<std::int64_t> offset(static_cast<std::size_t>(E) + 1, 0);
  for (int e = 0; e < E; ++e)
    offset[static_cast<std::size_t>(e) + 1] =
        offset[static_cast<std::size_t>(e)] + plan.base[static_cast<std::size_t>(e)];
  weave::host_matrix<weave::bfloat16> out(static_cast<std::size_t>(plan.kept), H);
  const std::size_t bytes = H * 2;
  for (auto _ : state) {
    for (std::size_t q = 0; q < in.ids.size(); ++q) {
      const auto row = offset[static_cast<std::size_t>(in.ids[q])] + plan.location[q];
      std::memcpy(out.row(static_cast<std::size_t>(row)).data(),
                  x.row(q / static_cast<std::size_t>(k)).data(), bytes);
    }
    benchmark::ClobberMemory();
  }
  set_row_counters(state, static_cast<double>(plan.kept), static_cast<double>(bytes));
}

void memcpy_baseline(benchmark::State& state) {
  const std::size_t T = arg(state, 0), H = arg(state, 3);
  const auto& x = tokens(T, H);
  weave::host_matrix<weave::bfloat16> out(T, H);
  for (auto _ : state) {
    std::memcpy(out.data(), x.data(), T * H * 2);
    benchmark::ClobberMemory();
  }
  set_row_counters(state, static_cast<double>(T), static_cast<double>(H * 2));
}

// One dispatch plan and its receiver plan (weave's, in host_space) for a (T, E, k) batch over
// `devices` devices, with rows of element type T at every layout; the receiver holds every
// destination's rows (one rank receiving what all sources send it, with this source's
// distribution).
template <class T>
struct layouts {
  weave::host_stream stream{"layouts"};
  weave::placement where;
  int k;
  dispatch_planner sender;
  std::size_t rows;
  expert_planner experts;
  weave::host_matrix<T> ori, sfd, epd, back, out;

  layouts(std::size_t tokens, int E, int k_, std::size_t H)
      : where(weave::placement::contiguous(E, devices < E ? devices : E))
      , k(k_)
      , sender(where, k, tokens, stream)
      , rows(build(sender, tokens, E, k, stream))
      , experts(where, k, sender.plan, rows, stream) {
    ori = weave::host_matrix<T>(tokens, H);
    for (std::size_t i = 0; i < ori.elements().size(); ++i)
      ori.elements()[i] = T(static_cast<float>(i % 251) / 64.0f - 1.0f);
    sfd = weave::host_matrix<T>(rows, H);
    epd = weave::host_matrix<T>(experts.epd_rows(), H);
    back = weave::host_matrix<T>(rows, H);
    out = weave::host_matrix<T>(tokens, H);
    ori_sfd();
    sfd_epd();
    epd_sfd();
    stream.synchronize();
  }

  // The four moves, enqueued on `stream` (inline while the calling thread holds it).
  void ori_sfd() {
    weave::layout_move<space>(stream, ori.view(), sfd.view(), sender.plan.row_token().data(),
                              nullptr, nullptr, sender.plan.token_rows().data(), k, nullptr,
                              nullptr);
  }
  void sfd_epd() {
    weave::layout_move<space>(stream, sfd.view(), epd.view(), experts.plan.epd_row_source().data(),
                              nullptr, experts.plan.epd_rows_count(), experts.plan.row_epd().data(),
                              k, nullptr, nullptr);
  }
  void epd_sfd() {
    weave::row_moves<space>::merge(stream, epd.view(), back.view(), experts.plan.row_epd().data(),
                                   k, experts.plan.row_weight().data(), nullptr, false);
  }
  void sfd_ori() {
    weave::row_moves<space>::merge(stream, back.view(), out.view(), sender.plan.token_rows().data(),
                                   k, nullptr, nullptr, false);
  }

 private:
  static std::size_t build(dispatch_planner& p, std::size_t tokens, int E, int k,
                           weave::host_stream& s) {
    const auto& in = inputs(tokens, E, k);
    p.plan.build(s, in.ids, in.weights);
    p.plan.check_errors(s);
    return static_cast<std::size_t>(p.plan.read_rows(s));
  }
};

enum class layout_move { ori_sfd, sfd_epd, epd_sfd, sfd_ori };

// Counts the rows a merge reads: its valid (non -1) indices.
std::size_t valid(std::span<const std::int64_t> index) {
  std::size_t n = 0;
  for (const auto i : index)
    n += i >= 0 ? 1 : 0;
  return n;
}

// Times `run` (manual time) and, before each run, a memcpy with the same traffic (`traffic` / 2
// bytes read and as many written), so both see the same load; reports GB/s of traffic for both
// and their ratio `vs_memcpy` (memcpy time / run time).
template <class Run>
void time_vs_memcpy(benchmark::State& state, std::size_t traffic, Run&& run) {
  const std::size_t copy_bytes = traffic / 2;
  std::vector<std::byte> from(copy_bytes, std::byte{1}), to(copy_bytes, std::byte{0});
  run();
  std::memcpy(to.data(), from.data(), copy_bytes);
  using clock = std::chrono::steady_clock;
  double run_s = 0, copy_s = 0;
  for (auto _ : state) {
    const auto t0 = clock::now();
    std::memcpy(to.data(), from.data(), copy_bytes);
    benchmark::ClobberMemory();
    const auto t1 = clock::now();
    run();
    benchmark::ClobberMemory();
    const auto t2 = clock::now();
    const double seconds = std::chrono::duration<double>(t2 - t1).count();
    state.SetIterationTime(seconds);
    run_s += seconds;
    copy_s += std::chrono::duration<double>(t1 - t0).count();
  }
  const auto n = static_cast<double>(state.iterations());
  state.counters["GB/s"] = static_cast<double>(traffic) * n / run_s / 1e9;
  state.counters["memcpy_GB/s"] = static_cast<double>(traffic) * n / copy_s / 1e9;
  state.counters["vs_memcpy"] = copy_s / run_s;
}

template <class T>
void move_vs_memcpy(benchmark::State& state, layout_move move) {
  const std::size_t tokens = arg(state, 0), H = arg(state, 3);
  const int E = static_cast<int>(state.range(1)), k = static_cast<int>(state.range(2));
  layouts<T> l(tokens, E, k, H);
  const std::size_t row = H * sizeof(T);
  std::size_t read_rows = 0, written_rows = 0;
  switch (move) {
  case layout_move::ori_sfd:
    read_rows = written_rows = l.sfd.rows();
    break;
  case layout_move::sfd_epd:
    read_rows = written_rows = l.epd.rows();
    break;
  case layout_move::epd_sfd:
    read_rows = valid(l.experts.plan.row_epd());
    written_rows = l.back.rows();
    break;
  case layout_move::sfd_ori:
    read_rows = valid(l.sender.plan.token_rows());
    written_rows = l.out.rows();
    break;
  }
  const auto run = [&] {
    switch (move) {
    case layout_move::ori_sfd:
      return l.ori_sfd();
    case layout_move::sfd_epd:
      return l.sfd_epd();
    case layout_move::epd_sfd:
      return l.epd_sfd();
    case layout_move::sfd_ori:
      return l.sfd_ori();
    }
  };
  {
    const inline_steps held(state, l.stream);
    time_vs_memcpy(state, (read_rows + written_rows) * row, run);
  }
  state.counters["rows/s"] = benchmark::Counter(static_cast<double>(written_rows),
                                                benchmark::Counter::kIsIterationInvariantRate);
}

// The machine's sequential streaming copy (the kernels' 16-byte loop with non-temporal stores)
// beside memcpy, same bytes: how far glibc's memcpy is from the bandwidth ceiling here.
void stream_vs_memcpy(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  std::vector<std::byte> from(bytes, std::byte{1}), to(bytes, std::byte{0});
  time_vs_memcpy(state, 2 * bytes, [&] {
    weave::detail::copy_row(to.data(), from.data(), bytes, true);
    weave::detail::end_streaming(true);
  });
}

void shapes(benchmark::internal::Benchmark* b, std::vector<std::int64_t> Ts) {
  b->ArgNames({"T", "E", "k"});
  for (const auto T : Ts)
    for (const std::int64_t E : {8, 64, 256})
      for (const std::int64_t k : {1, 2, 8})
        b->Args({T, E, k});
  b->Unit(benchmark::kMillisecond)->MinTime(0.2)->UseRealTime();
}

void row_shapes(benchmark::internal::Benchmark* b, std::vector<std::int64_t> Ts, std::int64_t H,
                bool long_only) {
  b->ArgNames({"T", "E", "k", "H"});
  for (const auto T : Ts)
    for (const std::int64_t E : {8, 64, 256})
      for (const std::int64_t k : {1, 2, 8}) {
        // Long cases: hidden 4096 where the output stays under ~1 GiB (T * k <= 128k rows).
        if (long_only && T * k > 131072)
          continue;
        b->Args({T, E, k, H});
      }
  b->Unit(benchmark::kMillisecond)->MinTime(0.2)->UseRealTime();
}

void register_moves() {
  const std::pair<const char*, layout_move> moves[] = {{"encode/ori_sfd", layout_move::ori_sfd},
                                                       {"encode/sfd_epd", layout_move::sfd_epd},
                                                       {"decode/epd_sfd", layout_move::epd_sfd},
                                                       {"decode/sfd_ori", layout_move::sfd_ori}};
  for (const auto& [name, move] : moves)
    for (const bool bf16 : {false, true}) {
      const std::string full = std::string(name) + (bf16 ? "/bf16" : "/f32");
      auto* b =
          bf16 ? benchmark::RegisterBenchmark(full.c_str(), move_vs_memcpy<weave::bfloat16>, move)
               : benchmark::RegisterBenchmark(full.c_str(), move_vs_memcpy<float>, move);
      b->ArgNames({"T", "E", "k", "H"});
      // T = 16384: from DRAM (the goal's shapes); T = 256: every buffer in the caches, which
      // leaves the kernel's own cost (the conversions) and shows what bounds it.
      for (const std::int64_t T : {16384, 256})
        for (const std::int64_t k : {2, 8})
          b->Args({T, 64, k, 1024});
      b->Unit(benchmark::kMillisecond)->MinTime(0.5)->UseManualTime();
    }
  benchmark::RegisterBenchmark("copy/stream", stream_vs_memcpy)
      ->ArgNames({"bytes"})
      ->Arg(std::int64_t{256} << 20)
      ->Unit(benchmark::kMillisecond)
      ->MinTime(0.5)
      ->UseManualTime();
}

void register_all() {
  register_moves();
  const std::vector<std::int64_t> all = {4096, 16384, 65536}, short_rows = {4096, 16384};
  shapes(benchmark::RegisterBenchmark("gate", gate), all);
  shapes(benchmark::RegisterBenchmark("plan/weave", plan_weave), all);
  shapes(benchmark::RegisterBenchmark("plan/naive_mask", plan_naive_mask), all);
  for (const bool is_long : {false, true}) {
    const std::string tag = is_long ? "long/" : "";
    const std::int64_t H = is_long ? 4096 : 512;
    const auto& Ts = is_long ? all : short_rows;
    row_shapes(benchmark::RegisterBenchmark((tag + "gather/weave_sfd").c_str(), gather_weave), Ts,
               H, is_long);
    row_shapes(benchmark::RegisterBenchmark((tag + "gather/naive_mask").c_str(), gather_naive_mask),
               Ts, H, is_long);
    row_shapes(benchmark::RegisterBenchmark((tag + "scatter/weave_epd").c_str(), scatter_weave), Ts,
               H, is_long);
    auto* m = benchmark::RegisterBenchmark((tag + "memcpy").c_str(), memcpy_baseline);
    m->ArgNames({"T", "E", "k", "H"});
    for (const auto T : Ts)
      m->Args({T, 0, 0, H});
    m->Unit(benchmark::kMillisecond)->MinTime(0.2)->UseRealTime();
  }
}

} // namespace

int main(int argc, char** argv) {
  // Without an explicit filter, skip the long cases so the default run stays short.
  std::vector<char*> args(argv, argv + argc);
  bool filtered = false;
  for (int i = 1; i < argc; ++i)
    filtered = filtered || std::strncmp(argv[i], "--benchmark_filter", 18) == 0;
  static char skip_long[] = "--benchmark_filter=-long";
  if (!filtered)
    args.push_back(skip_long);
  int count = static_cast<int>(args.size());
  args.push_back(nullptr);
  register_all();
  benchmark::Initialize(&count, args.data());
  if (benchmark::ReportUnrecognizedArguments(count, args.data()))
    return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
