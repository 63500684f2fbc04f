// decode_exchange on an in-process world of 2 and 4 ranks (one thread each): results equal
// the naive reference of their combine (per device by default, the dynamic exchange's output;
// per pair) bitwise for f32 and bf16 rows, with ranks of zero tokens and
// of exactly max_tokens_per_rank, -1 ids, replicated experts; every bad input on one rank
// fails it with its typed error and every peer with peer_failure, and the next call works.
#include "decode_cases.hpp"

#include <weave/comm/communicator.hpp>
#include <weave/comm/local_world.hpp>
#include <weave/core/dtype.hpp>
#include <weave/core/host_matrix.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/overlap/detail/decode_input_rows.hpp>
#include <weave/overlap/detail/decode_records.hpp>
#include <weave/overlap/detail/decode_slot_counts.hpp>
#include <weave/overlap/moe_exchange.hpp>

#include <algorithm>
#include <map>
#include <random>
#include <span>
#include <string>
#include <vector>

using local = weave::local_communicator;

TEST_CASE_TEMPLATE("decode_exchange equals the naive reference on 2 and 4 ranks", T, float,
                   weave::bfloat16) {
  for (int ranks : {2, 4}) {
    CAPTURE(ranks);
    weave::local_world world(ranks);
    world.run([&](local& c) {
      decode_test::check_against_reference<T>(
          c, weave::placement::contiguous(decode_test::experts, ranks));
    });
  }
}

TEST_CASE("decode_exchange with 128 slots per rank, most idle in a call, equals the reference") {
  // A call feeds a few of many slots (E = 256 on 2 ranks): the resets and the pool's order
  // follow the slots fed, call after call, for either combine and gathered inputs.
  weave::local_world world(2);
  for (const bool partial_sums : {true, false})
    for (const bool gathered : {false, true}) {
      CAPTURE(partial_sums);
      CAPTURE(gathered);
      world.run([&](local& c) {
        decode_test::check_against_reference<float>(c, weave::placement::contiguous(256, 2),
                                                    partial_sums, gathered);
      });
    }
}

namespace {

// A local communicator passed through: what the decode exchange needs but the bounded
// all-to-all, which the wrappers below add (or not).
struct forwarding_comm {
  using stream_type = weave::host_stream;
  local* inner = nullptr;
  int rank() const { return inner->rank(); }
  int size() const { return inner->size(); }
  void all_to_all_v(weave::host_stream& s, const void* send, std::span<const std::int64_t> sc,
                    std::span<const std::int64_t> sd, void* recv, std::span<const std::int64_t> rc,
                    std::span<const std::int64_t> rd, std::size_t unit) {
    inner->all_to_all_v(s, send, sc, sd, recv, rc, rd, unit);
  }
  void exchange_counts(weave::host_stream& s, std::span<const std::int64_t> in,
                       std::span<std::int64_t> out) {
    inner->exchange_counts(s, in, out);
  }
  void abort(const std::string& why) { inner->abort(why); }
};

// With (`Bounded`) or without the bounded all-to-all; records, when it runs, each bounded
// all-to-all's bytes per peer.
template <bool Bounded>
struct recording_comm : forwarding_comm {
  std::vector<std::vector<std::int64_t>>* sent = nullptr;
  void all_to_all_v_bounded(weave::host_stream& s, const void* send,
                            std::span<const std::int64_t> sc, std::span<const std::int64_t> sd,
                            void* recv, std::span<const std::int64_t> rc,
                            std::span<const std::int64_t> rd, std::span<std::int64_t> received,
                            std::size_t unit) requires Bounded {
    s.submit([this, sc] { sent->emplace_back(sc.begin(), sc.end()); });
    inner->all_to_all_v_bounded(s, send, sc, sd, recv, rc, rd, received, unit);
  }
};
static_assert(weave::has_bounded_all_to_all<recording_comm<true>> &&
              !weave::has_bounded_all_to_all<recording_comm<false>>);

// A bounded all-to-all that sends rank 1 one byte less of rank 0's message than the layer
// asked for (what a rogue or broken peer might do).
struct shortening_comm : forwarding_comm {
  std::vector<std::int64_t> counts; // the counts sent, set on the stream
  void all_to_all_v_bounded(weave::host_stream& s, const void* send,
                            std::span<const std::int64_t> sc, std::span<const std::int64_t> sd,
                            void* recv, std::span<const std::int64_t> rc,
                            std::span<const std::int64_t> rd, std::span<std::int64_t> received,
                            std::size_t unit) {
    counts.assign(sc.size(), 0);
    s.submit([this, sc] {
      std::copy(sc.begin(), sc.end(), counts.begin());
      if (rank() == 0)
        --counts[1];
    });
    inner->all_to_all_v_bounded(s, send, counts, sd, recv, rc, rd, received, unit);
  }
};

} // namespace

