// Block-scaled FP8 quantisation on the host (one thread) beside memcpy of the same source bytes:
// - quantize: bf16 / f32 rows -> e4m3 codes + one f32 scale per 128 elements (exact and
//   power-of-two scales);
// - dequantize: e4m3 codes + scales -> bf16 / f32 rows;
// - memcpy: the source rows' bytes, the bandwidth ceiling of a pass that reads them once.
// Counters: GB/s of source bytes (src_GBps; what memcpy moves too), rows/s, and wire_ratio, the
// quantised bytes per row (codes + scales) over the bf16 row's bytes.
// Arguments: T tokens, H hidden size.
#include <benchmark/benchmark.h>

#include <weave/core/host_matrix.hpp>
#include <weave/routing/quantize.hpp>

#include <cstring>
#include <random>
#include <vector>

namespace {

template <class T>
weave::host_matrix<T> activations(std::size_t T_, std::size_t H) {
  weave::host_matrix<T> out(T_, H);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& v : out.elements())
    v = T(normal(rng));
  return out;
}

void counters(benchmark::State& state, std::size_t src_bytes) {
  const auto T_ = static_cast<double>(state.range(0));
  const auto H = static_cast<double>(state.range(1));
  state.counters["src_GBps"] = benchmark::Counter(static_cast<double>(src_bytes) * 1e-9,
                                                  benchmark::Counter::kIsIterationInvariantRate);
  state.counters["rows_per_s"] =
      benchmark::Counter(T_, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["wire_ratio"] = (H + 4 * H / 128) / (2 * H);
}

template <class T>
void quantize(benchmark::State& state, weave::scale_rounding rounding) {
  const auto T_ = static_cast<std::size_t>(state.range(0));
  const auto H = static_cast<std::size_t>(state.range(1));
  const auto src = activations<T>(T_, H);
  weave::host_matrix<weave::fp8_e4m3> codes(T_, H);
  weave::host_matrix<float> scales(T_, H / 128);
  weave::block_quantization q;
  q.rounding = rounding;
  for (auto _ : state) {
    weave::quantize_rows(src.view(), codes.view(), scales.view(), q);
    benchmark::DoNotOptimize(codes.data());
    benchmark::ClobberMemory();
  }
  counters(state, T_ * H * sizeof(T));
}

template <class T>
void dequantize(benchmark::State& state) {
  const auto T_ = static_cast<std::size_t>(state.range(0));
  const auto H = static_cast<std::size_t>(state.range(1));
  const auto src = activations<float>(T_, H);
  weave::host_matrix<weave::fp8_e4m3> codes(T_, H);
  weave::host_matrix<float> scales(T_, H / 128);
  weave::quantize_rows(src.view(), codes.view(), scales.view());
  weave::host_matrix<T> out(T_, H);
  for (auto _ : state) {
    weave::dequantize_rows(codes.view(), scales.view(), out.view());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  counters(state, T_ * H + T_ * H / 128 * sizeof(float));
}

template <class T>
void memcpy_baseline(benchmark::State& state) {
  const auto T_ = static_cast<std::size_t>(state.range(0));
  const auto H = static_cast<std::size_t>(state.range(1));
  const auto src = activations<T>(T_, H);
  weave::host_matrix<T> dst(T_, H);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), T_ * H * sizeof(T));
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  counters(state, T_ * H * sizeof(T));
}

void shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"T", "H"});
  b->Args({1024, 7168}); // DeepSeek-V3's hidden size
  b->Args({4096, 2048});
  b->Unit(benchmark::kMillisecond)->MinTime(0.3)->UseRealTime();
}

void register_all() {
  using weave::bfloat16;
  using weave::scale_rounding;
  shapes(benchmark::RegisterBenchmark("memcpy/bf16", memcpy_baseline<bfloat16>));
  shapes(benchmark::RegisterBenchmark("quantize/bf16_e4m3", quantize<bfloat16>,
                                      scale_rounding::exact));
  shapes(benchmark::RegisterBenchmark("quantize/bf16_e4m3_pow2", quantize<bfloat16>,
                                      scale_rounding::power_of_two));
  shapes(benchmark::RegisterBenchmark("memcpy/f32", memcpy_baseline<float>));
  shapes(benchmark::RegisterBenchmark("quantize/f32_e4m3", quantize<float>, scale_rounding::exact));
  shapes(benchmark::RegisterBenchmark("dequantize/e4m3_bf16", dequantize<bfloat16>));
  shapes(benchmark::RegisterBenchmark("dequantize/e4m3_f32", dequantize<float>));
}

} // namespace

int main(int argc, char** argv) {
  register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv))
    return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
