// Every header and token record of a decode message is checked, in every execution space
// (host_space, and emulated_gpu_space, which takes cuda_space's host-side path; both send one
// message per peer, its side table after its records' rows): a failed header fails the call with
// its sender's cause, and a header or record no sender writes is an `errc::protocol` error naming
// the sender, never rows read as valid, a NaN output without an error, or a peer left waiting.
// Rank 1 of a 2-rank local_world sends a header (or record) of its dispatch replaced through a
// corrupting communicator, to every rank or to rank 0 only. Also the messages' sizes: a header
// to itself, the dispatch's room to a peer, the combine's rows (exact on host streams).
#include "corrupting_communicator.hpp"
#include "decode_cases.hpp"

#include <weave/comm/local_world.hpp>
#include <weave/exec/emulated_gpu_space.hpp>
#include <weave/exec/host_space.hpp>
#include <weave/overlap/decode_exchange.hpp>

#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

using namespace std::chrono_literals;
using weave_test::corrupting_communicator;

namespace {

// How one rank's call ended.
struct ending {
  weave::errc code{};
  int origin = -2; // a peer_error's origin rank
  weave::errc origin_code{};
  std::string message;
};

template <class F>
ending ending_of(F&& f) {
  try {
    f();
  } catch (const weave::peer_error& e) {
    return {e.code(), e.origin().rank, e.origin().code, e.message()};
  } catch (const weave::error& e) {
    return {e.code(), -2, {}, e.message()};
  }
  return {};
}

// Rank 1's dispatch header to `dest` (-1: every rank, itself included) becomes `header`.
struct injection {
  int dest = -1;
  weave::decode_header header;
  std::function<void(std::span<std::byte>)> edit{}; // set: edits the message instead
};

// A rank's tokens: rank 1 routes rows to every slot of rank 0 (experts 0-3), so that a slot
// the injection empties on rank 0 returns fewer rows than rank 1 sent.
moe_test::rank_input<float> input_of(int rank) {
  const std::vector<std::int32_t> ids = rank == 1
                                            ? std::vector<std::int32_t>{0, 1, 2, 3, 4, 5, 1, 6, 7}
                                            : std::vector<std::int32_t>{4, 5, 6, 7, 0, 1};
  moe_test::rank_input<float> in{weave::host_matrix<float>(ids.size() / 3, decode_test::hidden),
                                 ids, std::vector<float>(ids.size(), 0.5f)};
  for (std::size_t i = 0; i < in.x.elements().size(); ++i)
    in.x.elements()[i] = 0.25f * static_cast<float>(i % 7) - 0.5f;
  return in;
}

const moe_test::linear_experts& experts_fn() {
  static const moe_test::linear_experts f(decode_test::experts, decode_test::hidden, 3);
  return f;
}

weave::placement where() {
  return weave::placement::contiguous(decode_test::experts, 2);
}

// Runs one call per rank of the decode exchange in `Space` on a 2-rank world whose rank 1
// sends `inj` (the header starts the message), the experts after a host wait or queued; a world
// timeout of `timeout`.
template <class Space>
std::vector<ending> run_injected(const injection& inj, decode_test::experts_wait wait,
                                 std::chrono::milliseconds timeout = 20s) {
  using exchange = decode_test::exchange_in<Space, corrupting_communicator, float>;
  weave::local_world world(2, {timeout, {}});
  std::vector<ending> got(2);
  world.run([&](weave::local_communicator& local) {
    const int r = local.rank();
    corrupting_communicator comm(local, {}, [&, r](int n, int dest, std::span<std::byte> bytes) {
      if (r == 1 && n == 0 && (inj.dest < 0 || dest == inj.dest)) {
        if (inj.edit)
          inj.edit(bytes);
        else
          std::memcpy(bytes.data(), &inj.header, sizeof inj.header);
      }
    });
    weave::host_stream s("decode");
    auto ex = std::make_unique<exchange>(comm, where(), decode_test::options());
    got[static_cast<std::size_t>(r)] = ending_of(
        [&] { (void)decode_test::decode_call(*ex, input_of(r), experts_fn(), s, nullptr, wait); });
    try {
      s.synchronize();
    } catch (const weave::error&) {
    }
  });
  return got;
}

weave::decode_header failed_header() {
  return weave::detail::failed_header(1, weave::errc::out_of_range, "injected: rank 1 failed");
}

// Headers no sender writes, each with the words its error names.
struct bad_header {
  const char* what;
  weave::decode_header header;
  const char* says;
};

std::vector<bad_header> bad_headers(std::uint32_t unknown_flag) {
  std::vector<bad_header> out;
  const auto ok = [] {
    weave::decode_header h;
    h.rows = 1;
    h.source = 1;
    return h;
  };
  weave::decode_header h = ok();
  h.status = static_cast<weave::decode_status>(7);
  out.push_back({"status 7", h, "status 7 (0: ok, 1: failed)"});
  h = ok();
  h.rows = static_cast<std::int64_t>(decode_test::max_tokens) + 1;
  out.push_back({"rows past the slot", h, "9 rows, outside [0, 8]"});
  h = ok();
  h.rows = -1;
  out.push_back({"negative rows", h, "-1 rows"});
  h = ok();
  h.source = 0;
  out.push_back({"another source", h, "source rank 0"});
  h = ok();
  h.code = 4;
  out.push_back({"a code in an ok header", h, "code 4 in a header of status ok"});
  h = failed_header();
  h.code = 99;
  out.push_back({"a code that is no errc", h, "code 99, which is no errc"});
  h = failed_header();
  h.rows = 3;
  out.push_back({"a failed header with rows", h, "a failed header of 3 rows"});
  h = failed_header();
  h.flags = static_cast<std::int32_t>(unknown_flag);
  out.push_back({"unknown flags", h, "flags"});
  h = failed_header();
  std::memset(h.cause, 'x', sizeof h.cause);
  out.push_back({"a cause without its zero byte", h, "a cause without its zero byte"});
  return out;
}

// Every rank fails the call with rank 1's cause.
void check_failed_everywhere(const std::vector<ending>& got) {
  for (const ending& e : got) {
    CHECK(e.code == weave::errc::peer_failure);
    CHECK(e.origin == 1);
    CHECK(e.origin_code == weave::errc::out_of_range);
    CHECK(e.message.find("injected: rank 1 failed") != std::string::npos);
  }
}

// Rank 0 names rank 1 and what is wrong with its header.
void check_refused(const ending& e, const char* exchange, const char* says) {
  CHECK(e.code == weave::errc::protocol);
  CHECK(e.message.find(std::string(exchange) + ": rank 1 sent a header no weave rank writes") == 0);
  CHECK(e.message.find(says) != std::string::npos);
}

} // namespace

