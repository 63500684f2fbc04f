//! \file
//! CUDA top-k gating (compiled by the consumer's nvcc): the device twin of `top_k_gate` in
//! `gate.hpp`, one warp per token.
//!
//! Same options and outputs as the host gate (softmax or sigmoid scores, additive selection
//! bias, highest selection first with ties to the lower expert id, weights = unbiased scores,
//! optional renormalization in rank order). The softmax sum is a warp tree reduction rather
//! than the host's sequential sum and `expf` may differ from the host's `std::exp` by an ulp,
//! so weights agree with the host to about 1e-6 relative (tests allow 1e-5); ids agree exactly
//! unless two selection scores are within that distance of each other. The optional top score
//! (largest unbiased score over all E experts) agrees to the same tolerance. Not on the device:
//! the device and group limits (`options.limit` and `options.groups` must be null), the
//! auxiliary loss and the `limited` count.
//! Logits, bias, ids and weights are device memory.
#pragma once

#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/core/cuda_dtype.hpp"
#include "weave/core/cuda_error.hpp"
#include "weave/core/tensor.hpp"
#include "weave/exec/cuda_stream.hpp"
#include "weave/routing/gate.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math_constants.h>

#include <cstddef>
#include <cstdint>
#include <span>

WEAVE_NAMESPACE_BEGIN

//! Bits the device gate sets in its error word (bad input found on the device).
enum cuda_gate_error : std::uint32_t {
  cuda_gate_bad_logit = 1, //!< a NaN or +inf logit
  cuda_gate_empty_row = 2, //!< a softmax row of only -inf logits
  cuda_gate_bad_bias = 4,  //!< a non-finite bias value
};

