// GPU benchmarks, each beside its baseline in this one binary (timed with CUDA events):
// - row gathers/merges (hidden 4096 bf16) against cudaMemcpyAsync device-to-device bandwidth;
// - device gating + counting-sort plan against the gate + Tutel-style mask plan (O(T * E));
// - a one-GPU pipeline emulation (1 GiB each way): peer "ranks" are buffers, the all-to-all
//   is cudaMemcpyAsync on two high-priority copy streams (one per direction), experts are a
//   compute kernel of calibrated length; chunked with events against unchunked, reporting how
//   much of the exposed copy time is hidden;
// - the MoE exchange (cuda_moe_exchange over a one-rank NCCL communicator: plans, layout moves,
//   all-to-alls and merges, forward) dynamic and static, eager and replayed from a CUDA graph,
//   against a naive per-(token, expert) dispatch + combine of the same tokens;
// - the same exchange over four ranks of cuda_local_world on the one GPU (per-layer time with
//   the host wait a trainer pays, dynamic against static shapes, 1 and 4 chunks);
// - decode-sized layers (1, 8, 64, 256 tokens, one-rank NCCL): cuda_decode_exchange eager and
//   replayed from a CUDA graph against the dynamic cuda_moe_exchange sized for the same batch.
// Every instance runs a fixed number of iterations once, its setup outside the timed loop
// (register_benchmarks below). Without a GPU the binary lists its benchmarks
// (--benchmark_list_tests) and otherwise reports skipped (exit 77). bench/gpu/run.sh runs each
// instance in its own process and prints the table of ratios.
#include <benchmark/benchmark.h>

#include <weave/core/cuda_error.hpp>
#include <weave/placement/placement.hpp>
#include <weave/routing/cuda_row_moves.cuh>
#include <weave/routing/gate.cuh>
#include <weave/routing/plan.cuh>
#ifdef WEAVE_BENCH_NCCL
#include <weave/comm/cuda_local_world.hpp>
#include <weave/comm/nccl_communicator.hpp>
#include <weave/overlap/cuda_decode_exchange.cuh>
#include <weave/overlap/cuda_exchange.cuh>

#include <nccl.h>
#endif

#include "mask_routing.cuh"

#include <cuda_runtime.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <numeric>
#include <random>
#include <string_view>
#include <vector>

namespace {

constexpr std::size_t hidden = 4096;
constexpr std::size_t row_bytes = hidden * 2; // bf16

// bf16 bits of a value in [-1, 1) from a hash of (i, seed): random data made on the device
// (filling gigabytes from the host would dominate the run).
__global__ void fill_random_kernel(std::uint16_t* p, std::size_t n, std::uint32_t seed) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    std::uint32_t h = static_cast<std::uint32_t>(i) * 0x9E3779B1u ^ seed * 0x85EBCA77u;
    h ^= h >> 15;
    h *= 0x2C1B3C6Du;
    h ^= h >> 12;
    const float f = static_cast<float>(h >> 8) * (2.0f / 16777216.0f) - 1.0f;
    p[i] = static_cast<std::uint16_t>(__float_as_uint(f) >> 16);
  }
}

// Device memory, freed at scope exit; filled with random bf16 values so nothing runs on zeros.
struct dev_buffer {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  explicit dev_buffer(std::size_t n, std::uint32_t seed)
      : bytes(n) {
    WEAVE_CUDA_CHECK(cudaMalloc(&ptr, n == 0 ? 1 : n));
    if (n >= 2) {
      fill_random_kernel<<<1024, 256>>>(static_cast<std::uint16_t*>(ptr), n / 2, seed);
      WEAVE_CUDA_CHECK(cudaGetLastError());
      WEAVE_CUDA_CHECK(cudaDeviceSynchronize());
    }
  }
  //! Scratch (workspaces, outputs written before they are read): allocated, not filled.
  struct scratch_t {};
  dev_buffer(scratch_t, std::size_t n)
      : bytes(n) {
    WEAVE_CUDA_CHECK(cudaMalloc(&ptr, n == 0 ? 1 : n));
  }
  template <class T>
  explicit dev_buffer(const std::vector<T>& host)
      : bytes(host.size() * sizeof(T)) {
    WEAVE_CUDA_CHECK(cudaMalloc(&ptr, bytes == 0 ? 1 : bytes));
    if (bytes) {
      WEAVE_CUDA_CHECK(cudaMemcpy(ptr, host.data(), bytes, cudaMemcpyHostToDevice));
      // A pageable upload may return before its DMA lands, and the benchmarks' streams are
      // non-blocking (not ordered after the legacy stream): wait for it here.
      WEAVE_CUDA_CHECK(cudaDeviceSynchronize());
    }
  }
  ~dev_buffer() { (void)cudaFree(ptr); }
  dev_buffer(const dev_buffer&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr);
  }
  template <class T>
  std::span<const T> span() const {
    return {as<T>(), bytes / sizeof(T)};
  }
  weave::token_view rows() const {
    return weave::token_view(static_cast<std::byte*>(ptr), bytes / row_bytes, hidden,
                             weave::dtype::bf16, weave::memory_space::device, 0);
  }
};

