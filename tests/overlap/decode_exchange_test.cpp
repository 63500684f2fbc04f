// The decode exchange on an in-process world of 1, 2 and 4 ranks (one thread each), every case
// written once and run in host_space (`decode_exchange`) and in emulated_gpu_space (the control
// flow of `cuda_decode_exchange` on host streams): outputs equal the naive reference of their
// combine (per device by default, the dynamic exchange's output; per pair) bitwise for f32, bf16
// and f16 rows, with ranks of zero tokens and of exactly max_tokens_per_rank, -1 ids, replicated
// experts, gathered inputs, an FP8 dispatch, and both spaces give the same bits; the experts'
// view (per-slot accessors and raw arrays of a packed pool); the messages' sizes; every bad input
// on one rank fails it with its typed error and every peer with peer_failure, and the next call
// works; construction agreement, misuse, lifetime; calls queued, inside a claim, captured.
#include "decode_cases.hpp"

#include <weave/comm/communicator.hpp>
#include <weave/comm/local_world.hpp>
#include <weave/core/dtype.hpp>
#include <weave/core/host_matrix.hpp>
#include <weave/exec/emulated_gpu_space.hpp>
#include <weave/exec/host_space.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/overlap/moe_exchange.hpp>

#include <algorithm>
#include <chrono>
#include <random>
#include <span>
#include <string>
#include <vector>

using local = weave::local_communicator;

namespace {

// A test case's execution space and row type.
template <class S, class T>
struct in_space {
  using space = S;
  using type = T;
};

const weave::placement& replicated() {
  // 2 ranks of 6 slots: experts 0, 1, 4 and 5 have a replica on each rank.
  static const weave::placement where(
      8, 2, std::vector<std::int32_t>{0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 0, 1});
  return where;
}

} // namespace

TEST_CASE_TEMPLATE("decode_exchange equals the naive reference on 1, 2 and 4 ranks", C,
                   in_space<weave::host_space, float>, in_space<weave::host_space, weave::bfloat16>,
                   in_space<weave::host_space, weave::half>,
                   in_space<weave::emulated_gpu_space, float>,
                   in_space<weave::emulated_gpu_space, weave::bfloat16>,
                   in_space<weave::emulated_gpu_space, weave::half>) {
  using Space = typename C::space;
  using T = typename C::type;
  for (int ranks : {1, 2, 4})
    for (const bool initialize : {false, true}) {
      CAPTURE(ranks);
      CAPTURE(initialize);
      weave::local_world world(ranks);
      world.run([&](local& c) {
        decode_test::reference_case how;
        how.initialize = initialize;
        decode_test::check_against_reference<Space, T>(
            c, weave::placement::contiguous(decode_test::experts, ranks), how);
      });
    }
}

TEST_CASE_TEMPLATE("decode_exchange with 128 slots per rank, most idle in a call, equals the "
                   "reference",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  // A call feeds a few of many slots (E = 256 on 2 ranks): the resets and the pool's order
  // follow the slots fed, call after call, for either combine and gathered inputs.
  weave::local_world world(2);
  for (const bool partial_sums : {true, false})
    for (const bool gathered : {false, true}) {
      CAPTURE(partial_sums);
      CAPTURE(gathered);
      world.run([&](local& c) {
        decode_test::check_against_reference<Space, float>(c, weave::placement::contiguous(256, 2),
                                                           {partial_sums, gathered, gathered});
      });
    }
}

TEST_CASE_TEMPLATE("decode_exchange with replicated experts equals the naive reference", Space,
                   weave::host_space, weave::emulated_gpu_space) {
  weave::local_world world(2);
  for (const bool partial_sums : {false, true}) {
    CAPTURE(partial_sums);
    world.run([&](local& c) {
      decode_test::check_against_reference<Space, float>(c, replicated(), {partial_sums});
    });
  }
}

TEST_CASE_TEMPLATE("decode_exchange with partial sums equals its per-device reference on 1, 2 "
                   "and 4 ranks, replicas too",
                   C, in_space<weave::host_space, float>,
                   in_space<weave::host_space, weave::bfloat16>,
                   in_space<weave::emulated_gpu_space, float>,
                   in_space<weave::emulated_gpu_space, weave::bfloat16>) {
  using Space = typename C::space;
  using T = typename C::type;
  for (int ranks : {1, 2, 4}) {
    CAPTURE(ranks);
    weave::local_world world(ranks);
    world.run([&](local& c) {
      decode_test::check_against_reference<Space, T>(
          c, weave::placement::contiguous(decode_test::experts, ranks), {true});
    });
  }
  weave::local_world world(2);
  world.run(
      [&](local& c) { decode_test::check_against_reference<Space, T>(c, replicated(), {true}); });
}

