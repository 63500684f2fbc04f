//! \file
//! CUDA top-k gating (compiled by the consumer's nvcc): the device twin of `top_k_gate` in
//! `gate.hpp`, one warp per token.
//!
//! Same options and outputs as the host gate (softmax or sigmoid scores, additive selection
//! bias, DeepSeek-V3's group limit, highest selection first with ties to the lower expert id,
//! weights = unbiased scores, optional renormalization in rank order, `route_scale`,
//! `gate_precision`). The group limit and the weights' finishing are the host's rules written
//! once for both (`weave/routing/gate_steps.hpp`), so given the same scores the device keeps
//! the same groups, chooses the same experts and writes the same weights bit for bit. The
//! scores themselves can differ: the softmax sum is a warp tree reduction rather than the
//! host's sequential sum and `expf` may differ from the host's `std::exp` by an ulp, so weights
//! agree with the host to about 1e-6 relative (tests allow 1e-5; with `gate_precision::bf16`, a
//! bf16 rounding can land one bf16 ulp apart) and ids agree exactly unless two selection (or
//! group) scores are within that distance of each other. The optional top score (largest
//! unbiased score over all E experts) agrees to the same tolerance. Not on the device: the
//! device limit (`options.limit` must be null: it resolves replicas per token through the
//! placement), the auxiliary loss and the `limited` count.
//! Logits, bias, ids and weights are device memory.
#pragma once

#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/core/cuda_dtype.hpp"
#include "weave/core/cuda_error.hpp"
#include "weave/core/float_bits.hpp"
#include "weave/core/tensor.hpp"
#include "weave/exec/cuda_stream.hpp"
#include "weave/routing/gate.hpp"
#include "weave/routing/gate_steps.hpp"
#include "weave/routing/group_limit.hpp"

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

// The launch's arguments (one struct: the kernel's parameter list stays short).
struct gate_kernel_args {
  const std::byte* logits = nullptr;
  std::size_t stride = 0; // bytes between logit rows
  std::int64_t tokens = 0;
  int E = 0, k = 0;
  bool sigmoid = false;
  bool bf16 = false; // gate_precision::bf16: logits and sigmoid scores rounded to bf16
  const float* bias = nullptr;
  int groups = 0; // group limit: 0 for none
  int top_groups = 0, group_scores = 0;
  gate_weight_rule weights;
  std::int32_t* ids = nullptr;
  float* weight = nullptr;
  float* top_score = nullptr;
  std::uint32_t* error = nullptr;
};

// Floats of shared memory per warp: E scores, E selection keys, then the group scores.
WEAVE_HOST_DEVICE inline std::size_t gate_smem_floats(int E, int groups) {
  return 2 * static_cast<std::size_t>(E) + static_cast<std::size_t>(groups);
}

// One warp per token (grid-stride over warps). A taken expert's key becomes NaN, which valid
// keys never are (scores lie in [0, 1], bias is finite), so it is skipped by later rounds; so
// does every expert of a group the token does not keep.
template <class T>
__global__ void top_k_gate_kernel(gate_kernel_args a) {
  extern __shared__ float gate_smem[];
  const int E = a.E, k = a.k;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int warp = static_cast<int>(threadIdx.x / 32);
  const int warps = static_cast<int>(blockDim.x / 32);
  float* score = gate_smem + static_cast<std::size_t>(warp) * gate_smem_floats(E, a.groups);
  float* key = score + E;
  float* group_score_of = key + E;
  const float* bias = a.bias;
  const float neg_inf = -CUDART_INF_F;
  std::uint32_t flags = 0;
  for (std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * warps + warp; t < a.tokens;
       t += static_cast<std::int64_t>(gridDim.x) * warps) {
    const T* row = reinterpret_cast<const T*>(a.logits + static_cast<std::size_t>(t) * a.stride);
    float top = neg_inf;
    for (int e = lane; e < E; e += 32) {
      float x = gate_load(row, static_cast<std::size_t>(e));
      if (a.bf16)
        x = round_to_bf16(x);
      if (is_nan(x) || is_positive_inf(x)) // bits: no flag may fold these away
        flags |= cuda_gate_bad_logit;
      score[e] = x;
      top = x > top ? x : top;
    }
    for (int off = 16; off > 0; off /= 2) {
      const float o = __shfl_xor_sync(0xffffffffu, top, off);
      top = o > top ? o : top;
    }
    if (!a.sigmoid) {
      if (is_negative_inf(top))
        flags |= cuda_gate_empty_row;
      float sum = 0.0f;
      for (int e = lane; e < E; e += 32) { // a -inf logit scores 0 on its bits (host gate)
        score[e] = is_negative_inf(score[e]) ? 0.0f : expf(score[e] - top);
        sum += score[e];
      }
      for (int off = 16; off > 0; off /= 2)
        sum += __shfl_xor_sync(0xffffffffu, sum, off);
      for (int e = lane; e < E; e += 32)
        score[e] = score[e] / sum;
    } else {
      for (int e = lane; e < E; e += 32) {
        score[e] = is_negative_inf(score[e]) ? 0.0f : 1.0f / (1.0f + expf(-score[e]));
        if (a.bf16)
          score[e] = round_to_bf16(score[e]);
      }
    }
    float best_score = neg_inf;
    for (int e = lane; e < E; e += 32) {
      if (bias != nullptr && !is_finite(bias[e]))
        flags |= cuda_gate_bad_bias;
      key[e] = bias != nullptr ? score[e] + bias[e] : score[e];
      best_score = score[e] > best_score ? score[e] : best_score;
    }
    if (a.top_score != nullptr) {
      for (int off = 16; off > 0; off /= 2) {
        const float o = __shfl_xor_sync(0xffffffffu, best_score, off);
        best_score = o > best_score ? o : best_score;
      }
      if (lane == 0)
        a.top_score[t] = best_score;
    }
    __syncwarp();
    if (a.groups > 0) {
      // The host's group rule (gate_steps.hpp): score every group, then drop every expert of
      // a group outside the token's best top_groups. A lane per group in both phases.
      const int size = E / a.groups;
      for (int g = lane; g < a.groups; g += 32)
        group_score_of[g] = group_score(key + g * size, size, a.group_scores);
      __syncwarp();
      for (int g = lane; g < a.groups; g += 32)
        if (!group_kept(group_score_of, a.groups, a.top_groups, g))
          for (int e = g * size; e < (g + 1) * size; ++e)
            key[e] = CUDART_NAN_F;
      __syncwarp();
    }
    std::int32_t* tid = a.ids + static_cast<std::size_t>(t) * static_cast<std::size_t>(k);
    float* tw = a.weight + static_cast<std::size_t>(t) * static_cast<std::size_t>(k);
    for (int r = 0; r < k; ++r) {
      float best = neg_inf;
      int best_id = -1;
      for (int e = lane; e < E; e += 32)
        if (!is_nan(key[e]) && gate_better(key[e], e, best, best_id)) {
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
      }
      __syncwarp();
      if (lane == best_id % 32)
        key[best_id] = CUDART_NAN_F;
      __syncwarp();
    }
    if (lane == 0)
      finish_weights(tw, k, a.weights); // the host's arithmetic, in rank order
    __syncwarp();                       // the next token reuses this warp's shared arrays
  }
  if (flags != 0 && a.error != nullptr)
    atomicOr(reinterpret_cast<unsigned int*>(a.error), flags);
}