// Both ways a test's experts wait for the dispatch.
constexpr decode_test::experts_wait waits[] = {decode_test::experts_wait::host,
                                               decode_test::experts_wait::queued};

TEST_CASE_TEMPLATE("decode_exchange: a failed header fails the call on every rank", Space,
                   weave::host_space, weave::emulated_gpu_space) {
  const auto started = std::chrono::steady_clock::now();
  for (const auto wait : waits) {
    CAPTURE(static_cast<int>(wait));
    check_failed_everywhere(run_injected<Space>({-1, failed_header()}, wait));
  }
  CHECK(std::chrono::steady_clock::now() - started < 10s);
}

TEST_CASE_TEMPLATE("decode_exchange: a failed header sent to some ranks only fails them with its "
                   "cause, and the others as each space can tell",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  // Rank 0 alone gets rank 1's failed header: it fails with the cause. A failed message to some
  // ranks only is trusted as every sender's failure is (with one message per peer a receiver
  // cannot tell it from one told to all), so rank 0 leaves the call: where host code runs at
  // enqueue time rank 0's combine still runs and returns none of the rows rank 1 sent
  // (size_mismatch at rank 1's check); on host streams rank 0's stream fails at the dispatch,
  // its combine never runs, and rank 1 waits for it until the world's timeout.
  const auto got = run_injected<Space>({0, failed_header()}, decode_test::experts_wait::host,
                                       Space::runs_later ? 3s : 20s);
  CHECK(got[0].code == weave::errc::peer_failure);
  CHECK(got[0].origin == 1);
  CHECK(got[0].message.find("injected: rank 1 failed") != std::string::npos);
  CHECK(got[1].code == (Space::runs_later ? weave::errc::timeout : weave::errc::size_mismatch));
}

