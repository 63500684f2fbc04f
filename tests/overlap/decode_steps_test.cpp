// The decode exchange's steps (weave/overlap/detail/decode_steps.hpp) and the one-pass forms that
// serial spaces run instead (decode_serial_steps.hpp), against brute-force computations over
// random calls: a dispatch's records, side tables and maps (`decode_position_serial` and
// `decode_position_step` over every destination), the expert pool of the received records
// (`decode_slots_serial` and the per-slot count, scan, busy and place steps: counts, first rows,
// busy slots, each pool row's input and return, the one-row blocks, gathered row pointers),
// call after call on the same arrays, after a call with more fed slots and after a failed one;
// and the record helpers both sides share (`rows_by_device`, `read_record`).
#include <doctest/doctest.h>

#include <weave/overlap/decode_options.hpp>
#include <weave/overlap/detail/decode_pool_steps.hpp>
#include <weave/overlap/detail/decode_serial_steps.hpp>
#include <weave/overlap/detail/decode_wire.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <vector>

namespace {

using weave::detail::decode_call_arrays;
using weave::detail::decode_wire;

// One k-sized pick of distinct values from [0, n) (n >= k), in random order.
std::vector<std::int32_t> distinct(std::mt19937& rng, std::int32_t n, std::int64_t k) {
  std::vector<std::int32_t> all(static_cast<std::size_t>(n));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  all.resize(static_cast<std::size_t>(k));
  return all;
}

// --- decode_position_serial / decode_position_step -----------------------------------------

// The arrays one form of the position step writes, and its send buffer (garbage first: a
// receiver reads only what the step wrote).
struct positions {
  std::vector<std::byte> send;
  std::vector<std::int64_t> pair_pos, records, pairs_to, send_index, token_rows, own_token;
  positions(const decode_wire& at, std::size_t pairs)
      : send(at.buffer_bytes(), std::byte{0x5A})
      , pair_pos(pairs, -9)
      , records(static_cast<std::size_t>(at.D), -9)
      , pairs_to(static_cast<std::size_t>(at.D), -9)
      , send_index(at.rows(), -1) // the layer fills both maps with -1 first
      , token_rows(pairs, -1)
      , own_token(static_cast<std::size_t>(at.M), -9) {}
  weave::detail::decode_position_step step(const decode_wire& at, std::int64_t tokens, int k,
                                           std::int64_t spd, std::int64_t own, bool own_rows,
                                           const std::vector<std::int32_t>& pair_slot,
                                           const float* weights) {
    return {at,
            tokens,
            k,
            spd,
            own,
            own_rows,
            pair_slot.data(),
            weights,
            send.data(),
            pair_pos.data(),
            records.data(),
            pairs_to.data(),
            send_index.data(),
            token_rows.data(),
            own_token.data()};
  }
};

} // namespace

