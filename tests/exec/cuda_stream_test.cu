// cuda_stream_ref/cuda_event against the CUDA runtime itself: ordering through events between
// two caller-owned streams, and the wrapper never destroying the caller's stream.
#include <doctest/doctest.h>

#include <weave/exec/cuda_stream.hpp>

#include <cuda_runtime.h>

#include <vector>

namespace {
__global__ void spin_then_write(int* out, int value, long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
  *out = value;
}
__global__ void copy_one(const int* in, int* out) {
  *out = *in;
}
} // namespace

TEST_CASE("cuda_stream_ref orders a consumer stream after a producer's event") {
  cudaStream_t raw_a = nullptr, raw_b = nullptr;
  WEAVE_CUDA_CHECK(cudaStreamCreateWithFlags(&raw_a, cudaStreamNonBlocking));
  WEAVE_CUDA_CHECK(cudaStreamCreateWithFlags(&raw_b, cudaStreamNonBlocking));
  int *value = nullptr, *copy = nullptr;
  WEAVE_CUDA_CHECK(cudaMalloc(&value, sizeof(int)));
  WEAVE_CUDA_CHECK(cudaMalloc(&copy, sizeof(int)));
  WEAVE_CUDA_CHECK(cudaMemset(value, 0, sizeof(int)));
  {
    weave::cuda_stream_ref a(raw_a), b(raw_b);
    weave::cuda_event done;
    for (int round = 1; round <= 10; ++round) {
      spin_then_write<<<1, 1, 0, a.get()>>>(value, round, 2'000'000);
      a.record(done);
      b.wait(done);
      copy_one<<<1, 1, 0, b.get()>>>(value, copy);
      b.synchronize();
      int host = 0;
      WEAVE_CUDA_CHECK(cudaMemcpy(&host, copy, sizeof(int), cudaMemcpyDeviceToHost));
      REQUIRE(host == round);
    }
    CHECK(done.query());
    weave::cuda_event start(cudaEventDefault), end(cudaEventDefault);
    a.record(start);
    spin_then_write<<<1, 1, 0, a.get()>>>(value, 0, 1'000'000);
    a.record(end);
    end.synchronize();
    CHECK(weave::cuda_event::elapsed_ms(start, end) > 0.0f);
  }
  // The wrappers are gone; the caller's streams still work.
  WEAVE_CUDA_CHECK(cudaStreamSynchronize(raw_a));
  WEAVE_CUDA_CHECK(cudaStreamDestroy(raw_a));
  WEAVE_CUDA_CHECK(cudaStreamDestroy(raw_b));
  WEAVE_CUDA_CHECK(cudaFree(value));
  WEAVE_CUDA_CHECK(cudaFree(copy));
}

TEST_CASE("CUDA errors become weave::error naming the call") {
  void* p = nullptr;
  try {
    WEAVE_CUDA_CHECK(cudaMalloc(&p, std::size_t{1} << 62));
    FAIL("no throw");
  } catch (const weave::error& e) {
    CHECK(e.code() == weave::errc::cuda);
    CHECK(e.message().find("cudaMalloc") != std::string::npos);
  }
  (void)cudaGetLastError();
}
