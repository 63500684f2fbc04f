// The errc of the weave::error a callable throws (errc::internal when it throws none), for
// tests that check the error kind of many bad calls in a row.
#pragma once

#include <weave/core/error.hpp>

namespace weave_test {

template <class F>
weave::errc code_of(F&& f) {
  try {
    f();
  } catch (const weave::error& e) {
    return e.code();
  }
  return weave::errc::internal;
}

} // namespace weave_test
