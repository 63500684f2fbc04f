// Decode message headers and token records, as both decode exchanges read them: the host
// `decode_exchange`'s check of a phase (`check_decode_headers`) and the device exchange's receive
// step (`decode_receive_step`, then the expert layout it feeds, `decode_slot_layout_step`), run
// here on the host as host_space runs them. Whatever the messages hold: a header or record no
// sender writes is refused (`errc::protocol`, naming its sender), a failed header anywhere fails
// the phase, and only valid counts and choices reach the receive layout, whose indices stay
// inside the buffers.
#include "fuzz_support.hpp"

#include <fuzzer/FuzzedDataProvider.h>
#include <weave/overlap/decode_options.hpp>
#include <weave/overlap/detail/device_decode_steps.hpp>

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
  const std::size_t choices = in.ConsumeIntegralInRange<std::size_t>(1, slots);
  const std::uint32_t known = in.ConsumeBool() ? 0u : 7u | weave::device_decode_nonfinite;
  // A device dispatch buffer of rows of 96 bytes: per rank its header, its records' rows (the row
  // index is what the layout step writes), then their side table, mostly records a sender writes.
  const auto at = weave::detail::decode_layout::dispatch(ranks, max_rows, choices, 96);
  const auto back = weave::detail::decode_layout::combine(ranks, max_rows, choices, 96);
  std::vector<std::byte> buffer(at.rows() * at.stride);
  const auto M = static_cast<std::int64_t>(max_rows);
  const auto C = static_cast<std::int64_t>(choices);
  for (int d = 0; d < ranks; ++d) {
    *at.header(buffer.data(), d) = header(in, d, M, known);
    std::int32_t* side = at.side_table(buffer.data(), d);
    for (std::int64_t r = 0; r < M; ++r) {
      std::vector<std::int32_t> pick(static_cast<std::size_t>(slots));
      for (int l = 0; l < slots; ++l)
        pick[static_cast<std::size_t>(l)] = l;
      const auto n = in.ConsumeIntegralInRange<std::int64_t>(1, C);
      for (std::int64_t c = 0; c < C; ++c) {
        const auto j =
            in.ConsumeIntegralInRange<std::size_t>(static_cast<std::size_t>(c), pick.size() - 1);
        std::swap(pick[static_cast<std::size_t>(c)], pick[j]);
        side[r * C + c] = c < n ? pick[static_cast<std::size_t>(c)] : -1;
      }
      if (in.ConsumeIntegralInRange(0, 7) == 0)
        side[r * C + in.ConsumeIntegralInRange<std::int64_t>(0, C - 1)] =
            in.ConsumeIntegralInRange<std::int32_t>(-3, slots + 1);
    }
  }

  // The host exchange's check of the headers.
  const auto verdict = weave::detail::check_decode_headers(
      static_cast<std::size_t>(ranks), 1, M, known, "fuzz",
      [&](std::size_t d, std::size_t) {
        return *at.header(buffer.data(), static_cast<std::int64_t>(d));
      },
      [](const weave::decode_header& h) {
        return weave::failure_record{h.source, static_cast<weave::errc>(h.code), true, "cause"};
      });
  bool any_fault = false, any_failed = false, any_bad_record = false;
  std::int64_t pairs = 0;
  for (int d = 0; d < ranks; ++d) {
    const weave::decode_header& h = *at.header(buffer.data(), d);
    const auto fault = weave::detail::decode_header_fault_of(h, d, M, known);
    any_fault = any_fault || fault != weave::decode_header_fault::none;
    any_failed = any_failed || (fault == weave::decode_header_fault::none &&
                                h.status == weave::decode_status::failed);
    if (fault != weave::decode_header_fault::none)
      WEAVE_FUZZ_CHECK(!weave::detail::describe_header_fault(fault, h, M).empty());
    if (fault != weave::decode_header_fault::none || h.status != weave::decode_status::ok)
      continue;
    // A naive reading of the records: distinct slots of this rank, at least one, then -1.
    const std::int32_t* side = at.side_table(buffer.data(), d);
    for (std::int64_t r = 0; r < h.rows; ++r) {
      std::vector<bool> seen(static_cast<std::size_t>(slots));
      std::int64_t c = 0;
      bool ok = true;
      for (; c < C && side[r * C + c] != -1; ++c) {
        const std::int32_t v = side[r * C + c];
        ok = ok && v >= 0 && v < slots && !seen[static_cast<std::size_t>(v)];
        if (ok)
          seen[static_cast<std::size_t>(v)] = true;
      }
      ok = ok && c > 0;
      for (std::int64_t rest = c; rest < C; ++rest)
        ok = ok && side[r * C + rest] == -1;
      any_bad_record = any_bad_record || !ok;
      pairs += ok ? c : 0;
    }
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
  std::vector<std::int64_t> arrived(static_cast<std::size_t>(ranks), -7);
  std::uint32_t call_failed = 0, error = 0;
  weave::detail::decode_kept kept{};
  const weave::detail::decode_receive_step dispatch{
      at, buffer.data(), known, slots, nullptr, arrived.data(), &call_failed, &error, &kept};
  for (int d = 0; d < ranks; ++d)
    dispatch(d);
  const bool fails = any_fault || any_failed || any_bad_record;
  WEAVE_FUZZ_CHECK((call_failed != 0) == fails);
  WEAVE_FUZZ_CHECK(kept.bad_claimed == (any_fault ? 1u : 0u));
  WEAVE_FUZZ_CHECK(kept.peer_claimed == (any_failed ? 1u : 0u));
  WEAVE_FUZZ_CHECK(kept.record_claimed == (any_bad_record ? 1u : 0u));
  if (kept.bad_claimed != 0) {
    const auto fault = static_cast<weave::decode_header_fault>(kept.bad_fault);
    WEAVE_FUZZ_CHECK(fault != weave::decode_header_fault::none && kept.bad_limit == M);
    WEAVE_FUZZ_CHECK(weave::detail::decode_header_fault_of(kept.bad, kept.bad_sender, M, known) ==
                     fault);
  }
  if (kept.peer_claimed != 0)
    WEAVE_FUZZ_CHECK(kept.peer.status == weave::decode_status::failed &&
                     weave::detail::is_errc(kept.peer.code));
  if (kept.record_claimed != 0)
    WEAVE_FUZZ_CHECK(kept.record >= 0 && kept.record < M && kept.record_choice >= 0 &&
                     kept.record_choice < C);
  std::int64_t arrived_pairs = 0;
  for (const std::int64_t n : arrived) {
    WEAVE_FUZZ_CHECK(n >= 0 && n <= M * C);
    arrived_pairs += n;
  }
  if (!fails)
    WEAVE_FUZZ_CHECK(arrived_pairs == pairs);

  const auto S = static_cast<std::size_t>(ranks * slots);
  std::vector<std::int64_t> source_rows(S, -7), source_offsets(S, -7),
      expert_rows(static_cast<std::size_t>(slots), -7), index(S * max_rows, -7),
      returns(back.rows(), -1);
  const weave::detail::decode_slot_layout_step layout{at,
                                                      back,
                                                      buffer.data(),
                                                      &call_failed,
                                                      source_rows.data(),
                                                      source_offsets.data(),
                                                      expert_rows.data(),
                                                      index.data(),
                                                      returns.data(),
                                                      nullptr,
                                                      nullptr};
  std::int64_t laid_out = 0;
  for (int l = 0; l < slots; ++l) {
    layout(l);
    const std::int64_t n = expert_rows[static_cast<std::size_t>(l)];
    WEAVE_FUZZ_CHECK(n >= 0 && n <= ranks * M);
    laid_out += n;
    for (int d = 0; d < ranks; ++d)
      WEAVE_FUZZ_CHECK(source_rows[static_cast<std::size_t>(l * ranks + d)] >= 0 &&
                       source_rows[static_cast<std::size_t>(l * ranks + d)] <= M);
  }
  WEAVE_FUZZ_CHECK(laid_out == (fails ? 0 : pairs));
  for (const std::int64_t i : index)
    WEAVE_FUZZ_CHECK(i >= -1 && i < static_cast<std::int64_t>(at.rows()));
  std::int64_t returned = 0;
  for (const std::int64_t i : returns) {
    WEAVE_FUZZ_CHECK(i >= -1 && i < static_cast<std::int64_t>(index.size()));
    returned += i >= 0;
  }
  WEAVE_FUZZ_CHECK(returned == laid_out);

  // The combine's receive: a message returning other rows than were sent fails the call.
  std::vector<std::byte> combine(back.rows() * back.stride);
  std::vector<std::int64_t> expected(static_cast<std::size_t>(ranks));
  for (int d = 0; d < ranks; ++d) {
    *back.header(combine.data(), d) = header(in, d, M * C, known);
    expected[static_cast<std::size_t>(d)] = in.ConsumeIntegralInRange<std::int64_t>(0, M * C);
  }
  call_failed = 0;
  kept = {};
  const weave::detail::decode_receive_step returns_step{
      back, combine.data(), known, slots, expected.data(), nullptr, &call_failed, &error, &kept};
  bool combine_fails = false;
  for (int d = 0; d < ranks; ++d) {
    const weave::decode_header& h = *back.header(combine.data(), d);
    combine_fails = combine_fails ||
                    weave::detail::decode_header_fault_of(h, d, M * C, known) !=
                        weave::decode_header_fault::none ||
                    h.status != weave::decode_status::ok ||
                    h.rows != expected[static_cast<std::size_t>(d)];
  }
  for (int d = 0; d < ranks; ++d)
    returns_step(d);
  WEAVE_FUZZ_CHECK((call_failed != 0) == combine_fails);
  return 0;
}