// Shared memory the device gate can use per block.
inline constexpr std::size_t gate_smem_limit = 48 * 1024;

// Warps per block: as many of 4 as fit in `gate_smem_limit` (at least one: checked first).
inline int gate_warps(int E, int groups) {
  const std::size_t fit = gate_smem_limit / (sizeof(float) * gate_smem_floats(E, groups));
  return fit >= 4 ? 4 : static_cast<int>(fit);
}

} // namespace detail

//! Largest number of experts the device gate handles (one warp's scores in shared memory);
//! with a group limit, 2 * E + groups must not exceed 2 * `cuda_gate_max_experts`.
inline constexpr int cuda_gate_max_experts =
    static_cast<int>(detail::gate_smem_limit / (2 * sizeof(float)));

//! CUDA `top_k_gate` on `stream`: writes k ids and weights per token of `logits` ([T, E], f32,
//! f16, bf16 or f64, device memory) to `ids` / `weights` (T * k each) and, when `top_score` is
//! not empty (T values, device memory), each token's top score as the host gate does.
//! `options.bias`, when given, must be device (or managed) memory too: a host `gate_options`
//! cannot be reused as it is (`options.groups` is read on the host). Input errors found on the
//! device are OR-ed into `*error` (`cuda_gate_error` bits; device memory, may be null) and leave
//! that token's outputs unspecified. Throws `errc::invalid_argument` for k outside 1..E, E above
//! `cuda_gate_max_experts` (or 2 * E + groups above twice that), logits not in device memory or
//! of a non-floating type, a bias in host memory, a group limit or `route_scale` the host gate
//! refuses (k above the experts of the kept groups among them), `errc::not_supported` for a
//! device limit, `errc::size_mismatch` as the host gate does.
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
  detail::check_route_scale(options.route_scale);
  if (options.groups != nullptr) {
    detail::validate_group_limit(*options.groups, static_cast<int>(E), k);
    WEAVE_EXPECT(detail::gate_smem_floats(static_cast<int>(E), options.groups->groups) <=
                     2 * static_cast<std::size_t>(cuda_gate_max_experts),
                 errc::invalid_argument, "CUDA gate over ", E, " experts in ",
                 options.groups->groups, " groups (2 * experts + groups up to ",
                 2 * cuda_gate_max_experts, " supported)");
  }
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
  detail::gate_kernel_args a;
  a.logits = logits.data();
  a.stride = logits.row_stride();
  a.tokens = static_cast<std::int64_t>(T);
  a.E = static_cast<int>(E);
  a.k = k;
  a.sigmoid = options.scoring == gate_scoring::sigmoid;
  a.bf16 = options.precision == gate_precision::bf16;
  a.bias = options.bias.empty() ? nullptr : options.bias.data();
  if (options.groups != nullptr) {
    const group_limit& g = *options.groups;
    a.groups = g.groups;
    a.top_groups = g.top_groups;
    a.group_scores = detail::group_score_count(g.scores_per_group, a.E / g.groups,
                                               a.bias != nullptr); // as select_groups
  }
  a.weights = detail::weight_rule_of(options);
  a.ids = ids.data();
  a.weight = weights.data();
  a.top_score = top_score.empty() ? nullptr : top_score.data();
  a.error = error;
  const int warps = detail::gate_warps(a.E, a.groups);
  const auto blocks_needed = (static_cast<std::int64_t>(T) + warps - 1) / warps;
  const auto blocks = static_cast<unsigned>(blocks_needed < 65535 ? blocks_needed : 65535);
  const std::size_t smem =
      static_cast<std::size_t>(warps) * sizeof(float) * detail::gate_smem_floats(a.E, a.groups);
  auto launch = [&]<class L>(L*) {
    detail::top_k_gate_kernel<L>
        <<<blocks, static_cast<unsigned>(32 * warps), smem, stream.get()>>>(a);
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
