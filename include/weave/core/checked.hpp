//! \file
//! Overflow-checked integer arithmetic and narrowing, for sizes handed to backends whose counts
//! are 32-bit (MPI, some CUDA launch parameters) or products that may exceed 64 bits.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <utility>

WEAVE_NAMESPACE_BEGIN

//! Converts `value` to `To`, or throws `errc::size_overflow` naming `what` and the value.
template <std::integral To, std::integral From>
constexpr To checked_cast(From value, const char* what = "value") {
  if (!std::in_range<To>(value))
    WEAVE_THROW(errc::size_overflow, what, " = ", value, " does not fit in the target type (range ",
                +std::numeric_limits<To>::min(), "..", +std::numeric_limits<To>::max(), ")");
  return static_cast<To>(value);
}

//! `a * b` for sizes, or throws `errc::size_overflow`.
constexpr std::size_t checked_mul(std::size_t a, std::size_t b, const char* what = "size") {
  std::size_t out = 0;
  if (__builtin_mul_overflow(a, b, &out))
    WEAVE_THROW(errc::size_overflow, what, ": ", a, " * ", b, " overflows 64 bits");
  return out;
}

//! `a + b` for sizes, or throws `errc::size_overflow`.
constexpr std::size_t checked_add(std::size_t a, std::size_t b, const char* what = "size") {
  std::size_t out = 0;
  if (__builtin_add_overflow(a, b, &out))
    WEAVE_THROW(errc::size_overflow, what, ": ", a, " + ", b, " overflows 64 bits");
  return out;
}

//! Rounds `value` up to a multiple of `alignment` (a power of two).
constexpr std::size_t align_up(std::size_t value, std::size_t alignment) noexcept {
  return (value + alignment - 1) & ~(alignment - 1);
}

WEAVE_NAMESPACE_END
