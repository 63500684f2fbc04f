//! \file
//! `quant_moves<host_space>`: block quantisation's row primitives (see
//! `weave/routing/quantize.hpp`) as host-stream tasks, with the host kernels' arithmetic
//! (results equal `quantize_rows` / `dequantize_rows` bitwise).
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/tensor.hpp"
#include "weave/exec/emulated_gpu_space.hpp"
#include "weave/exec/host_space.hpp"
#include "weave/routing/quantize.hpp"
#include "weave/routing/row_moves.hpp"

#include <cstddef>
#include <cstdint>

WEAVE_NAMESPACE_BEGIN

template <>
struct quant_moves<host_space> {
  static void quantize(host_stream& s, const_token_view src, token_view dst, token_view scales,
                       const std::int64_t* index, const std::int64_t* count,
                       const block_quantization& q, std::int64_t* status) {
    detail::check_quantized(src, dst, scales, q, "quant_moves::quantize");
    detail::check_host_memory(src, dst, scales, "quant_moves::quantize");
    WEAVE_EXPECT(index != nullptr || src.rows() >= dst.rows(), errc::size_mismatch,
                 "quant_moves::quantize: ", src.rows(), " source rows for ", dst.rows(),
                 " destination rows without an index");
    host_space::enqueue(s, [=] {
      const std::size_t n = detail::counted_rows(count, dst.rows());
      detail::visit_fp8(dst.element_type(), "quant_moves::quantize", [&]<class Fp8>(Fp8*) {
        detail::visit_float(src.element_type(), "quant_moves::quantize", [&]<class T>(T*) {
          for (std::size_t i = 0; i < n; ++i) {
            const std::int64_t from = index == nullptr ? static_cast<std::int64_t>(i) : index[i];
            if (from < 0)
              continue;
            std::size_t block = 0;
            const bool finite = detail::quantize_row(
                reinterpret_cast<const T*>(src.row(static_cast<std::size_t>(from))),
                reinterpret_cast<Fp8*>(dst.row(i)), reinterpret_cast<float*>(scales.row(i)),
                src.cols(), q, block);
            if (!finite && status != nullptr && (*status < 0 || from < *status))
              *status = from;
          }
        });
      });
    });
  }

  static void dequantize(host_stream& s, const_token_view src, const_token_view scales,
                         token_view dst, const std::int64_t* index, const std::int64_t* count,
                         const block_quantization& q) {
    detail::check_quantized(dst, src, scales, q, "quant_moves::dequantize");
    detail::check_host_memory(src, scales, dst, "quant_moves::dequantize");
    WEAVE_EXPECT(index != nullptr || src.rows() >= dst.rows(), errc::size_mismatch,
                 "quant_moves::dequantize: ", src.rows(), " source rows for ", dst.rows(),
                 " destination rows without an index");
    host_space::enqueue(s, [=] {
      const std::size_t n = detail::counted_rows(count, dst.rows());
      detail::visit_fp8(src.element_type(), "quant_moves::dequantize", [&]<class Fp8>(Fp8*) {
        detail::visit_float(dst.element_type(), "quant_moves::dequantize", [&]<class T>(T*) {
          for (std::size_t i = 0; i < n; ++i) {
            const std::int64_t from = index == nullptr ? static_cast<std::int64_t>(i) : index[i];
            if (from < 0)
              continue;
            const auto r = static_cast<std::size_t>(from);
            detail::dequantize_row(reinterpret_cast<const Fp8*>(src.row(r)),
                                   reinterpret_cast<const float*>(scales.row(r)),
                                   reinterpret_cast<T*>(dst.row(i)), src.cols(), q.block);
          }
        });
      });
    });
  }
};

//! The emulated CUDA space moves rows as host_space does (its streams are host streams).
template <>
struct quant_moves<emulated_gpu_space> : quant_moves<host_space> {};

WEAVE_NAMESPACE_END
