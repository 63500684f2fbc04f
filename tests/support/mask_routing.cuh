// Tutel-style mask-based dispatch positions on the GPU, O(T * E): the baseline the counting-sort
// plan is checked and timed against. With one expert per destination (D = E), the SFD row of
// (token t, expert e) is offset[e] + (tokens before t choosing e): a one-hot mask [E][T], one
// exclusive scan over all E * T entries (a column's positions are its scan minus the scan at
// its start) and per-expert totals give it without any sort.
#pragma once

#include <weave/core/cuda_error.hpp>

#include <cub/cub.cuh>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace weave_test {

// mask[e * T + t] = 1 for every valid (t, e) pair of `ids` (mask zeroed before).
__global__ void mask_fill_kernel(const std::int32_t* ids, std::int64_t T, int k,
                                 std::int32_t* mask) {
  const std::int64_t p = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p >= T * k)
    return;
  const std::int32_t e = ids[p];
  if (e >= 0)
    mask[static_cast<std::int64_t>(e) * T + p / k] = 1;
}

// counts[e] = tokens choosing e, from the scan and the mask's last column entry.
__global__ void mask_counts_kernel(const std::int32_t* mask, const std::int32_t* scan,
                                   std::int64_t T, int E, std::int32_t* counts) {
  const int e = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (e >= E)
    return;
  const std::int64_t first = static_cast<std::int64_t>(e) * T, last = first + T - 1;
  counts[e] = scan[last] + mask[last] - scan[first];
}

// row[t * k + i] = offset[e] + position of t in column e, or -1 for no expert.
__global__ void mask_rows_kernel(const std::int32_t* ids, const std::int32_t* scan,
                                 const std::int32_t* offsets, std::int64_t T, int k,
                                 std::int64_t* row) {
  const std::int64_t p = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p >= T * k)
    return;
  const std::int32_t e = ids[p];
  if (e < 0) {
    row[p] = -1;
    return;
  }
  const std::int64_t first = static_cast<std::int64_t>(e) * T;
  row[p] = offsets[e] + (scan[first + p / k] - scan[first]);
}

// Device scratch of the mask path for T tokens and E experts (caller allocates `bytes()`).
struct mask_routing {
  std::int64_t T = 0;
  int E = 0, k = 0;
  std::size_t scan_temp = 0, offsets_temp = 0;

  mask_routing(std::int64_t tokens, int experts, int choices)
      : T(tokens)
      , E(experts)
      , k(choices) {
    WEAVE_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, scan_temp,
                                                   static_cast<const std::int32_t*>(nullptr),
                                                   static_cast<std::int32_t*>(nullptr), T * E));
    WEAVE_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, offsets_temp,
                                                   static_cast<const std::int32_t*>(nullptr),
                                                   static_cast<std::int32_t*>(nullptr), E));
  }
  static std::size_t up(std::size_t x) { return (x + 255) / 256 * 256; }
  std::size_t cells() const { return static_cast<std::size_t>(T) * static_cast<std::size_t>(E); }
  std::size_t bytes() const {
    return 2 * up(cells() * 4) + 2 * up(static_cast<std::size_t>(E) * 4) +
           up(scan_temp > offsets_temp ? scan_temp : offsets_temp);
  }

  // rows[t * k + i] (device, T * k) from device ids; all on `stream`.
  void run(const std::int32_t* ids, std::int64_t* rows, void* workspace,
           cudaStream_t stream) const {
    auto* base = static_cast<std::byte*>(workspace);
    auto* mask = reinterpret_cast<std::int32_t*>(base);
    auto* scan = reinterpret_cast<std::int32_t*>(base + up(cells() * 4));
    auto* counts = reinterpret_cast<std::int32_t*>(base + 2 * up(cells() * 4));
    auto* offsets = counts + up(static_cast<std::size_t>(E) * 4) / 4;
    void* temp = base + 2 * up(cells() * 4) + 2 * up(static_cast<std::size_t>(E) * 4);
    std::size_t temp_bytes = scan_temp > offsets_temp ? scan_temp : offsets_temp;
    const std::int64_t pairs = T * k;
    if (pairs == 0)
      return;
    WEAVE_CUDA_CHECK(cudaMemsetAsync(mask, 0, cells() * 4, stream));
    const auto blocks = static_cast<unsigned>((pairs + 255) / 256);
    mask_fill_kernel<<<blocks, 256, 0, stream>>>(ids, T, k, mask);
    WEAVE_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(temp, temp_bytes, mask, scan, T * E, stream));
    mask_counts_kernel<<<static_cast<unsigned>((E + 255) / 256), 256, 0, stream>>>(mask, scan, T, E,
                                                                                   counts);
    temp_bytes = scan_temp > offsets_temp ? scan_temp : offsets_temp;
    WEAVE_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(temp, temp_bytes, counts, offsets, E, stream));
    mask_rows_kernel<<<blocks, 256, 0, stream>>>(ids, scan, offsets, T, k, rows);
    WEAVE_CUDA_CHECK(cudaGetLastError());
  }
};

} // namespace weave_test