TEST_CASE_TEMPLATE("decode_exchange with gathered inputs equals the reference of either combine "
                   "on 1, 2 and 4 ranks, replicas too",
                   C, in_space<weave::host_space, float>,
                   in_space<weave::host_space, weave::bfloat16>,
                   in_space<weave::emulated_gpu_space, float>,
                   in_space<weave::emulated_gpu_space, weave::bfloat16>) {
  // The experts read each row where it arrived: a peer's message or this rank's own tokens.
  using Space = typename C::space;
  using T = typename C::type;
  for (const bool partial_sums : {true, false}) {
    CAPTURE(partial_sums);
    for (int ranks : {1, 2, 4}) {
      CAPTURE(ranks);
      weave::local_world world(ranks);
      world.run([&](local& c) {
        decode_test::check_against_reference<Space, T>(
            c, weave::placement::contiguous(decode_test::experts, ranks), {partial_sums, true});
      });
    }
    weave::local_world world(2);
    world.run([&](local& c) {
      decode_test::check_against_reference<Space, T>(c, replicated(), {partial_sums, true});
    });
  }
}

TEST_CASE_TEMPLATE("decode_exchange in host_space and in emulated_gpu_space gives the same bits", T,
                   float, weave::bfloat16, weave::half) {
  // Outputs and counts of the same calls, for either combine, copied or gathered inputs, the
  // workspace given or taken, on 1, 2 and 4 ranks and a replicated placement.
  for (const bool partial_sums : {true, false})
    for (const bool gathered : {false, true}) {
      CAPTURE(partial_sums);
      CAPTURE(gathered);
      const decode_test::reference_case how{partial_sums, gathered, partial_sums};
      for (int ranks : {1, 2, 4}) {
        CAPTURE(ranks);
        weave::local_world world(ranks);
        world.run([&](local& c) {
          decode_test::check_spaces_agree<T>(
              c, weave::placement::contiguous(decode_test::experts, ranks), how);
        });
      }
      weave::local_world world(2);
      world.run([&](local& c) { decode_test::check_spaces_agree<T>(c, replicated(), how); });
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

// One all-to-all as it left: over the bounded all-to-all or not, and its bytes per peer.
struct sent_bytes {
  bool bounded = false;
  std::vector<std::int64_t> counts;
};

// With (`Bounded`) or without the bounded all-to-all; records each all-to-all's bytes per peer
// when it runs (read in the stream, where the layer sets them).
template <bool Bounded>
struct recording_comm : forwarding_comm {
  std::vector<sent_bytes>* sent = nullptr;
  void all_to_all_v(weave::host_stream& s, const void* send, std::span<const std::int64_t> sc,
                    std::span<const std::int64_t> sd, void* recv, std::span<const std::int64_t> rc,
                    std::span<const std::int64_t> rd, std::size_t unit) {
    s.submit([this, sc] { sent->push_back({false, {sc.begin(), sc.end()}}); });
    inner->all_to_all_v(s, send, sc, sd, recv, rc, rd, unit);
  }
  void all_to_all_v_bounded(weave::host_stream& s, const void* send,
                            std::span<const std::int64_t> sc, std::span<const std::int64_t> sd,
                            void* recv, std::span<const std::int64_t> rc,
                            std::span<const std::int64_t> rd, std::span<std::int64_t> received,
                            std::size_t unit) requires Bounded {
    s.submit([this, sc] { sent->push_back({true, {sc.begin(), sc.end()}}); });
    inner->all_to_all_v_bounded(s, send, sc, sd, recv, rc, rd, received, unit);
  }
};
static_assert(weave::has_bounded_all_to_all<recording_comm<true>> &&
              !weave::has_bounded_all_to_all<recording_comm<false>>);

// A bounded all-to-all that sends rank 1 one byte less of rank 0's message than the layer
// asked for (what a rogue or broken peer might do).
struct shortening_comm : forwarding_comm {
  std::vector<std::int64_t> counts; // the counts sent, set on the stream
  bool used = false;
  void all_to_all_v_bounded(weave::host_stream& s, const void* send,
                            std::span<const std::int64_t> sc, std::span<const std::int64_t> sd,
                            void* recv, std::span<const std::int64_t> rc,
                            std::span<const std::int64_t> rd, std::span<std::int64_t> received,
                            std::size_t unit) {
    used = true;
    counts.assign(sc.size(), 0);
    s.submit([this, sc] {
      std::copy(sc.begin(), sc.end(), counts.begin());
      if (rank() == 0)
        --counts[1];
    });
    inner->all_to_all_v_bounded(s, send, counts, sd, recv, rc, rd, received, unit);
  }
};

// Records (one per token that reaches device d) and pairs of `in` on device d, `per_device`
// experts each (contiguous placement).
std::pair<std::size_t, std::size_t> records_and_pairs(const moe_test::rank_input<float>& in, int d,
                                                      int per_device) {
  std::size_t records = 0, pairs = 0;
  for (std::size_t t = 0; t * decode_test::k < in.ids.size(); ++t) {
    std::size_t here = 0;
    for (int j = 0; j < decode_test::k; ++j) {
      const int id = in.ids[t * decode_test::k + static_cast<std::size_t>(j)];
      here += id >= 0 && id / per_device == d ? 1 : 0;
    }
    records += here > 0 ? 1 : 0;
    pairs += here;
  }
  return {records, pairs};
}

} // namespace

TEST_CASE_TEMPLATE("decode_exchange's dispatch sends a peer its records alone over a bounded "
                   "all-to-all on host streams, whole messages elsewhere, with the same results",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  // Host streams know the counts when they send: a dispatch message holds its records alone
  // where the communicator has a bounded all-to-all, and a combine message its rows. Where host
  // code runs at enqueue time (CUDA) every message is sent whole.
  constexpr int ranks = 4, per_device = decode_test::experts / ranks; // choices = min(k, 2)
  const auto where = weave::placement::contiguous(decode_test::experts, ranks);
  constexpr std::size_t header = sizeof(weave::decode_header),
                        row = decode_test::hidden * sizeof(float), M = decode_test::max_tokens;
  for (const bool partial_sums : {true, false}) {
    CAPTURE(partial_sums);
    // The documented format, counted by brute force: a header, then per record (a token that
    // reaches the device) its row and min(k, local experts) slots (and as many weights); a
    // combine message a row per record (partial sums) or per pair.
    const std::size_t entry =
        static_cast<std::size_t>(std::min(decode_test::k, per_device)) * 4 * (partial_sums ? 2 : 1);
    const std::size_t dispatch_room = header + M * (row + entry),
                      combine_room = header + (partial_sums ? M : M * 2) * row;
    weave::local_world world(ranks);
    world.run([&](local& c) {
      for (const bool with_bounded : {true, false}) {
        CAPTURE(with_bounded);
        std::vector<sent_bytes> sent;
        if (with_bounded) {
          recording_comm<true> comm;
          comm.inner = &c;
          comm.sent = &sent;
          decode_test::check_against_reference<Space, float>(comm, where, {partial_sums});
        } else {
          recording_comm<false> comm;
          comm.inner = &c;
          comm.sent = &sent;
          decode_test::check_against_reference<Space, float>(comm, where, {partial_sums});
        }
        const bool exact = Space::runs_later;
        REQUIRE(sent.size() == 8); // check_against_reference's four calls, two phases each
        for (int call = 0; call < 4; ++call) {
          CAPTURE(call);
          std::vector<moe_test::rank_input<float>> in;
          for (int r = 0; r < ranks; ++r) {
            std::mt19937 rng(static_cast<std::uint32_t>(100 * call + r));
            in.push_back(moe_test::random_input<float>(decode_test::tokens_of(r, call),
                                                       decode_test::hidden, decode_test::experts,
                                                       decode_test::k, rng));
          }
          const sent_bytes& dispatch = sent[static_cast<std::size_t>(2 * call)];
          const sent_bytes& combine = sent[static_cast<std::size_t>(2 * call + 1)];
          CHECK(dispatch.bounded == (exact && with_bounded));
          CHECK(!combine.bounded);
          for (int d = 0; d < ranks; ++d) {
            CAPTURE(d);
            const auto i = static_cast<std::size_t>(d);
            if (d == c.rank()) { // a rank's messages to itself: headers
              CHECK(dispatch.counts[i] == static_cast<std::int64_t>(header));
              CHECK(combine.counts[i] == static_cast<std::int64_t>(header));
              continue;
            }
            const std::size_t records =
                records_and_pairs(in[static_cast<std::size_t>(c.rank())], d, per_device).first;
            // What this rank returns to d: a row per record d sent here, or per pair.
            const auto [back_records, back_pairs] = records_and_pairs(in[i], c.rank(), per_device);
            CHECK(dispatch.counts[i] ==
                  static_cast<std::int64_t>(exact && with_bounded ? header + records * (row + entry)
                                                                  : dispatch_room));
            CHECK(combine.counts[i] ==
                  static_cast<std::int64_t>(
                      exact ? header + (partial_sums ? back_records : back_pairs) * row
                            : combine_room));
          }
        }
      }
    });
  }
}

TEST_CASE_TEMPLATE("decode_exchange: a dispatch message shorter than its header's records fails "
                   "every rank on host streams, the receiver with protocol",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  // Where host code runs at enqueue time the messages go whole over the plain all-to-all: the
  // bounded one (which shortens here) is never used, and the call equals the reference.
  weave::local_world world(2);
  world.run_collect([&](local& c) {
    shortening_comm comm;
    comm.inner = &c;
    const auto where = weave::placement::contiguous(decode_test::experts, 2);
    decode_test::exchange_in<Space, shortening_comm, float> ex(comm, where, decode_test::options());
    weave::host_stream s("decode");
    std::mt19937 rng(static_cast<std::uint32_t>(3 + c.rank()));
    auto in = moe_test::random_input<float>(decode_test::max_tokens, decode_test::hidden,
                                            decode_test::experts, decode_test::k, rng);
    in.ids[0] = decode_test::experts - 1; // token 0 on rank 1's experts too: a record
    in.ids[1] = 0;
    in.ids[2] = 1;
    const moe_test::linear_experts f(decode_test::experts, decode_test::hidden, 2);
    std::vector<float> y;
    const auto got = decode_test::outcome_of([&] { y = decode_test::decode_call(ex, in, f, s); });
    INFO("rank ", c.rank(), ": ", got.message);
    if constexpr (Space::runs_later) {
      CHECK(comm.used);
      if (c.rank() == 1) {
        CHECK(got.code == weave::errc::protocol);
      } else {
        CHECK(got.code == weave::errc::peer_failure);
      }
      CHECK(got.message.find("rank 0 sent a dispatch message of") != std::string::npos);
    } else {
      CHECK(!comm.used);
      CHECK(got.code == weave::errc{});
      CHECK(decode_test::bitwise_equal(
          y, decode_test::expected(in, decode_test::options(), f, where, c.rank())));
    }
  });
}

TEST_CASE_TEMPLATE("decode_exchange gives input_rows with gathered inputs only, input without "
                   "them only",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  weave::local_world world(2);
  world.run([&](local& c) {
    for (const bool gathered : {false, true}) {
      CAPTURE(gathered);
      weave::decode_options o{2, 4, 2};
      o.gathered_inputs = gathered;
      decode_test::exchange_in<Space, local, float> ex(c, weave::placement::contiguous(4, 2), o);
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
      CHECK((xs.input_row_pointers() != nullptr) == gathered);
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
      ex.synchronize(s);
      CHECK(y == x); // 0.5 * x + 0.5 * x
    }
  });
}

TEST_CASE_TEMPLATE("decode_exchange gives an expert fed one row that row, a peer's read where it "
                   "arrived and this rank's copied, call after call",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  // One token per rank, k = 2 (one expert on each rank): in call c rank r's token goes to slot
  // (r + c) % 2 of both ranks, so every fed slot gets one row, from this rank or its peer in
  // turn. The caller's x is overwritten once the dispatch ran: the default layer does not
  // borrow it, so an expert still reads the token's values. A peer's row is its input block (in
  // the received message), this rank's own a copy in the pool.
  weave::local_world world(2);
  world.run([&](local& c) {
    weave::decode_options o{2, 4, 1};
    decode_test::exchange_in<Space, local, float> ex(c, weave::placement::contiguous(4, 2), o);
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
        const std::byte* block = xs.input_blocks()[l];
        CHECK((block != nullptr) == (source != c.rank()));
        CHECK(xs.input(l).data() == (block != nullptr ? reinterpret_cast<const float*>(block)
                                                      : xs.input_pool() + xs.slot_first()[l] * 4));
        std::copy_n(xs.input(l).data(), 4, xs.output(l).data());
      }
      ex.combine(h, std::span<float>(y), s);
      ex.synchronize(s);
      CHECK(y == std::vector<float>(4, value)); // 0.5 * x + 0.5 * x
    }
  });
}

