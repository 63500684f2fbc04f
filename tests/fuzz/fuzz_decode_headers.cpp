// Decode message headers and token records, as the decode exchange reads them in every execution
// space: the check of a phase's headers (`check_decode_headers`), the receive step
// (`decode_receive_step`) on the wire format of decode_wire.hpp (a header, its records' rows, then
// their side table; this rank's own side table in its send buffer), then the expert pool it feeds,
// in both forms (`decode_slots_serial`, which host_space runs, and the per-slot count, scan, busy
// and place steps of the GPU), run here on the host. Whatever the messages hold: a header or
// record no sender writes is refused (`errc::protocol`, naming its sender), a failed header
// anywhere fails the phase, and only valid counts and choices reach the pool, whose indices stay
// inside the buffers and whose two forms agree.
#include "fuzz_support.hpp"

#include <fuzzer/FuzzedDataProvider.h>
#include <weave/overlap/decode_options.hpp>
#include <weave/overlap/detail/decode_pool_steps.hpp>
#include <weave/overlap/detail/decode_serial_steps.hpp>
#include <weave/overlap/detail/decode_wire.hpp>

#include <algorithm>
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

// One form's pool arrays (`decode_call_arrays`), zero where the layer's initialisation zeroes
// them, -7 elsewhere.
struct pool_arrays {
  std::vector<std::int64_t> slot_rows, first, source_rows, source_first, busy, from_peer, from_own,
      merge_index, own_index, return_index, own_token;
  std::vector<float> merge_weight, own_weight;
  std::vector<const std::byte*> row_ptr, block;
  pool_arrays(const weave::detail::decode_wire& at, const weave::detail::decode_wire& back,
              std::int64_t L, std::size_t pool)
      : slot_rows(static_cast<std::size_t>(L + 1), 0)
      , first(static_cast<std::size_t>(L + 1), 0)
      , source_rows(static_cast<std::size_t>(L * at.D), 0)
      , source_first(static_cast<std::size_t>(L * at.D), 0)
      , busy(static_cast<std::size_t>(L + 1), 0)
      , from_peer(pool, -7)
      , from_own(pool, -7)
      , merge_index(back.rows() * static_cast<std::size_t>(at.choices), -7)
      , own_index(static_cast<std::size_t>(at.M * at.choices), -7)
      , return_index(back.rows(), -7)
      , own_token(static_cast<std::size_t>(at.M), 0)
      , merge_weight(merge_index.size())
      , own_weight(own_index.size())
      , row_ptr(pool)
      , block(static_cast<std::size_t>(L)) {}
  weave::detail::decode_call_arrays arrays() {
    weave::detail::decode_call_arrays a;
    a.slot_rows = slot_rows.data();
    a.first = first.data();
    a.source_rows = source_rows.data();
    a.source_first = source_first.data();
    a.busy = busy.data();
    a.from_peer = from_peer.data();
    a.from_own = from_own.data();
    a.merge_index = merge_index.data();
    a.merge_weight = merge_weight.data();
    a.own_index = own_index.data();
    a.own_weight = own_weight.data();
    a.return_index = return_index.data();
    a.own_token = own_token.data();
    a.row_ptr = row_ptr.data();
    a.block = block.data();
    return a;
  }
};

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  const int ranks = in.ConsumeIntegralInRange(1, 4), slots = in.ConsumeIntegralInRange(1, 3);
  const int own = in.ConsumeIntegralInRange(0, ranks - 1);
  const std::size_t max_rows = in.ConsumeIntegralInRange<std::size_t>(1, 4);
  const std::size_t choices = in.ConsumeIntegralInRange<std::size_t>(1, slots);
  const bool partial = in.ConsumeBool();
  const std::uint32_t known = in.ConsumeBool() ? 0u : 7u | weave::decode_nonfinite_flag;
  // A dispatch's buffers of rows of 96 bytes: per rank its header, its records' rows (the row
  // index is what the pool's maps hold), then their side table, mostly records a sender writes;
  // this rank's own side table in the send buffer. What no sender writes is garbage.
  const auto at = weave::detail::decode_wire::dispatch(ranks, max_rows, choices, 96, partial);
  const auto back =
      weave::detail::decode_wire::combine(ranks, partial ? max_rows : max_rows * choices, 96);
  const std::byte garbage{in.ConsumeIntegral<unsigned char>()};
  std::vector<std::byte> recv(at.buffer_bytes(), garbage), send(at.buffer_bytes(), garbage);
  const auto M = static_cast<std::int64_t>(max_rows);
  const auto C = static_cast<std::int64_t>(choices);
  for (int d = 0; d < ranks; ++d) {
    const weave::decode_header h = header(in, d, M, known);
    *at.header(recv.data(), d) = h;
    // The side table where a reader of this header looks for it (the rows it announces, or,
    // for a header no sender writes, after any count of them).
    const std::int64_t n =
        h.rows >= 0 && h.rows <= M ? h.rows : in.ConsumeIntegralInRange<std::int64_t>(0, M);
    std::int32_t* side = at.side_table(d == own ? send.data() : recv.data(), d, n);
    float* weights = at.side_weights(d == own ? send.data() : recv.data(), d, n);
    for (std::int64_t r = 0; r < n; ++r) {
      std::vector<std::int32_t> pick(static_cast<std::size_t>(slots));
      for (int l = 0; l < slots; ++l)
        pick[static_cast<std::size_t>(l)] = l;
      const auto count = in.ConsumeIntegralInRange<std::int64_t>(1, C);
      for (std::int64_t c = 0; c < C; ++c) {
        const auto j =
            in.ConsumeIntegralInRange<std::size_t>(static_cast<std::size_t>(c), pick.size() - 1);
        std::swap(pick[static_cast<std::size_t>(c)], pick[j]);
        side[r * C + c] = c < count ? pick[static_cast<std::size_t>(c)] : -1;
        if (partial)
          weights[r * C + c] = static_cast<float>(in.ConsumeIntegral<std::uint8_t>());
      }
      if (in.ConsumeIntegralInRange(0, 7) == 0)
        side[r * C + in.ConsumeIntegralInRange<std::int64_t>(0, C - 1)] =
            in.ConsumeIntegralInRange<std::int32_t>(-3, slots + 1);
    }
  }

  // The check of the headers.
  const auto verdict = weave::detail::check_decode_headers(
      static_cast<std::size_t>(ranks), 1, M, known, "fuzz",
      [&](std::size_t d, std::size_t) {
        return *at.header(recv.data(), static_cast<std::int64_t>(d));
      },
      [](const weave::decode_header& h) {
        return weave::failure_record{h.source, static_cast<weave::errc>(h.code), true, "cause"};
      });
  bool any_fault = false, any_failed = false, any_bad_record = false;
  std::int64_t pairs = 0, records = 0;
  for (int d = 0; d < ranks; ++d) {
    const weave::decode_header& h = *at.header(recv.data(), d);
    const auto fault = weave::detail::decode_header_fault_of(h, d, M, known);
    any_fault = any_fault || fault != weave::decode_header_fault::none;
    any_failed = any_failed || (fault == weave::decode_header_fault::none &&
                                h.status == weave::decode_status::failed);
    if (fault != weave::decode_header_fault::none)
      WEAVE_FUZZ_CHECK(!weave::detail::describe_header_fault(fault, h, M).empty());
    if (fault != weave::decode_header_fault::none || h.status != weave::decode_status::ok)
      continue;
    // A naive reading of the records: distinct slots of this rank, at least one, then -1.
    const std::int32_t* side = at.side_table(d == own ? send.data() : recv.data(), d, h.rows);
    records += h.rows;
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

  // The dispatch's receive.
  std::vector<std::int64_t> arrived(static_cast<std::size_t>(ranks), -7);
  std::uint32_t call_failed = 0, error = 0;
  weave::detail::decode_kept kept{};
  const weave::detail::decode_receive_step dispatch{
      at,      recv.data(),    send.data(),  own,    known, slots,
      nullptr, arrived.data(), &call_failed, &error, &kept};
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
  std::int64_t arrived_rows = 0;
  for (const std::int64_t n : arrived) {
    WEAVE_FUZZ_CHECK(n >= 0 && n <= (partial ? M : M * C));
    arrived_rows += n;
  }
  if (!fails)
    WEAVE_FUZZ_CHECK(arrived_rows == (partial ? records : pairs));

  // The expert pool, in both forms: only a call that did not fail places rows.
  const auto L = static_cast<std::int64_t>(slots);
  const auto pool = static_cast<std::size_t>(ranks) * max_rows * choices;
  std::vector<std::byte> x(max_rows * 32);
  pool_arrays serial(at, back, L, pool), steps(at, back, L, pool);
  const weave::detail::decode_received received{at, recv.data(), send.data(), own, &call_failed};
  const bool in_place = in.ConsumeBool(), gathered = !in_place && in.ConsumeBool();
  const auto maps = [&](pool_arrays& p) {
    return weave::detail::decode_pool_maps{at,       back,        own,         partial,
                                           gathered, in_place,    false,       32,
                                           x.data(), recv.data(), send.data(), p.arrays()};
  };
  std::vector<std::uint64_t> fed(1);
  std::vector<std::int64_t> cursor(static_cast<std::size_t>(L));
  weave::detail::decode_slots_serial(received, maps(serial), L, fed.data(), cursor.data());
  std::fill(steps.merge_index.begin(), steps.merge_index.end(), -1);
  std::fill(steps.own_index.begin(), steps.own_index.end(), -1);
  std::fill(steps.return_index.begin(), steps.return_index.end(), -1);
  const auto sa = steps.arrays();
  for (std::int64_t l = 0; l < L; ++l)
    weave::detail::decode_slot_count_step{received, sa.slot_rows, sa.source_rows,
                                          sa.source_first}(l);
  std::int64_t total = 0;
  for (std::int64_t l = 0; l <= L; ++l) {
    const std::int64_t v = steps.slot_rows[static_cast<std::size_t>(l)];
    steps.first[static_cast<std::size_t>(l)] = total;
    total += v;
  }
  weave::detail::decode_busy_step{sa.slot_rows, L, sa.busy}(0);
  for (std::int64_t l = 0; l < L; ++l)
    weave::detail::decode_place_step{received, maps(steps)}(l);
  WEAVE_FUZZ_CHECK(total == (fails ? 0 : pairs));
  WEAVE_FUZZ_CHECK(serial.slot_rows == steps.slot_rows && serial.first == steps.first &&
                   serial.source_rows == steps.source_rows &&
                   serial.source_first == steps.source_first);
  const auto busy = static_cast<std::size_t>(steps.busy[static_cast<std::size_t>(L)]);
  WEAVE_FUZZ_CHECK(serial.busy[static_cast<std::size_t>(L)] ==
                   steps.busy[static_cast<std::size_t>(L)]);
  WEAVE_FUZZ_CHECK(std::equal(steps.busy.begin(),
                              steps.busy.begin() + static_cast<std::ptrdiff_t>(busy),
                              serial.busy.begin()));
  for (std::int64_t l = 0; l < L; ++l) {
    const std::int64_t n = steps.slot_rows[static_cast<std::size_t>(l)];
    WEAVE_FUZZ_CHECK(n >= 0 && n <= ranks * M);
    for (int d = 0; d < ranks; ++d) {
      const std::int64_t from = steps.source_rows[static_cast<std::size_t>(l * ranks + d)];
      WEAVE_FUZZ_CHECK(from >= 0 && from <= M);
    }
  }
  const auto placed = static_cast<std::size_t>(total);
  WEAVE_FUZZ_CHECK(placed <= pool);
  for (const pool_arrays* p : {&serial, &steps})
    for (std::size_t i = 0; i < placed; ++i) {
      // Each pool row reads one received row, or one of this rank's tokens.
      WEAVE_FUZZ_CHECK((p->from_peer[i] >= 0) + (p->from_own[i] >= 0) <= 1);
      WEAVE_FUZZ_CHECK(p->from_peer[i] >= -1 &&
                       p->from_peer[i] < static_cast<std::int64_t>(at.rows()));
      WEAVE_FUZZ_CHECK(p->from_own[i] >= -1 && p->from_own[i] < M);
      WEAVE_FUZZ_CHECK(p->from_peer[i] == (p == &serial ? steps : serial).from_peer[i]);
      WEAVE_FUZZ_CHECK(p->from_own[i] == (p == &serial ? steps : serial).from_own[i]);
      if (gathered)
        WEAVE_FUZZ_CHECK(p->row_ptr[i] == (p == &serial ? steps : serial).row_ptr[i]);
    }
  // Every placed row returns once: to its record's combine row (partial sums: an entry of it).
  std::int64_t returned = 0;
  for (const auto* index : {&steps.merge_index, &steps.own_index, &steps.return_index})
    for (const std::int64_t i : *index) {
      WEAVE_FUZZ_CHECK(i >= -1 && i < static_cast<std::int64_t>(pool));
      returned += i >= 0;
    }
  WEAVE_FUZZ_CHECK(returned == total);

  // The combine's receive: a message returning other rows than were sent fails the call.
  std::vector<std::byte> combine(back.buffer_bytes());
  std::vector<std::int64_t> expected(static_cast<std::size_t>(ranks));
  const std::int64_t back_rows = partial ? M : M * C;
  for (int d = 0; d < ranks; ++d) {
    *back.header(combine.data(), d) = header(in, d, back_rows, known);
    expected[static_cast<std::size_t>(d)] = in.ConsumeIntegralInRange<std::int64_t>(0, back_rows);
  }
  call_failed = 0;
  error = 0;
  kept = {};
  const weave::detail::decode_receive_step returns_step{
      back,    combine.data(), combine.data(), own,  known, slots, expected.data(),
      nullptr, &call_failed,   &error,         &kept};
  bool combine_fails = false;
  for (int d = 0; d < ranks; ++d) {
    const weave::decode_header& h = *back.header(combine.data(), d);
    combine_fails = combine_fails ||
                    weave::detail::decode_header_fault_of(h, d, back_rows, known) !=
                        weave::decode_header_fault::none ||
                    h.status != weave::decode_status::ok ||
                    h.rows != expected[static_cast<std::size_t>(d)];
  }
  for (int d = 0; d < ranks; ++d)
    returns_step(d);
  WEAVE_FUZZ_CHECK((call_failed != 0) == combine_fails);
  return 0;
}
