// The fault matrix, written once for every communicator (local_world threads, MPI processes),
// every execution space CI has (host streams; the CUDA path's control flow emulated on them) and
// both shapes (dynamic, static): one rank (the culprit) injects a fault; every rank must end the
// case with a typed error of the right code (the culprit its own, its peers a peer_error naming
// the culprit, its code and its message, or every rank the same config_mismatch), within 30 s
// although every timeout is 60 s (so nothing was left to a timeout), and no rank may return
// numbers. After a fault that every rank learnt at the same count exchange, the layer must still
// compute the dense reference; after one that aborted the communicator, it must report itself
// unusable and fail at once. Healthy cases (a rank with no tokens, "no expert" ids) must equal
// the reference.
#pragma once

#include "aligned_buffer.hpp"
#include "moe_test_support.hpp"

#include <weave/core/failure.hpp>
#include <weave/exec/emulated_gpu_space.hpp>
#include <weave/exec/host_space.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/overlap/moe_exchange.hpp>
#include <weave/placement/policies.hpp>
#include <weave/routing/host_quant_moves.hpp>
#include <weave/routing/host_row_moves.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace fault_matrix {

using namespace std::chrono_literals;

// Every communicator and world timeout of the suite: a case that needed one would exceed the
// 30 s every case must end in.
inline constexpr auto timeout = 60s;
inline constexpr auto deadline = 30s;

enum class fault {
  none,                   // healthy, with "no expert" (-1) ids
  zero_tokens,            // healthy, the culprit has no tokens
  placement,              // same experts and devices, another slot table
  expert_count,           // the culprit believes in half the experts (its ids stay in range)
  hidden,                 // another row size
  dtype,                  // another element type
  id_too_big,             // an expert id >= E
  id_below_minus_one,     // an expert id < -1
  nan_weight,             // a NaN gate weight
  duplicate_expert,       // one expert twice in a token's top-k
  too_many_tokens,        // more tokens than max_tokens
  wrong_id_count,         // ids for another token count
  backward_tokens,        // a backward of another token count
  throw_forward_experts,  // the expert callback throws in the forward
  throw_backward_experts, // the expert callback throws in the backward
};

inline const char* name(fault f) {
  static const char* names[] = {"none",
                                "zero_tokens",
                                "placement",
                                "expert_count",
                                "hidden",
                                "dtype",
                                "id_too_big",
                                "id_below_minus_one",
                                "nan_weight",
                                "duplicate_expert",
                                "too_many_tokens",
                                "wrong_id_count",
                                "backward_tokens",
                                "throw_forward_experts",
                                "throw_backward_experts"};
  return names[static_cast<int>(f)];
}

inline constexpr fault all_faults[] = {fault::none,
                                       fault::zero_tokens,
                                       fault::placement,
                                       fault::expert_count,
                                       fault::hidden,
                                       fault::dtype,
                                       fault::id_too_big,
                                       fault::id_below_minus_one,
                                       fault::nan_weight,
                                       fault::duplicate_expert,
                                       fault::too_many_tokens,
                                       fault::wrong_id_count,
                                       fault::backward_tokens,
                                       fault::throw_forward_experts,
                                       fault::throw_backward_experts};

// What a fault must end in.
struct expected {
  bool fails = true;
  bool config = false;    // every rank: config_mismatch naming `field`
  const char* field = ""; // the field the message names
  weave::errc code{};     // the culprit's code (its peers: peer_failure with this origin code)
  bool foreign = false;   // the culprit's error is its callback's own std::runtime_error
  bool in_band = false;   // every rank learnt it at a count exchange: the layer stays usable
};

inline expected expectation(fault f) {
  using weave::errc;
  switch (f) {
  case fault::none:
  case fault::zero_tokens:
    return {false};
  case fault::placement:
    return {true, true, "placement (slot -> expert table)"};
  case fault::expert_count:
    return {true, true, "experts"};
  case fault::hidden:
    return {true, true, "hidden"};
  case fault::dtype:
    return {true, true, "element type"};
  case fault::id_too_big:
  case fault::id_below_minus_one:
    return {true, false, "", errc::out_of_range, false, true};
  case fault::nan_weight:
  case fault::duplicate_expert:
    return {true, false, "", errc::invalid_argument, false, true};
  case fault::too_many_tokens:
    return {true, false, "", errc::invalid_argument, false, true};
  case fault::wrong_id_count:
    return {true, false, "", errc::size_mismatch, false, true};
  case fault::backward_tokens:
    return {true, false, "", errc::size_mismatch, false, false};
  case fault::throw_forward_experts:
  case fault::throw_backward_experts:
    return {true, false, "", errc::internal, true, false};
  }
  return {};
}

