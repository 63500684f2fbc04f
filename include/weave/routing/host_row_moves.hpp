//! \file
//! `row_moves<host_space>`: the row primitives of `weave/routing/row_moves.hpp` as host-stream
//! tasks (run at once within a task of the stream, as `host_space` steps are), with the host
//! kernels' arithmetic (results equal `gather_rows` / `merge_rows` bitwise; `dot` sums in column
//! order), and the scatter form of the layout moves (`layout_move`).
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/tensor.hpp"
#include "weave/exec/emulated_gpu_space.hpp"
#include "weave/exec/host_space.hpp"
#include "weave/routing/host_row_kernels.hpp"
#include "weave/routing/kernels_host.hpp"
#include "weave/routing/row_moves.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

WEAVE_NAMESPACE_BEGIN

template <>
struct row_moves<host_space> {
  static void gather(host_stream& s, const_token_view src, token_view dst,
                     const std::int64_t* index, const float* scale, const std::int64_t* count) {
    detail::check_rows(src, dst, "row_moves::gather");
    detail::check_host(src, dst, "row_moves::gather");
    if (scale != nullptr)
      detail::visit_float(src.element_type(), "gate-scaled gather", [](auto*) {});
    host_space::enqueue(s, [=] {
      detail::gather_rows_host(src, dst, index, scale, detail::counted_rows(count, dst.rows()));
    });
  }

  static void scatter(host_stream& s, const_token_view src, token_view dst,
                      const std::int64_t* index, int k, const float* scale,
                      const std::int64_t* count) {
    detail::check_rows(src, dst, "row_moves::scatter");
    detail::check_host(src, dst, "row_moves::scatter");
    WEAVE_EXPECT(k >= 1, errc::invalid_argument, "row_moves::scatter with k = ", k);
    if (scale != nullptr)
      detail::visit_float(src.element_type(), "gate-scaled scatter", [](auto*) {});
    host_space::enqueue(s, [=] {
      detail::scatter_rows_host(src, dst, index, static_cast<std::size_t>(k), scale,
                                detail::counted_rows(count, src.rows()));
    });
  }

  static void merge(host_stream& s, const_token_view src, token_view dst, const std::int64_t* index,
                    int k, const float* weight, const std::int64_t* count, bool skip_empty) {
    detail::check_rows(src, dst, "row_moves::merge");
    detail::check_host(src, dst, "row_moves::merge");
    WEAVE_EXPECT(k >= 1, errc::invalid_argument, "row_moves::merge with k = ", k);
    detail::visit_float(src.element_type(), "merge", [](auto*) {});
    host_space::enqueue(s, [=] {
      detail::merge_rows_host(src, dst, index, static_cast<std::size_t>(k), weight,
                              detail::counted_rows(count, dst.rows()), skip_empty);
    });
  }

  static void dot(host_stream& s, const_token_view a, const_token_view b, float* out,
                  const std::int64_t* count) {
    WEAVE_EXPECT(a.cols() == b.cols() && a.element_type() == b.element_type(), errc::size_mismatch,
                 "row_moves::dot of rows of ", a.cols(), " ", a.element_type(), " and ", b.cols(),
                 " ", b.element_type());
    host_space::enqueue(s, [=] {
      const std::size_t n = detail::counted_rows(count, std::min(a.rows(), b.rows()));
      for (std::size_t i = 0; i < n; ++i) {
        float acc = 0.0f;
        for (std::size_t h = 0; h < a.cols(); ++h)
          acc += load_as_float(a.row(i), h, a.element_type()) *
                 load_as_float(b.row(i), h, b.element_type());
        out[i] = acc;
      }
    });
  }
};

//! The emulated CUDA space moves rows as host_space does (its streams are host streams).
template <>
struct row_moves<emulated_gpu_space> : row_moves<host_space> {};

WEAVE_NAMESPACE_END