TEST_CASE("decode_exchange's dispatch sends a peer its records alone over a bounded all-to-all, "
          "whole messages elsewhere, with the same results") {
  constexpr int ranks = 4; // 2 experts each: choices = min(k, 2)
  const auto where = weave::placement::contiguous(decode_test::experts, ranks);
  for (const bool partial_sums : {true, false}) {
    CAPTURE(partial_sums);
    weave::local_world world(ranks);
    world.run([&](local& c) {
      std::vector<std::vector<std::int64_t>> sent;
      recording_comm<true> bounded;
      bounded.inner = &c;
      bounded.sent = &sent;
      decode_test::check_against_reference<float>(bounded, where, partial_sums);
      recording_comm<false> whole;
      whole.inner = &c;
      decode_test::check_against_reference<float>(whole, where, partial_sums);
      // The documented format, counted by brute force: a header, then per record (a token that
      // reaches the device) its row and min(k, local experts) slots (and as many weights).
      const int per_device = decode_test::experts / ranks;
      const std::size_t entry = static_cast<std::size_t>(std::min(decode_test::k, per_device)) * 4 *
                                (partial_sums ? 2 : 1);
      REQUIRE(sent.size() == 4); // the dispatches of check_against_reference's four calls
      for (int call = 0; call < 4; ++call) {
        std::mt19937 rng(static_cast<std::uint32_t>(100 * call + c.rank()));
        const auto in = moe_test::random_input<float>(decode_test::tokens_of(c.rank(), call),
                                                      decode_test::hidden, decode_test::experts,
                                                      decode_test::k, rng);
        for (int d = 0; d < ranks; ++d) {
          if (d == c.rank())
            continue;
          std::size_t records = 0;
          for (std::size_t t = 0; t * decode_test::k < in.ids.size(); ++t) {
            bool reaches = false;
            for (int j = 0; j < decode_test::k; ++j) {
              const int id = in.ids[t * decode_test::k + static_cast<std::size_t>(j)];
              reaches = reaches || (id >= 0 && id / per_device == d);
            }
            records += reaches ? 1 : 0;
          }
          CAPTURE(call);
          CAPTURE(d);
          CHECK(sent[static_cast<std::size_t>(call)][static_cast<std::size_t>(d)] ==
                static_cast<std::int64_t>(sizeof(weave::decode_header) +
                                          records * (decode_test::hidden * sizeof(float) + entry)));
        }
      }
    });
  }
}

TEST_CASE("decode_exchange: a dispatch message shorter than its header's records fails every "
          "rank, the receiver with protocol") {
  weave::local_world world(2);
  world.run_collect([&](local& c) {
    shortening_comm comm;
    comm.inner = &c;
    const auto where = weave::placement::contiguous(decode_test::experts, 2);
    weave::decode_exchange<shortening_comm, float> ex(comm, where, decode_test::options());
    weave::host_stream s("decode");
    std::mt19937 rng(static_cast<std::uint32_t>(3 + c.rank()));
    auto in = moe_test::random_input<float>(decode_test::max_tokens, decode_test::hidden,
                                            decode_test::experts, decode_test::k, rng);
    in.ids[0] = decode_test::experts - 1; // token 0 on rank 1's experts too: a record
    in.ids[1] = 0;
    in.ids[2] = 1;
    std::vector<float> y(in.x.rows() * decode_test::hidden);
    const auto got = decode_test::outcome_of([&] {
      auto h = ex.dispatch(in.x.elements(), in.ids, in.weights, s);
      s.synchronize();                       // rank 1 fails here; rank 0's dispatch may complete
      ex.combine(h, std::span<float>(y), s); // and then learns it in the combine
      s.synchronize();
    });
    INFO("rank ", c.rank(), ": ", got.message);
    if (c.rank() == 1) {
      CHECK(got.code == weave::errc::protocol);
      CHECK(got.message.find("rank 0 sent a dispatch message of") != std::string::npos);
    } else {
      CHECK(got.code == weave::errc::peer_failure);
      CHECK(got.message.find("rank 0 sent a dispatch message of") != std::string::npos);
    }
  });
}