// The problem every rank builds: E = 4 experts per rank, k = 2, hidden 8, 24 tokens per rank
// (max_tokens), 3 chunks.
inline constexpr int experts_per_rank = 4, k = 2, chunks = 3;
inline constexpr std::size_t hidden = 8, tokens = 24;
inline const char* const exploded = "expert kernel exploded";

inline weave::moe_options options(bool fixed) {
  weave::moe_options o;
  o.k = k;
  o.hidden = hidden;
  o.max_tokens = tokens;
  o.chunks = chunks;
  o.save_for_backward = true;
  o.static_shape = fixed;
  return o;
}

// The layer under test, named for the messages.
template <class Space>
std::string layer_name(bool fixed) {
  return std::string(std::is_same_v<Space, weave::host_space> ? "host_space" : "emulated GPU") +
         (fixed ? ", static shapes" : ", dynamic shapes");
}

// One rank's layer in `Space`, given a workspace poisoned with 0xFF bytes (nothing may read what
// it did not write) before its first call. The workspace is declared first, so that it outlives
// the exchange (whose destructor waits for the work it queued); an aborted MPI layer is kept
// whole (see `run_case`).
template <class Space, class Comm>
struct layer {
  std::unique_ptr<weave_test::aligned_buffer> ws;
  weave::basic_moe_exchange<Space, Comm> ex;
  layer(Comm& comm, const weave::placement& where, const weave::moe_options& o)
      : ex(comm, where, o) {
    ws = std::make_unique<weave_test::aligned_buffer>(ex.workspace_size());
    weave::host_stream s("init");
    ex.initialize(ws->ptr, ws->size, s);
  }
};

// One rank's input: random distinct top-k ids over E experts (with -1 holes), the fault's
// poison on the culprit.
inline moe_test::rank_input<float> input_of(int rank, int ranks, fault f, bool culprit) {
  std::mt19937 rng(1000 + static_cast<unsigned>(rank));
  const std::size_t n = culprit && f == fault::zero_tokens ? 0 : tokens;
  auto in = moe_test::random_input<float>(n, hidden, experts_per_rank * ranks, k, rng);
  if (!culprit)
    return in;
  const int E = experts_per_rank * ranks;
  switch (f) {
  case fault::none:
    for (std::size_t i = 0; i < in.ids.size(); i += 3)
      in.ids[i] = -1; // many "no expert" choices
    break;
  case fault::id_too_big:
    in.ids[17] = E;
    break;
  case fault::id_below_minus_one:
    in.ids[17] = -2;
    break;
  case fault::nan_weight:
    in.weights[17] = std::numeric_limits<float>::quiet_NaN();
    break;
  case fault::duplicate_expert:
    in.ids[17] = in.ids[16] = (in.ids[16] >= 0 ? in.ids[16] : 0);
    break;
  default:
    break;
  }
  return in;
}

// How one rank's case ended.
struct outcome {
  bool failed = false;
  weave::errc code{};
  std::string message;
  std::optional<weave::failure_record> origin; // a peer_error's
  bool foreign = false;                        // not a weave::error
  std::chrono::duration<double> took{};
};

inline outcome outcome_of(const std::exception_ptr& e) {
  outcome o;
  if (!e)
    return o;
  o.failed = true;
  try {
    std::rethrow_exception(e);
  } catch (const weave::peer_error& p) {
    o.code = p.code();
    o.message = p.what();
    o.origin = p.origin();
  } catch (const weave::error& w) {
    o.code = w.code();
    o.message = w.what();
  } catch (const std::exception& x) {
    o.foreign = true;
    o.message = x.what();
  }
  return o;
}

