//! \file
//! Host row-movement kernels between the ORI, SFD and EPD layouts, and their layout-named
//! forms over `dispatch_plan` / `expert_plan`.
//!
//! Two primitives cover all four moves (the CUDA ones in `weave/routing/kernels.cuh` have the
//! same arguments plus a stream):
//! - `gather_rows(src, dst, index, scale)`: dst[i] = src[index[i]], times scale[i] if given;
//! - `merge_rows(src, dst, index, k, weight)`: dst[i] = sum over j < k with index[i*k+j] >= 0 of
//!   weight[i*k+j] * src[index[i*k+j]] (or the plain sum), in j order, fp32 accumulation.
//! Rows of f32, f16 and bf16 are supported; an unscaled gather copies bytes of any dtype.
//! Results are bitwise deterministic: fixed order, one rounding per step (the loops, at memory
//! speed, are in `weave/routing/host_row_kernels.hpp`).
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/dtype.hpp"
#include "weave/core/error.hpp"
#include "weave/core/tensor.hpp"
#include "weave/routing/dispatch_plan.hpp"
#include "weave/routing/expert_plan.hpp"
#include "weave/routing/host_row_kernels.hpp"

#include <cstddef>
#include <cstdint>
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
  if (!scale.empty())
    detail::visit_float(src.element_type(), "gate-scaled gather_rows", [](auto*) {});
  detail::gather_rows_host(src, dst, index.data(), scale.empty() ? nullptr : scale.data(),
                           index.size());
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
  detail::visit_float(src.element_type(), "merge_rows", [](auto*) {});
  detail::merge_rows_host(src, dst, index.data(), static_cast<std::size_t>(k),
                          weight.empty() ? nullptr : weight.data(), dst.rows(), false);
}

namespace detail {

// The inverse map of a layout move as a scatter: `index` holds k destination rows per source
// row (a plan's invariant, checked again here), so each destination row is written once.
inline void scatter_move(const char* what, const_token_view src, token_view dst,
                         std::span<const std::int64_t> index, std::size_t k,
                         std::span<const float> scale) {
  check_rows(src, dst, what);
  check_host(src, dst, what);
  WEAVE_EXPECT(index.size() == src.rows() * k && (scale.empty() || scale.size() == index.size()),
               errc::size_mismatch, what, ": ", index.size(), " destinations and ", scale.size(),
               " scales for ", src.rows(), " rows with k = ", k);
  check_index(index, dst.rows(), true, what);
  if (!scale.empty())
    visit_float(src.element_type(), what, [](auto*) {});
  scatter_rows_host(src, dst, index.data(), k, scale.empty() ? nullptr : scale.data(), src.rows());
}

} // namespace detail

//! ORI -> SFD: the plan's tokens into its send rows (one per token and destination device).
//! Equals `gather_rows(ori, sfd, plan.row_token())`, done as a scatter over `token_rows()`
//! (each token read once).
inline void dispatch_gather(const dispatch_plan& plan, const_token_view ori, token_view sfd) {
  WEAVE_EXPECT(ori.rows() == plan.tokens(), errc::size_mismatch, "dispatch_gather: ", ori.rows(),
               " ORI rows for a plan of ", plan.tokens(), " tokens");
  WEAVE_EXPECT(sfd.rows() == static_cast<std::size_t>(plan.rows()), errc::size_mismatch,
               "dispatch_gather: ", sfd.rows(), " SFD rows for a plan of ", plan.rows());
  detail::scatter_move("dispatch_gather", ori, sfd, plan.token_rows(),
                       static_cast<std::size_t>(plan.k()), {});
}

//! SFD -> EPD: received rows into one row per local expert choice, grouped by local expert;
//! `gate_scaled` multiplies each by its gate weight (then merge with `weighted = false`).
//! Equals `gather_rows(received, epd, plan.epd_row_source(), [plan.epd_weight()])`, done as a
//! scatter over `row_epd()` (each received row read once).
inline void expert_scatter(const expert_plan& plan, const_token_view received, token_view epd,
                           bool gate_scaled = false) {
  WEAVE_EXPECT(received.rows() == static_cast<std::size_t>(plan.rows()), errc::size_mismatch,
               "expert_scatter: ", received.rows(), " received rows for a plan of ", plan.rows());
  WEAVE_EXPECT(epd.rows() == static_cast<std::size_t>(plan.epd_rows()), errc::size_mismatch,
               "expert_scatter: ", epd.rows(), " EPD rows for a plan of ", plan.epd_rows());
  detail::scatter_move("expert_scatter", received, epd, plan.row_epd(),
                       static_cast<std::size_t>(plan.k()),
                       gate_scaled ? plan.row_weight() : std::span<const float>{});
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