// The decode layer's default combine sums as the dynamic moe_exchange does: the same tokens,
// routing and experts give the dynamic exchange's output bitwise (a model served by moe_exchange
// for prefill and decode_exchange for decoding computes one function), in the same space,
// including -1 ids, ranks of no tokens, replicated experts and three ranks; the per-pair combine
// gives other bits.
template <class Space, class T>
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
    weave::basic_moe_exchange<Space, local> dynamic(c, where, mo);
    weave::host_stream compute("compute"), comm_stream("comm");
    weave::host_matrix<T> y_dynamic(tokens, hidden);
    dynamic.forward(
        mine.x.view(), mine.ids, mine.weights, y_dynamic.view(),
        [&](const weave::basic_expert_batch<Space>& b) { moe_test::run_experts<T>(f, b); }, compute,
        comm_stream);
    dynamic.synchronize(compute, comm_stream);
    const std::vector<T> want(y_dynamic.elements().begin(), y_dynamic.elements().end());
    weave::decode_options o{k, hidden, 32};
    decode_test::exchange_in<Space, local, T> decode(c, where, o);
    CHECK(decode_test::bitwise_equal(decode_test::decode_call(decode, mine, f, comm_stream), want));
    o.gathered_inputs = true; // the experts read the rows where they arrived: the same sums
    decode_test::exchange_in<Space, local, T> gathered(c, where, o);
    CHECK(
        decode_test::bitwise_equal(decode_test::decode_call(gathered, mine, f, comm_stream), want));
    o.gathered_inputs = false;
    o.partial_sums = false;
    decode_test::exchange_in<Space, local, T> per_pair(c, where, o);
    const auto y = decode_test::decode_call(per_pair, mine, f, comm_stream);
    CHECK(decode_test::bitwise_equal(y, decode_test::reference(mine, k, f)));
    if (tokens > 0)
      CHECK(!decode_test::bitwise_equal(y, want)); // (one rounding fewer per device there)
  });
}

