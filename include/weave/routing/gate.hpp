//! \file
//! Top-k gating over [T, E] gate logits (f32, f16, bf16 or f64 rows; fp32 math).
//!
//! Scores are softmax probabilities or element-wise sigmoids of the logits. Experts are chosen
//! by selection score = score + bias[e] (the additive per-expert bias of aux-loss-free
//! balancing, DeepSeek-V3 style; empty bias = none), highest first, ties to the lower expert id,
//! optionally restricted to M devices (`device_limit`, by score) and/or to the token's best
//! expert groups (`group_limit`, DeepSeek-V3; applied first). The weight of a choice is its
//! unbiased score, optionally renormalized over the token's k choices, then multiplied by
//! `route_scale` (DeepSeek-V3's `routed_scaling_factor`). `gate_precision::bf16` rounds logits,
//! scores and weights to bf16 where DeepSeek-V3's reference gate does in a bf16 model (see
//! `gate_precision`). Optionally the gate also writes each token's top score: its largest
//! unbiased score over all E experts (Tutel's `scores.max(dim=1)`, the priority of its
//! batch-prioritized routing). The GShard/Tutel load-balancing loss is returned beside:
//! l_aux = E * sum_e mean_t(p[t, e]) * f[e], where p are the softmax probabilities (sigmoid
//! scores divided by their token's sum) and f[e] the fraction of tokens whose first choice is e.
#pragma once

#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/core/dtype.hpp"
#include "weave/core/error.hpp"
#include "weave/core/float_bits.hpp"
#include "weave/core/tensor.hpp"
#include "weave/routing/device_limit.hpp"
#include "weave/routing/gate_steps.hpp"
#include "weave/routing/group_limit.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

WEAVE_NAMESPACE_BEGIN

//! How logits become scores.
enum class gate_scoring : std::uint8_t {
  softmax, //!< p = softmax(logits) over the E experts
  sigmoid, //!< p = 1 / (1 + exp(-logit)), per expert
};

//! The precision of the gate's arithmetic.
enum class gate_precision : std::uint8_t {
  //! Logits read as float, every step in f32 (the default).
  f32,
  //! DeepSeek-V3's reference inference gate in a bf16 model (`Gate.forward` in its
  //! inference/model.py, whose logits come out of a bf16 GEMM): each logit is rounded to bf16
  //! (a no-op for bf16 logits; one that rounds to +inf is rejected as +inf); sigmoid scores are
  //! rounded to bf16 (torch's bf16 sigmoid), softmax scores stay f32 (the reference asks for an
  //! f32 softmax); the selection score is the score plus the f32 bias, in f32 (bf16 + f32
  //! promotes to f32); with sigmoid scores the weights stay bf16: their sum (accumulated in f32
  //! in rank order) is rounded to bf16, and so is each quotient and the product by
  //! `route_scale`; the final weights are rounded to bf16 (the reference's `type_as(x)`).
  //! Group scores, the choice and the tie rules are as in f32.
  bf16,
};

//! Parameters of `top_k_gate`.
struct gate_options {
  int k = 1;                                    //!< choices per token, 1..E
  gate_scoring scoring = gate_scoring::softmax; //!< score function
  bool renormalize = false;                     //!< divide the k weights by their sum
  std::span<const float> bias = {};             //!< per-expert selection bias (E values) or empty
  const device_limit* limit = nullptr;          //!< restrict each token to M devices (by score)
  const group_limit* groups = nullptr;          //!< restrict each token to its best expert groups
  //! Multiplies every weight after the renormalization (DeepSeek-V3's `routed_scaling_factor`,
  //! 2.5 for V3); finite and positive. The top score is not scaled.
  float route_scale = 1.0f;
  gate_precision precision = gate_precision::f32; //!< see `gate_precision`
};

//! What `top_k_gate` returns beside the choices.
struct gate_summary {
  double aux_loss = 0.0;    //!< GShard load-balancing loss of the batch
  std::size_t tokens = 0;   //!< rows gated
  std::int64_t limited = 0; //!< tokens whose unrestricted top-k was changed by the limits
};

//! Reusable scratch of `top_k_gate`; keeping one across calls avoids allocating per call.
struct gate_scratch {
  std::vector<float> score, selection;
  std::vector<double> mean_prob, first_choice;
  std::vector<std::uint8_t> allowed;
  std::vector<std::int32_t> unlimited;
  device_select_scratch devices;
  group_select_scratch groups;
};

