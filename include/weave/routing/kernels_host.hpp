//! \file
//! Host row-movement kernels between the ORI, SFD and EPD layouts, and their layout-named
//! forms over `dispatch_plan` / `expert_plan`.
//!
//! Two primitives cover all four moves (the CUDA ones in `weave/routing/kernels.cuh` have the
//! same arguments plus a stream):
//! - `gather_rows(src, dst, index, scale)`: dst[i] = src[index[i]], times scale[i] if given;
//! - `merge_rows(src, dst, index, k, weight)`: dst[i] = sum over j < k with index[i*k+j] >= 0 of
//!   weight[i*k+j] * src[index[i*k+j]] (or the plain sum), in j order, fp32 accumulation.
//! Rows of f32, f16 and bf16 (and f64 for gathers) are supported; an unscaled gather copies
//! bytes of any dtype. Results are bitwise deterministic: fixed order, one rounding per step.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/dtype.hpp"
#include "weave/core/error.hpp"
#include "weave/core/tensor.hpp"
#include "weave/routing/dispatch_plan.hpp"
#include "weave/routing/expert_plan.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

WEAVE_NAMESPACE_BEGIN

namespace detail {

inline void check_rows(const const_token_view& src, const token_view& dst, const char* what) {
  WEAVE_EXPECT(src.element_type() == dst.element_type(), errc::invalid_argument, what,
               ": source rows of ", src.element_type(), ", destination rows of ",
               dst.element_type());
  WEAVE_EXPECT(src.cols() == dst.cols(), errc::size_mismatch, what, ": source rows of ", src.cols(),
               " elements, destination rows of ", dst.cols());
}

inline void check_host(const const_token_view& src, const token_view& dst, const char* what) {
  WEAVE_EXPECT(host_accessible(src.space()) && host_accessible(dst.space()), errc::invalid_argument,
               what, " on the host with ", src.space(), " -> ", dst.space(), " memory");
}

inline void check_index(std::span<const std::int64_t> index, std::size_t rows, bool allow_pad,
                        const char* what) {
  for (std::size_t i = 0; i < index.size(); ++i)
    WEAVE_EXPECT((allow_pad && index[i] == -1) ||
                     (index[i] >= 0 && static_cast<std::size_t>(index[i]) < rows),
                 errc::out_of_range, what, ": index[", i, "] = ", index[i], " outside [",
                 allow_pad ? "-1" : "0", ", ", rows, ")");
}

template <class F>
void visit_float(dtype t, const char* what, F&& f) {
  switch (t) {
  case dtype::f32:
    return f(static_cast<float*>(nullptr));
  case dtype::f16:
    return f(static_cast<half*>(nullptr));
  case dtype::bf16:
    return f(static_cast<bfloat16*>(nullptr));
  default:
    WEAVE_THROW(errc::not_supported, what, " of ", t, " rows (f32, f16 and bf16 are supported)");
  }
}

template <class T>
void scale_row(const T* in, T* out, std::size_t cols, float s) {
  for (std::size_t c = 0; c < cols; ++c)
    out[c] = T(s * static_cast<float>(in[c]));
}

template <class T>
void merge_row(const const_token_view& src, T* out, std::size_t cols, const std::int64_t* index,
               const float* weight, std::size_t k) {
  constexpr std::size_t block = 256; // fp32 accumulators for a slice of the row, on the stack
  for (std::size_t c0 = 0; c0 < cols; c0 += block) {
    const std::size_t n = cols - c0 < block ? cols - c0 : block;
    float acc[block];
    for (std::size_t c = 0; c < n; ++c)
      acc[c] = 0.0f;
    for (std::size_t j = 0; j < k; ++j) {
      if (index[j] < 0)
        continue;
      const T* in = reinterpret_cast<const T*>(src.row(static_cast<std::size_t>(index[j]))) + c0;
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

} // namespace detail

//! dst[i] = src[index[i]] (times `scale[i]` when `scale` is not empty). Throws
//! `errc::size_mismatch` unless dst has index.size() rows (and scale as many values) and the
//! same columns, `errc::out_of_range` for an index outside [0, src.rows()),
//! `errc::not_supported` for scaling non-float rows.
inline void gather_rows(const_token_view src, token_view dst, std::span<const std::int64_t> index,
                        std::span<const float> scale = {}) {
  detail::check_rows(src, dst, "gather_rows");
  detail::check_host(src, dst, "gather_rows");
  WEAVE_EXPECT(dst.rows() == index.size(), errc::size_mismatch, "gather_rows: ", index.size(),
               " indices for ", dst.rows(), " destination rows");
  WEAVE_EXPECT(scale.empty() || scale.size() == index.size(), errc::size_mismatch,
               "gather_rows: ", scale.size(), " scales for ", index.size(), " rows");
  detail::check_index(index, src.rows(), false, "gather_rows");
  if (scale.empty()) {
    const std::size_t bytes = src.row_bytes();
    for (std::size_t i = 0; i < index.size(); ++i)
      std::memcpy(dst.row(i), src.row(static_cast<std::size_t>(index[i])), bytes);
    return;
  }
  detail::visit_float(src.element_type(), "gate-scaled gather_rows", [&]<class T>(T*) {
    for (std::size_t i = 0; i < index.size(); ++i)
      detail::scale_row(reinterpret_cast<const T*>(src.row(static_cast<std::size_t>(index[i]))),
                        reinterpret_cast<T*>(dst.row(i)), src.cols(), scale[i]);
  });
}

//! dst[i] = sum over j of weight[i*k+j] * src[index[i*k+j]] (plain sum if `weight` is empty),
//! skipping -1 indices, in j order with fp32 accumulation; a row with no index becomes zeros.
//! Throws `errc::size_mismatch` unless index (and weight) hold k per destination row,
//! `errc::out_of_range` for an index outside [-1, src.rows()), `errc::not_supported` for
//! non-float rows.
inline void merge_rows(const_token_view src, token_view dst, std::span<const std::int64_t> index,
                       int k, std::span<const float> weight = {}) {
  detail::check_rows(src, dst, "merge_rows");
  detail::check_host(src, dst, "merge_rows");
  WEAVE_EXPECT(k >= 1 && index.size() == dst.rows() * static_cast<std::size_t>(k),
               errc::size_mismatch, "merge_rows: ", index.size(), " indices for ", dst.rows(),
               " rows with k = ", k);
  WEAVE_EXPECT(weight.empty() || weight.size() == index.size(), errc::size_mismatch,
               "merge_rows: ", weight.size(), " weights for ", index.size(), " indices");
  detail::check_index(index, src.rows(), true, "merge_rows");
  const auto kk = static_cast<std::size_t>(k);
  detail::visit_float(src.element_type(), "merge_rows", [&]<class T>(T*) {
    for (std::size_t i = 0; i < dst.rows(); ++i)
      detail::merge_row(src, reinterpret_cast<T*>(dst.row(i)), src.cols(), index.data() + i * kk,
                        weight.empty() ? nullptr : weight.data() + i * kk, kk);
  });
}

//! ORI -> SFD: the plan's tokens into its send rows (one per token and destination device).
inline void dispatch_gather(const dispatch_plan& plan, const_token_view ori, token_view sfd) {
  WEAVE_EXPECT(ori.rows() == plan.tokens(), errc::size_mismatch, "dispatch_gather: ", ori.rows(),
               " ORI rows for a plan of ", plan.tokens(), " tokens");
  gather_rows(ori, sfd, plan.row_token());
}

//! SFD -> EPD: received rows into one row per local expert choice, grouped by local expert;
//! `gate_scaled` multiplies each by its gate weight (then merge with `weighted = false`).
inline void expert_scatter(const expert_plan& plan, const_token_view received, token_view epd,
                           bool gate_scaled = false) {
  WEAVE_EXPECT(received.rows() == static_cast<std::size_t>(plan.rows()), errc::size_mismatch,
               "expert_scatter: ", received.rows(), " received rows for a plan of ", plan.rows());
  gather_rows(received, epd, plan.epd_row_source(),
              gate_scaled ? plan.epd_weight() : std::span<const float>{});
}

//! EPD -> SFD: per received row, the sum of its local experts' outputs times their gate
//! weights (`weighted`), in route-entry order; the result goes back in received order.
inline void expert_merge(const expert_plan& plan, const_token_view expert_out, token_view back,
                         bool weighted = true) {
  WEAVE_EXPECT(expert_out.rows() == static_cast<std::size_t>(plan.epd_rows()), errc::size_mismatch,
               "expert_merge: ", expert_out.rows(), " expert output rows for a plan of ",
               plan.epd_rows());
  merge_rows(expert_out, back, plan.row_epd(), plan.k(),
             weighted ? plan.row_weight() : std::span<const float>{});
}

//! SFD -> ORI: per token, the sum of the rows its destination devices returned, in ascending
//! device order; tokens sent nowhere get zeros.
inline void combine_merge(const dispatch_plan& plan, const_token_view returned, token_view ori) {
  WEAVE_EXPECT(returned.rows() == static_cast<std::size_t>(plan.rows()), errc::size_mismatch,
               "combine_merge: ", returned.rows(), " returned rows for a plan of ", plan.rows());
  merge_rows(returned, ori, plan.token_rows(), plan.k());
}

WEAVE_NAMESPACE_END