// A compute stream and two high-priority copy streams (one per direction, as an all-to-all's
// send and receive run at once).
struct stream_pair {
  cudaStream_t compute = nullptr, copy = nullptr, copy_back = nullptr;
  stream_pair() {
    int least = 0, greatest = 0;
    WEAVE_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    WEAVE_CUDA_CHECK(cudaStreamCreateWithPriority(&compute, cudaStreamNonBlocking, least));
    WEAVE_CUDA_CHECK(cudaStreamCreateWithPriority(&copy, cudaStreamNonBlocking, greatest));
    WEAVE_CUDA_CHECK(cudaStreamCreateWithPriority(&copy_back, cudaStreamNonBlocking, greatest));
  }
  ~stream_pair() {
    (void)cudaStreamDestroy(compute);
    (void)cudaStreamDestroy(copy);
    (void)cudaStreamDestroy(copy_back);
  }
};

// Times `work(stream)` per iteration with events; sets bytes and items counters.
template <class F>
void time_on_stream(benchmark::State& state, cudaStream_t stream, F&& work) {
  weave::cuda_event start(cudaEventDefault), stop(cudaEventDefault);
  work(stream); // warm-up: module load, first-touch
  WEAVE_CUDA_CHECK(cudaStreamSynchronize(stream));
  for (auto _ : state) {
    WEAVE_CUDA_CHECK(cudaEventRecord(start.get(), stream));
    work(stream);
    WEAVE_CUDA_CHECK(cudaEventRecord(stop.get(), stream));
    WEAVE_CUDA_CHECK(cudaEventSynchronize(stop.get()));
    float ms = 0;
    WEAVE_CUDA_CHECK(cudaEventElapsedTime(&ms, start.get(), stop.get()));
    state.SetIterationTime(static_cast<double>(ms) / 1e3);
  }
}

void set_bandwidth(benchmark::State& state, double bytes_per_iteration) {
  state.counters["GB/s"] =
      benchmark::Counter(bytes_per_iteration * 1e-9 * static_cast<double>(state.iterations()),
                         benchmark::Counter::kIsRate);
  state.counters["bytes"] = bytes_per_iteration;
}

std::vector<std::int64_t> random_index(std::size_t n, std::size_t range, std::uint32_t seed) {
  std::vector<std::int64_t> index(n);
  std::iota(index.begin(), index.end(), 0);
  std::mt19937 rng(seed);
  for (auto& i : index)
    i %= static_cast<std::int64_t>(range);
  std::shuffle(index.begin(), index.end(), rng);
  return index;
}

// --- bandwidth: copy baseline, gathers, merges --------------------------------------------

void BM_d2d_copy(benchmark::State& state) {
  const auto T = static_cast<std::size_t>(state.range(0));
  dev_buffer src(T * row_bytes, 1), dst(T * row_bytes, 2);
  stream_pair s;
  time_on_stream(state, s.compute, [&](cudaStream_t st) {
    WEAVE_CUDA_CHECK(cudaMemcpyAsync(dst.ptr, src.ptr, src.bytes, cudaMemcpyDeviceToDevice, st));
  });
  set_bandwidth(state, 2.0 * static_cast<double>(T * row_bytes)); // read + write
}

void BM_gather(benchmark::State& state) {
  const auto T = static_cast<std::size_t>(state.range(0));
  const bool scaled = state.range(1) != 0;
  dev_buffer src(T * row_bytes, 3), dst(T * row_bytes, 4);
  dev_buffer index(random_index(T, T, 5));
  dev_buffer scale(std::vector<float>(T, 0.5f));
  stream_pair s;
  time_on_stream(state, s.compute, [&](cudaStream_t st) {
    weave::row_moves<weave::cuda_space>::gather(weave::cuda_stream_ref(st), src.rows(), dst.rows(),
                                                index.as<std::int64_t>(),
                                                scaled ? scale.as<float>() : nullptr, nullptr);
  });
  set_bandwidth(state, 2.0 * static_cast<double>(T * row_bytes));
}

// merge of k source rows per destination row (weighted), as the combine of top-k routing.
void BM_merge(benchmark::State& state) {
  const auto T = static_cast<std::size_t>(state.range(0));
  const int k = static_cast<int>(state.range(1));
  dev_buffer src(T * static_cast<std::size_t>(k) * row_bytes, 6), dst(T * row_bytes, 7);
  const std::size_t pairs = T * static_cast<std::size_t>(k);
  dev_buffer index(random_index(pairs, pairs, 8));
  dev_buffer weight(std::vector<float>(pairs, 0.5f));
  stream_pair s;
  time_on_stream(state, s.compute, [&](cudaStream_t st) {
    weave::row_moves<weave::cuda_space>::merge(weave::cuda_stream_ref(st), src.rows(), dst.rows(),
                                               index.as<std::int64_t>(), k, weight.as<float>(),
                                               nullptr, false);
  });
  set_bandwidth(state, static_cast<double>((pairs + T) * row_bytes));
}

// --- gating + plan against the mask baseline -----------------------------------------------

