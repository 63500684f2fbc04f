#include <doctest/doctest.h>

#include <weave/core/checked.hpp>
#include <weave/core/error.hpp>

#include <cstdint>
#include <limits>
#include <string>
#include <system_error>
#include <type_traits>
#include <version>

TEST_CASE("weave::error carries its code, a message naming the value, and the location") {
  const int bad_k = 9;
  int line = 0;
  try {
    line = __LINE__ + 1;
    WEAVE_EXPECT(bad_k <= 8, weave::errc::invalid_argument, "k = ", bad_k, " exceeds E = ", 8);
    FAIL("WEAVE_EXPECT did not throw");
  } catch (const weave::error& e) {
    CHECK(e.code() == weave::errc::invalid_argument);
    CHECK(e.message() == "k = 9 exceeds E = 8");
    CHECK(static_cast<int>(e.where().line()) == line);
    const std::string what = e.what();
    CHECK(what.find("weave invalid_argument: k = 9 exceeds E = 8") == 0);
    CHECK(what.find("error_test.cpp") != std::string::npos);
  }
}

TEST_CASE("weave::source_location names the caller, with or without std::source_location") {
  // Where the standard library has it, weave's type is std::source_location itself, so code
  // written against the standard type keeps compiling; elsewhere (clang 14 with libstdc++ 12)
  // it is weave's own class with the same members.
#if defined(__cpp_lib_source_location)
  static_assert(std::is_same_v<weave::source_location, std::source_location>);
#endif
  const auto here = weave::source_location::current();
  const int line = __LINE__ - 1;
  CHECK(static_cast<int>(here.line()) == line);
  CHECK(std::string(here.file_name()).find("error_test.cpp") != std::string::npos);
  CHECK(std::string(here.function_name()).size() > 0);
  // As a default argument it names the line that constructs the error, not error.hpp.
  const weave::error e(weave::errc::internal, "x");
  CHECK(static_cast<int>(e.where().line()) == __LINE__ - 1);
  CHECK(std::string(e.where().file_name()).find("error_test.cpp") != std::string::npos);
}

TEST_CASE("WEAVE_EXPECT evaluates its message only on failure") {
  int evaluated = 0;
  auto expensive = [&] {
    ++evaluated;
    return "x";
  };
  WEAVE_EXPECT(true, weave::errc::internal, expensive());
  CHECK(evaluated == 0);
  CHECK_THROWS_AS(WEAVE_EXPECT(false, weave::errc::internal, expensive()), weave::error);
  CHECK(evaluated == 1);
}

TEST_CASE("errc interoperates with std::error_code") {
  std::error_code ec = weave::errc::timeout;
  CHECK(ec.category().name() == std::string("weave"));
  CHECK(ec.message() == "timeout");
  CHECK(ec == weave::errc::timeout);
  CHECK(ec != weave::errc::peer_failure);
  for (int code = 1; code <= 16; ++code) {
    CHECK(std::string(weave::to_string(static_cast<weave::errc>(code))) != "unknown");
    CHECK(weave::detail::is_errc(code));
  }
  CHECK(std::string(weave::to_string(weave::errc::protocol)) == "protocol");
  CHECK(std::string(weave::to_string(weave::errc::experts_lost)) == "experts_lost");
  for (const std::int64_t other :
       {std::int64_t{0}, std::int64_t{17}, std::int64_t{-1}, std::int64_t{1} << 32})
    CHECK_FALSE(weave::detail::is_errc(other));
}

TEST_CASE("checked_cast rejects values that do not fit, naming them") {
  CHECK(weave::checked_cast<int>(std::size_t{123}) == 123);
  CHECK(weave::checked_cast<std::int32_t>(std::int64_t{-5}) == -5);
  const std::size_t big = std::size_t{1} << 31;
  try {
    (void)weave::checked_cast<int>(big, "send count");
    FAIL("no throw");
  } catch (const weave::error& e) {
    CHECK(e.code() == weave::errc::size_overflow);
    CHECK(e.message().find("send count = 2147483648") == 0);
  }
  CHECK_THROWS_AS((void)weave::checked_cast<std::uint32_t>(-1), weave::error);
  CHECK(weave::checked_cast<int>(std::numeric_limits<int>::max()) ==
        std::numeric_limits<int>::max());
}

TEST_CASE("checked_mul and checked_add detect 64-bit overflow") {
  CHECK(weave::checked_mul(1u << 20, 1u << 20) == (std::size_t{1} << 40));
  CHECK_THROWS_AS((void)weave::checked_mul(std::size_t{1} << 40, std::size_t{1} << 40),
                  weave::error);
  CHECK_THROWS_AS((void)weave::checked_add(std::numeric_limits<std::size_t>::max(), 1),
                  weave::error);
  CHECK(weave::align_up(1, 256) == 256);
  CHECK(weave::align_up(256, 256) == 256);
  CHECK(weave::align_up(0, 64) == 0);
}
