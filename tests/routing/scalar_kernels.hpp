// The host row kernels as they were before vectorisation (one input at a time, a stack block of
// fp32 accumulators, conversions through the dtype constructors): the reference the vectorised
// kernels must equal bitwise.
#pragma once

#include <weave/core/dtype.hpp>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace scalar {

template <class T>
void scale_row(const T* in, T* out, std::size_t cols, float s) {
  for (std::size_t c = 0; c < cols; ++c)
    out[c] = T(s * static_cast<float>(in[c]));
}

// `rows[j]` is the j-th input row or null (index -1); `weight` null for a plain sum.
template <class T>
void merge_row(const std::vector<const T*>& rows, T* out, std::size_t cols, const float* weight) {
  constexpr std::size_t block = 256;
  for (std::size_t c0 = 0; c0 < cols; c0 += block) {
    const std::size_t n = cols - c0 < block ? cols - c0 : block;
    float acc[block];
    for (std::size_t c = 0; c < n; ++c)
      acc[c] = 0.0f;
    for (std::size_t j = 0; j < rows.size(); ++j) {
      if (rows[j] == nullptr)
        continue;
      const T* in = rows[j] + c0;
      if (weight != nullptr) {
        const float w = weight[j];
        for (std::size_t c = 0; c < n; ++c) {
          const float product = w * static_cast<float>(in[c]);
          acc[c] = acc[c] + product;
        }
      } else {
        for (std::size_t c = 0; c < n; ++c)
          acc[c] = acc[c] + static_cast<float>(in[c]);
      }
    }
    for (std::size_t c = 0; c < n; ++c)
      out[c0 + c] = T(acc[c]);
  }
}

} // namespace scalar