TEST_CASE("decode_position_serial equals decode_position_step on every destination and a "
          "brute-force layout of the records") {
  std::mt19937 rng(5);
  for (int trial = 0; trial < 3000; ++trial) {
    CAPTURE(trial);
    const int D = 1 + static_cast<int>(rng() % 4);
    const std::int64_t spd = 1 + static_cast<std::int64_t>(rng() % (trial % 5 == 0 ? 70 : 4));
    const int k = 1 + static_cast<int>(rng() % std::min<std::int64_t>(6, D * spd));
    const std::int64_t M = 1 + static_cast<std::int64_t>(rng() % 6);
    const std::int64_t tokens = static_cast<std::int64_t>(rng() % static_cast<unsigned>(M + 1));
    const std::int64_t own = static_cast<std::int64_t>(rng() % static_cast<unsigned>(D));
    const bool partial = rng() % 2 == 0, own_rows = rng() % 3 == 0;
    const std::int64_t choices = std::min<std::int64_t>(k, spd);
    const std::size_t row = 16 * (1 + rng() % 3);
    CAPTURE(D);
    CAPTURE(spd);
    CAPTURE(k);
    CAPTURE(tokens);
    CAPTURE(partial);
    CAPTURE(own_rows);
    const auto at = decode_wire::dispatch(D, static_cast<std::size_t>(M),
                                          static_cast<std::size_t>(choices), row, partial);
    // Each token's choices: distinct physical slots (distinct experts), a few not routed; the
    // slots of a small world often share a device.
    const auto pairs = static_cast<std::size_t>(tokens * k);
    std::vector<std::int32_t> pair_slot;
    std::vector<float> weights;
    for (std::int64_t t = 0; t < tokens; ++t)
      for (const std::int32_t s : distinct(rng, static_cast<std::int32_t>(D * spd), k)) {
        pair_slot.push_back(rng() % 7 == 0 ? -1 : s);
        weights.push_back(static_cast<float>(rng() % 1000) / 64.0f);
      }
    const float* w = partial ? weights.data() : nullptr;

    positions serial(at, pairs), steps(at, pairs);
    std::vector<std::int64_t> last(static_cast<std::size_t>(D)), next(static_cast<std::size_t>(D));
    weave::detail::decode_position_serial(
        serial.step(at, tokens, k, spd, own, own_rows, pair_slot, w), last.data(), next.data());
    const auto step = steps.step(at, tokens, k, spd, own, own_rows, pair_slot, w);
    for (std::int64_t d = 0; d < D; ++d)
      step(d);

    // Brute force: per device, a record per token with a pair there, in token order; its side
    // entries the local slots of those pairs in choice order, -1 after; each pair's combine row.
    positions want(at, pairs);
    std::vector<std::vector<std::int32_t>> side(static_cast<std::size_t>(D));
    std::vector<std::vector<float>> side_w(static_cast<std::size_t>(D));
    for (std::int64_t d = 0; d < D; ++d) {
      std::int64_t r = 0, pair = 0;
      for (std::int64_t t = 0; t < tokens; ++t) {
        std::int64_t c = 0;
        for (int j = 0; j < k; ++j) {
          const auto p = static_cast<std::size_t>(t * k + j);
          if (pair_slot[p] < 0 || pair_slot[p] / spd != d)
            continue;
          if (c == 0 && (d != own || own_rows)) {
            want.token_rows[p] = at.payload_row(d, r);
            want.send_index[static_cast<std::size_t>(at.payload_row(d, r))] = t;
          }
          side[static_cast<std::size_t>(d)].push_back(
              static_cast<std::int32_t>(pair_slot[p] - d * spd));
          side_w[static_cast<std::size_t>(d)].push_back(weights[p]);
          want.pair_pos[p] = partial ? r : pair;
          ++c;
          ++pair;
        }
        if (c == 0)
          continue;
        for (; c < choices; ++c) {
          side[static_cast<std::size_t>(d)].push_back(-1);
          side_w[static_cast<std::size_t>(d)].push_back(0.0f);
        }
        if (d == own)
          want.own_token[static_cast<std::size_t>(r)] = t;
        ++r;
      }
      want.records[static_cast<std::size_t>(d)] = r;
      want.pairs_to[static_cast<std::size_t>(d)] = pair;
    }

    for (const positions* got : {&serial, &steps}) {
      CAPTURE(got == &serial);
      CHECK(got->records == want.records);
      CHECK(got->pairs_to == want.pairs_to);
      CHECK(got->token_rows == want.token_rows);
      CHECK(got->send_index == want.send_index);
      for (std::size_t p = 0; p < pairs; ++p)
        if (pair_slot[p] >= 0)
          CHECK(got->pair_pos[p] == want.pair_pos[p]);
      const auto own_records =
          static_cast<std::size_t>(want.records[static_cast<std::size_t>(own)]);
      CHECK(std::equal(want.own_token.begin(),
                       want.own_token.begin() + static_cast<std::ptrdiff_t>(own_records),
                       got->own_token.begin()));
      auto* buffer = const_cast<std::byte*>(got->send.data());
      for (std::int64_t d = 0; d < D; ++d) {
        CAPTURE(d);
        const std::int64_t n = want.records[static_cast<std::size_t>(d)];
        const auto& entries = side[static_cast<std::size_t>(d)];
        REQUIRE(entries.size() == static_cast<std::size_t>(n * choices));
        CHECK((entries.empty() || std::memcmp(at.side_table(buffer, d, n), entries.data(),
                                              entries.size() * sizeof(std::int32_t)) == 0));
        if (!partial)
          continue;
        for (std::size_t e = 0; e < entries.size(); ++e)
          if (entries[e] >= 0) // (the weight beside a -1 entry is never read)
            CHECK(std::memcmp(at.side_weights(buffer, d, n) + e,
                              &side_w[static_cast<std::size_t>(d)][e], sizeof(float)) == 0);
      }
    }
  }
}