// Rank 1's first token chooses experts 0, 1 and 2, all on rank 0 (local slots 0-2): its record
// there is the first, listing them at `side_at` bytes into the message. Each case replaces them:
// `run(inj)` runs an exchange, and `peer` checks how rank 1's call ended.
template <class Run, class Peer>
void check_bad_records(Run&& run, std::size_t side_at, Peer&& peer) {
  struct bad_choices {
    const char* what;
    std::vector<std::int32_t> choices;
    const char* says;
  };
  const std::vector<bad_choices> cases{
      {"no choice", {-1, -1, -1}, "choice 0: local slot -1"},
      {"a slot past the device's", {0, 4, -1}, "choice 1: local slot 4 of 4"},
      {"a negative slot", {0, -7, 2}, "choice 1: local slot -7"},
      {"a slot twice", {1, 2, 1}, "choice 2: local slot 1"},
      {"a choice after the end", {0, -1, 2}, "choice 2: local slot 2"},
  };
  const auto started = std::chrono::steady_clock::now();
  for (const bad_choices& bad : cases) {
    CAPTURE(bad.what);
    injection inj{0, {}, [&](std::span<std::byte> bytes) {
                    std::memcpy(bytes.data() + side_at, bad.choices.data(),
                                bad.choices.size() * sizeof(std::int32_t));
                  }};
    const auto got = run(inj);
    CHECK(got[0].code == weave::errc::protocol);
    CHECK(got[0].message.find(
              "decode_exchange: rank 1 sent a token record no weave rank writes (record 0") == 0);
    CHECK(got[0].message.find(bad.says) != std::string::npos);
    peer(got[1]);
  }
  // The same choices in another order, or fewer of them, are records a sender could write:
  // the call runs (and matches the reference in the other tests).
  injection fine{0, {}, [&](std::span<std::byte> bytes) {
                   const std::int32_t same[] = {2, 0, 1};
                   std::memcpy(bytes.data() + side_at, same, sizeof same);
                 }};
  const auto got = run(fine);
  CHECK(got[0].code == weave::errc{});
  CHECK(got[1].code == weave::errc{});
  CHECK(std::chrono::steady_clock::now() - started < 10s);
}

// How rank 1 ends when rank 0 refused its message: on host streams rank 0 aborts the world (its
// peers may not know), so rank 1 fails with a peer_error naming it; where host code runs at
// enqueue time rank 0's combine returns none of rank 1's rows (size_mismatch at rank 1's check).
template <class Space>
void check_refused_peer(const ending& e) {
  if constexpr (Space::runs_later) {
    CHECK(e.code == weave::errc::peer_failure);
    CHECK(e.origin == 0);
    CHECK(e.origin_code == weave::errc::protocol);
  } else {
    CHECK(e.code == weave::errc::size_mismatch);
  }
}

