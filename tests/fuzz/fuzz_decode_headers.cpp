// Decode message headers, as both decode exchanges read them: the host `decode_exchange`'s check
// of a phase (`check_decode_headers`) and the device exchange's receive step
// (`decode_receive_step`, then the expert layout it feeds, `decode_expert_index_step`), run here
// on the host as host_space runs them. Whatever the headers hold: a header no sender writes is
// refused (`errc::protocol`, naming its sender), a failed header anywhere fails the phase, and
// only valid row counts reach the receive layout, which stays inside the message buffer.
#include "fuzz_support.hpp"

#include <fuzzer/FuzzedDataProvider.h>
#include <weave/overlap/decode_options.hpp>
#include <weave/overlap/device_decode_steps.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <vector>

namespace {

// A header: often one a sender writes (which every reader accepts), then a few of its bytes
// changed.
weave::decode_header header(FuzzedDataProvider& in, std::int64_t sender, std::int64_t max_rows,
                            std::uint32_t known) {
  weave::decode_header h;
  if (in.ConsumeBool()) {
    h = weave::detail::failed_header(static_cast<int>(sender),
                                     static_cast<weave::errc>(in.ConsumeIntegral<std::int32_t>()),
                                     in.ConsumeRandomLengthString(120));
    if (in.ConsumeBool())
      h.flags = static_cast<std::int32_t>(in.ConsumeIntegral<std::uint32_t>() & known);
  } else {
    h.rows = in.ConsumeIntegralInRange<std::int64_t>(0, max_rows);
    h.source = static_cast<std::int32_t>(sender);
  }
  WEAVE_FUZZ_CHECK(weave::detail::decode_header_fault_of(h, sender, max_rows, known) ==
                   weave::decode_header_fault::none);
  auto* bytes = reinterpret_cast<unsigned char*>(&h);
  for (int n = in.ConsumeIntegralInRange(0, 3); n > 0; --n)
    bytes[in.ConsumeIntegralInRange<std::size_t>(0, sizeof h - 1)] =
        in.ConsumeIntegral<unsigned char>();
  return h;
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  const int ranks = in.ConsumeIntegralInRange(1, 4), slots = in.ConsumeIntegralInRange(1, 3);
  const std::size_t max_rows = in.ConsumeIntegralInRange<std::size_t>(1, 4);
  const std::uint32_t known = in.ConsumeBool() ? 0u : 7u | weave::device_decode_nonfinite;
  // A device message buffer of rows of 96 bytes: each rank's block holds its headers, then the
  // payload rows of each slot (the row index is what the layout step writes).
  const auto at = weave::detail::decode_layout::of(ranks, slots, max_rows, 96);
  std::vector<std::byte> buffer(at.rows() * at.stride);
  const auto M = static_cast<std::int64_t>(max_rows);
  for (int d = 0; d < ranks; ++d)
    for (int l = 0; l < slots; ++l)
      *at.header(buffer.data(), d, l) = header(in, d, M, known);
  std::vector<std::int64_t> expected(static_cast<std::size_t>(ranks * slots));
  for (std::int64_t& e : expected)
    e = in.ConsumeIntegralInRange<std::int64_t>(0, M);

  // The host exchange's check.
  const auto verdict = weave::detail::check_decode_headers(
      static_cast<std::size_t>(ranks), static_cast<std::size_t>(slots), M, known, "fuzz",
      [&](std::size_t d, std::size_t l) {
        return *at.header(buffer.data(), static_cast<std::int64_t>(d),
                          static_cast<std::int64_t>(l));
      },
      [](const weave::decode_header& h) {
        return weave::failure_record{h.source, static_cast<weave::errc>(h.code), true, "cause"};
      });
  bool any_fault = false, any_failed = false;
  for (int d = 0; d < ranks; ++d)
    for (int l = 0; l < slots; ++l) {
      const weave::decode_header& h = *at.header(buffer.data(), d, l);
      const auto fault = weave::detail::decode_header_fault_of(h, d, M, known);
      any_fault = any_fault || fault != weave::decode_header_fault::none;
      any_failed = any_failed || (fault == weave::decode_header_fault::none &&
                                  h.status == weave::decode_status::failed);
      if (fault != weave::decode_header_fault::none)
        WEAVE_FUZZ_CHECK(!weave::detail::describe_header_fault(fault, h, M).empty());
    }
  WEAVE_FUZZ_CHECK(static_cast<bool>(verdict.failure) == (any_fault || any_failed));
  if (verdict.failure) {
    try {
      std::rethrow_exception(verdict.failure);
    } catch (const weave::peer_error& e) {
      WEAVE_FUZZ_CHECK(e.origin().rank >= 0 && e.origin().rank < ranks);
      WEAVE_FUZZ_CHECK(weave::detail::is_errc(static_cast<std::int64_t>(e.origin().code)));
    } catch (const weave::error& e) {
      WEAVE_FUZZ_CHECK(e.code() == weave::errc::protocol && !verdict.told);
    }
  }

  // The device exchange's steps: the dispatch's receive, then its expert layout; the combine's.
  const auto S = static_cast<std::size_t>(ranks * slots);
  std::vector<std::int64_t> source_rows(S, -7), source_offsets(S, -7),
      expert_rows(static_cast<std::size_t>(slots), -7), index(S * max_rows, -7);
  std::uint32_t call_failed = 0, error = 0;
  weave::detail::decode_kept kept{};
  const weave::detail::decode_receive_step dispatch{at,
                                                    buffer.data(),
                                                    known,
                                                    nullptr,
                                                    source_rows.data(),
                                                    source_offsets.data(),
                                                    expert_rows.data(),
                                                    &call_failed,
                                                    &error,
                                                    &kept};
  for (int l = 0; l < slots; ++l)
    dispatch(l);
  WEAVE_FUZZ_CHECK((call_failed != 0) == (any_fault || any_failed));
  WEAVE_FUZZ_CHECK(kept.bad_claimed == (any_fault ? 1u : 0u));
  WEAVE_FUZZ_CHECK(kept.peer_claimed == (any_failed ? 1u : 0u));
  if (kept.bad_claimed != 0) {
    const auto fault = static_cast<weave::decode_header_fault>(kept.bad_fault);
    WEAVE_FUZZ_CHECK(fault != weave::decode_header_fault::none);
    WEAVE_FUZZ_CHECK(weave::detail::decode_header_fault_of(kept.bad, kept.bad_sender, M, known) ==
                     fault);
  }
  if (kept.peer_claimed != 0)
    WEAVE_FUZZ_CHECK(kept.peer.status == weave::decode_status::failed &&
                     weave::detail::is_errc(kept.peer.code));
  for (int l = 0; l < slots; ++l) {
    WEAVE_FUZZ_CHECK(expert_rows[static_cast<std::size_t>(l)] >= 0 &&
                     expert_rows[static_cast<std::size_t>(l)] <= ranks * M);
    for (int d = 0; d < ranks; ++d) {
      const std::int64_t n = source_rows[static_cast<std::size_t>(l * ranks + d)];
      WEAVE_FUZZ_CHECK(n >= 0 && n <= M);
    }
  }
  const weave::detail::decode_expert_index_step layout{
      at, source_rows.data(), source_offsets.data(), expert_rows.data(), index.data()};
  for (std::size_t i = 0; i < index.size(); ++i) {
    layout(static_cast<std::int64_t>(i));
    WEAVE_FUZZ_CHECK(index[i] >= -1 && index[i] < static_cast<std::int64_t>(at.rows()));
  }
  // The combine's receive: a message returning other rows than were sent fails the call.
  call_failed = 0;
  kept = {};
  const weave::detail::decode_receive_step combine{at,      buffer.data(), known,   expected.data(),
                                                   nullptr, nullptr,       nullptr, &call_failed,
                                                   &error,  &kept};
  for (int l = 0; l < slots; ++l)
    combine(l);
  if (any_fault || any_failed)
    WEAVE_FUZZ_CHECK(call_failed != 0);
  return 0;
}