TEST_CASE("decode_exchange with replicated experts equals the naive reference") {
  // 2 ranks of 6 slots: experts 0, 1, 4 and 5 have a replica on each rank.
  const weave::placement where(8, 2, std::vector<std::int32_t>{0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 0, 1});
  weave::local_world world(2);
  world.run([&](local& c) { decode_test::check_against_reference<float>(c, where); });
}

TEST_CASE_TEMPLATE("decode_exchange with partial sums equals its per-device reference on 1, 2 "
                   "and 4 ranks, replicas too",
                   T, float, weave::bfloat16) {
  for (int ranks : {1, 2, 4}) {
    CAPTURE(ranks);
    weave::local_world world(ranks);
    world.run([&](local& c) {
      decode_test::check_against_reference<T>(
          c, weave::placement::contiguous(decode_test::experts, ranks), true);
    });
  }
  const weave::placement where(8, 2, std::vector<std::int32_t>{0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 0, 1});
  weave::local_world world(2);
  world.run([&](local& c) { decode_test::check_against_reference<T>(c, where, true); });
}

TEST_CASE_TEMPLATE("decode_exchange with gathered inputs equals the reference of either combine "
                   "on 1, 2 and 4 ranks, replicas too",
                   T, float, weave::bfloat16) {
  // The experts read each row where it arrived: a peer's message or this rank's own tokens.
  for (const bool partial_sums : {true, false}) {
    CAPTURE(partial_sums);
    for (int ranks : {1, 2, 4}) {
      CAPTURE(ranks);
      weave::local_world world(ranks);
      world.run([&](local& c) {
        decode_test::check_against_reference<T>(
            c, weave::placement::contiguous(decode_test::experts, ranks), partial_sums, true);
      });
    }
    const weave::placement where(8, 2,
                                 std::vector<std::int32_t>{0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 0, 1});
    weave::local_world world(2);
    world.run(
        [&](local& c) { decode_test::check_against_reference<T>(c, where, partial_sums, true); });
  }
}

TEST_CASE("decode_exchange gives input_rows with gathered inputs only, input without them only") {
  weave::local_world world(2);
  world.run([&](local& c) {
    for (const bool gathered : {false, true}) {
      CAPTURE(gathered);
      weave::decode_options o{2, 4, 2};
      o.gathered_inputs = gathered;
      weave::decode_exchange<local, float> ex(c, weave::placement::contiguous(4, 2), o);
      weave::host_stream s("decode");
      // Token t of rank r is r * 10 + t in every column, routed to experts 0 and 3 (one on each
      // rank).
      std::vector<float> x(8), w(4, 0.5f), y(8);
      for (std::size_t e = 0; e < x.size(); ++e)
        x[e] = static_cast<float>(c.rank() * 10) + static_cast<float>(e / 4);
      const std::vector<std::int32_t> ids{0, 3, 0, 3};
      auto h = ex.dispatch(x, ids, w, s);
      s.synchronize();
      const auto xs = h.experts();
      const auto refused = gathered ? moe_test::error_code_of([&] { (void)xs.input(0); })
                                    : moe_test::error_code_of([&] { (void)xs.input_rows(0); });
      CHECK(refused == weave::errc::invalid_state);
      // Expert 0 (rank 0's slot 0) and expert 3 (rank 1's slot 1) get both ranks' tokens,
      // source 0's first, each in token order.
      const int mine = c.rank();
      CHECK(xs.rows(mine) == 4);
      for (std::int64_t r = 0; r < std::min<std::int64_t>(xs.rows(mine), 4); ++r) {
        const float want = static_cast<float>((r / 2) * 10 + r % 2);
        const float* row = gathered ? xs.input_rows(mine)[static_cast<std::size_t>(r)]
                                    : xs.input(mine).data() + r * 4;
        CHECK(std::vector<float>(row, row + 4) == std::vector<float>(4, want));
        if (gathered && r / 2 == c.rank()) // this rank's own tokens stay in x
          CHECK(row == x.data() + (r % 2) * 4);
      }
      for (int l = 0; l < 2; ++l)
        for (std::int64_t r = 0; r < xs.rows(l); ++r)
          std::copy_n(gathered ? xs.input_rows(l)[static_cast<std::size_t>(r)]
                               : xs.input(l).data() + r * 4,
                      4, xs.output(l).data() + r * 4);
      ex.combine(h, std::span<float>(y), s);
      s.synchronize();
      CHECK(y == x); // 0.5 * x + 0.5 * x
    }
  });
}

