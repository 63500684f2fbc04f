// Cluster files (`read_cluster`): any text is read or refused with a typed error; what is read
// writes back and reads again to the same cluster.
#include "fuzz_support.hpp"

#include <weave/sim/cluster.hpp>

#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  weave::sim::cluster c;
  const bool read =
      weave_fuzz::accepted({weave::errc::invalid_argument, weave::errc::size_overflow}, [&] {
        std::istringstream in(text);
        c = weave::sim::read_cluster(in);
      });
  if (!read)
    return 0;
  std::ostringstream out;
  weave::sim::write_cluster(out, c); // what was read is a valid cluster: no refusal
  std::istringstream again(out.str());
  WEAVE_FUZZ_CHECK(weave::sim::read_cluster(again) == c);
  return 0;
}
