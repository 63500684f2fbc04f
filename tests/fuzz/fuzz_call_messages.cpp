// The message a tagged mpi_communicator collective receives from a peer (`mpi_call_messages`): a
// call header, then the peer's block when it is small enough, of any length MPI may deliver up
// to the posted capacity. Whatever arrives is accepted only when the header names this rank's
// call, kind and size and the body is empty or exactly the block; anything else is
// `errc::call_mismatch` or `errc::size_mismatch`. Every message a sender writes for the same call
// and size is accepted, and its block reads back unchanged.
#include "fuzz_support.hpp"

#include <fuzzer/FuzzedDataProvider.h>
#include <weave/comm/mpi_call_header.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using header = weave::detail::mpi_call_header;

weave::call_tag any_tag(FuzzedDataProvider& in) {
  return weave::call_tag::of(in.ConsumeIntegralInRange<std::uint32_t>(0, 3),
                             in.ConsumeIntegralInRange<std::uint64_t>(0, 3),
                             weave::call_stage::dispatch, in.ConsumeIntegralInRange<int>(0, 2));
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  weave::detail::mpi_call_messages messages(in.ConsumeIntegralInRange<std::size_t>(0, 80));
  messages.prepare(2);
  const std::int64_t kind = in.ConsumeBool() ? header::all_to_all : header::counts;
  const std::size_t unit = in.ConsumeIntegralInRange<std::size_t>(1, 16);
  const auto count = in.ConsumeIntegralInRange<std::int64_t>(0, 12); // what this rank receives
  const std::size_t bytes = static_cast<std::size_t>(count) * unit;
  const weave::call_tag tag = any_tag(in);
  // The sender's message: one written for some call and size (often this rank's), then maybe
  // overwritten in part; its length anything MPI could deliver into the receive.
  const auto sent_count = in.ConsumeBool() ? count : in.ConsumeIntegralInRange<std::int64_t>(0, 12);
  const std::size_t sent_bytes = static_cast<std::size_t>(sent_count) * unit;
  std::vector<std::byte> block(sent_bytes);
  for (std::byte& b : block)
    b = static_cast<std::byte>(in.ConsumeIntegral<std::uint8_t>());
  const weave::call_tag sent_tag = in.ConsumeBool() ? tag : any_tag(in);
  const auto [message, written] = messages.write(
      1, sent_tag, kind, header::size_of(kind, sent_count, unit), block.data(), sent_bytes);
  std::int64_t* slot = messages.receive_buffer(1);
  std::memcpy(slot, message, static_cast<std::size_t>(written));
  int length = written;
  const bool tampered = in.ConsumeBool();
  if (tampered) {
    length = in.ConsumeIntegralInRange<int>(0, messages.capacity());
    const std::vector<std::uint8_t> noise = in.ConsumeBytes<std::uint8_t>(
        in.ConsumeIntegralInRange<std::size_t>(0, static_cast<std::size_t>(messages.capacity())));
    if (!noise.empty())
      std::memcpy(slot, noise.data(), noise.size());
  }
  const std::int64_t expected = header::size_of(kind, count, unit);
  try {
    messages.check(1, length, 0, 1, tag, kind, expected, bytes, "all_to_all_v");
  } catch (const weave::error& e) {
    WEAVE_FUZZ_CHECK(e.code() == weave::errc::call_mismatch ||
                     e.code() == weave::errc::size_mismatch);
    // An untouched message of this call and size is never refused.
    WEAVE_FUZZ_CHECK(tampered || sent_tag != tag || sent_count != count);
    return 0;
  }
  // Accepted: the header states this rank's call, kind and size, the body is empty or the block.
  WEAVE_FUZZ_CHECK(slot[0] == header::marker && slot[2] == kind && slot[3] == expected);
  WEAVE_FUZZ_CHECK(weave::call_tag{static_cast<std::uint64_t>(slot[1])} == tag);
  const std::size_t body = static_cast<std::size_t>(length) - header::words * sizeof(std::int64_t);
  WEAVE_FUZZ_CHECK(body == 0 || body == bytes);
  WEAVE_FUZZ_CHECK(messages.inside(1) == (body > 0 || bytes == 0));
  if (!tampered) { // a sender's message: the block inside exactly when it fits, unchanged
    WEAVE_FUZZ_CHECK(messages.inside(1) == (bytes <= messages.inline_bytes()));
    if (messages.inside(1)) {
      std::vector<std::byte> out(bytes);
      messages.copy_block(1, out.data(), bytes);
      WEAVE_FUZZ_CHECK(std::equal(out.begin(), out.end(), block.begin(), block.end()));
    }
  }
  return 0;
}