namespace detail {

inline void check_route_scale(float scale) {
  WEAVE_EXPECT(is_finite(scale) && scale > 0.0f, errc::invalid_argument, "route_scale = ", scale,
               " (need a finite value above 0)");
}

//! The weights' rule of a call with `options`.
inline gate_weight_rule weight_rule_of(const gate_options& options) {
  const bool bf16 = options.precision == gate_precision::bf16;
  return {options.renormalize, bf16 && options.scoring == gate_scoring::sigmoid, bf16,
          options.route_scale};
}

// Keeps the k best (selection, id) pairs sorted: higher selection first, then lower id. Ids
// arrive ascending, so an equal selection never displaces an earlier (lower) id.
inline void top_k_insert(std::int32_t* ids, float* keys, int& filled, int k, std::int32_t id,
                         float key) {
  if (filled == k && !(key > keys[k - 1]))
    return;
  int at = filled < k ? filled : k - 1;
  while (at > 0 && key > keys[at - 1]) {
    ids[at] = ids[at - 1];
    keys[at] = keys[at - 1];
    --at;
  }
  ids[at] = id;
  keys[at] = key;
  if (filled < k)
    ++filled;
}

} // namespace detail

//! Gates `logits` ([T, E], one row per token): writes k expert ids per token to `ids` and their
//! weights to `weights` (token-major, rank order = descending selection score) and, when
//! `top_score` is not empty, each token's largest unbiased score over all E experts (before bias,
//! device limit, renormalization and route scale: the priority of Tutel's batch-prioritized
//! routing). Throws `errc::invalid_argument` for k outside 1..E, NaN or +inf logits, a row of
//! -inf logits (softmax), non-finite bias, a `route_scale` that is not finite and positive, a
//! group limit k does not fit in, or a non-floating logit type; `errc::size_mismatch` for output
//! spans that are not T * k long, a `top_score` that is neither empty nor T long, or a bias that
//! is not E long. Logits are computed in float: f64 logits are narrowed first, so a
//! finite value above FLT_MAX counts as +inf (rejected) and one below -FLT_MAX as -inf, on the
//! host and the CUDA gate alike.
inline gate_summary top_k_gate(const_token_view logits, const gate_options& options,
                               std::span<std::int32_t> ids, std::span<float> weights,
                               gate_scratch& scratch, std::span<float> top_score = {}) {
  const std::size_t T = logits.rows();
  const std::size_t E = logits.cols();
  const int k = options.k;
  WEAVE_EXPECT(E >= 1 && E <= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()),
               errc::invalid_argument, "gate over ", E, " experts");
  WEAVE_EXPECT(k >= 1 && static_cast<std::size_t>(k) <= E, errc::invalid_argument, "k = ", k,
               " outside 1..", E, " (the number of experts)");
  WEAVE_EXPECT(is_floating(logits.element_type()), errc::invalid_argument, "gate logits of type ",
               logits.element_type(), " (need f32, f16, bf16 or f64)");
  WEAVE_EXPECT(host_accessible(logits.space()), errc::invalid_argument, "gate logits in ",
               logits.space(), " memory (the host gate reads them)");
  const std::size_t kk = static_cast<std::size_t>(k);
  const std::size_t out = checked_mul(T, kk, "gate outputs");
  WEAVE_EXPECT(ids.size() == out && weights.size() == out, errc::size_mismatch, "gate outputs of ",
               ids.size(), " ids and ", weights.size(), " weights for ", T, " tokens with k = ", k);
  WEAVE_EXPECT(top_score.empty() || top_score.size() == T, errc::size_mismatch,
               "gate top_score of ", top_score.size(), " values for ", T, " tokens");
  WEAVE_EXPECT(options.bias.empty() || options.bias.size() == E, errc::size_mismatch, "bias of ",
               options.bias.size(), " values for ", E, " experts");
  for (std::size_t e = 0; e < options.bias.size(); ++e)
    WEAVE_EXPECT(detail::is_finite(options.bias[e]), errc::invalid_argument, "bias[", e,
                 "] = ", options.bias[e]);
  detail::check_route_scale(options.route_scale);
  if (options.limit != nullptr)
    detail::validate_limit(*options.limit, static_cast<int>(E), k);
  if (options.groups != nullptr)
    detail::validate_group_limit(*options.groups, static_cast<int>(E), k);

  scratch.score.resize(E);
  scratch.selection.resize(E);
  scratch.allowed.resize(E);
  scratch.unlimited.resize(kk);
  scratch.mean_prob.assign(E, 0.0);
  scratch.first_choice.assign(E, 0.0);
  float* score = scratch.score.data();
  float* selection = scratch.selection.data();
  const bool bf16 = options.precision == gate_precision::bf16;
  const detail::gate_weight_rule rule = detail::weight_rule_of(options);
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  gate_summary summary;
  summary.tokens = T;

  for (std::size_t t = 0; t < T; ++t) {
    const std::byte* row = logits.row(t);
    float top = neg_inf;
    for (std::size_t e = 0; e < E; ++e) {
      float x = load_as_float(row, e, logits.element_type());
      if (bf16)
        x = detail::round_to_bf16(x);
      // NaN or +inf, from the bits (see weave/core/float_bits.hpp: fast math folds isnan).
      WEAVE_EXPECT(!detail::is_nan(x) && !detail::is_positive_inf(x), errc::invalid_argument,
                   "logit[", t, ", ", e, "] = ", x);
      score[e] = x;
      top = x > top ? x : top;
    }
    float prob_sum = 0.0f;
    if (options.scoring == gate_scoring::softmax) {
      WEAVE_EXPECT(!detail::is_negative_inf(top), errc::invalid_argument, "token ", t,
                   " has only -inf logits: softmax is undefined");
      // A -inf logit (a masked expert) scores exactly 0, as exp(-inf) is, decided from its
      // bits: under fast math the arithmetic on infinities is unspecified (NaN, say).
      for (std::size_t e = 0; e < E; ++e) {
        score[e] = detail::is_negative_inf(score[e]) ? 0.0f : std::exp(score[e] - top);
        prob_sum += score[e];
      }
      for (std::size_t e = 0; e < E; ++e)
        score[e] /= prob_sum;
      prob_sum = 1.0f;
    } else {
      for (std::size_t e = 0; e < E; ++e) {
        score[e] = detail::is_negative_inf(score[e]) ? 0.0f // as in softmax
                                                     : 1.0f / (1.0f + std::exp(-score[e]));
        if (bf16)
          score[e] = detail::round_to_bf16(score[e]);
        prob_sum += score[e];
      }
    }
    float best_score = score[0];
    for (std::size_t e = 0; e < E; ++e) {
      selection[e] = options.bias.empty() ? score[e] : score[e] + options.bias[e];
      if (prob_sum > 0.0f)
        scratch.mean_prob[e] += static_cast<double>(score[e] / prob_sum);
      best_score = score[e] > best_score ? score[e] : best_score;
    }
    if (!top_score.empty())
      top_score[t] = best_score;

    std::int32_t* tid = ids.data() + t * kk;
    float* tw = weights.data() + t * kk;
    int filled = 0;
    if (options.limit != nullptr || options.groups != nullptr) {
      // The unrestricted choice, only to count tokens the limits changed.
      int free_filled = 0;
      for (std::size_t e = 0; e < E; ++e)
        detail::top_k_insert(scratch.unlimited.data(), tw, free_filled, k,
                             static_cast<std::int32_t>(e), selection[e]);
      if (options.groups != nullptr) // masks other groups to -inf, which select_devices skips
        select_groups(*options.groups, scratch.selection, !options.bias.empty(), scratch.groups);
      if (options.limit != nullptr)
        select_devices(*options.limit, scratch.selection, k, t, scratch.devices, scratch.allowed);
      else
        for (std::size_t e = 0; e < E; ++e)
          scratch.allowed[e] = detail::is_negative_inf(selection[e]) ? 0 : 1;
      for (std::size_t e = 0; e < E; ++e)
        if (scratch.allowed[e])
          detail::top_k_insert(tid, tw, filled, k, static_cast<std::int32_t>(e), selection[e]);
      bool same = true;
      for (std::size_t i = 0; i < kk; ++i)
        same = same && scratch.unlimited[i] == tid[i];
      summary.limited += same ? 0 : 1;
    } else {
      for (std::size_t e = 0; e < E; ++e)
        detail::top_k_insert(tid, tw, filled, k, static_cast<std::int32_t>(e), selection[e]);
    }
    for (std::size_t i = 0; i < kk; ++i)
      tw[i] = score[static_cast<std::size_t>(tid[i])];
    detail::finish_weights(tw, k, rule);
    scratch.first_choice[static_cast<std::size_t>(tid[0])] += 1.0;
  }
  if (T > 0) {
    double loss = 0.0;
    for (std::size_t e = 0; e < E; ++e)
      loss += (scratch.mean_prob[e] / static_cast<double>(T)) *
              (scratch.first_choice[e] / static_cast<double>(T));
    summary.aux_loss = loss * static_cast<double>(E);
  }
  return summary;
}

//! `top_k_gate` with its own scratch (allocates; keep a `gate_scratch` to avoid that).
inline gate_summary top_k_gate(const_token_view logits, const gate_options& options,
                               std::span<std::int32_t> ids, std::span<float> weights,
                               std::span<float> top_score = {}) {
  gate_scratch scratch;
  return top_k_gate(logits, options, ids, weights, scratch, top_score);
}

//! Per-token priority from the weights alone: the largest of its k weights. Equals the gate's
//! `top_score` (Tutel's priority) only for unrenormalized weights without bias or device limit;
//! prefer `top_score`.
inline void max_weight_priority(std::span<const float> weights, int k, std::span<float> priority) {
  WEAVE_EXPECT(k >= 1 && weights.size() == priority.size() * static_cast<std::size_t>(k),
               errc::size_mismatch, weights.size(), " weights for ", priority.size(),
               " tokens with k = ", k);
  const auto kk = static_cast<std::size_t>(k);
  for (std::size_t t = 0; t < priority.size(); ++t) {
    float best = weights[t * kk];
    for (std::size_t i = 1; i < kk; ++i)
      best = weights[t * kk + i] > best ? weights[t * kk + i] : best;
    priority[t] = best;
  }
}

WEAVE_NAMESPACE_END