namespace detail {

__device__ inline float gate_load(const float* p, std::size_t e) {
  return p[e];
}
__device__ inline float gate_load(const double* p, std::size_t e) {
  return static_cast<float>(p[e]);
}
__device__ inline float gate_load(const __half* p, std::size_t e) {
  return __half2float(p[e]);
}
__device__ inline float gate_load(const __nv_bfloat16* p, std::size_t e) {
  return __bfloat162float(p[e]);
}

// (key, id) is better than (best, best_id): higher key, then lower id; id < 0 is "none".
__device__ inline bool gate_better(float key, int id, float best, int best_id) {
  return id >= 0 && (best_id < 0 || key > best || (key == best && id < best_id));
}

// One warp per token (grid-stride over warps). Shared memory: per warp E scores then E
// selection keys. A taken expert's key becomes NaN, which valid keys never are (scores lie in
// [0, 1], bias is finite), so it is skipped by later rounds.
template <class T>
__global__ void top_k_gate_kernel(const std::byte* logits, std::size_t stride, std::int64_t tokens,
                                  int E, int k, bool sigmoid, bool renormalize, const float* bias,
                                  std::int32_t* ids, float* weights, float* top_score,
                                  std::uint32_t* error) {
  extern __shared__ float gate_smem[];
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int warp = static_cast<int>(threadIdx.x / 32);
  const int warps = static_cast<int>(blockDim.x / 32);
  float* score = gate_smem + static_cast<std::size_t>(warp) * 2 * static_cast<std::size_t>(E);
  float* key = score + E;
  const float neg_inf = -CUDART_INF_F;
  std::uint32_t flags = 0;
  for (std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * warps + warp; t < tokens;
       t += static_cast<std::int64_t>(gridDim.x) * warps) {
    const T* row = reinterpret_cast<const T*>(logits + static_cast<std::size_t>(t) * stride);
    float top = neg_inf;
    for (int e = lane; e < E; e += 32) {
      const float x = gate_load(row, static_cast<std::size_t>(e));
      if (isnan(x) || x == CUDART_INF_F)
        flags |= cuda_gate_bad_logit;
      score[e] = x;
      top = x > top ? x : top;
    }
    for (int off = 16; off > 0; off /= 2) {
      const float o = __shfl_xor_sync(0xffffffffu, top, off);
      top = o > top ? o : top;
    }
    if (!sigmoid) {
      if (top == neg_inf)
        flags |= cuda_gate_empty_row;
      float sum = 0.0f;
      for (int e = lane; e < E; e += 32) {
        score[e] = expf(score[e] - top);
        sum += score[e];
      }
      for (int off = 16; off > 0; off /= 2)
        sum += __shfl_xor_sync(0xffffffffu, sum, off);
      for (int e = lane; e < E; e += 32)
        score[e] = score[e] / sum;
    } else {
      for (int e = lane; e < E; e += 32)
        score[e] = 1.0f / (1.0f + expf(-score[e]));
    }
    float best_score = neg_inf;
    for (int e = lane; e < E; e += 32) {
      if (bias != nullptr && !isfinite(bias[e]))
        flags |= cuda_gate_bad_bias;
      key[e] = bias != nullptr ? score[e] + bias[e] : score[e];
      best_score = score[e] > best_score ? score[e] : best_score;
    }
    if (top_score != nullptr) {
      for (int off = 16; off > 0; off /= 2) {
        const float o = __shfl_xor_sync(0xffffffffu, best_score, off);
        best_score = o > best_score ? o : best_score;
      }
      if (lane == 0)
        top_score[t] = best_score;
    }
    __syncwarp();
    std::int32_t* tid = ids + static_cast<std::size_t>(t) * static_cast<std::size_t>(k);
    float* tw = weights + static_cast<std::size_t>(t) * static_cast<std::size_t>(k);
    float chosen_sum = 0.0f;
    for (int r = 0; r < k; ++r) {
      float best = neg_inf;
      int best_id = -1;
      for (int e = lane; e < E; e += 32)
        if (!isnan(key[e]) && gate_better(key[e], e, best, best_id)) {
          best = key[e];
          best_id = e;
        }
      // Butterfly over a strict total order: every lane ends with the same winner.
      for (int off = 16; off > 0; off /= 2) {
        const float ob = __shfl_xor_sync(0xffffffffu, best, off);
        const int oid = __shfl_xor_sync(0xffffffffu, best_id, off);
        if (gate_better(ob, oid, best, best_id)) {
          best = ob;
          best_id = oid;
        }
      }
      if (best_id < 0) { // only with invalid input (flagged above): keep the outputs defined
        best_id = 0;
        best = 0.0f;
      }
      if (lane == 0) {
        tid[r] = best_id;
        tw[r] = score[best_id];
        chosen_sum += score[best_id];
      }
      __syncwarp();
      if (lane == best_id % 32)
        key[best_id] = CUDART_NAN_F;
      __syncwarp();
    }
    if (lane == 0 && renormalize && chosen_sum > 0.0f)
      for (int r = 0; r < k; ++r)
        tw[r] = tw[r] / chosen_sum;
    __syncwarp(); // the next token reuses this warp's shared arrays
  }
  if (flags != 0 && error != nullptr)
    atomicOr(reinterpret_cast<unsigned int*>(error), flags);
}

// Warps per block for E experts: as many of 4 as fit in 48 KiB of shared memory.
inline int gate_warps(int E) {
  const std::size_t per_warp = 2 * sizeof(float) * static_cast<std::size_t>(E);
  const std::size_t fit = (48 * 1024) / per_warp;
  return fit >= 4 ? 4 : static_cast<int>(fit);
}

} // namespace detail

//! Largest number of experts the device gate handles (one warp's scores in shared memory).
inline constexpr int cuda_gate_max_experts = 48 * 1024 / (2 * static_cast<int>(sizeof(float)));

