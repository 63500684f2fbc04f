// Failure records on the wire (`decode_failure`, `encode_failure`, `record_of`): any 16 words
// from any sender of any world are read or refused with `errc::protocol`; what is read encodes
// back to the same words and names a rank of the world; any record made by `record_of` travels
// and reads back.
#include "fuzz_support.hpp"

#include <fuzzer/FuzzedDataProvider.h>
#include <weave/core/failure.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <optional>
#include <stdexcept>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  const int ranks = in.ConsumeIntegralInRange<int>(1, 1 << 20);
  const int sender = in.ConsumeIntegralInRange<int>(0, ranks - 1);
  std::array<std::int64_t, weave::failure_words> words{};
  for (std::int64_t& w : words) {
    // Mostly what an encoder writes, else anything: a status word near the real ones.
    switch (in.ConsumeIntegralInRange<int>(0, 3)) {
    case 0:
      w = in.ConsumeIntegral<std::int64_t>();
      break;
    case 1:
      w = (std::int64_t{in.ConsumeIntegralInRange<int>(0, 8)} << 32) |
          (std::int64_t{in.ConsumeIntegralInRange<int>(0, 3)} << 16) |
          in.ConsumeIntegralInRange<int>(0, 16);
      break;
    case 2:
      w = in.ConsumeIntegral<std::uint8_t>();
      break;
    default:
      w = 0;
    }
  }
  std::optional<weave::failure_record> read;
  if (weave_fuzz::accepted({weave::errc::protocol},
                           [&] { read = weave::decode_failure(words, sender, ranks); })) {
    std::array<std::int64_t, weave::failure_words> back{};
    weave::encode_failure(read ? &*read : nullptr, back);
    WEAVE_FUZZ_CHECK(back == words); // one wire form per record
    if (read) {
      WEAVE_FUZZ_CHECK(read->rank >= 0 && read->rank < ranks);
      WEAVE_FUZZ_CHECK(weave::detail::is_errc(static_cast<std::int64_t>(read->code)));
      WEAVE_FUZZ_CHECK(!read->describe().empty());
    }
  }
  // A record made from any exception travels: it encodes, and reads back as itself (its
  // message cut at a zero byte and to 119 bytes).
  const int code = in.ConsumeIntegralInRange<int>(-2, 20);
  const int origin = in.ConsumeIntegralInRange<int>(-3, ranks + 2);
  const std::string message = in.ConsumeRandomLengthString(300);
  std::exception_ptr failure;
  switch (in.ConsumeIntegralInRange<int>(0, 2)) {
  case 0:
    failure = std::make_exception_ptr(weave::error(static_cast<weave::errc>(code), message));
    break;
  case 1:
    failure = std::make_exception_ptr(weave::peer_error(
        {origin, static_cast<weave::errc>(code), in.ConsumeBool(), message}, "fuzz"));
    break;
  default:
    failure = std::make_exception_ptr(std::runtime_error(message));
  }
  const weave::failure_record record = weave::record_of(failure, sender);
  std::array<std::int64_t, weave::failure_words> wire{};
  weave::encode_failure(&record, wire);
  WEAVE_FUZZ_CHECK(wire[0] != 0);
  // It names a rank of a world large enough to hold its origin.
  const int world = std::max(record.rank + 1, ranks);
  const std::optional<weave::failure_record> back = weave::decode_failure(wire, sender, world);
  WEAVE_FUZZ_CHECK(back && back->rank == record.rank && back->code == record.code &&
                   back->weave_error == record.weave_error);
  const std::string sent = record.message.substr(0, record.message.find('\0')).substr(0, 119);
  WEAVE_FUZZ_CHECK(back->message == sent);
  return 0;
}
