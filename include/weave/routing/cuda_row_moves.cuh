//! \file
//! `row_moves<cuda_space>`: the row primitives of `weave/routing/row_moves.hpp` as CUDA kernels
//! (the kernels of `detail/cuda_row_kernels.cuh`, with device-resident row counts and padding
//! rows), and with them `layout_move` in `cuda_space` (a gather). The one form of the row moves
//! on CUDA streams: the plans' maps (`device_dispatch_plan::maps`, `device_expert_plan::maps`)
//! feed it.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/tensor.hpp"
#include "weave/exec/cuda_space.cuh"
#include "weave/routing/detail/cuda_row_kernels.cuh"
#include "weave/routing/kernels_host.hpp"
#include "weave/routing/row_moves.hpp"

#include <cstdint>

WEAVE_NAMESPACE_BEGIN

template <>
struct row_moves<cuda_space> {
  static void gather(cuda_stream_ref s, const_token_view src, token_view dst,
                     const std::int64_t* index, const float* scale, const std::int64_t* count) {
    detail::check_rows(src, dst, "row_moves::gather");
    detail::check_device(src, dst, "row_moves::gather");
    detail::launch_gather(s, src, dst, index, scale, static_cast<std::int64_t>(dst.rows()), count);
  }

  static void merge(cuda_stream_ref s, const_token_view src, token_view dst,
                    const std::int64_t* index, int k, const float* weight,
                    const std::int64_t* count, bool skip_empty) {
    detail::check_rows(src, dst, "row_moves::merge");
    detail::check_device(src, dst, "row_moves::merge");
    WEAVE_EXPECT(k >= 1, errc::invalid_argument, "row_moves::merge with k = ", k);
    detail::launch_merge(s, src, dst, index, k, weight, static_cast<std::int64_t>(dst.rows()),
                         count, skip_empty);
  }

  static void dot(cuda_stream_ref s, const_token_view a, const_token_view b, float* out,
                  const std::int64_t* count) {
    WEAVE_EXPECT(a.cols() == b.cols() && a.element_type() == b.element_type(), errc::size_mismatch,
                 "row_moves::dot of rows of ", a.cols(), " ", a.element_type(), " and ", b.cols(),
                 " ", b.element_type());
    const auto rows = static_cast<std::int64_t>(a.rows() < b.rows() ? a.rows() : b.rows());
    if (rows == 0)
      return;
    constexpr unsigned threads = 256; // 8 rows per block
    const std::int64_t blocks = (rows + 7) / 8;
    const unsigned grid = static_cast<unsigned>(blocks < 65535 ? blocks : 65535);
    detail::visit_cuda_float(a.element_type(), "row_moves::dot", [&]<class T>(T*) {
      detail::dot_kernel<T><<<grid, threads, 0, s.get()>>>(
          a.data(), a.row_stride(), b.data(), b.row_stride(), out, rows, count, a.cols());
    });
    WEAVE_CUDA_CHECK(cudaGetLastError());
  }
};

WEAVE_NAMESPACE_END