TEST_CASE_TEMPLATE("decode_exchange by default returns the dynamic moe_exchange's output bitwise",
                   C, in_space<weave::host_space, float>,
                   in_space<weave::host_space, weave::bfloat16>,
                   in_space<weave::host_space, weave::half>,
                   in_space<weave::emulated_gpu_space, float>,
                   in_space<weave::emulated_gpu_space, weave::bfloat16>,
                   in_space<weave::emulated_gpu_space, weave::half>) {
  using Space = typename C::space;
  using T = typename C::type;
  for (int ranks : {2, 3, 4}) {
    CAPTURE(ranks);
    check_decode_equals_dynamic<Space, T>(ranks, weave::placement::contiguous(4 * ranks, ranks), 4);
  }
  // Replicated experts; k = 8 puts several choices of a token on each device.
  check_decode_equals_dynamic<Space, T>(2, replicated(), 3);
  check_decode_equals_dynamic<Space, T>(2, weave::placement::contiguous(16, 2), 8);
}

TEST_CASE_TEMPLATE("decode_exchange with partial sums returns one row per token record", Space,
                   weave::host_space, weave::emulated_gpu_space) {
  // The combine message from rank d holds a header and one row per record this rank sent d
  // (a token routed to d at all), however many of d's experts the token chose.
  weave::local_world world(2);
  world.run([&](local& c) {
    weave::decode_options o = decode_test::options();
    o.partial_sums = true;
    const auto where = weave::placement::contiguous(decode_test::experts, 2);
    decode_test::exchange_in<Space, local, float> ex(c, where, o);
    CHECK(ex.combine_bytes_per_peer() ==
          sizeof(weave::decode_header) + decode_test::max_tokens * decode_test::hidden * 4);
    o.partial_sums = false; // a row per (record, local choice): min(k, 4) = 3 per record
    CHECK(decode_test::exchange_in<Space, local, float>(c, where, o).combine_bytes_per_peer() ==
          sizeof(weave::decode_header) + 3 * decode_test::max_tokens * decode_test::hidden * 4);
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

TEST_CASE_TEMPLATE("decode_exchange: calls queued back to back without waiting equal the "
                   "reference",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  for (int ranks : {2, 4}) {
    CAPTURE(ranks);
    weave::local_world world(ranks);
    world.run([&](local& c) { decode_test::check_queued_calls<Space>(c); });
  }
}

TEST_CASE_TEMPLATE("decode_exchange inside the caller's claim of its stream runs on the calling "
                   "thread",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  weave::local_world_options inline_ops; // small collectives on the calling thread, as over MPI
  inline_ops.inline_max_bytes = 1 << 20;
  for (int ranks : {2, 4}) {
    CAPTURE(ranks);
    weave::local_world world(ranks, inline_ops);
    world.run([&](local& c) { decode_test::check_inside_a_claim<Space>(c); });
  }
}

TEST_CASE_TEMPLATE("decode_exchange destroyed with a call still queued waits for it, after calls "
                   "that ran on the calling thread",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  for (int ranks : {2, 4}) {
    CAPTURE(ranks);
    weave::local_world world(ranks);
    world.run([&](local& c) { decode_test::check_destroyed_while_queued<Space>(c); });
  }
}

TEST_CASE_TEMPLATE("decode_exchange fail-stop: one rank's bad call fails every rank, none hangs",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  for (int ranks : {2, 4}) {
    CAPTURE(ranks);
    weave::local_world world(ranks);
    world.run([&](local& c) { decode_test::check_every_fault<Space>(c); });
  }
}

TEST_CASE_TEMPLATE("decode_exchange: ranks built differently fail construction on every rank, "
                   "typed",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  // Rank 1 disagrees on one field at a time: every rank gets config_mismatch naming it; a rank
  // whose options are invalid on their own gets its error and its peer a peer_error naming it.
  using exchange = decode_test::exchange_in<Space, local, float>;
  struct variant {
    const char* field;
    weave::decode_options options;
    int experts;
  };
  weave::decode_options fp8 = decode_test::fp8_options(true);
  fp8.hidden = 4; // one block of 4
  fp8.fp8_dispatch->blocks.block = 4;
  fp8.k = 2;
  fp8.max_tokens_per_rank = 2;
  const variant variants[] = {{"max_tokens_per_rank", {2, 4, 3}, 4},
                              {"hidden", {2, 8, 2}, 4},
                              {"k", {1, 4, 2}, 4},
                              {"experts", {2, 4, 2}, 8},
                              {"partial_sums", {2, 4, 2, {}, false}, 4},
                              {"fp8_dispatch", fp8, 4}};
  for (const variant& v : variants) {
    CAPTURE(v.field);
    weave::local_world world(2);
    std::vector<std::string> messages(2);
    std::vector<weave::errc> codes(2);
    world.run([&](local& c) {
      const bool odd = c.rank() == 1;
      const auto r = static_cast<std::size_t>(c.rank());
      try {
        exchange ex(c, weave::placement::contiguous(odd ? v.experts : 4, 2),
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
  // Options invalid on one rank: its own error there, a peer_error naming it on the other.
  weave::local_world world(2);
  std::vector<weave::errc> codes(2);
  world.run([&](local& c) {
    codes[static_cast<std::size_t>(c.rank())] = moe_test::error_code_of([&] {
      exchange ex(c, weave::placement::contiguous(4, 2), {2, 4, c.rank() == 1 ? 0u : 2u});
    });
  });
  CHECK(codes[0] == weave::errc::peer_failure);
  CHECK(codes[1] == weave::errc::invalid_argument);
  // Gathered inputs are refused beside an FP8 dispatch (the experts read codes and scales from
  // the pool) on every rank, naming the option; without one they are taken in every space (the
  // reference cases run them).
  std::vector<decode_test::outcome> got(2);
  world.run([&](local& c) {
    weave::decode_options o = decode_test::fp8_options(true);
    o.gathered_inputs = true;
    got[static_cast<std::size_t>(c.rank())] = decode_test::outcome_of(
        [&] { exchange ex(c, weave::placement::contiguous(decode_test::experts, 2), o); });
  });
  for (const auto& g : got) {
    CHECK(g.code == weave::errc::invalid_argument);
    CHECK(g.message.find("gathered_inputs") != std::string::npos);
  }
  world.run([&](local& c) {
    weave::decode_options o{2, 4, 2};
    o.gathered_inputs = true;
    got[static_cast<std::size_t>(c.rank())] =
        decode_test::outcome_of([&] { exchange ex(c, weave::placement::contiguous(4, 2), o); });
  });
  for (const auto& g : got)
    CHECK(g.code == weave::errc{});
}

TEST_CASE_TEMPLATE("decode_exchange refuses a second handle, a foreign one, another stream and a "
                   "short workspace",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  weave::local_world world(1);
  world.run([&](local& c) {
    using exchange = decode_test::exchange_in<Space, local, float>;
    exchange ex(c, weave::placement::contiguous(4, 1), {2, 4, 2});
    weave::host_stream s("decode");
    std::vector<float> x(8, 1.0f), w(4, 0.5f), y(8);
    std::vector<std::int32_t> ids{0, 1, 2, 3};
    CHECK(ex.workspace_size() == exchange::workspace_size(1, 4, {2, 4, 2}));
    weave_test::aligned_buffer ws(ex.workspace_size());
    CHECK(moe_test::error_code_of([&] { ex.initialize(ws.ptr, ws.size - 1, s); }) ==
          weave::errc::size_mismatch);
    CHECK(moe_test::error_code_of([&] { ex.initialize(nullptr, ws.size, s); }) ==
          weave::errc::invalid_argument);
    // (Without `initialize` the first call would take the workspace itself.)
    ex.initialize(ws.ptr, ws.size, s);
    auto h = ex.dispatch(x, ids, w, s);
    CHECK(moe_test::error_code_of([&] { (void)ex.dispatch(x, ids, w, s); }) ==
          weave::errc::invalid_state);
    CHECK(moe_test::error_code_of([&] { ex.initialize(ws.ptr, ws.size, s); }) ==
          weave::errc::invalid_state); // not with a handle alive
    weave::host_stream other("other");
    CHECK(moe_test::error_code_of([&] { ex.combine(h, std::span<float>(y), other); }) ==
          weave::errc::invalid_argument); // every call on the first call's stream
    CHECK(h.valid());
    decltype(h) empty;
    CHECK(moe_test::error_code_of([&] { ex.combine(empty, std::span<float>(y), s); }) ==
          weave::errc::invalid_argument);
    CHECK(moe_test::error_code_of([&] { (void)empty.experts(); }) == weave::errc::invalid_state);
    const auto xs = h.experts();
    if constexpr (Space::runs_later) { // the view checks that the dispatch ran
      const bool refused =
          moe_test::error_code_of([&] { (void)xs.rows(0); }) == weave::errc::invalid_state;
      CHECK((refused || s.query())); // refused unless the dispatch has already run
    }
    s.synchronize();
    CHECK(xs.rows(0) == 1);
    CHECK(moe_test::error_code_of([&] { (void)xs.rows(4); }) == weave::errc::out_of_range);
    CHECK(moe_test::error_code_of([&] { (void)xs.rows(0, 1); }) == weave::errc::out_of_range);
    CHECK(moe_test::error_code_of([&] { (void)xs.input_codes(0); }) == weave::errc::invalid_state);
    for (int l = 0; l < 4; ++l)
      std::copy(xs.input(l).begin(), xs.input(l).end(), xs.output(l).begin());
    ex.combine(h, std::span<float>(y), s);
    ex.synchronize(s);
    CHECK(y == std::vector<float>(8, 1.0f)); // 0.5 * x + 0.5 * x
    CHECK(!h.valid());
    auto next = ex.dispatch(x, ids, w, s);
    s.synchronize();
    if constexpr (Space::runs_later) // a view of a call a later dispatch replaced
      CHECK(moe_test::error_code_of([&] { (void)xs.rows(0); }) == weave::errc::invalid_state);
    CHECK(next.experts().rows(0) == 1);
    ex.combine(next, std::span<float>(y), s);
    ex.synchronize(s);
  });
}

TEST_CASE_TEMPLATE("decode_exchange takes its workspace at the first call without initialize",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  // The same calls on a layer given its workspace and on one that takes it: the same bits.
  weave::local_world world(2);
  world.run([&](local& c) {
    const auto where = weave::placement::contiguous(decode_test::experts, 2);
    const auto given =
        decode_test::check_against_reference<Space, float>(c, where, {true, false, true});
    const auto taken = decode_test::check_against_reference<Space, float>(c, where, {true});
    REQUIRE(given.size() == taken.size());
    for (std::size_t call = 0; call < given.size(); ++call)
      CHECK(decode_test::bitwise_equal(given[call], taken[call]));
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
    o.max_tokens_per_rank = 16; // sizes every buffer, taken once at the first call
    weave::decode_exchange<weave::local_communicator, float> layer(
        comm, weave::placement::contiguous(experts, comm.size()), o);
    weave::host_stream stream("decode");
    auto h = layer.dispatch(in.x.elements(), in.ids, in.weights, stream); // one all-to-all
    stream.submit([&f, xs = h.experts(), H = o.hidden] { // runs once the dispatch arrived
      for (const std::int64_t l : xs.busy()) { // the slots with rows; xs.rows(l, source) per source
        const int slot = static_cast<int>(l);
        for (std::size_t r = 0; r * H < xs.input(slot).size(); ++r)
          f.apply(xs.expert(slot), xs.input(slot).data() + r * H, xs.output(slot).data() + r * H);
      }
    });
    layer.combine(h, std::span<float>(y), stream); // one all-to-all; y = sum_j w_j f_j(x)
    layer.synchronize(stream); // a failure on any rank throws here, on every rank
    //! [decode]
    CHECK(decode_test::bitwise_equal(
        y, decode_test::expected(in, o, f, weave::placement::contiguous(experts, comm.size()),
                                 comm.rank())));
  });
}

// The docs' example of the same layer in emulated_gpu_space, which runs cuda_space's control
// flow on host streams: the workspace given once, the experts queued after the dispatch reading
// the raw arrays as a GPU kernel would, one wait at the end.
TEST_CASE("decode_exchange example: a space's workspace and the experts on the raw arrays") {
  constexpr int experts = 8, k = 2;
  constexpr std::size_t hidden = 32;
  const moe_test::linear_experts f(experts, hidden, 3);
  weave::local_world world(2);
  world.run([&](local& comm) {
    std::mt19937 rng(static_cast<std::uint32_t>(comm.rank()));
    const auto in =
        moe_test::random_input<float>(comm.rank() == 0 ? 5 : 0, hidden, experts, k, rng);
    std::vector<float> y(in.x.rows() * hidden);
    //! [decode_workspace]
    weave::basic_decode_exchange<weave::emulated_gpu_space, weave::local_communicator, float> layer(
        comm, weave::placement::contiguous(experts, comm.size()), {k, hidden, 16});
    weave_test::aligned_buffer ws(layer.workspace_size()); // memory of the space, once
    weave::host_stream stream("decode");
    layer.initialize(ws.ptr, ws.size, stream);
    auto h = layer.dispatch(in.x.elements(), in.ids, in.weights, stream); // never waits
    stream.submit([&f, xs = h.experts()] { // on a GPU: kernels reading the arrays on the device
      const std::int64_t* busy = xs.busy_slots(); // the fed slots, their count at [L]
      const auto H = static_cast<std::int64_t>(xs.hidden());
      for (std::int64_t i = 0; i < busy[xs.local_experts()]; ++i) {
        const std::int64_t l = busy[i], first = xs.slot_first()[l];
        const std::byte* block = xs.input_blocks()[l]; // a peer's one row, where it arrived
        const float* input =
            block != nullptr ? reinterpret_cast<const float*>(block) : xs.input_pool() + first * H;
        for (std::int64_t r = 0; r < xs.slot_rows()[l]; ++r) // slot l: pool rows from `first`
          f.apply(xs.expert(static_cast<int>(l)), input + r * H,
                  xs.output_pool() + (first + r) * H);
      }
    });
    layer.combine(h, std::span<float>(y), stream);
    layer.synchronize(stream); // the one wait: this rank's failure, else a peer's
    //! [decode_workspace]
    CHECK(decode_test::bitwise_equal(
        y, decode_test::expected(in, {k, hidden, 16}, f,
                                 weave::placement::contiguous(experts, comm.size()), comm.rank())));
  });
}

TEST_CASE_TEMPLATE("a decode handle dropped without its combine aborts the world: the peer fails, "
                   "never hangs",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  weave::local_world world(2);
  std::vector<decode_test::outcome> got(2);
  world.run([&](local& c) {
    got[static_cast<std::size_t>(c.rank())] = decode_test::check_dropped_handle<Space>(c);
  });
  CHECK(got[0].message.empty()); // dropping is not an error of its own rank
  CHECK(got[1].code == weave::errc::peer_failure);
  CHECK(got[1].message.find("without its combine") != std::string::npos);
}

TEST_CASE_TEMPLATE("a decode layer destroyed between a dispatch and its combine aborts the world: "
                   "the peer fails at once, the handle goes stale",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  weave::local_world world(2); // the default timeout: 60 s
  std::vector<decode_test::outcome> got(2);
  bool stale = false;
  const auto start = std::chrono::steady_clock::now();
  world.run([&](local& c) {
    got[static_cast<std::size_t>(c.rank())] = decode_test::check_destroyed_layer<Space>(c, stale);
  });
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(5));
  CHECK(got[0].message.empty());
  CHECK(stale);
  CHECK(got[1].code == weave::errc::peer_failure);
  CHECK(got[1].message.find("destroyed between a dispatch and its combine") != std::string::npos);
}

TEST_CASE_TEMPLATE("FP8 decode equals the reference on brute-force quantised rows", C,
                   in_space<weave::host_space, float>, in_space<weave::host_space, weave::bfloat16>,
                   in_space<weave::emulated_gpu_space, float>,
                   in_space<weave::emulated_gpu_space, weave::bfloat16>) {
  using Space = typename C::space;
  using T = typename C::type;
  for (int ranks : {1, 2, 4})
    for (bool dequantized : {true, false})
      for (bool partial_sums : {true, false}) {
        CAPTURE(ranks);
        CAPTURE(dequantized);
        CAPTURE(partial_sums);
        weave::local_world world(ranks);
        world.run([&](local& c) {
          decode_test::check_fp8_decode<Space, T>(c, dequantized, {}, partial_sums);
        });
      }
}

// Hidden sizes that are not a multiple of 4: the wire rows keep their scales aligned (under
// UBSan a misaligned float access fails this test), the outputs equal the reference.
TEST_CASE_TEMPLATE("FP8 decode at hidden sizes that are not a multiple of 4", Space,
                   weave::host_space, weave::emulated_gpu_space) {
  for (const auto shape : {decode_test::fp8_shape{6, 3}, decode_test::fp8_shape{130, 2}})
    for (int ranks : {1, 2}) {
      CAPTURE(shape.hidden);
      CAPTURE(ranks);
      weave::local_world world(ranks);
      world.run([&](local& c) {
        decode_test::check_fp8_decode<Space, weave::bfloat16>(c, true, shape);
        decode_test::check_fp8_decode<Space, float>(c, false, shape);
      });
    }
}

TEST_CASE_TEMPLATE("FP8 decode: a NaN token on one rank fails the call on every rank", Space,
                   weave::host_space, weave::emulated_gpu_space) {
  for (int ranks : {2, 4}) {
    CAPTURE(ranks);
    weave::local_world world(ranks);
    world.run([&](local& c) { decode_test::check_fp8_nonfinite<Space>(c); });
  }
}

// A decode call issues nothing a CUDA graph capture refuses (host_capture.hpp): no host wait, no
// pageable copy (emulated_gpu_space), no allocation, no wait for an event recorded outside the
// capture. Eager, captured and eager calls give the naive reference's outputs (host streams run
// a captured call as it is issued).
TEST_CASE_TEMPLATE("decode calls pass the CUDA capture rules", Space, weave::host_space,
                   weave::emulated_gpu_space) {
  weave::local_world world(2);
  world.run([&](local& c) {
    const auto where = weave::placement::contiguous(decode_test::experts, 2);
    weave::host_stream s("decode");
    decode_test::initialized_layer<decode_test::exchange_in<Space, local, float>> layer(
        c, where, s, decode_test::options());
    const moe_test::linear_experts f(decode_test::experts, decode_test::hidden, 5);
    std::mt19937 rng(static_cast<std::uint32_t>(c.rank()) + 3);
    const auto in = moe_test::random_input<float>(decode_test::max_tokens, decode_test::hidden,
                                                  decode_test::experts, decode_test::k, rng);
    const auto want = decode_test::expected(in, decode_test::options(), f, where, c.rank());
    for (const bool captured : {false, true, false}) {
      CAPTURE(captured);
      std::vector<float> y(in.x.rows() * decode_test::hidden, -7.0f);
      if (captured)
        s.begin_capture();
      auto h = layer.ex.dispatch(in.x.elements(), in.ids, in.weights, s);
      s.submit([&f, xs = h.experts()] { decode_test::run_linear_experts(xs, f, false, 2); });
      layer.ex.combine(h, std::span<float>(y), s);
      if (captured)
        s.end_capture();
      layer.ex.synchronize(s);
      CHECK(decode_test::bitwise_equal(y, want));
    }
  });
}
