// A stand-in for std::source_location where the standard library lacks it: Debian's clang 14
// (the clang that has libFuzzer here) with GCC 12's libstdc++, whose <source_location> is empty
// without __builtin_source_location. weave's errors name std::source_location, so the fuzz
// build force-includes this header when CMake finds it missing (tests/fuzz/CMakeLists.txt).
// Only the harnesses use it; drop it once weave's headers compile with clang 14 on their own.
#pragma once

#include <source_location>
#include <version>

#if !defined(__cpp_lib_source_location)
namespace std {
struct source_location {
  static constexpr source_location current(const char* file = __builtin_FILE(),
                                           const char* function = __builtin_FUNCTION(),
                                           unsigned line = __builtin_LINE(),
                                           unsigned column = __builtin_COLUMN()) noexcept {
    source_location at;
    at.file_ = file;
    at.function_ = function;
    at.line_ = line;
    at.column_ = column;
    return at;
  }
  constexpr source_location() noexcept = default;
  constexpr const char* file_name() const noexcept { return file_; }
  constexpr const char* function_name() const noexcept { return function_; }
  constexpr unsigned line() const noexcept { return line_; }
  constexpr unsigned column() const noexcept { return column_; }

 private:
  const char* file_ = "";
  const char* function_ = "";
  unsigned line_ = 0, column_ = 0;
};
} // namespace std
#endif