// Args of the gate benchmarks: experts E, tokens T (k = 8).
struct gate_inputs {
  int E;
  std::size_t T;
  int k = 8;
  dev_buffer logits, ids, weights;
  gate_inputs(int experts, std::size_t tokens)
      : E(experts)
      , T(tokens)
      , logits(random_logits(experts, tokens))
      , ids(dev_buffer::scratch_t{}, tokens * 8 * sizeof(std::int32_t))
      , weights(dev_buffer::scratch_t{}, tokens * 8 * sizeof(float)) {}
  static std::vector<float> random_logits(int E, std::size_t T) {
    std::vector<float> v(T * static_cast<std::size_t>(E));
    std::mt19937 rng(static_cast<std::uint32_t>(E));
    std::normal_distribution<float> normal(0, 1);
    for (auto& x : v)
      x = normal(rng);
    return v;
  }
  void gate(cudaStream_t st) const {
    weave::gate_options options;
    options.k = k;
    options.renormalize = true;
    weave::top_k_gate(weave::cuda_stream_ref(st),
                      weave::const_token_view(static_cast<const std::byte*>(logits.ptr), T,
                                              static_cast<std::size_t>(E), weave::dtype::f32,
                                              weave::memory_space::device, 0),
                      options, std::span<std::int32_t>(ids.as<std::int32_t>(), T * k),
                      std::span<float>(weights.as<float>(), T * k));
  }
};

void BM_gate(benchmark::State& state) {
  const gate_inputs in(static_cast<int>(state.range(0)), static_cast<std::size_t>(state.range(1)));
  stream_pair s;
  time_on_stream(state, s.compute, [&](cudaStream_t st) { in.gate(st); });
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(in.T * static_cast<std::size_t>(state.iterations())),
                         benchmark::Counter::kIsRate);
}

// One expert per destination, so both paths produce the same per-expert positions.
void BM_gate_plan_weave(benchmark::State& state) {
  const gate_inputs in(static_cast<int>(state.range(0)), static_cast<std::size_t>(state.range(1)));
  const auto p = weave::placement::contiguous(in.E, in.E);
  weave::cuda_dispatch_plan plan(p, in.k, 0, in.T);
  dev_buffer ws(dev_buffer::scratch_t{}, plan.workspace_size());
  stream_pair s;
  plan.initialize(ws.ptr, ws.bytes, weave::cuda_stream_ref(s.compute));
  time_on_stream(state, s.compute, [&](cudaStream_t st) {
    in.gate(st);
    plan.build(weave::cuda_stream_ref(st), in.ids.span<std::int32_t>(), in.weights.span<float>());
  });
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(in.T * static_cast<std::size_t>(state.iterations())),
                         benchmark::Counter::kIsRate);
}

void BM_gate_plan_mask(benchmark::State& state) {
  const gate_inputs in(static_cast<int>(state.range(0)), static_cast<std::size_t>(state.range(1)));
  const weave_test::mask_routing mask(static_cast<std::int64_t>(in.T), in.E, in.k);
  dev_buffer ws(dev_buffer::scratch_t{}, mask.bytes());
  dev_buffer rows(dev_buffer::scratch_t{}, in.T * 8 * sizeof(std::int64_t));
  stream_pair s;
  time_on_stream(state, s.compute, [&](cudaStream_t st) {
    in.gate(st);
    mask.run(in.ids.as<std::int32_t>(), rows.as<std::int64_t>(), ws.ptr, st);
  });
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(in.T * static_cast<std::size_t>(state.iterations())),
                         benchmark::Counter::kIsRate);
}

// --- pipeline emulation ---------------------------------------------------------------------

// Expert stand-in: `iters` dependent FMAs per float read, one float read and written per 256
// bytes of the chunk, so it is arithmetic-bound like an expert GEMM rather than competing with
// the copies for memory bandwidth; it reads its chunk, so it depends on the copy. Its length is
// calibrated against the copy time.
__global__ void expert_kernel(const float* in, float* out, std::size_t n, int iters) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    float x = in[i * 64];
    for (int j = 0; j < iters; ++j)
      x = fmaf(x, 0.999f, 0.001f);
    out[i * 64] = x;
  }
}

struct pipeline {
  static constexpr std::size_t bytes = std::size_t{1} << 30; // per direction
  dev_buffer send, recv, result, back;
  stream_pair s;
  int iters = 64;
  int sms = 1;
  std::vector<weave::cuda_event> copied, computed;
  weave::cuda_event start{cudaEventDefault}, stop{cudaEventDefault};

  pipeline()
      : send(bytes, 11)
      , recv(bytes, 12)
      , result(bytes, 13)
      , back(bytes, 14) {
    int device = 0;
    WEAVE_CUDA_CHECK(cudaGetDevice(&device));
    WEAVE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    for (int i = 0; i < 64; ++i) {
      copied.emplace_back();
      computed.emplace_back();
    }
  }

