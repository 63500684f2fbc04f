//! \file
//! Host row-movement kernels between the ORI, SFD and EPD layouts: the two row primitives
//! every layout move is made of, called directly on host memory.
//!
//! Two primitives cover all four moves:
//! - `gather_rows(src, dst, index, scale)`: dst[i] = src[index[i]], times scale[i] if given;
//! - `merge_rows(src, dst, index, k, weight)`: dst[i] = sum over j < k with index[i*k+j] >= 0 of
//!   weight[i*k+j] * src[index[i*k+j]] (or the plain sum), in j order, fp32 accumulation.
//! Rows of f32, f16 and bf16 are supported; an unscaled gather copies bytes of any dtype.
//! Results are bitwise deterministic: fixed order, one rounding per step (the loops, at memory
//! speed, are in `weave/routing/host_row_kernels.hpp`). The layout moves over a plan's maps, in
//! stream order and in every execution space, are `row_moves<Space>` and `layout_move`
//! (`weave/routing/row_moves.hpp`; on host streams `weave/routing/host_row_moves.hpp`, on CUDA
//! streams `weave/routing/cuda_row_moves.cuh`).
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/dtype.hpp"
#include "weave/core/error.hpp"
#include "weave/core/tensor.hpp"
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

WEAVE_NAMESPACE_END
