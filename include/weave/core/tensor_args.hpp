//! \file
//! Call arguments of any tensor type: which argument types only view memory (so a temporary of
//! them may be passed), and the conversions weave's tensor-generic overloads apply (token rows
//! from a view or any `tensor_traits` type; flat element spans from spans, contiguous ranges or
//! 2-D tensors).
//!
//! weave borrows a call's tensors until its streams are synchronized, so a temporary that owns
//! its memory (`layer.dispatch(x.contiguous(), ...)` on a `torch::Tensor`, a `std::vector`
//! returned by a function) would dangle. The tensor-generic overloads reject such arguments at
//! compile time (they are deleted for `dangling_tensor_arg` types); views, spans and named
//! tensors (lvalues) are accepted.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/dtype.hpp"
#include "weave/core/error.hpp"
#include "weave/core/tensor.hpp"

#include <concepts>
#include <cstddef>
#include <ranges>
#include <span>
#include <type_traits>

WEAVE_NAMESPACE_BEGIN

//! True for types that view memory they do not own, so that a temporary of the type may be
//! passed where weave borrows rows (copying it does not copy the rows): token views, `std::span`
//! and every `std::ranges` borrowed range. Specialise it as `true` for your own view types.
template <class T>
inline constexpr bool enable_borrowed_tensor = std::ranges::enable_borrowed_range<T>;

template <class Byte>
inline constexpr bool enable_borrowed_tensor<basic_token_view<Byte>> = true;

//! True when an argument of forwarding-reference type `T&&` would dangle once the call
//! returns: a temporary (rvalue) of a type that owns its memory.
template <class T>
concept dangling_tensor_arg =
    !std::is_lvalue_reference_v<T> && !enable_borrowed_tensor<std::remove_cvref_t<T>>;

namespace detail {

// Rows to read: a token view as it is, anything else through its tensor_traits.
template <class T>
const_token_view as_const_rows(const T& t) {
  if constexpr (std::is_convertible_v<const T&, const_token_view>)
    return t;
  else
    return make_token_view(t);
}

// Rows to write: a mutable token view, or a tensor whose traits give mutable data.
template <class T>
token_view as_mutable_rows(T& t) {
  if constexpr (std::is_convertible_v<T&, token_view>) {
    return t;
  } else {
    auto view = make_token_view(t);
    static_assert(std::is_same_v<decltype(view), token_view>,
                  "weave: output rows need a mutable tensor (its tensor_traits::data(T&) must "
                  "return void*, and the argument must not be const)");
    return view;
  }
}

// A flat span of `E` (k values per token: ids, weights, gate gradients): a span or contiguous
// range as it is, or a packed 2-D tensor of E's dtype through its tensor_traits.
template <class E, class T>
std::span<E> as_elements(T& t, const char* what) {
  if constexpr (std::is_convertible_v<T&, std::span<E>>) {
    return std::span<E>(t);
  } else {
    const auto view = make_token_view(t);
    using byte = typename decltype(view)::byte_type;
    static_assert(std::is_const_v<E> || !std::is_const_v<byte>,
                  "weave: an output argument needs a mutable tensor");
    WEAVE_EXPECT(view.element_type() == dtype_of_v<E>, errc::invalid_argument, what,
                 ": a tensor of ", view.element_type(), " where ", dtype_of_v<E>,
                 " values are expected");
    WEAVE_EXPECT(view.packed() || view.rows() <= 1, errc::invalid_argument, what,
                 ": the tensor's rows are strided (", view.row_stride(),
                 " bytes apart); pass a contiguous one");
    return std::span<E>(reinterpret_cast<E*>(view.data()), view.rows() * view.cols());
  }
}

} // namespace detail

WEAVE_NAMESPACE_END