  void compute(std::size_t offset, std::size_t len, cudaStream_t st) const {
    const std::size_t n = len / 256;
    // Half the resident threads: room for the copies should they run on the SMs.
    const auto blocks = static_cast<unsigned>(
        std::min<std::size_t>((n + 255) / 256, static_cast<std::size_t>(sms) * 4));
    expert_kernel<<<blocks, 256, 0, st>>>(
        reinterpret_cast<const float*>(recv.as<std::byte>() + offset),
        reinterpret_cast<float*>(result.as<std::byte>() + offset), n, iters);
    WEAVE_CUDA_CHECK(cudaGetLastError());
  }

  // Milliseconds from the first copy to the last return copy with `chunks` chunks
  // (0 = compute only, no copies).
  float run(int chunks) {
    WEAVE_CUDA_CHECK(cudaEventRecord(start.get(), s.copy));
    WEAVE_CUDA_CHECK(cudaStreamWaitEvent(s.compute, start.get(), 0));
    if (chunks == 0) {
      compute(0, bytes, s.compute);
      WEAVE_CUDA_CHECK(cudaEventRecord(computed[0].get(), s.compute));
      WEAVE_CUDA_CHECK(cudaStreamWaitEvent(s.copy_back, computed[0].get(), 0));
    }
    const std::size_t chunk = chunks == 0 ? 0 : bytes / static_cast<std::size_t>(chunks);
    for (int c = 0; c < chunks; ++c) {
      const std::size_t off = static_cast<std::size_t>(c) * chunk;
      WEAVE_CUDA_CHECK(cudaMemcpyAsync(recv.as<std::byte>() + off, send.as<std::byte>() + off,
                                       chunk, cudaMemcpyDeviceToDevice, s.copy));
      WEAVE_CUDA_CHECK(cudaEventRecord(copied[c].get(), s.copy));
      WEAVE_CUDA_CHECK(cudaStreamWaitEvent(s.compute, copied[c].get(), 0));
      compute(off, chunk, s.compute);
      WEAVE_CUDA_CHECK(cudaEventRecord(computed[c].get(), s.compute));
    }
    for (int c = 0; c < chunks; ++c) { // return copies wait for their chunk's compute
      const std::size_t off = static_cast<std::size_t>(c) * chunk;
      WEAVE_CUDA_CHECK(cudaStreamWaitEvent(s.copy_back, computed[c].get(), 0));
      WEAVE_CUDA_CHECK(cudaMemcpyAsync(back.as<std::byte>() + off, result.as<std::byte>() + off,
                                       chunk, cudaMemcpyDeviceToDevice, s.copy_back));
    }
    // The last return copy follows every compute, which follows every send copy.
    WEAVE_CUDA_CHECK(cudaEventRecord(stop.get(), s.copy_back));
    WEAVE_CUDA_CHECK(cudaEventSynchronize(stop.get()));
    float ms = 0;
    WEAVE_CUDA_CHECK(cudaEventElapsedTime(&ms, start.get(), stop.get()));
    return ms;
  }

  float median(int chunks, int reps = 5) {
    std::vector<float> t;
    for (int i = 0; i < reps; ++i)
      t.push_back(run(chunks));
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  }

  // Expert time = one-way copy time of the whole buffer (a balanced layer).
  // Two rounds: the first estimate may still include launch overhead.
  void calibrate() {
    (void)run(1); // warm-up
    iters = 64;
    const float copy_one_way = (median(1) - median(0)) / 2;
    for (int round = 0; round < 2; ++round)
      iters = std::max(1, static_cast<int>(static_cast<float>(iters) * copy_one_way / median(0)));
  }
};

void BM_pipeline(benchmark::State& state) {
  const int chunks = static_cast<int>(state.range(0));
  pipeline p;
  p.calibrate();
  const float compute_ms = p.median(0);
  const float unchunked_ms = p.median(1);
  float total = 0;
  for (auto _ : state) {
    const float ms = p.run(chunks);
    total += ms;
    state.SetIterationTime(static_cast<double>(ms) / 1e3);
  }
  const float mean_ms = total / static_cast<float>(state.iterations());
  const float exposed_unchunked = unchunked_ms - compute_ms;
  const float exposed = mean_ms - compute_ms;
  state.counters["compute_ms"] = compute_ms;
  state.counters["unchunked_ms"] = unchunked_ms;
  state.counters["exposed_copy_ms"] = exposed;
  state.counters["hidden_pct"] =
      exposed_unchunked > 0 ? 100.0 * (exposed_unchunked - exposed) / exposed_unchunked : 0.0;
}

#ifdef WEAVE_BENCH_NCCL
// --- the MoE exchange against a naive per-(token, expert) dispatch ----------------------------

constexpr std::size_t exchange_tokens = 8192;
constexpr int exchange_experts = 64, exchange_k = 8;

// Identity experts: a copy of the batch's rows (the exchange's own cost is what is measured).
struct copy_rows {
  const ::uint4* in;
  ::uint4* out;
  __host__ __device__ void operator()(std::int64_t i) const { out[i] = in[i]; }
};

// row_token[rows[p]] = the token of pair p: the mask layout's gather map.
struct invert_rows {
  const std::int64_t* rows;
  int k;
  std::int64_t* row_token;
  __host__ __device__ void operator()(std::int64_t p) const {
    if (rows[p] >= 0)
      row_token[rows[p]] = p / k;
  }
};

