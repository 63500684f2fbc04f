// What the harnesses share: a property that must hold aborts the run with a message (libFuzzer
// then reports the input as a crash), and a parser may refuse an input only with a weave::error
// of the codes the harness allows; any other exception escapes and is a finding too.
#pragma once

#include <weave/core/error.hpp>

#include <cstdio>
#include <cstdlib>
#include <initializer_list>

namespace weave_fuzz {

[[noreturn]] inline void fail(const char* what, const char* file, int line) {
  std::fprintf(stderr, "weave fuzz: property broken at %s:%d: %s\n", file, line, what);
  std::abort();
}

// Runs `f`; returns true if it returned, false if it threw a weave::error whose code is one of
// `allowed` (anything else is a finding).
template <class F>
bool accepted(std::initializer_list<weave::errc> allowed, F&& f) {
  try {
    f();
    return true;
  } catch (const weave::error& e) {
    for (const weave::errc code : allowed)
      if (e.code() == code)
        return false;
    std::fprintf(stderr, "weave fuzz: unexpected error code: %s\n", e.what());
    std::abort();
  }
}

} // namespace weave_fuzz

#define WEAVE_FUZZ_CHECK(cond)                                                                     \
  do {                                                                                             \
    if (!(cond))                                                                                   \
      ::weave_fuzz::fail(#cond, __FILE__, __LINE__);                                               \
  } while (false)
