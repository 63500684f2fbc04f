//! \file
//! `row_buffer`: an owned, 256-byte aligned host buffer of token rows that hands out views.
//! Capacity only grows, so a buffer sized once is never reallocated by later calls.
#pragma once

#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/core/dtype.hpp"
#include "weave/core/error.hpp"
#include "weave/core/tensor.hpp"

#include <cstddef>
#include <memory>
#include <new>

WEAVE_NAMESPACE_BEGIN

class row_buffer {
 public:
  row_buffer() = default;
  row_buffer(std::size_t cols, dtype type)
      : cols_(cols)
      , type_(type) {}

  //! Makes room for `rows` rows, keeping nothing (contents are scratch).
  void reserve(std::size_t rows) {
    if (rows <= capacity_)
      return;
    const std::size_t bytes = checked_mul(rows, row_bytes(), "row buffer bytes");
    data_.reset(static_cast<std::byte*>(::operator new (bytes, std::align_val_t{256})));
    capacity_ = rows;
  }

  std::size_t capacity() const noexcept { return capacity_; }
  std::size_t row_bytes() const noexcept { return cols_ * size_of(type_); }
  std::size_t bytes() const noexcept { return capacity_ * row_bytes(); }
  std::byte* data() noexcept { return data_.get(); }
  const std::byte* data() const noexcept { return data_.get(); }

  //! The first `rows` rows; throws `errc::internal` past the capacity (sizes are planned).
  token_view view(std::size_t rows) {
    WEAVE_EXPECT(rows <= capacity_, errc::internal, "row_buffer: ", rows,
                 " rows requested from a buffer of ", capacity_);
    return token_view(data_.get(), rows, cols_, type_);
  }
  const_token_view view(std::size_t rows) const {
    WEAVE_EXPECT(rows <= capacity_, errc::internal, "row_buffer: ", rows,
                 " rows requested from a buffer of ", capacity_);
    return const_token_view(data_.get(), rows, cols_, type_);
  }

 private:
  struct aligned_delete {
    void operator()(std::byte* p) const noexcept { ::operator delete (p, std::align_val_t{256}); }
  };
  std::size_t cols_ = 0;
  dtype type_ = dtype::f32;
  std::size_t capacity_ = 0;
  std::unique_ptr<std::byte, aligned_delete> data_;
};

WEAVE_NAMESPACE_END
