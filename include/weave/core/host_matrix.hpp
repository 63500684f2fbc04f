//! \file
//! `host_matrix<T>`: a small owning row-major host buffer with a `tensor_traits` specialisation.
//! It is what weave's tests, examples and benchmarks use for activations; trainers use their own.
#pragma once

#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/core/tensor.hpp"

#include <cstddef>
#include <span>
#include <vector>

WEAVE_NAMESPACE_BEGIN

//! Owning rows × cols matrix of `T` in host memory.
template <class T>
class host_matrix {
 public:
  host_matrix() = default;
  host_matrix(std::size_t rows, std::size_t cols, T fill = T{})
      : rows_(rows)
      , cols_(cols)
      , data_(checked_mul(rows, cols, "host_matrix elements"), fill) {}

  std::size_t rows() const noexcept { return rows_; }
  std::size_t cols() const noexcept { return cols_; }
  T* data() noexcept { return data_.data(); }
  const T* data() const noexcept { return data_.data(); }
  std::span<T> row(std::size_t i) noexcept { return {data_.data() + i * cols_, cols_}; }
  std::span<const T> row(std::size_t i) const noexcept { return {data_.data() + i * cols_, cols_}; }
  T& operator()(std::size_t r, std::size_t c) noexcept { return data_[r * cols_ + c]; }
  const T& operator()(std::size_t r, std::size_t c) const noexcept { return data_[r * cols_ + c]; }
  std::span<T> elements() noexcept { return data_; }
  std::span<const T> elements() const noexcept { return data_; }

  token_view view() { return make_token_view(*this); }
  const_token_view view() const { return make_token_view(*this); }

  friend bool operator==(const host_matrix&, const host_matrix&) = default;

 private:
  std::size_t rows_ = 0;
  std::size_t cols_ = 0;
  std::vector<T> data_;
};

template <class T>
struct tensor_traits<host_matrix<T>> {
  static void* data(host_matrix<T>& m) noexcept { return m.data(); }
  static const void* data(const host_matrix<T>& m) noexcept { return m.data(); }
  static std::size_t rows(const host_matrix<T>& m) noexcept { return m.rows(); }
  static std::size_t cols(const host_matrix<T>& m) noexcept { return m.cols(); }
  static dtype element_type(const host_matrix<T>&) noexcept { return dtype_of_v<T>; }
  static memory_space space(const host_matrix<T>&) noexcept { return memory_space::host; }
};

WEAVE_NAMESPACE_END