// Gate choices for the exchange benchmarks: the device gate over random logits.
struct exchange_inputs {
  std::size_t T;
  dev_buffer logits, ids, weights, x, y;
  explicit exchange_inputs(std::size_t tokens = exchange_tokens, std::uint32_t seed = 21)
      : T(tokens)
      , logits(gate_inputs::random_logits(exchange_experts, tokens))
      , ids(dev_buffer::scratch_t{}, tokens * exchange_k * sizeof(std::int32_t))
      , weights(dev_buffer::scratch_t{}, tokens * exchange_k * sizeof(float))
      , x(tokens * row_bytes, seed)
      , y(tokens * row_bytes, seed + 1) {}
  void gate(cudaStream_t st) const {
    weave::gate_options options;
    options.k = exchange_k;
    options.renormalize = true;
    weave::top_k_gate(weave::cuda_stream_ref(st),
                      weave::const_token_view(static_cast<const std::byte*>(logits.ptr), T,
                                              exchange_experts, weave::dtype::f32,
                                              weave::memory_space::device, 0),
                      options, std::span<std::int32_t>(ids.as<std::int32_t>(), T * exchange_k),
                      std::span<float>(weights.as<float>(), T * exchange_k));
  }
};

void identity_experts(const weave::cuda_expert_batch& b) {
  weave::cuda_space::for_each(b.stream, static_cast<std::int64_t>(b.input.rows() * row_bytes / 16),
                              copy_rows{reinterpret_cast<const ::uint4*>(b.input.data()),
                                        reinterpret_cast<::uint4*>(b.output.data())});
}

weave::moe_options exchange_options(std::size_t tokens, int chunks, bool fixed) {
  weave::moe_options o;
  o.k = exchange_k;
  o.hidden = hidden;
  o.element = weave::dtype::bf16;
  o.max_tokens = tokens;
  o.chunks = chunks;
  o.static_shape = fixed;
  return o;
}

// One rank: every expert on this GPU, so each token sends one row (CT = 1) where a naive
// dispatch sends k. Args: static shapes, chunks, replay from a CUDA graph.
void BM_exchange(benchmark::State& state) {
  const bool fixed = state.range(0) != 0, graph = state.range(2) != 0;
  const int chunks = static_cast<int>(state.range(1));
  ncclComm_t raw = nullptr;
  int device = 0;
  WEAVE_CUDA_CHECK(cudaGetDevice(&device));
  WEAVE_NCCL_CHECK(ncclCommInitAll(&raw, 1, &device));
  {
    weave::nccl_communicator comm(raw);
    const exchange_inputs in;
    stream_pair s;
    in.gate(s.compute);
    weave::cuda_moe_exchange<weave::nccl_communicator> ex(
        comm, weave::placement::contiguous(exchange_experts, 1),
        exchange_options(exchange_tokens, chunks, fixed));
    dev_buffer ws(dev_buffer::scratch_t{}, ex.workspace_size());
    ex.initialize(ws.ptr, ws.bytes, weave::cuda_stream_ref(s.compute));
    const auto experts = identity_experts;
    const auto forward = [&](cudaStream_t st) {
      ex.forward(in.x.rows(), in.ids.span<std::int32_t>(), in.weights.span<float>(), in.y.rows(),
                 experts, weave::cuda_stream_ref(st), weave::cuda_stream_ref(s.copy));
    };
    cudaGraphExec_t exec = nullptr;
    if (graph) {
      forward(s.compute); // loads the kernels: module loading cannot happen in a capture
      WEAVE_CUDA_CHECK(cudaStreamSynchronize(s.compute));
      cudaGraph_t g = nullptr;
      WEAVE_CUDA_CHECK(cudaStreamBeginCapture(s.compute, cudaStreamCaptureModeThreadLocal));
      forward(s.compute);
      WEAVE_CUDA_CHECK(cudaStreamEndCapture(s.compute, &g));
      WEAVE_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
      WEAVE_CUDA_CHECK(cudaGraphDestroy(g));
    }
    time_on_stream(state, s.compute, [&](cudaStream_t st) {
      if (graph)
        WEAVE_CUDA_CHECK(cudaGraphLaunch(exec, st));
      else
        forward(st);
    });
    ex.check_errors(weave::cuda_stream_ref(s.compute));
    const weave::moe_stats stats = ex.stats(weave::cuda_stream_ref(s.compute));
    state.counters["rows_sent"] = static_cast<double>(stats.sent_rows);
    state.counters["naive_rows"] = static_cast<double>(stats.naive_rows());
    if (exec)
      WEAVE_CUDA_CHECK(cudaGraphExecDestroy(exec));
  }
  WEAVE_NCCL_CHECK(ncclCommDestroy(raw));
  state.counters["tokens/s"] = benchmark::Counter(
      static_cast<double>(exchange_tokens * state.iterations()), benchmark::Counter::kIsRate);
}