TEST_CASE("decode_exchange gives an expert fed one row that row, a peer's read where it arrived "
          "and this rank's copied, call after call") {
  // One token per rank, k = 2 (one expert on each rank): in call c rank r's token goes to slot
  // (r + c) % 2 of both ranks, so every fed slot gets one row, from this rank or its peer in
  // turn. The caller's x is overwritten once the dispatch ran: the default layer does not
  // borrow it, so an expert still reads the token's values.
  weave::local_world world(2);
  world.run([&](local& c) {
    weave::decode_options o{2, 4, 1};
    weave::decode_exchange<local, float> ex(c, weave::placement::contiguous(4, 2), o);
    weave::host_stream s("decode");
    for (int call = 0; call < 6; ++call) {
      CAPTURE(call);
      const float value = static_cast<float>(c.rank() * 10 + call);
      std::vector<float> x(4, value), w(2, 0.5f), y(4);
      const int slot = (c.rank() + call) % 2;
      const std::vector<std::int32_t> ids{slot, 2 + slot};
      auto h = ex.dispatch(x, ids, w, s);
      s.synchronize();
      std::fill(x.begin(), x.end(), -1.0f);
      const auto xs = h.experts();
      for (int l = 0; l < 2; ++l) {
        CAPTURE(l);
        const int source = ((l - call) % 2 + 2) % 2;
        REQUIRE(xs.rows(l) == 1);
        CHECK(xs.rows(l, source) == 1);
        const float want = static_cast<float>(source * 10 + call);
        CHECK(std::vector<float>(xs.input(l).begin(), xs.input(l).end()) ==
              std::vector<float>(4, want));
        std::copy_n(xs.input(l).data(), 4, xs.output(l).data());
      }
      ex.combine(h, std::span<float>(y), s);
      s.synchronize();
      CHECK(y == std::vector<float>(4, value)); // 0.5 * x + 0.5 * x
    }
  });
}