TEST_CASE_TEMPLATE("decode_exchange: a token record whose choices no sender writes is a protocol "
                   "error",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  // The side table follows the rows of the message's records (rows of hidden floats, a
  // multiple of 16 bytes): 3, every token of rank 1 has an expert on rank 0 (experts 0-3).
  const std::size_t side_at =
      sizeof(weave::decode_header) + 3 * decode_test::hidden * sizeof(float);
  for (const auto wait : waits) {
    CAPTURE(static_cast<int>(wait));
    check_bad_records([wait](const injection& inj) { return run_injected<Space>(inj, wait); },
                      side_at, check_refused_peer<Space>);
  }
}

TEST_CASE_TEMPLATE("decode_exchange: a header no sender writes is a protocol error naming the "
                   "sender",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  const auto started = std::chrono::steady_clock::now();
  // (Flag 1 is a failed dispatch plan's, which a failed header may carry.)
  for (const bad_header& bad : bad_headers(1u << 12))
    for (const auto wait : waits) {
      CAPTURE(bad.what);
      CAPTURE(static_cast<int>(wait));
      const auto got = run_injected<Space>({0, bad.header}, wait);
      check_refused(got[0], "decode_exchange", bad.says);
      check_refused_peer<Space>(got[1]);
    }
  CHECK(std::chrono::steady_clock::now() - started < 10s);
}

TEST_CASE("decode header checks accept every header the senders write") {
  // The failed headers senders write (a call refused with its cause, or the steps' flags), and
  // ok headers up to full.
  weave::decode_header flagged;
  flagged.status = weave::decode_status::failed;
  flagged.code = static_cast<std::int32_t>(weave::errc::out_of_range);
  flagged.flags = 1 | static_cast<std::int32_t>(weave::decode_nonfinite_flag);
  flagged.source = 2;
  const std::uint32_t known_flags = 7 | weave::decode_nonfinite_flag;
  CHECK(weave::detail::decode_header_fault_of(flagged, 2, 8, known_flags) ==
        weave::decode_header_fault::none);
  CHECK(weave::detail::decode_header_fault_of(flagged, 2, 8, 0) ==
        weave::decode_header_fault::flags);
  const auto refused = weave::detail::failed_header(2, weave::errc::size_mismatch,
                                                    std::string(300, 'c')); // cut to 103 bytes
  CHECK(weave::detail::decode_header_fault_of(refused, 2, 8, 0) ==
        weave::decode_header_fault::none);
  CHECK(weave::detail::decode_header_fault_of(
            weave::detail::failed_header(2, weave::errc::internal, ""), 2, 8, 0) ==
        weave::decode_header_fault::none);
  // A message with a zero byte inside, or a code that is no errc (a weave::error built from a
  // cast integer), is still written as a header every reader accepts.
  const auto odd = weave::detail::failed_header(2, static_cast<weave::errc>(99),
                                                std::string("before\0after", 12));
  CHECK(weave::detail::decode_header_fault_of(odd, 2, 8, 0) == weave::decode_header_fault::none);
  CHECK(odd.code == static_cast<std::int32_t>(weave::errc::internal));
  CHECK(std::string(odd.cause) == "before");
  for (const std::int64_t rows : {0, 1, 8}) {
    weave::decode_header ok;
    ok.rows = rows;
    ok.source = 2;
    CHECK(weave::detail::decode_header_fault_of(ok, 2, 8, 0) == weave::decode_header_fault::none);
  }
}

