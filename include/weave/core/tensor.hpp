//! \file
//! Borrowing the caller's tensors: the `tensor_traits` customization point and `token_view`.
//!
//! weave never owns activations. A trainer's tensor type becomes usable by specialising
//! `weave::tensor_traits<T>` (the primary template fails with a message saying how), after which
//! `weave::make_token_view(t)` borrows it as rows of tokens.
#pragma once

#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/core/dtype.hpp"
#include "weave/core/error.hpp"
#include "weave/core/memory.hpp"

#include <concepts>
#include <cstddef>
#include <span>
#include <type_traits>
#include <vector>

WEAVE_NAMESPACE_BEGIN

namespace detail {
template <class>
inline constexpr bool always_false = false;
} // namespace detail

//! Customization point describing a 2-D row-major tensor (rows = tokens).
//!
//! A specialisation provides static functions:
//! - `data(t)`: `void*` or `const void*` to row 0 (constness carries into the view);
//! - `rows(t)`, `cols(t)`: the shape, in elements;
//! - `element_type(t)`: a `weave::dtype`;
//! - `space(t)`: a `weave::memory_space`;
//! - optionally `device(t)` (GPU ordinal, default -1) and `row_stride_bytes(t)` (default packed).
template <class Tensor>
struct tensor_traits {
  static_assert(detail::always_false<Tensor>,
                "weave::tensor_traits<T> is not specialised for this tensor type. Specialise it "
                "with static data(t), rows(t), cols(t), element_type(t) and space(t) (see "
                "weave/core/tensor.hpp and examples/custom_tensor.cpp).");
};

//! A non-owning view of `rows()` token rows of `cols()` elements each.
//!
//! `Byte` is `std::byte` (mutable) or `const std::byte`. Rows may be strided (a slice of a wider
//! tensor), but elements within a row are contiguous.
template <class Byte>
class basic_token_view {
  static_assert(std::is_same_v<std::remove_const_t<Byte>, std::byte>);

 public:
  using byte_type = Byte;

  constexpr basic_token_view() noexcept = default;

  //! Views `rows` rows of `cols` elements of `type` at `data`. A `row_stride_bytes` of 0 means
  //! packed rows. Throws `errc::invalid_argument` for a stride shorter than a row.
  constexpr basic_token_view(Byte* data, std::size_t rows, std::size_t cols, dtype type,
                             memory_space space = memory_space::host, int device = -1,
                             std::size_t row_stride_bytes = 0)
      : data_(data)
      , rows_(rows)
      , cols_(cols)
      , type_(type)
      , space_(space)
      , device_(device) {
    const std::size_t row_bytes = checked_mul(cols, size_of(type), "row bytes");
    stride_ = row_stride_bytes == 0 ? row_bytes : row_stride_bytes;
    WEAVE_EXPECT(stride_ >= row_bytes, errc::invalid_argument, "row stride ", stride_,
                 " bytes is shorter than a row of ", row_bytes, " bytes");
    WEAVE_EXPECT(data != nullptr || rows == 0 || row_bytes == 0, errc::invalid_argument,
                 "null data for a view of ", rows, " rows");
    (void)checked_mul(rows, stride_, "view bytes");
  }

  //! A mutable view converts to a const one.
  template <class Other>
  requires(std::is_const_v<Byte> && !std::is_const_v<Other>) constexpr basic_token_view(
      const basic_token_view<Other>& other) noexcept
      : data_(other.data())
      , rows_(other.rows())
      , cols_(other.cols())
      , stride_(other.row_stride())
      , type_(other.element_type())
      , space_(other.space())
      , device_(other.device()) {}

  constexpr Byte* data() const noexcept { return data_; }
  constexpr std::size_t rows() const noexcept { return rows_; }
  constexpr std::size_t cols() const noexcept { return cols_; }
  constexpr dtype element_type() const noexcept { return type_; }
  constexpr memory_space space() const noexcept { return space_; }
  constexpr int device() const noexcept { return device_; }
  //! Bytes of one row's elements.
  constexpr std::size_t row_bytes() const noexcept { return cols_ * size_of(type_); }
  //! Bytes from one row to the next.
  constexpr std::size_t row_stride() const noexcept { return stride_; }
  constexpr bool packed() const noexcept { return stride_ == row_bytes(); }
  constexpr bool empty() const noexcept { return rows_ == 0; }