//! CUDA `top_k_gate` on `stream`: writes k ids and weights per token of `logits` ([T, E], f32,
//! f16, bf16 or f64, device memory) to `ids` / `weights` (T * k each) and, when `top_score` is
//! not empty (T values, device memory), each token's top score as the host gate does.
//! `options.bias`, when given, must be device (or managed) memory too: a host `gate_options`
//! cannot be reused as it is. Input errors found on the device are OR-ed into `*error`
//! (`cuda_gate_error` bits; device memory, may be null) and leave that token's outputs
//! unspecified. Throws `errc::invalid_argument` for k outside 1..E, E above
//! `cuda_gate_max_experts`, logits not in device memory or of a non-floating type, a bias in
//! host memory, `errc::not_supported` for a device or group limit, `errc::size_mismatch` as the
//! host gate does.
inline void top_k_gate(cuda_stream_ref stream, const_token_view logits, const gate_options& options,
                       std::span<std::int32_t> ids, std::span<float> weights,
                       std::uint32_t* error = nullptr, std::span<float> top_score = {}) {
  const std::size_t T = logits.rows();
  const std::size_t E = logits.cols();
  const int k = options.k;
  WEAVE_EXPECT(E >= 1 && E <= static_cast<std::size_t>(cuda_gate_max_experts),
               errc::invalid_argument, "CUDA gate over ", E, " experts (1..", cuda_gate_max_experts,
               " supported)");
  WEAVE_EXPECT(k >= 1 && static_cast<std::size_t>(k) <= E, errc::invalid_argument, "k = ", k,
               " outside 1..", E, " (the number of experts)");
  WEAVE_EXPECT(is_floating(logits.element_type()), errc::invalid_argument, "gate logits of type ",
               logits.element_type(), " (need f32, f16, bf16 or f64)");
  WEAVE_EXPECT(device_accessible(logits.space()), errc::invalid_argument, "CUDA gate logits in ",
               logits.space(), " memory");
  WEAVE_EXPECT(options.limit == nullptr, errc::not_supported,
               "device-limited routing on the GPU (use the host gate)");
  WEAVE_EXPECT(options.groups == nullptr, errc::not_supported,
               "group-limited routing on the GPU (use the host gate)");
  const std::size_t out = checked_mul(T, static_cast<std::size_t>(k), "gate outputs");
  WEAVE_EXPECT(ids.size() == out && weights.size() == out, errc::size_mismatch, "gate outputs of ",
               ids.size(), " ids and ", weights.size(), " weights for ", T, " tokens with k = ", k);
  WEAVE_EXPECT(options.bias.empty() || options.bias.size() == E, errc::size_mismatch, "bias of ",
               options.bias.size(), " values for ", E, " experts");
  if (!options.bias.empty()) {
    // A host bias would fault inside the kernel with an illegal address; say so here instead.
    cudaPointerAttributes attributes{};
    WEAVE_CUDA_CHECK(cudaPointerGetAttributes(&attributes, options.bias.data()));
    WEAVE_EXPECT(attributes.type == cudaMemoryTypeDevice ||
                     attributes.type == cudaMemoryTypeManaged,
                 errc::invalid_argument,
                 "CUDA gate bias in host memory (it must be device or managed memory)");
  }
  WEAVE_EXPECT(top_score.empty() || top_score.size() == T, errc::size_mismatch,
               "gate top_score of ", top_score.size(), " values for ", T, " tokens");
  if (T == 0)
    return;
  const int Ei = static_cast<int>(E);
  const int warps = detail::gate_warps(Ei);
  const auto blocks_needed = (static_cast<std::int64_t>(T) + warps - 1) / warps;
  const auto blocks = static_cast<unsigned>(blocks_needed < 65535 ? blocks_needed : 65535);
  const std::size_t smem = static_cast<std::size_t>(warps) * 2 * sizeof(float) * E;
  const float* bias = options.bias.empty() ? nullptr : options.bias.data();
  const bool sigmoid = options.scoring == gate_scoring::sigmoid;
  auto launch = [&]<class L>(L*) {
    detail::top_k_gate_kernel<L><<<blocks, static_cast<unsigned>(32 * warps), smem, stream.get()>>>(
        logits.data(), logits.row_stride(), static_cast<std::int64_t>(T), Ei, k, sigmoid,
        options.renormalize, bias, ids.data(), weights.data(),
        top_score.empty() ? nullptr : top_score.data(), error);
  };
  switch (logits.element_type()) {
  case dtype::f32:
    launch(static_cast<float*>(nullptr));
    break;
  case dtype::f64:
    launch(static_cast<double*>(nullptr));
    break;
  case dtype::f16:
    launch(static_cast<__half*>(nullptr));
    break;
  default:
    launch(static_cast<__nv_bfloat16*>(nullptr));
    break;
  }
  WEAVE_CUDA_CHECK(cudaGetLastError());
}

WEAVE_NAMESPACE_END
