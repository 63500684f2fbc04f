//! \file
//! Per-token steps of top-k gating written once for the host and the device
//! (`WEAVE_HOST_DEVICE`): the bf16 rounding of `gate_precision::bf16` and the finishing of a
//! token's k weights (renormalization, bf16 arithmetic, `route_scale`).
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

} // namespace detail

WEAVE_NAMESPACE_END