// The decode layer's default combine sums as the dynamic moe_exchange does: the same tokens,
// routing and experts give the dynamic exchange's output bitwise (a model served by moe_exchange
// for prefill and decode_exchange for decoding computes one function), including -1 ids, ranks
// of no tokens, replicated experts and three ranks; the per-pair combine gives other bits.
template <class T>
void check_decode_equals_dynamic(int ranks, const weave::placement& where, int k) {
  constexpr std::size_t hidden = 32;
  const int experts = where.num_experts();
  const moe_test::linear_experts f(experts, hidden, 17);
  std::vector<moe_test::rank_input<T>> in;
  std::mt19937 rng(static_cast<std::uint32_t>(ranks * 31 + k));
  for (int r = 0; r < ranks; ++r)
    in.push_back(moe_test::random_input<T>(r == 1 ? 0 : 12 + 3 * r, hidden, experts, k, rng));
  weave::local_world world(ranks);
  world.run([&](local& c) {
    const auto& mine = in[static_cast<std::size_t>(c.rank())];
    const std::size_t tokens = mine.x.rows();
    weave::moe_options mo;
    mo.k = k;
    mo.hidden = hidden;
    mo.element = weave::dtype_of_v<T>;
    mo.max_tokens = 32;
    weave::moe_exchange<local> dynamic(c, where, mo);
    weave::host_stream compute("compute"), comm_stream("comm");
    weave::host_matrix<T> y_dynamic(tokens, hidden);
    dynamic.forward(
        mine.x.view(), mine.ids, mine.weights, y_dynamic.view(),
        [&](const weave::expert_batch& b) { f.template operator()<T>(b); }, compute, comm_stream);
    dynamic.synchronize(compute, comm_stream);
    const std::vector<T> want(y_dynamic.elements().begin(), y_dynamic.elements().end());
    weave::decode_options o{k, hidden, 32};
    weave::decode_exchange<local, T> decode(c, where, o);
    CHECK(decode_test::bitwise_equal(decode_test::decode_call(decode, mine, f, comm_stream), want));
    o.gathered_inputs = true; // the experts read the rows where they arrived: the same sums
    weave::decode_exchange<local, T> gathered(c, where, o);
    CHECK(
        decode_test::bitwise_equal(decode_test::decode_call(gathered, mine, f, comm_stream), want));
    o.gathered_inputs = false;
    o.partial_sums = false;
    weave::decode_exchange<local, T> per_pair(c, where, o);
    const auto y = decode_test::decode_call(per_pair, mine, f, comm_stream);
    if (tokens > 0)
      CHECK(!decode_test::bitwise_equal(y, want)); // (one rounding fewer per device there)
  });
}

TEST_CASE_TEMPLATE("decode_exchange by default returns the dynamic moe_exchange's output bitwise",
                   T, float, weave::bfloat16, weave::half) {
  for (int ranks : {2, 3, 4}) {
    CAPTURE(ranks);
    check_decode_equals_dynamic<T>(ranks, weave::placement::contiguous(4 * ranks, ranks), 4);
  }
  // 2 ranks of 6 slots: experts 0, 1, 4 and 5 have a replica on each rank; k = 8 puts several
  // choices of a token on each device.
  check_decode_equals_dynamic<T>(
      2, weave::placement(8, 2, std::vector<std::int32_t>{0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 0, 1}), 3);
  check_decode_equals_dynamic<T>(2, weave::placement::contiguous(16, 2), 8);
}

TEST_CASE("decode_exchange with partial sums returns one row per token record") {
  // The combine message from rank d holds a header and one row per record this rank sent d
  // (a token routed to d at all), however many of d's experts the token chose.
  weave::local_world world(2);
  world.run([&](local& c) {
    weave::decode_options o = decode_test::options();
    o.partial_sums = true;
    const auto where = weave::placement::contiguous(decode_test::experts, 2);
    weave::decode_exchange<local, float> ex(c, where, o);
    CHECK(ex.combine_bytes_per_peer() ==
          (sizeof(weave::decode_header) + decode_test::max_tokens * decode_test::hidden * 4 + 15) /
              16 * 16);
    weave::host_stream s("decode");
    std::mt19937 rng(static_cast<std::uint32_t>(5 + c.rank()));
    const auto in = moe_test::random_input<float>(decode_test::max_tokens, decode_test::hidden,
                                                  decode_test::experts, decode_test::k, rng);
    const moe_test::linear_experts f(decode_test::experts, decode_test::hidden, 4);
    const auto y = decode_test::decode_call(ex, in, f, s);
    CHECK(decode_test::bitwise_equal(
        y, decode_test::partial_sums_reference(in, decode_test::k, f, where, c.rank())));
  });
}

