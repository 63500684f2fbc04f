//! \file
//! `weave::source_location`: where a check failed, on every compiler weave supports.
//!
//! Where the standard library provides `std::source_location` (`__cpp_lib_source_location`),
//! `weave::source_location` is that type, so code written against `std::source_location` keeps
//! working. Some pairings lack it: clang 14 with libstdc++ 12 (Debian 12's default clang) ships
//! an empty `<source_location>`, because libstdc++ builds it on `__builtin_source_location`,
//! which clang gained only in version 15. There `weave::source_location` is a small class with
//! the same members (`current()`, `file_name()`, `line()`, `column()`, `function_name()`),
//! captured with the `__builtin_FILE()` family that GCC, clang, nvcc's front end and MSVC have
//! had for years. As with the standard type, `current()` used as a default argument names the
//! caller.
#pragma once

#include "weave/core/config.hpp"

#include <version>
#if defined(__cpp_lib_source_location)
#include <source_location>
#else
#include <cstdint>
#endif

WEAVE_NAMESPACE_BEGIN

#if defined(__cpp_lib_source_location)

//! The standard library's source location.
using source_location = std::source_location;

#else

// GCC has no __builtin_COLUMN; the column is then 0, as the standard allows.
#if defined(__has_builtin)
#if __has_builtin(__builtin_COLUMN)
#define WEAVE_DETAIL_COLUMN() __builtin_COLUMN()
#endif
#endif
#ifndef WEAVE_DETAIL_COLUMN
#define WEAVE_DETAIL_COLUMN() 0
#endif

//! A source location with `std::source_location`'s interface, for standard libraries that lack
//! it (see the file comment).
class source_location {
 public:
  constexpr source_location() noexcept = default;

  //! The location of the call; used as a default argument, the location of the caller.
  static constexpr source_location
  current(const char* file = __builtin_FILE(), const char* function = __builtin_FUNCTION(),
          std::uint_least32_t line = __builtin_LINE(),
          std::uint_least32_t column = WEAVE_DETAIL_COLUMN()) noexcept {
    source_location where;
    where.file_ = file;
    where.function_ = function;
    where.line_ = line;
    where.column_ = column;
    return where;
  }

  constexpr const char* file_name() const noexcept { return file_; }
  constexpr const char* function_name() const noexcept { return function_; }
  constexpr std::uint_least32_t line() const noexcept { return line_; }
  //! 0 where the compiler cannot say.
  constexpr std::uint_least32_t column() const noexcept { return column_; }

 private:
  const char* file_ = "";
  const char* function_ = "";
  std::uint_least32_t line_ = 0;
  std::uint_least32_t column_ = 0;
};

#endif

WEAVE_NAMESPACE_END
