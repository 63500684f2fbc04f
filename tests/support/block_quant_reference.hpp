// A brute-force model of block-scaled FP8 quantisation (`weave/routing/quantize.hpp`): per
// block, the scale from the documented definition (amax in double, the power of two by
// log2/ceil), every code by searching the nearest FP8 value (fp8_reference.hpp).
#pragma once

#include <weave/routing/quantize.hpp>

#include "fp8_reference.hpp"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace fp8_ref {

// The scale of a block and its multiplier, from the definition.
inline std::pair<float, float> reference_scale(const float* x, std::size_t n,
                                               const weave::block_quantization& q,
                                               float max_finite) {
  double amax = 0;
  for (std::size_t j = 0; j < n; ++j)
    amax = std::max(amax, std::fabs(static_cast<double>(x[j])));
  const float a = std::max(static_cast<float>(amax), q.min_amax);
  const float exact = a * (1.0f / max_finite);
  if (q.rounding == weave::scale_rounding::power_of_two) {
    const int e = static_cast<int>(std::ceil(std::log2(static_cast<double>(exact))));
    return {static_cast<float>(std::ldexp(1.0, e)), static_cast<float>(std::ldexp(1.0, -e))};
  }
  return {exact, max_finite / a};
}

// One finite row quantised by the definition: its codes (one byte per element) and its scales
// (one per block).
struct quantized_row {
  std::vector<std::uint8_t> codes;
  std::vector<float> scales;
};

inline quantized_row quantize_row(const float* x, std::size_t cols,
                                  const weave::block_quantization& q, const table& t) {
  quantized_row out{std::vector<std::uint8_t>(cols), std::vector<float>(cols / q.block)};
  const auto max_finite = static_cast<float>(t.max_finite());
  for (std::size_t b = 0; b < cols / q.block; ++b) {
    const auto [scale, multiplier] = reference_scale(x + b * q.block, q.block, q, max_finite);
    out.scales[b] = scale;
    for (std::size_t j = b * q.block; j < (b + 1) * q.block; ++j)
      out.codes[j] = t.round(x[j] * multiplier, weave::fp8_overflow::saturate);
  }
  return out;
}

} // namespace fp8_ref