TEST_CASE("decode_slot_counts equals a brute-force count call after call, also after a call "
          "stopped half way") {
  for (const std::size_t slots : {1u, 5u, 64u, 130u}) {
    CAPTURE(slots);
    const std::size_t sources = 3;
    weave::detail::decode_slot_counts counts(slots, sources);
    std::mt19937 rng(static_cast<std::uint32_t>(slots));
    for (int call = 0; call < 40; ++call) {
      CAPTURE(call);
      counts.begin();
      const bool dense = call % 4 == 3;
      const std::size_t rows = rng() % (dense ? 4 * slots : 9);
      std::map<std::size_t, std::vector<std::size_t>> seen; // slot -> each row's source
      for (std::size_t i = 0; i < rows; ++i) {
        const std::size_t slot = dense ? rng() % slots : (rng() % 2 ? slots - 1 : rng() % slots);
        const std::size_t source = rng() % sources;
        CHECK(counts.add(slot, source) == static_cast<std::int64_t>(seen[slot].size()));
        seen[slot].push_back(source);
      }
      if (call % 5 == 4)
        continue; // stopped before `finish` (a bad record): the next call starts from zero
      counts.finish();
      std::vector<int> busy;
      std::int64_t first = 0;
      for (std::size_t l = 0; l < slots; ++l) {
        const auto it = seen.find(l);
        const auto n =
            it == seen.end() ? std::int64_t{0} : static_cast<std::int64_t>(it->second.size());
        CHECK(counts.rows(l) == n);
        for (std::size_t s = 0; s < sources; ++s)
          CHECK(counts.rows(l, s) ==
                (it == seen.end() ? 0 : std::count(it->second.begin(), it->second.end(), s)));
        CHECK(counts.first(l) == (n == 0 ? 0 : first));
        if (n > 0) {
          busy.push_back(static_cast<int>(l));
          first += n;
        }
      }
      CHECK(std::vector<int>(counts.busy().begin(), counts.busy().end()) == busy);
    }
  }
}

TEST_CASE("decode_input_rows gives each slot its rows as a brute-force list, call after call, "
          "a peer's single row in place and every other row copied") {
  // Random calls of pairs (slot, source row, own or not) placed in pool order; a slot's block
  // must hold its rows' values in order, and a block of one row a peer sent must be that row
  // itself (no copy), one of this rank's own a copy in the pool.
  using rows_t = weave::detail::decode_input_rows<float>;
  constexpr std::size_t slots = 6, hidden = 3, pool_rows = 40, sources = 12;
  for (const auto how : {rows_t::mode::copied, rows_t::mode::blocks, rows_t::mode::gathered}) {
    CAPTURE(static_cast<int>(how));
    rows_t inputs(how, pool_rows, slots);
    std::vector<float> pool(pool_rows * hidden), source(sources * hidden);
    std::mt19937 rng(7);
    for (int call = 0; call < 60; ++call) {
      CAPTURE(call);
      for (float& v : source) // every call's rows differ: a stale pointer reads other values
        v = static_cast<float>(rng() % 1000);
      // Each slot's rows: indices into `source`; rows 0-5 are this rank's own tokens.
      std::vector<std::vector<std::size_t>> expected(slots);
      const std::size_t pairs = rng() % (call % 3 == 0 ? 3 : pool_rows);
      for (std::size_t p = 0; p < pairs; ++p)
        expected[rng() % slots].push_back(rng() % sources);
      std::vector<std::size_t> first(slots, 0);
      for (std::size_t l = 1; l < slots; ++l)
        first[l] = first[l - 1] + expected[l - 1].size();
      for (std::size_t l = 0; l < slots; ++l)
        for (std::size_t i = 0; i < expected[l].size(); ++i) {
          const std::size_t r = expected[l][i];
          inputs.place(reinterpret_cast<std::byte*>(pool.data()), first[l] + i, l,
                       static_cast<std::int64_t>(expected[l].size()),
                       reinterpret_cast<const std::byte*>(source.data() + r * hidden),
                       hidden * sizeof(float), r < 6);
        }
      for (std::size_t l = 0; l < slots; ++l) {
        CAPTURE(l);
        const std::size_t n = expected[l].size();
        std::vector<float> want;
        for (const std::size_t r : expected[l])
          want.insert(want.end(), source.begin() + static_cast<std::ptrdiff_t>(r * hidden),
                      source.begin() + static_cast<std::ptrdiff_t>((r + 1) * hidden));
        if (how == rows_t::mode::gathered) {
          CHECK(moe_test::error_code_of([&] {
                  (void)inputs.block(pool.data(), l, first[l], n, hidden);
                }) == weave::errc::invalid_state);
          const auto rows = inputs.gathered(first[l], n);
          REQUIRE(rows.size() == n);
          for (std::size_t i = 0; i < n; ++i)
            CHECK(rows[i] == source.data() + expected[l][i] * hidden);
          continue;
        }
        CHECK(moe_test::error_code_of([&] { (void)inputs.gathered(first[l], n); }) ==
              weave::errc::invalid_state);
        const auto block = inputs.block(pool.data(), l, first[l], n, hidden);
        CHECK(std::vector<float>(block.begin(), block.end()) == want);
        const bool in_place = how == rows_t::mode::blocks && n == 1 && expected[l][0] >= 6;
        CHECK((block.data() == source.data() + (n == 1 ? expected[l][0] : 0) * hidden) == in_place);
      }
    }
  }
}

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