// Ends the process if a case hangs: a hang must fail the suite, not stall it.
class watchdog {
 public:
  explicit watchdog(std::string what)
      : what_(std::move(what))
      , thread_([this] {
        const auto until = std::chrono::steady_clock::now() + 2 * timeout;
        while (!done_.load() && std::chrono::steady_clock::now() < until)
          std::this_thread::sleep_for(20ms);
        if (!done_.load()) {
          std::fprintf(stderr, "fault matrix: %s hung; giving up\n", what_.c_str());
          std::_Exit(3);
        }
      }) {}
  ~watchdog() {
    done_ = true;
    thread_.join();
  }

 private:
  std::string what_;
  std::atomic<bool> done_{false};
  std::thread thread_;
};

// Checks one rank's end of a case against the expectation.
inline void check(const outcome& o, fault f, int rank, int culprit) {
  const expected want = expectation(f);
  INFO("fault ", std::string(name(f)), ", rank ", rank, " (culprit ", culprit, "): ", o.message);
  CHECK(o.took < deadline);
  if (!want.fails) {
    CHECK_FALSE(o.failed);
    return;
  }
  REQUIRE(o.failed); // no rank may return numbers
  if (want.config) {
    CHECK(o.code == weave::errc::config_mismatch);
    CHECK(o.message.find(want.field) != std::string::npos);
    return;
  }
  if (rank == culprit) {
    CHECK(o.foreign == want.foreign);
    if (want.foreign)
      CHECK(o.message == exploded);
    else
      CHECK(o.code == want.code);
    return;
  }
  CHECK(o.code == weave::errc::peer_failure);
  REQUIRE(o.origin.has_value());
  CHECK(o.origin->rank == culprit);
  CHECK(o.origin->weave_error == !want.foreign);
  if (want.foreign)
    CHECK(o.origin->message == exploded);
  else
    CHECK(o.origin->code == want.code);
  CHECK(!o.origin->message.empty());
}