// Identity experts of a decode call: each local slot's rows copied from its input (the pool, or
// a single row read where it arrived) to its output rows in the pool; one block per slot, the
// counts read on the device from the view's arrays.
__global__ void copy_slot_rows(const std::byte* const* blocks, const ::uint4* in, ::uint4* out,
                               const std::int64_t* first, const std::int64_t* rows,
                               std::int64_t words_per_row) {
  const std::int64_t l = blockIdx.x;
  const ::uint4* from = blocks[l] != nullptr ? reinterpret_cast<const ::uint4*>(blocks[l])
                                             : in + first[l] * words_per_row;
  ::uint4* to = out + first[l] * words_per_row;
  for (std::int64_t i = threadIdx.x; i < rows[l] * words_per_row; i += blockDim.x)
    to[i] = from[i];
}

// Decode-sized layers on one GPU (one-rank NCCL, E = 64, k = 8, bf16 4096). Args: mode (0 the
// dynamic cuda_moe_exchange, 1 cuda_decode_exchange eager, 2 the decode layer replayed from a
// CUDA graph), tokens. Per-layer time on the stream, with the dynamic layer's host waits.
void BM_decode(benchmark::State& state) {
  const int mode = static_cast<int>(state.range(0));
  const auto T = static_cast<std::size_t>(state.range(1));
  ncclComm_t raw = nullptr;
  int device = 0;
  WEAVE_CUDA_CHECK(cudaGetDevice(&device));
  WEAVE_NCCL_CHECK(ncclCommInitAll(&raw, 1, &device));
  {
    weave::nccl_communicator comm(raw);
    const exchange_inputs in(T);
    stream_pair s;
    in.gate(s.compute);
    const auto where = weave::placement::contiguous(exchange_experts, 1);
    if (mode == 0) {
      weave::cuda_moe_exchange<weave::nccl_communicator> ex(comm, where,
                                                            exchange_options(T, 1, false));
      dev_buffer ws(dev_buffer::scratch_t{}, ex.workspace_size());
      ex.initialize(ws.ptr, ws.bytes, weave::cuda_stream_ref(s.compute));
      time_on_stream(state, s.compute, [&](cudaStream_t st) {
        ex.forward(in.x.rows(), in.ids.span<std::int32_t>(), in.weights.span<float>(), in.y.rows(),
                   identity_experts, weave::cuda_stream_ref(st), weave::cuda_stream_ref(s.copy));
      });
      ex.check_errors(weave::cuda_stream_ref(s.compute));
    } else {
      using layer_type = weave::cuda_decode_exchange<weave::nccl_communicator, weave::bfloat16>;
      layer_type ex(comm, where, {exchange_k, hidden, T});
      dev_buffer ws(dev_buffer::scratch_t{}, ex.workspace_size());
      ex.initialize(ws.ptr, ws.bytes, weave::cuda_stream_ref(s.compute));
      const std::span<const weave::bfloat16> x(in.x.as<weave::bfloat16>(), T * hidden);
      const std::span<weave::bfloat16> y(in.y.as<weave::bfloat16>(), T * hidden);
      const auto layer = [&](cudaStream_t st) {
        auto h = ex.dispatch(x, in.ids.span<std::int32_t>(), in.weights.span<float>(),
                             weave::cuda_stream_ref(st));
        const auto xs = h.experts();
        const auto words = static_cast<std::int64_t>(row_bytes / 16);
        copy_slot_rows<<<static_cast<unsigned>(xs.local_experts()), 256, 0, st>>>(
            xs.input_blocks(), reinterpret_cast<const ::uint4*>(xs.input_pool()),
            reinterpret_cast<::uint4*>(xs.output_pool()), xs.slot_first(), xs.slot_rows(), words);
        WEAVE_CUDA_CHECK(cudaGetLastError());
        ex.combine(h, y, weave::cuda_stream_ref(st));
      };
      cudaGraphExec_t exec = nullptr;
      if (mode == 2) {
        layer(s.compute); // loads the kernels: module loading cannot happen in a capture
        ex.check_errors(weave::cuda_stream_ref(s.compute));
        cudaGraph_t g = nullptr;
        WEAVE_CUDA_CHECK(cudaStreamBeginCapture(s.compute, cudaStreamCaptureModeThreadLocal));
        layer(s.compute);
        WEAVE_CUDA_CHECK(cudaStreamEndCapture(s.compute, &g));
        WEAVE_CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
        WEAVE_CUDA_CHECK(cudaGraphDestroy(g));
      }
      time_on_stream(state, s.compute, [&](cudaStream_t st) {
        if (exec)
          WEAVE_CUDA_CHECK(cudaGraphLaunch(exec, st));
        else
          layer(st);
      });
      ex.check_errors(weave::cuda_stream_ref(s.compute));
      if (exec)
        WEAVE_CUDA_CHECK(cudaGraphExecDestroy(exec));
    }
  }
  WEAVE_NCCL_CHECK(ncclCommDestroy(raw));
  state.SetLabel(mode == 0 ? "dynamic" : mode == 1 ? "decode" : "decode, graph");
}