TEST_CASE("decode_exchange: calls queued back to back without waiting equal the reference") {
  for (int ranks : {2, 4}) {
    CAPTURE(ranks);
    weave::local_world world(ranks);
    world.run([&](local& c) { decode_test::check_queued_calls(c); });
  }
}

TEST_CASE("decode_exchange inside the caller's claim of its stream runs on the calling thread") {
  weave::local_world_options inline_ops; // small collectives on the calling thread, as over MPI
  inline_ops.inline_max_bytes = 1 << 20;
  for (int ranks : {2, 4}) {
    CAPTURE(ranks);
    weave::local_world world(ranks, inline_ops);
    world.run([&](local& c) { decode_test::check_inside_a_claim(c); });
  }
}

TEST_CASE("decode_exchange destroyed with a call still queued waits for it, after calls that "
          "ran on the calling thread") {
  for (int ranks : {2, 4}) {
    CAPTURE(ranks);
    weave::local_world world(ranks);
    world.run([&](local& c) { decode_test::check_destroyed_while_queued(c); });
  }
}

TEST_CASE("decode_exchange fail-stop: one rank's bad call fails every rank, none hangs") {
  for (int ranks : {2, 4}) {
    CAPTURE(ranks);
    weave::local_world world(ranks);
    world.run([&](local& c) { decode_test::check_every_fault(c); });
  }
}

TEST_CASE("decode_exchange: ranks built differently fail construction on every rank, typed") {
  // Rank 1 disagrees on one field at a time: every rank gets config_mismatch naming it; a rank
  // whose options are invalid on their own gets its error and its peer a peer_error naming it.
  struct variant {
    const char* field;
    weave::decode_options options;
    int experts;
  };
  const variant variants[] = {{"max_tokens_per_rank", {2, 4, 3}, 4},
                              {"hidden", {2, 8, 2}, 4},
                              {"k", {1, 4, 2}, 4},
                              {"experts", {2, 4, 2}, 8},
                              {"partial_sums", {2, 4, 2, {}, false}, 4}};
  for (const variant& v : variants) {
    CAPTURE(v.field);
    weave::local_world world(2);
    std::vector<std::string> messages(2);
    std::vector<weave::errc> codes(2);
    world.run([&](local& c) {
      const bool odd = c.rank() == 1;
      const auto r = static_cast<std::size_t>(c.rank());
      try {
        weave::decode_exchange<local, float> ex(
            c, weave::placement::contiguous(odd ? v.experts : 4, 2),
            odd ? v.options : weave::decode_options{2, 4, 2});
      } catch (const weave::error& e) {
        codes[r] = e.code();
        messages[r] = e.message();
      }
    });
    for (std::size_t r = 0; r < 2; ++r) {
      CHECK(codes[r] == weave::errc::config_mismatch);
      CHECK(messages[r].find(std::string("disagree on ") + v.field) != std::string::npos);
    }
  }
  weave::local_world world(2);
  std::vector<weave::errc> codes(2);
  world.run([&](local& c) {
    codes[static_cast<std::size_t>(c.rank())] = moe_test::error_code_of([&] {
      weave::decode_exchange<local, float> ex(c, weave::placement::contiguous(4, 2),
                                              {2, 4, c.rank() == 1 ? 0u : 2u});
    });
  });
  CHECK(codes[0] == weave::errc::peer_failure);
  CHECK(codes[1] == weave::errc::invalid_argument);
}