// One rank's part of a case: build the layer in `Space` (static shapes if `fixed`), run forward
// and backward with the fault, wait once, check the outcome, then check what the layer can still
// do. `Keep` holds what an aborted MPI layer must keep alive (see mpi_communicator): it gets the
// layer after an abort.
template <class Space, class Comm, class Keep>
void run_case(Comm& comm, fault f, int culprit, bool fixed, Keep&& keep) {
  const int rank = comm.rank(), ranks = comm.size();
  const bool me = rank == culprit;
  const int E = experts_per_rank * ranks;
  weave::moe_options o = options(fixed);
  weave::placement where = weave::placement::contiguous(E, ranks);
  if (me && f == fault::placement) // the same experts and devices, another slot table
    where = weave::place_round_robin(E, weave::topology::flat(ranks));
  if (me && f == fault::expert_count)
    where = weave::placement::contiguous(E / 2, ranks);
  if (me && f == fault::hidden)
    o.hidden = hidden / 2;
  if (me && f == fault::dtype)
    o.element = weave::dtype::bf16;
  const auto in = input_of(rank, ranks, f, me);
  const moe_test::linear_experts dense(E, hidden, 5);
  const auto start = std::chrono::steady_clock::now();
  std::exception_ptr failure;
  std::unique_ptr<layer<Space, Comm>> l;
  weave::host_stream compute("compute"), stream("comm");
  weave::host_matrix<float> y(in.x.rows(), hidden), dx(in.x.rows(), hidden);
  std::vector<float> dw(in.ids.size());
  // The callbacks throw themselves (in host_space in a task of the compute stream, in the
  // emulated GPU at enqueue time, as a CUDA caller's host code would); the experts' compute is a
  // step of the batch's stream.
  const auto forward_experts = [&dense, me, f](const weave::basic_expert_batch<Space>& b) {
    if (me && f == fault::throw_forward_experts && b.chunk == 1)
      throw std::runtime_error(exploded);
    moe_test::run_experts<float>(dense, b);
  };
  const auto backward_experts = [&dense, me, f](const weave::basic_expert_grad_batch<Space>& b) {
    if (me && f == fault::throw_backward_experts && b.chunk == 1)
      throw std::runtime_error(exploded);
    moe_test::run_experts<float>(dense, b);
  };
  const auto forward = [&](const moe_test::rank_input<float>& x, std::span<const std::int32_t> ids,
                           weave::host_matrix<float>& out) {
    l->ex.forward(x.x.view(), ids, x.weights, out.view(), forward_experts, compute, stream);
  };
  const auto backward = [&](weave::const_token_view dy, weave::host_matrix<float>& grad_x,
                            std::vector<float>& grad_w) {
    l->ex.backward(dy, grad_x.view(), grad_w, backward_experts, compute, stream);
  };
  // With static shapes where host code runs at enqueue time (the CUDA control flow), a forward
  // rejected at the culprit's call reaches its peers only through the flags `synchronize` reads
  // (no host reads the counts): they would go on to the backward, whose collectives the culprit
  // (its forward threw, so it has no backward to issue) never joins, and wait out their timeout.
  // So there every rank waits for the forward before it issues the backward, as such a caller
  // must.
  const bool wait_after_forward =
      !Space::runs_later && fixed && (f == fault::too_many_tokens || f == fault::wrong_id_count);
  try {
    l = std::make_unique<layer<Space, Comm>>(comm, where, o);
    try {
      auto ids = std::span<const std::int32_t>(in.ids);
      if (me && f == fault::wrong_id_count)
        ids = ids.first(ids.size() - 1);
      weave::host_matrix<float> many(tokens + 1, hidden), many_y(tokens + 1, hidden);
      if (me && f == fault::too_many_tokens) {
        std::vector<std::int32_t> more(in.ids);
        more.resize((tokens + 1) * k, 0);
        moe_test::rank_input<float> big{std::move(many), more, std::vector<float>(more.size(), 1)};
        forward(big, big.ids, many_y);
      } else {
        forward(in, ids, y);
      }
      if (wait_after_forward)
        l->ex.synchronize(compute, stream);
      if (me && f == fault::backward_tokens) {
        weave::host_matrix<float> fewer(in.x.rows() - 1, hidden);
        backward(fewer.view(), dx, dw);
      } else {
        backward(in.x.view(), dx, dw);
      }
    } catch (...) {
      failure = std::current_exception(); // thrown at the call: the streams still finish
    }
    try {
      l->ex.synchronize(compute, stream);
    } catch (...) {
      failure = failure ? failure : std::current_exception();
    }
  } catch (...) {
    failure = std::current_exception(); // the construction
  }
  outcome out = outcome_of(failure);
  out.took = std::chrono::steady_clock::now() - start;
  check(out, f, rank, culprit);
  const expected want = expectation(f);
  if (!want.fails) {
    moe_test::check_rank_against_dense(rank, where, k, E, {}, in, dense, y, &dx, &dw,
                                       l->ex.stats(compute), 1e-4);
    return;
  }
  if (!l)
    return;           // construction failed on every rank
  if (want.in_band) { // every rank stopped at the same exchange: the layer works on
    CHECK(l->ex.usable());
    const auto clean = input_of(rank, ranks, fault::none, false);
    weave::host_matrix<float> y2(clean.x.rows(), hidden), dx2(clean.x.rows(), hidden);
    std::vector<float> dw2(clean.ids.size());
    forward(clean, clean.ids, y2);
    backward(clean.x.view(), dx2, dw2);
    REQUIRE_NOTHROW(l->ex.synchronize(compute, stream));
    moe_test::check_rank_against_dense(rank, where, k, E, {}, clean, dense, y2, &dx2, &dw2,
                                       l->ex.stats(compute), 1e-4);
    return;
  }
  // The communicator was aborted: the layer says so, and a new call fails at once.
  CHECK_FALSE(l->ex.usable());
  const auto again = std::chrono::steady_clock::now();
  std::exception_ptr later;
  try {
    forward(in, in.ids, y);
  } catch (...) {
    later = std::current_exception();
  }
  try { // a call that threw may have enqueued work first (the emulated GPU's host code)
    l->ex.synchronize(compute, stream);
  } catch (...) {
    later = later ? later : std::current_exception();
  }
  CHECK(outcome_of(later).failed);
  CHECK(std::chrono::steady_clock::now() - again < deadline);
  keep(std::move(l));
}

} // namespace fault_matrix