// --- decode_slots_serial / the per-slot steps -------------------------------------------------

namespace {

// Which inputs the pool's rows get (`decode_pool_maps`): copies with a peer's one row in place
// (the default), copies of an FP8 dispatch (this rank's own rows in `send`), gathered pointers.
enum class inputs { blocks, fp8, gathered };

// One form's arrays (`decode_call_arrays`), zero where the layer's initialisation zeroes them,
// garbage elsewhere.
struct pool_arrays {
  std::vector<std::int64_t> slot_rows, first, source_rows, source_first, busy, from_peer, from_own,
      merge_index, own_index, return_index, own_token;
  std::vector<float> merge_weight, own_weight;
  std::vector<const std::byte*> row_ptr, block;
  pool_arrays(const decode_wire& at, const decode_wire& back, std::int64_t L)
      : slot_rows(static_cast<std::size_t>(L + 1), 0)
      , first(static_cast<std::size_t>(L + 1), 0)
      , source_rows(static_cast<std::size_t>(L * at.D), 0)
      , source_first(static_cast<std::size_t>(L * at.D), 0)
      , busy(static_cast<std::size_t>(L + 1), 0)
      , from_peer(pool(at), -9)
      , from_own(pool(at), -9)
      , merge_index(back.rows() * static_cast<std::size_t>(at.choices), -9)
      , own_index(static_cast<std::size_t>(at.M * at.choices), -9)
      , return_index(back.rows(), -9)
      , own_token(static_cast<std::size_t>(at.M), -9)
      , merge_weight(merge_index.size(), -9.0f)
      , own_weight(own_index.size(), -9.0f)
      , row_ptr(pool(at), nullptr)
      , block(static_cast<std::size_t>(L), nullptr) {}
  static std::size_t pool(const decode_wire& at) {
    return static_cast<std::size_t>(at.D * at.M * at.choices);
  }
  decode_call_arrays arrays() {
    decode_call_arrays a;
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

// One received record: its source, its index there, its local slots in choice order (then -1),
// its weights.
struct record {
  std::int64_t source, index;
  std::vector<std::int32_t> slots;
  std::vector<float> weights;
};

} // namespace

TEST_CASE("decode_slots_serial equals the per-slot count, scan, busy and place steps and a "
          "brute-force pool, call after call") {
  std::mt19937 rng(17);
  for (int sequence = 0; sequence < 240; ++sequence) {
    CAPTURE(sequence);
    const int D = 1 + static_cast<int>(rng() % 4);
    constexpr std::int64_t slot_counts[] = {1, 3, 5, 64, 65, 130};
    const std::int64_t L = slot_counts[rng() % 6];
    const int k = 1 + static_cast<int>(rng() % 4);
    const std::int64_t choices = std::min<std::int64_t>(k, L);
    const std::int64_t M = 1 + static_cast<std::int64_t>(rng() % 5);
    const std::int64_t own = static_cast<std::int64_t>(rng() % static_cast<unsigned>(D));
    const bool partial = sequence % 2 == 0;
    const auto how = static_cast<inputs>(sequence / 2 % 3);
    const bool fp8 = how == inputs::fp8, gathered = how == inputs::gathered,
               in_place = how == inputs::blocks;
    const std::size_t row = 32, x_row = 20;
    CAPTURE(D);
    CAPTURE(L);
    CAPTURE(choices);
    CAPTURE(M);
    CAPTURE(partial);
    CAPTURE(static_cast<int>(how));
    const auto at = decode_wire::dispatch(D, static_cast<std::size_t>(M),
                                          static_cast<std::size_t>(choices), row, partial);
    const auto back =
        decode_wire::combine(D, static_cast<std::size_t>(partial ? M : M * choices), row);
    std::vector<std::byte> recv(at.buffer_bytes(), std::byte{0x5A}),
        send(at.buffer_bytes(), std::byte{0x5A}), x(2 * static_cast<std::size_t>(M) * x_row);
    pool_arrays serial(at, back, L), steps(at, back, L);
    std::vector<std::uint64_t> fed(static_cast<std::size_t>((L + 63) / 64), ~std::uint64_t{0});
    std::vector<std::int64_t> cursor(static_cast<std::size_t>(L), -9);
    for (int call = 0; call < 12; ++call) {
      CAPTURE(call);
      // Dense and sparse calls in turn (a call after one with more fed slots), and now and
      // then a failed one (nothing placed).
      const bool dense = call % 3 == 0, failed = call % 5 == 4;
      const std::uint32_t call_failed = failed ? 1u : 0u;
      std::vector<record> records;
      std::vector<std::int64_t> own_token;
      for (std::int64_t d = 0; d < D; ++d) {
        const std::int64_t n =
            dense
                ? M - static_cast<std::int64_t>(rng() % 2)
                : (rng() % 3 == 0 ? static_cast<std::int64_t>(rng() % static_cast<unsigned>(M + 1))
                                  : 0);
        at.header(recv.data(), d)->rows = n; // this rank's own header is received too
        std::int32_t* side = at.side_table(d == own ? send.data() : recv.data(), d, n);
        float* side_w = at.side_weights(d == own ? send.data() : recv.data(), d, n);
        std::int64_t token = 0;
        for (std::int64_t r = 0; r < n; ++r) {
          record rec{d, r, {}, {}};
          const std::int64_t c =
              1 + static_cast<std::int64_t>(rng() % static_cast<unsigned>(choices));
          // Sparse calls use a few slots of many (the high ones too: past a 64-bit word).
          const auto picked = dense || L < 8 ? distinct(rng, static_cast<std::int32_t>(L), c)
                                             : std::vector<std::int32_t>{};
          for (std::int64_t e = 0; e < choices; ++e) {
            std::int32_t slot = -1;
            if (e < c)
              slot = !picked.empty() ? picked[static_cast<std::size_t>(e)]
                                     : static_cast<std::int32_t>(e == 0 ? L - 1 - (r % 2) : e);
            rec.slots.push_back(slot);
            rec.weights.push_back(static_cast<float>(rng() % 1000) / 32.0f);
            side[r * choices + e] = slot;
            if (partial)
              side_w[r * choices + e] = rec.weights.back();
          }
          if (d == own) { // the token each own record carries
            token += static_cast<std::int64_t>(rng() % 2);
            own_token.push_back(token++);
          }
          records.push_back(rec);
        }
      }
      std::copy(own_token.begin(), own_token.end(), serial.own_token.begin());
      std::copy(own_token.begin(), own_token.end(), steps.own_token.begin());
      for (std::size_t i = 0; i < x.size(); ++i)
        x[i] = static_cast<std::byte>(rng());
      const weave::detail::decode_received in{at, recv.data(), send.data(), own, &call_failed};
      const auto maps = [&](pool_arrays& p) {
        return weave::detail::decode_pool_maps{at,       back,        own,         partial,
                                               gathered, in_place,    fp8,         x_row,
                                               x.data(), recv.data(), send.data(), p.arrays()};
      };

      weave::detail::decode_slots_serial(in, maps(serial), L, fed.data(), cursor.data());
      // The GPU's form, as the layer runs it: the return maps cleared, then per slot.
      std::fill(steps.merge_index.begin(), steps.merge_index.end(), -1);
      std::fill(steps.own_index.begin(), steps.own_index.end(), -1);
      std::fill(steps.return_index.begin(), steps.return_index.end(), -1);
      const decode_call_arrays sa = steps.arrays();
      for (std::int64_t l = 0; l < L; ++l)
        weave::detail::decode_slot_count_step{in, sa.slot_rows, sa.source_rows, sa.source_first}(l);
      std::int64_t total = 0; // an exclusive scan of L + 1 counts
      for (std::int64_t l = 0; l <= L; ++l) {
        const std::int64_t v = steps.slot_rows[static_cast<std::size_t>(l)];
        steps.first[static_cast<std::size_t>(l)] = total;
        total += v;
      }
      weave::detail::decode_busy_step{sa.slot_rows, L, sa.busy}(0);
      for (std::int64_t l = 0; l < L; ++l)
        weave::detail::decode_place_step{in, maps(steps)}(l);

      // Brute force: each slot's rows, source by source, record by record.
      std::vector<std::vector<const record*>> rows_of(static_cast<std::size_t>(L));
      std::vector<std::vector<std::int64_t>> choice_of(static_cast<std::size_t>(L));
      if (!failed)
        for (const record& rec : records)
          for (std::size_t c = 0; c < rec.slots.size() && rec.slots[c] >= 0; ++c) {
            rows_of[static_cast<std::size_t>(rec.slots[c])].push_back(&rec);
            choice_of[static_cast<std::size_t>(rec.slots[c])].push_back(
                static_cast<std::int64_t>(c));
          }
      // A record's first pair among its source's (per-pair combine rows).
      std::map<std::pair<std::int64_t, std::int64_t>, std::int64_t> first_pair;
      std::vector<std::int64_t> pairs_from(static_cast<std::size_t>(D), 0);
      for (const record& rec : records) {
        first_pair[{rec.source, rec.index}] = pairs_from[static_cast<std::size_t>(rec.source)];
        pairs_from[static_cast<std::size_t>(rec.source)] += std::count_if(
            rec.slots.begin(), rec.slots.end(), [](std::int32_t s) { return s >= 0; });
      }
      std::vector<std::int64_t> want_busy;
      std::int64_t pool_row = 0;
      for (const pool_arrays* got : {&serial, &steps}) {
        CAPTURE(got == &serial);
        want_busy.clear();
        pool_row = 0;
        for (std::int64_t l = 0; l < L; ++l) {
          CAPTURE(l);
          const auto& list = rows_of[static_cast<std::size_t>(l)];
          const auto n = static_cast<std::int64_t>(list.size());
          CHECK(got->slot_rows[static_cast<std::size_t>(l)] == n);
          CHECK(got->first[static_cast<std::size_t>(l)] == pool_row);
          std::int64_t q = 0;
          for (std::int64_t d = 0; d < D; ++d) {
            const auto from_d = std::count_if(list.begin(), list.end(),
                                              [d](const record* r) { return r->source == d; });
            CHECK(got->source_rows[static_cast<std::size_t>(l * D + d)] == from_d);
            CHECK(got->source_first[static_cast<std::size_t>(l * D + d)] == (n == 0 ? 0 : q));
            q += from_d;
          }
          if (n > 0)
            want_busy.push_back(l);
          const bool one_peer_row = in_place && n == 1 && list[0]->source != own;
          for (std::int64_t i = 0; i < n; ++i) {
            const record& rec = *list[static_cast<std::size_t>(i)];
            const std::int64_t c =
                choice_of[static_cast<std::size_t>(l)][static_cast<std::size_t>(i)];
            const auto p = static_cast<std::size_t>(pool_row + i);
            const bool mine = rec.source == own;
            const std::int64_t payload = at.payload_row(rec.source, rec.index);
            CHECK(got->from_peer[p] == (mine || one_peer_row ? -1 : payload));
            CHECK(got->from_own[p] == (!mine ? -1
                                       : fp8 ? payload
                                             : own_token[static_cast<std::size_t>(rec.index)]));
            if (gathered)
              CHECK(got->row_ptr[p] ==
                    (mine ? x.data() + static_cast<std::size_t>(
                                           own_token[static_cast<std::size_t>(rec.index)]) *
                                           x_row
                          : recv.data() + static_cast<std::size_t>(payload) * row));
            if (partial) {
              const std::int64_t at_row =
                  mine ? rec.index : back.payload_row(rec.source, rec.index);
              const auto e = static_cast<std::size_t>(at_row * choices + c);
              CHECK((mine ? got->own_index : got->merge_index)[e] == static_cast<std::int64_t>(p));
              CHECK((mine ? got->own_weight : got->merge_weight)[e] ==
                    rec.weights[static_cast<std::size_t>(c)]);
            } else {
              const std::int64_t pair = first_pair[{rec.source, rec.index}] + c;
              if (mine)
                CHECK(got->own_index[static_cast<std::size_t>(pair)] ==
                      static_cast<std::int64_t>(p));
              else
                CHECK(got->return_index[static_cast<std::size_t>(
                          back.payload_row(rec.source, pair))] == static_cast<std::int64_t>(p));
            }
          }
          // A slot's block: the one row a peer sent, where it arrived; none otherwise (an idle
          // slot included, whatever the last call fed it).
          const std::byte* block =
              one_peer_row
                  ? recv.data() +
                        static_cast<std::size_t>(at.payload_row(list[0]->source, list[0]->index)) *
                            row
                  : nullptr;
          CHECK(got->block[static_cast<std::size_t>(l)] == block);
          pool_row += n;
        }
        CHECK(got->first[static_cast<std::size_t>(L)] == pool_row);
        CHECK(got->busy[static_cast<std::size_t>(L)] ==
              static_cast<std::int64_t>(want_busy.size()));
        CHECK(std::equal(want_busy.begin(), want_busy.end(), got->busy.begin()));
        // A partial-sum record's entries past its last choice return nothing.
        if (partial && !failed)
          for (const record& rec : records)
            for (std::size_t c = 0; c < rec.slots.size(); ++c)
              if (rec.slots[c] < 0) {
                const bool mine = rec.source == own;
                const std::int64_t at_row =
                    mine ? rec.index : back.payload_row(rec.source, rec.index);
                CHECK((mine ? got->own_index : got->merge_index)[static_cast<std::size_t>(
                          at_row * choices + static_cast<std::int64_t>(c))] == -1);
              }
      }
    }
  }
}

// --- the record helpers -----------------------------------------------------------------------

TEST_CASE("rows_by_device lists a token's devices ascending, each with its first pair, as a "
          "brute-force sort") {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 2000; ++trial) {
    const int k = 1 + static_cast<int>(rng() % 9);
    const int devices = 1 + static_cast<int>(rng() % 6);
    CAPTURE(k);
    CAPTURE(devices);
    std::vector<std::int64_t> device(static_cast<std::size_t>(k));
    for (auto& d : device) // about one pair in five not routed
      d = rng() % 5 == 0 ? -1 : static_cast<std::int64_t>(rng() % static_cast<unsigned>(devices));
    const int per_token = std::min(devices, k);
    // Brute force: each device's first pair, devices ascending, the row 100 * device + pair.
    std::map<std::int64_t, int> first;
    for (int j = 0; j < k; ++j)
      if (device[static_cast<std::size_t>(j)] >= 0)
        first.emplace(device[static_cast<std::size_t>(j)], j);
    std::vector<std::int64_t> expected;
    for (const auto& [d, j] : first)
      expected.push_back(100 * d + j);
    expected.resize(static_cast<std::size_t>(per_token), -1);
    std::vector<std::int64_t> rows(static_cast<std::size_t>(per_token), 7);
    weave::detail::rows_by_device(
        k, per_token, [&](int j) { return device[static_cast<std::size_t>(j)]; },
        [&](int j) { return 100 * device[static_cast<std::size_t>(j)] + j; }, rows.data());
    CHECK(rows == expected);
  }
}

TEST_CASE("read_record accepts exactly the records a brute-force check accepts") {
  // Local slots past 64 share the read's buckets (slot % 64): repeats and near misses among them.
  std::mt19937 rng(23);
  for (int trial = 0; trial < 20000; ++trial) {
    const std::int64_t choices = 1 + static_cast<std::int64_t>(rng() % 8);
    const std::int64_t slots = 1 + static_cast<std::int64_t>(rng() % 200);
    std::vector<std::int32_t> entry(static_cast<std::size_t>(choices));
    for (auto& e : entry) { // mostly valid slots, from a few buckets; some -1, a few outside
      const unsigned r = rng() % 20;
      e = r < 3    ? -1
          : r == 3 ? static_cast<std::int32_t>(slots)
          : r == 4 ? -5
                   : static_cast<std::int32_t>((rng() % 3) * 64 + rng() % 3) %
                         static_cast<std::int32_t>(slots);
    }
    if (rng() % 2 == 0) // a well-formed tail: -1 after the first few
      for (std::size_t c = 1 + rng() % entry.size(); c < entry.size(); ++c)
        entry[c] = -1;
    // Brute force: the first entry that is not a new slot in range, before the first -1, or
    // not -1 after it.
    weave::detail::record_read expected;
    for (std::int64_t c = 0; c < choices && expected.bad < 0; ++c) {
      const std::int32_t e = entry[static_cast<std::size_t>(c)];
      const bool ended = expected.count > 0 && expected.count < c;
      const bool repeat =
          std::find(entry.begin(), entry.begin() + c, e) != entry.begin() + c && e != -1;
      if (e == -1 && expected.count > 0)
        continue;
      if (ended || e < 0 || e >= slots || repeat) {
        expected.bad = c;
        expected.value = e;
      } else {
        ++expected.count;
      }
    }
    const auto got = weave::detail::read_record(
        [&](std::int64_t c) { return entry[static_cast<std::size_t>(c)]; }, choices, slots);
    CAPTURE(trial);
    CHECK(got.bad == expected.bad);
    if (expected.bad < 0)
      CHECK(got.count == expected.count);
    else
      CHECK(got.value == expected.value);
  }
}