  //! Start of row `i` (unchecked).
  constexpr Byte* row(std::size_t i) const noexcept { return data_ + i * stride_; }

  //! Row `i` as typed elements; throws `errc::invalid_argument` if `T` is not the view's dtype.
  template <class T>
  auto row_as(std::size_t i) const {
    using element = std::conditional_t<std::is_const_v<Byte>, const T, T>;
    WEAVE_EXPECT(dtype_of_v<T> == type_, errc::invalid_argument, "row_as<", dtype_of_v<T>,
                 "> on a view of ", type_);
    return std::span<element>(reinterpret_cast<element*>(row(i)), cols_);
  }

  //! Rows [first, first + count); throws `errc::out_of_range` past the end.
  constexpr basic_token_view subrows(std::size_t first, std::size_t count) const {
    WEAVE_EXPECT(first <= rows_ && count <= rows_ - first, errc::out_of_range, "rows [", first,
                 ", ", first + count, ") of a view of ", rows_, " rows");
    basic_token_view out = *this;
    out.data_ = count == 0 ? data_ : row(first);
    out.rows_ = count;
    return out;
  }

 private:
  Byte* data_ = nullptr;
  std::size_t rows_ = 0;
  std::size_t cols_ = 0;
  std::size_t stride_ = 0;
  dtype type_ = dtype::f32;
  memory_space space_ = memory_space::host;
  int device_ = -1;
};

using token_view = basic_token_view<std::byte>;
using const_token_view = basic_token_view<const std::byte>;

//! Borrows any tensor with a `tensor_traits` specialisation.
template <class Tensor>
auto make_token_view(Tensor& tensor) {
  using traits = tensor_traits<std::remove_const_t<Tensor>>;
  const auto* raw = traits::data(tensor);
  using pointer = decltype(traits::data(tensor));
  constexpr bool is_const = std::is_const_v<std::remove_pointer_t<pointer>>;
  using byte = std::conditional_t<is_const, const std::byte, std::byte>;
  int device = -1;
  if constexpr (requires { traits::device(tensor); })
    device = static_cast<int>(traits::device(tensor));
  std::size_t stride = 0;
  if constexpr (requires { traits::row_stride_bytes(tensor); })
    stride = static_cast<std::size_t>(traits::row_stride_bytes(tensor));
  return basic_token_view<byte>(
      static_cast<byte*>(const_cast<void*>(static_cast<const void*>(raw))),
      static_cast<std::size_t>(traits::rows(tensor)),
      static_cast<std::size_t>(traits::cols(tensor)), traits::element_type(tensor),
      traits::space(tensor), device, stride);
}

//! Views a flat span as `size / cols` rows; throws `errc::size_mismatch` unless `cols` divides it.
template <class T, std::size_t Extent>
auto make_token_view(std::span<T, Extent> elements, std::size_t cols,
                     memory_space space = memory_space::host, int device = -1) {
  WEAVE_EXPECT(cols > 0 && elements.size() % cols == 0, errc::size_mismatch, elements.size(),
               " elements do not form rows of ", cols);
  using byte = std::conditional_t<std::is_const_v<T>, const std::byte, std::byte>;
  return basic_token_view<byte>(reinterpret_cast<byte*>(elements.data()), elements.size() / cols,
                                cols, dtype_of_v<T>, space, device);
}

//! Views a vector's elements as rows of `cols` (host memory).
template <class T, class Alloc>
token_view make_token_view(std::vector<T, Alloc>& elements, std::size_t cols) {
  return make_token_view(std::span<T>(elements), cols);
}

template <class T, class Alloc>
const_token_view make_token_view(const std::vector<T, Alloc>& elements, std::size_t cols) {
  return make_token_view(std::span<const T>(elements), cols);
}

WEAVE_NAMESPACE_END