TEST_CASE_TEMPLATE("decode_exchange sends each token once per device and returns exactly its "
                   "rows",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  // Rank r's dispatch message to every other rank is sent whole here (the communicator has no
  // bounded all-to-all); its combine message to rank d holds one row per (token, expert) pair
  // rank d dispatched to rank r's experts, or per token with partial sums (the default), sent
  // exactly on host streams and whole (its room) where host code runs at enqueue time. Its
  // messages to itself are a header: the rows stay in the tokens and the expert pool.
  using exchange = decode_test::exchange_in<Space, corrupting_communicator, float>;
  for (const bool partial_sums : {false, true}) {
    CAPTURE(partial_sums);
    weave::decode_options o = decode_test::options();
    o.partial_sums = partial_sums;
    weave::local_world world(2, {20s, {}});
    std::vector<std::vector<std::size_t>> dispatch_sizes(2), combine_sizes(2);
    std::vector<std::size_t> fixed(2), combine_room(2);
    world.run([&](weave::local_communicator& local) {
      const auto r = static_cast<std::size_t>(local.rank());
      corrupting_communicator comm(local, {}, [&, r](int n, int, std::span<std::byte> bytes) {
        (n == 0 ? dispatch_sizes : combine_sizes)[r].push_back(bytes.size());
      });
      weave::host_stream s("decode");
      exchange ex(comm, where(), o);
      fixed[r] = ex.dispatch_bytes_per_peer();
      combine_room[r] = ex.combine_bytes_per_peer();
      // The workspace's size without building the layer agrees (4 local experts of 2 ranks).
      CHECK(ex.workspace_size() == exchange::workspace_size(2, 4, o));
      weave::decode_options fp8 = o;
      fp8.fp8_dispatch = weave::fp8_dispatch_options{weave::dtype::e4m3, {8}, true};
      fp8.max_tokens_per_rank = 5;
      CHECK(exchange(comm, where(), fp8).workspace_size() == exchange::workspace_size(2, 4, fp8));
      // Gathered inputs: no pool of input rows (a row pointer per pool row instead).
      weave::decode_options gathered = o;
      gathered.gathered_inputs = true;
      const std::size_t without_pool = exchange(comm, where(), gathered).workspace_size();
      CHECK(without_pool == exchange::workspace_size(2, 4, gathered));
      CHECK(without_pool < ex.workspace_size());
      (void)decode_test::decode_call(ex, input_of(local.rank()), experts_fn(), s);
    });
    const weave::placement w = where();
    for (std::size_t r = 0; r < 2; ++r) {
      CAPTURE(r);
      REQUIRE(dispatch_sizes[r].size() == 2);
      REQUIRE(combine_sizes[r].size() == 2);
      for (std::size_t d = 0; d < 2; ++d) {
        if (d == r) {
          CHECK(dispatch_sizes[r][d] == sizeof(weave::decode_header));
          CHECK(combine_sizes[r][d] == sizeof(weave::decode_header));
          continue;
        }
        CHECK(dispatch_sizes[r][d] == fixed[r]);
        // Pairs and tokens rank d routed to rank r's experts (unreplicated placement).
        const auto in = input_of(static_cast<int>(d));
        const auto K = static_cast<std::size_t>(decode_test::k);
        std::size_t pairs = 0, tokens = 0;
        for (std::size_t t = 0; t * K < in.ids.size(); ++t) {
          std::size_t here = 0;
          for (std::size_t j = 0; j < K; ++j)
            here += static_cast<std::size_t>(w.slot_for(in.ids[t * K + j], 0, static_cast<int>(d)) /
                                             w.slots_per_device()) == r;
          pairs += here;
          tokens += here > 0;
        }
        CHECK(combine_sizes[r][d] ==
              (Space::runs_later
                   ? sizeof(weave::decode_header) +
                         (partial_sums ? tokens : pairs) * decode_test::hidden * sizeof(float)
                   : combine_room[r]));
      }
    }
    // The fixed dispatch message: a header, max_tokens rows, min(k, 4) choices per token, and
    // with partial sums as many f32 weights; the combine's: a header and max_tokens rows, or
    // min(k, 4) rows per token per pair.
    CHECK(fixed[0] ==
          sizeof(weave::decode_header) +
              decode_test::max_tokens * decode_test::hidden * sizeof(float) +
              (partial_sums ? 2 : 1) * decode_test::max_tokens * 3 * sizeof(std::int32_t));
    CHECK(combine_room[0] ==
          sizeof(weave::decode_header) + (partial_sums ? 1 : 3) * decode_test::max_tokens *
                                             decode_test::hidden * sizeof(float));
  }
}