// Four ranks of cuda_local_world on the one GPU, 16 experts each, `world_tokens` tokens per
// rank: per-layer time of a forward plus the host wait a trainer pays before reading the
// output, measured on the host between barriers of the rank threads (the ranks move in
// lockstep: every collective is a rendezvous). Args: static shapes, chunks. A multi-rank
// cuda_local_world is not capturable (its streams wait on the peers' events), so graphs are
// measured on the one-rank NCCL path above.
constexpr std::size_t world_tokens = 4096;
constexpr int world_ranks = 4;

void BM_exchange_world(benchmark::State& state) {
  const bool fixed = state.range(0) != 0;
  const int chunks = static_cast<int>(state.range(1));
  using exchange = weave::cuda_moe_exchange<weave::cuda_local_communicator>;
  struct rank_state {
    std::unique_ptr<exchange_inputs> in;
    std::unique_ptr<stream_pair> s;
    std::unique_ptr<exchange> ex;
    std::unique_ptr<dev_buffer> ws;
  };
  weave::cuda_local_world world(world_ranks);
  std::vector<rank_state> ranks(world_ranks);
  const auto where = weave::placement::contiguous(exchange_experts, world_ranks);
  world.run([&](weave::cuda_local_communicator& comm) {
    rank_state& r = ranks[static_cast<std::size_t>(comm.rank())];
    r.in = std::make_unique<exchange_inputs>(world_tokens, 40u + 2u * comm.rank());
    r.s = std::make_unique<stream_pair>();
    r.in->gate(r.s->compute);
    r.ex = std::make_unique<exchange>(comm, where, exchange_options(world_tokens, chunks, fixed));
    r.ws = std::make_unique<dev_buffer>(dev_buffer::scratch_t{}, r.ex->workspace_size());
    r.ex->initialize(r.ws->ptr, r.ws->bytes, weave::cuda_stream_ref(r.s->compute));
    WEAVE_CUDA_CHECK(cudaStreamSynchronize(r.s->compute));
  });
  constexpr int reps = 10;
  std::barrier sync(world_ranks);
  std::vector<double> seconds;
  for (auto _ : state) {
    seconds.clear();
    world.run([&](weave::cuda_local_communicator& comm) {
      rank_state& r = ranks[static_cast<std::size_t>(comm.rank())];
      const weave::cuda_stream_ref compute(r.s->compute), copy(r.s->copy);
      for (int rep = 0; rep <= reps; ++rep) { // rep 0 warms up
        sync.arrive_and_wait();
        const auto start = std::chrono::steady_clock::now();
        r.ex->forward(r.in->x.rows(), r.in->ids.span<std::int32_t>(), r.in->weights.span<float>(),
                      r.in->y.rows(), identity_experts, compute, copy);
        WEAVE_CUDA_CHECK(cudaStreamSynchronize(r.s->compute));
        WEAVE_CUDA_CHECK(cudaStreamSynchronize(r.s->copy));
        sync.arrive_and_wait();
        if (comm.rank() == 0 && rep > 0)
          seconds.push_back(
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      }
      r.ex->check_errors(compute);
    });
    std::sort(seconds.begin(), seconds.end());
    state.SetIterationTime(seconds[seconds.size() / 2]);
  }
  const weave::moe_stats stats = ranks[0].ex->stats(weave::cuda_stream_ref(ranks[0].s->compute));
  state.counters["rows_sent"] = static_cast<double>(stats.sent_rows);
  state.counters["naive_rows"] = static_cast<double>(stats.naive_rows());
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(world_tokens * world_ranks *
                                             static_cast<std::size_t>(state.iterations())),
                         benchmark::Counter::kIsRate);
}

// The naive baseline on one GPU: the mask plan (one row per (token, expert)), a gather of
// T * k rows, identity experts, and a merge of k rows per token.
void BM_exchange_naive(benchmark::State& state) {
  const exchange_inputs in;
  stream_pair s;
  in.gate(s.compute);
  const weave_test::mask_routing mask(static_cast<std::int64_t>(exchange_tokens), exchange_experts,
                                      exchange_k);
  dev_buffer mws(dev_buffer::scratch_t{}, mask.bytes());
  dev_buffer rows(dev_buffer::scratch_t{}, exchange_tokens * exchange_k * sizeof(std::int64_t));
  dev_buffer row_token(std::vector<std::int64_t>(exchange_tokens * exchange_k, 0));
  dev_buffer expert_rows(exchange_tokens * exchange_k * row_bytes, 23);
  dev_buffer expert_out(exchange_tokens * exchange_k * row_bytes, 24);
  const auto view = [](const dev_buffer& b, std::size_t n) {
    return weave::token_view(static_cast<std::byte*>(b.ptr), n, hidden, weave::dtype::bf16,
                             weave::memory_space::device, 0);
  };
  const std::size_t pairs = exchange_tokens * exchange_k;
  time_on_stream(state, s.compute, [&](cudaStream_t st) {
    const weave::cuda_stream_ref r(st);
    mask.run(in.ids.as<std::int32_t>(), rows.as<std::int64_t>(), mws.ptr, st);
    // Dispatch into the mask layout (expert-major rows), experts, combine of each token's rows.
    weave::cuda_space::for_each(
        r, static_cast<std::int64_t>(pairs),
        invert_rows{rows.as<std::int64_t>(), exchange_k, row_token.as<std::int64_t>()});
    weave::row_moves<weave::cuda_space>::gather(r, in.x.rows(), view(expert_rows, pairs),
                                                row_token.as<std::int64_t>(), nullptr, nullptr);
    WEAVE_CUDA_CHECK(cudaMemcpyAsync(expert_out.ptr, expert_rows.ptr, pairs * row_bytes,
                                     cudaMemcpyDeviceToDevice, st));
    weave::row_moves<weave::cuda_space>::merge(r, view(expert_out, pairs), in.y.rows(),
                                               rows.as<std::int64_t>(), exchange_k,
                                               in.weights.as<float>(), nullptr, false);
  });
  state.counters["tokens/s"] = benchmark::Counter(
      static_cast<double>(exchange_tokens * state.iterations()), benchmark::Counter::kIsRate);
}
#endif

} // namespace

