//! \file
//! Per-token steps of top-k gating written once for the host and the device
//! (`WEAVE_HOST_DEVICE`): the bf16 rounding of `gate_precision::bf16`, the finishing of a
//! token's k weights (renormalization, bf16 arithmetic, `route_scale`), which both gates share,
//! and the CUDA gate's group-limit steps, which mirror the host's `select_groups` and are
//! checked against it on the host (`tests/routing/gate_steps_test.cpp`), since the CUDA gate
//! itself runs only where a GPU is.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/fp8.hpp"

#include <cstdint>

WEAVE_NAMESPACE_BEGIN

namespace detail {

//! `x` rounded to the nearest bf16 value (ties to even), as a float; NaN stays NaN. Equal to
//! `float(bfloat16(x))` and to CUDA's `__float2bfloat16_rn`.
WEAVE_HOST_DEVICE constexpr float round_to_bf16(float x) noexcept {
  const std::uint32_t b = float_bits(x);
  if ((b & 0x7fffffffu) > 0x7f800000u)
    return x;
  return bits_float((b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u);
}

//! How a gate call turns a token's k chosen scores into its weights.
struct gate_weight_rule {
  bool renormalize = false;  //!< divide by the sum of the k scores
  bool bf16_weights = false; //!< weights held in bf16: the sum and each quotient and product
                             //!< rounded to bf16 (sigmoid scores under `gate_precision::bf16`)
  bool bf16_output = false;  //!< the final weights rounded to bf16 (`gate_precision::bf16`)
  float route_scale = 1.0f;  //!< multiplies the weights after the renormalization
};

//! Finishes the `k` weights at `w` (the chosen scores, in rank order) under `rule`. The sum is
//! taken in f32 in rank order from 0 (then rounded to bf16 with `bf16_weights`, as torch rounds
//! the f32 accumulation of a bf16 sum); a sum of 0 leaves the scores undivided.
WEAVE_HOST_DEVICE inline void finish_weights(float* w, int k, const gate_weight_rule& rule) {
  if (rule.renormalize) {
    float sum = 0.0f;
    for (int i = 0; i < k; ++i)
      sum += w[i];
    if (rule.bf16_weights)
      sum = round_to_bf16(sum);
    if (sum > 0.0f)
      for (int i = 0; i < k; ++i) {
        w[i] = fdiv_rn(w[i], sum);
        if (rule.bf16_weights)
          w[i] = round_to_bf16(w[i]);
      }
  }
  for (int i = 0; i < k; ++i) {
    w[i] = fmul_rn(w[i], rule.route_scale); // exact for a scale of 1
    if (rule.bf16_weights || rule.bf16_output)
      w[i] = round_to_bf16(w[i]);
  }
}

//! How many of a group's best selection keys its score sums: `scores_per_group` when set, else
//! DeepSeek-V3's rule: 2 when the gate has a bias (`topk(2).sum`), 1 without (`amax`). A bias
//! with one expert per group takes that expert's key (the reference's `topk(2)` would fail).
WEAVE_HOST_DEVICE constexpr int group_score_count(int scores_per_group, int group_size,
                                                  bool biased) noexcept {
  return scores_per_group > 0 ? scores_per_group : biased && group_size >= 2 ? 2 : 1;
}

//! Group score of one token's group: the sum of the `m` highest of its `n` selection keys,
//! added in descending order starting from 0, as `select_groups` adds them (so the two agree
//! bit for bit). Keys must be finite. O(m * n) without scratch: each pass takes the best key
//! after the previous one in the order (higher key, then lower index).
WEAVE_HOST_DEVICE inline float group_score(const float* key, int n, int m) {
  float sum = 0.0f;
  float last = 0.0f;
  int last_at = -1;
  for (int i = 0; i < m; ++i) {
    float best = 0.0f;
    int best_at = -1;
    for (int e = 0; e < n; ++e) {
      const bool after = last_at < 0 || key[e] < last || (key[e] == last && e > last_at);
      if (after && (best_at < 0 || key[e] > best)) {
        best = key[e];
        best_at = e;
      }
    }
    sum += best;
    last = best;
    last_at = best_at;
  }
  return sum;
}

//! True when group `g` is among the `top` best of the `groups` scores at `score`: fewer than
//! `top` groups score higher or score the same with a lower index (ties keep the lower group,
//! as `select_groups` does).
WEAVE_HOST_DEVICE inline bool group_kept(const float* score, int groups, int top, int g) {
  int ahead = 0;
  for (int h = 0; h < groups; ++h)
    ahead += score[h] > score[g] || (score[h] == score[g] && h < g) ? 1 : 0;
  return ahead < top;
}

} // namespace detail

WEAVE_NAMESPACE_END