TEST_CASE("decode_exchange refuses a second handle, a foreign one and another stream") {
  weave::local_world world(1);
  world.run([&](local& c) {
    weave::decode_exchange<local, float> ex(c, weave::placement::contiguous(4, 1), {2, 4, 2});
    weave::host_stream s("decode");
    std::vector<float> x(8, 1.0f), w(4, 0.5f), y(8);
    std::vector<std::int32_t> ids{0, 1, 2, 3};
    auto h = ex.dispatch(x, ids, w, s);
    CHECK(moe_test::error_code_of([&] { (void)ex.dispatch(x, ids, w, s); }) ==
          weave::errc::invalid_state);
    weave::host_stream other("other");
    CHECK(moe_test::error_code_of([&] { ex.combine(h, std::span<float>(y), other); }) ==
          weave::errc::invalid_argument); // every call on the first call's stream
    CHECK(h.valid());
    decltype(h) empty;
    CHECK(moe_test::error_code_of([&] { ex.combine(empty, std::span<float>(y), s); }) ==
          weave::errc::invalid_argument);
    CHECK(moe_test::error_code_of([&] { (void)empty.experts(); }) == weave::errc::invalid_state);
    const auto xs = h.experts();
    const bool refused =
        moe_test::error_code_of([&] { (void)xs.rows(0); }) == weave::errc::invalid_state;
    CHECK((refused || s.query())); // refused unless the dispatch has already run
    s.synchronize();
    CHECK(xs.rows(0) == 1);
    for (int l = 0; l < 4; ++l)
      std::copy(xs.input(l).begin(), xs.input(l).end(), xs.output(l).begin());
    ex.combine(h, std::span<float>(y), s);
    s.synchronize();
    CHECK(y == std::vector<float>(8, 1.0f)); // 0.5 * x + 0.5 * x
    CHECK(!h.valid());
  });
}

// The docs' example: one decode layer per rank, the experts queued on the stream after the
// dispatch (no host wait inside the layer), checked against the naive reference.
TEST_CASE("decode_exchange example: one layer, experts queued between dispatch and combine") {
  constexpr int experts = 8, k = 2;
  constexpr std::size_t hidden = 32;
  const moe_test::linear_experts f(experts, hidden, 3);
  weave::local_world world(2);
  world.run([&](local& comm) {
    std::mt19937 rng(static_cast<std::uint32_t>(comm.rank()));
    const auto in =
        moe_test::random_input<float>(comm.rank() == 0 ? 5 : 0, hidden, experts, k, rng);
    std::vector<float> y(in.x.rows() * hidden);
    //! [decode]
    weave::decode_options o;
    o.k = k;
    o.hidden = hidden;
    o.max_tokens_per_rank = 16; // the messages: every buffer is allocated here, once
    weave::decode_exchange<weave::local_communicator, float> layer(
        comm, weave::placement::contiguous(experts, comm.size()), o);
    weave::host_stream stream("decode");
    auto h = layer.dispatch(in.x.elements(), in.ids, in.weights, stream); // one all-to-all
    stream.submit([&f, xs = h.experts(), H = o.hidden] { // runs once the dispatch arrived
      for (const int l : xs.busy()) // the slots with rows; xs.rows(l, source): rows per source
        for (std::size_t r = 0; r * H < xs.input(l).size(); ++r)
          f.apply(xs.expert(l), xs.input(l).data() + r * H, xs.output(l).data() + r * H);
    });
    layer.combine(h, std::span<float>(y), stream); // one all-to-all; y = sum_j w_j f_j(x)
    stream.synchronize(); // a failure on any rank throws here, on every rank
    //! [decode]
    CHECK(decode_test::bitwise_equal(
        y, decode_test::expected(in, o, f, weave::placement::contiguous(experts, comm.size()),
                                 comm.rank())));
  });
}