namespace {

// Every instance runs a fixed number of iterations, once: Google Benchmark's probing for an
// iteration count would re-run each function (its buffers, NCCL communicators, exchanges and
// workspaces included) several times. Setup stays outside the timed loops. An exception (a CUDA
// or NCCL error) ends the instance as an error in the report, not the process.
constexpr int bandwidth_iterations = 200, gate_iterations = 100, pipeline_iterations = 10,
              exchange_iterations = 50, decode_iterations = 100, world_iterations = 3;

template <void (*F)(benchmark::State&)>
void guarded(benchmark::State& state) {
  try {
    F(state);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

benchmark::internal::Benchmark* add(const char* name, void (*f)(benchmark::State&),
                                    int iterations) {
  return benchmark::RegisterBenchmark(name, f)
      ->UseManualTime()
      ->Iterations(iterations)
      ->Unit(benchmark::kMicrosecond);
}

void register_benchmarks() {
  add("BM_d2d_copy", guarded<BM_d2d_copy>, bandwidth_iterations)->Arg(16384)->Arg(65536);
  add("BM_gather", guarded<BM_gather>, bandwidth_iterations)
      ->Args({16384, 0})
      ->Args({65536, 0})
      ->Args({16384, 1})
      ->Args({65536, 1});
  add("BM_merge", guarded<BM_merge>, bandwidth_iterations)
      ->Args({16384, 2})
      ->Args({65536, 2})
      ->Args({16384, 8})
      ->Args({65536, 8});
  // Gate (k = 8) and plans: E = 64 and 256, T = 16384 and 65536 tokens.
  const auto gate_args = [](benchmark::internal::Benchmark* b) {
    for (const int E : {64, 256})
      for (const int T : {16384, 65536})
        b->Args({E, T});
  };
  add("BM_gate", guarded<BM_gate>, gate_iterations)->Apply(gate_args);
  add("BM_gate_plan_weave", guarded<BM_gate_plan_weave>, gate_iterations)->Apply(gate_args);
  add("BM_gate_plan_mask", guarded<BM_gate_plan_mask>, gate_iterations)->Apply(gate_args);
  add("BM_pipeline", guarded<BM_pipeline>, pipeline_iterations)
      ->Arg(1)
      ->Arg(2)
      ->Arg(4)
      ->Arg(8)
      ->Arg(16)
      ->Unit(benchmark::kMillisecond);
#ifdef WEAVE_BENCH_NCCL
  add("BM_exchange_naive", guarded<BM_exchange_naive>, exchange_iterations);
  add("BM_exchange", guarded<BM_exchange>, exchange_iterations)
      ->ArgNames({"static", "chunks", "graph"})
      ->Args({0, 1, 0})
      ->Args({0, 4, 0})
      ->Args({1, 1, 0})
      ->Args({1, 4, 0})
      ->Args({1, 1, 1})
      ->Args({1, 4, 1});
  add("BM_exchange_world", guarded<BM_exchange_world>, world_iterations)
      ->ArgNames({"static", "chunks"})
      ->Args({0, 1})
      ->Args({0, 4})
      ->Args({1, 1})
      ->Args({1, 4});
  add("BM_decode", guarded<BM_decode>, decode_iterations)
      ->ArgNames({"mode", "tokens"})
      ->Apply([](benchmark::internal::Benchmark* b) {
        for (int tokens : {1, 8, 64, 256}) // each size's modes next to each other
          for (int mode : {0, 1, 2})
            b->Args({mode, tokens});
      });
#endif
}

bool listing(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--benchmark_list_tests" || arg == "--benchmark_list_tests=true" || arg == "--help")
      return true;
  }
  return false;
}

} // namespace

// Lists its benchmarks anywhere; runs them only where a GPU is (else reports skipped, exit 77,
// as the CUDA tests do).
int main(int argc, char** argv) {
  register_benchmarks();
  if (!listing(argc, argv) && weave::cuda_device_count() == 0) {
    std::printf("skipped: no GPU\n");
    return 77;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv))
    return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
