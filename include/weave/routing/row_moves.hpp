//! \file
//! `row_moves<Space>`: the two row primitives of the device algorithms (gather and merge), with
//! the forms static shapes need: index -1 leaves a row untouched (padding), and the row count
//! may be read from memory of the space when the step runs. Specialised here for `host_space`
//! (over the host kernels' arithmetic, so results equal `gather_rows` / `merge_rows` bitwise)
//! and in `weave/routing/kernels.cuh` for `cuda_space`.
//!
//! - `gather(s, src, dst, index, scale, count)`: for i < n, dst[i] = src[index[i]] (times
//!   scale[i] when `scale` is not null) where index[i] >= 0;
//! - `merge(s, src, dst, index, k, weight, count, skip_empty)`: for i < n, dst[i] = the sum over
//!   j < k with index[i*k+j] >= 0 of weight[i*k+j] * src[index[i*k+j]] (plain sum when
//!   `weight` is null), in j order with fp32 accumulation; a row with no index becomes zeros,
//!   or is left untouched with `skip_empty`;
//! where n = dst.rows(), or min(*count, dst.rows()) when `count` is not null. Indices come from
//! plans and are not range-checked.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/tensor.hpp"
#include "weave/exec/host_space.hpp"
#include "weave/routing/kernels_host.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

WEAVE_NAMESPACE_BEGIN

//! Row primitives of an execution space (specialised per space).
template <class Space>
struct row_moves;

template <>
struct row_moves<host_space> {
  static void gather(host_stream& s, const_token_view src, token_view dst,
                     const std::int64_t* index, const float* scale, const std::int64_t* count) {
    detail::check_rows(src, dst, "row_moves::gather");
    detail::check_host(src, dst, "row_moves::gather");
    if (scale != nullptr)
      detail::visit_float(src.element_type(), "gate-scaled gather", [](auto*) {});
    s.submit([=] {
      const std::size_t n = rows(count, dst.rows());
      if (scale == nullptr) {
        for (std::size_t i = 0; i < n; ++i)
          if (index[i] >= 0)
            std::memcpy(dst.row(i), src.row(static_cast<std::size_t>(index[i])), src.row_bytes());
        return;
      }
      detail::visit_float(src.element_type(), "gate-scaled gather", [&]<class T>(T*) {
        for (std::size_t i = 0; i < n; ++i)
          if (index[i] >= 0)
            detail::scale_row(
                reinterpret_cast<const T*>(src.row(static_cast<std::size_t>(index[i]))),
                reinterpret_cast<T*>(dst.row(i)), src.cols(), scale[i]);
      });
    });
  }

  static void merge(host_stream& s, const_token_view src, token_view dst, const std::int64_t* index,
                    int k, const float* weight, const std::int64_t* count, bool skip_empty) {
    detail::check_rows(src, dst, "row_moves::merge");
    detail::check_host(src, dst, "row_moves::merge");
    WEAVE_EXPECT(k >= 1, errc::invalid_argument, "row_moves::merge with k = ", k);
    detail::visit_float(src.element_type(), "merge", [](auto*) {});
    s.submit([=] {
      const std::size_t n = rows(count, dst.rows());
      const auto kk = static_cast<std::size_t>(k);
      detail::visit_float(src.element_type(), "merge", [&]<class T>(T*) {
        for (std::size_t i = 0; i < n; ++i) {
          const std::int64_t* idx = index + i * kk;
          if (skip_empty && std::none_of(idx, idx + kk, [](std::int64_t x) { return x >= 0; }))
            continue;
          detail::merge_row(src, reinterpret_cast<T*>(dst.row(i)), src.cols(), idx,
                            weight == nullptr ? nullptr : weight + i * kk, kk);
        }
      });
    });
  }

 private:
  static std::size_t rows(const std::int64_t* count, std::size_t capacity) {
    if (count == nullptr)
      return capacity;
    return *count <= 0 ? 0 : std::min(static_cast<std::size_t>(*count), capacity);
  }
};

WEAVE_NAMESPACE_END
