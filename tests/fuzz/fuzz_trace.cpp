// Trace files (`read_trace_layers`, `read_trace`): any text is read or refused with a typed error;
// what is read writes back and reads again to the same trace.
#include "fuzz_support.hpp"

#include <weave/placement/trace_io.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>

namespace {

bool same(const weave::layered_trace& a, const weave::layered_trace& b) {
  if (a.layers.size() != b.layers.size() || a.scores.size() != b.scores.size())
    return false;
  for (std::size_t l = 0; l < a.layers.size(); ++l) {
    const auto &x = a.layers[l], &y = b.layers[l];
    if (x.num_experts != y.num_experts || x.k != y.k || x.ids != y.ids)
      return false;
  }
  for (std::size_t l = 0; l < a.scores.size(); ++l) { // bit for bit: the writer round-trips
    const auto &x = a.scores[l], &y = b.scores[l];
    if (x.size() != y.size() ||
        (!x.empty() && std::memcmp(x.data(), y.data(), x.size() * sizeof(float)) != 0))
      return false;
  }
  return true;
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  using weave::errc;
  const auto refusals = {errc::invalid_argument, errc::size_mismatch, errc::out_of_range,
                         errc::size_overflow};
  weave::layered_trace trace;
  const bool read = weave_fuzz::accepted(refusals, [&] {
    std::istringstream in(text);
    trace = weave::read_trace_layers(in);
  });
  // read_trace reads what read_trace_layers reads, when it is one layer.
  weave::routing_trace one;
  const bool read_one = weave_fuzz::accepted(refusals, [&] {
    std::istringstream in(text);
    one = weave::read_trace(in);
  });
  WEAVE_FUZZ_CHECK(read_one == (read && trace.layers.size() == 1));
  if (!read)
    return 0;
  if (read_one)
    WEAVE_FUZZ_CHECK(one.ids == trace.layers[0].ids && one.k == trace.layers[0].k &&
                     one.num_experts == trace.layers[0].num_experts);
  std::ostringstream out;
  weave::write_trace_layers(out, trace); // what was read is a valid trace: no refusal
  std::istringstream again(out.str());
  WEAVE_FUZZ_CHECK(same(weave::read_trace_layers(again), trace));
  return 0;
}
