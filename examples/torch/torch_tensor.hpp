//! \file
//! `weave::tensor_traits<torch::Tensor>`: borrowing libtorch CPU tensors as weave token rows.
//!
//! A 2-D tensor (rows = tokens) of f32, bf16 or f16 (or int32: a (tokens, k) tensor of expert
//! ids) whose elements are contiguous within a row
//! (stride(1) == 1) is viewed in place; rows may be strided (stride(0) >= size(1)), as for a
//! column slice of a wider tensor. Anything else (other dtypes, CUDA tensors, 1-D or 3-D
//! tensors, transposed views) is rejected with a `weave::error` naming what is wrong, instead of
//! being copied behind the caller's back: call `.contiguous()` or `.to()` first.
#pragma once

#include <torch/torch.h>

#include <weave/core/error.hpp>
#include <weave/core/tensor.hpp>

#include <cstddef>
#include <cstdint>

namespace weave_torch {

//! The weave dtype of a torch scalar type; throws `errc::not_supported` for the others.
inline weave::dtype to_weave_dtype(c10::ScalarType type) {
  switch (type) {
  case torch::kFloat32:
    return weave::dtype::f32;
  case torch::kBFloat16:
    return weave::dtype::bf16;
  case torch::kFloat16:
    return weave::dtype::f16;
  case torch::kInt32: // (tokens, k) expert ids
    return weave::dtype::i32;
  default:
    break;
  }
  WEAVE_THROW(weave::errc::not_supported, "torch dtype ", c10::toString(type),
              " has no weave type (use float32, bfloat16 or float16 rows, int32 ids)");
}

//! Throws `errc::invalid_argument` unless `t` can be borrowed as token rows.
inline void check_token_tensor(const torch::Tensor& t) {
  WEAVE_EXPECT(t.defined(), weave::errc::invalid_argument, "undefined torch tensor");
  WEAVE_EXPECT(t.dim() == 2, weave::errc::invalid_argument, "token rows need a 2-D tensor, got ",
               t.dim(), " dimensions");
  WEAVE_EXPECT(t.device().is_cpu(), weave::errc::not_supported,
               "only CPU torch tensors are supported, got ", t.device().str());
  WEAVE_EXPECT(t.size(1) <= 1 || t.stride(1) == 1, weave::errc::invalid_argument,
               "row elements must be contiguous, got column stride ", t.stride(1));
  WEAVE_EXPECT(t.size(0) <= 1 || t.stride(0) >= t.size(1), weave::errc::invalid_argument,
               "row stride ", t.stride(0), " is shorter than a row of ", t.size(1), " elements");
}

} // namespace weave_torch

//! A `torch::Tensor` as rows of tokens (see the file comment for what is accepted).
//! [traits]
template <>
struct weave::tensor_traits<torch::Tensor> {
  static void* data(torch::Tensor& t) {
    weave_torch::check_token_tensor(t);
    return t.data_ptr();
  }
  static const void* data(const torch::Tensor& t) {
    weave_torch::check_token_tensor(t);
    return t.data_ptr();
  }
  static std::int64_t rows(const torch::Tensor& t) { return t.size(0); }
  static std::int64_t cols(const torch::Tensor& t) { return t.size(1); }
  static weave::dtype element_type(const torch::Tensor& t) {
    return weave_torch::to_weave_dtype(t.scalar_type());
  }
  static weave::memory_space space(const torch::Tensor&) { return weave::memory_space::host; }
  //! Bytes between rows; 0 (packed) for a single row, whose stride torch leaves arbitrary.
  static std::size_t row_stride_bytes(const torch::Tensor& t) {
    if (t.size(0) <= 1)
      return 0;
    return static_cast<std::size_t>(t.stride(0)) * t.element_size();
  }
};
//! [traits]

namespace weave_torch {

//! The torch scalar type of a weave token dtype; throws `errc::not_supported` for the others.
inline c10::ScalarType to_torch_dtype(weave::dtype type) {
  switch (type) {
  case weave::dtype::f32:
    return torch::kFloat32;
  case weave::dtype::bf16:
    return torch::kBFloat16;
  case weave::dtype::f16:
    return torch::kFloat16;
  case weave::dtype::i32:
    return torch::kInt32;
  default:
    break;
  }
  WEAVE_THROW(weave::errc::not_supported, "weave dtype ", type, " has no torch token type");
}

//! Wraps the rows of a weave view as a 2-D torch tensor sharing its memory (no copy): expert
//! callbacks run torch ops directly on the exchange's EPD buffers. The tensor must not outlive
//! the view's memory.
inline torch::Tensor as_tensor(weave::const_token_view v) {
  const auto type = to_torch_dtype(v.element_type());
  const std::size_t element = weave::size_of(v.element_type());
  WEAVE_EXPECT(v.row_stride() % element == 0, weave::errc::invalid_argument, "row stride ",
               v.row_stride(), " bytes is not a whole number of ", element, "-byte elements");
  const auto rows = static_cast<std::int64_t>(v.rows());
  const auto cols = static_cast<std::int64_t>(v.cols());
  const auto stride = static_cast<std::int64_t>(v.row_stride() / element);
  return torch::from_blob(const_cast<std::byte*>(v.data()), {rows, cols}, {stride, 1},
                          torch::TensorOptions().dtype(type));
}

} // namespace weave_torch
