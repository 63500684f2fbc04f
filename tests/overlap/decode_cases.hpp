// The decode exchange's test cases, each written once for every execution space CI runs on host
// streams (`host_space`; `emulated_gpu_space`, which takes cuda_space's host-side path) and for
// any communicator (the local_world test runs them on threads, the MPI test on processes). Each
// function is one rank's side and checks with doctest; every rank builds the same global problem
// from the seed. Outputs are checked bitwise against the naive references of
// decode_test_support.hpp, per-(slot, source) counts against the pairs counted from the ids.
#pragma once

#include "block_quant_reference.hpp"
#include "decode_test_support.hpp"
#include "error_code.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <future>
#include <limits>
#include <random>
#include <thread>
#include <type_traits>

namespace decode_test {

constexpr int experts = 8, k = 3;
constexpr std::size_t hidden = 16, max_tokens = 8;

inline weave::decode_options options() {
  weave::decode_options o;
  o.k = k;
  o.hidden = hidden;
  o.max_tokens_per_rank = max_tokens;
  return o;
}

// Tokens of `rank` in call `call`: zero, full slots (exactly max_tokens) and sizes between.
inline std::size_t tokens_of(int rank, int call) {
  constexpr std::size_t table[] = {0, max_tokens, 3, 1, max_tokens, 0, 5, 2};
  return table[static_cast<std::size_t>(rank + 3 * call) % 8];
}

// How `check_against_reference` builds and drives its layer.
struct reference_case {
  bool partial_sums = false;
  bool gathered_inputs = false;
  // Given its workspace by `initialize` (garbage bytes first), or taking it at the first call.
  bool initialize = false;
};

// Several calls on one exchange in `Space`, each equal bitwise to the naive reference (with
// `partial_sums`, its per-device form), with per-slot counts equal to the pairs each source
// routed to the slot's expert (unreplicated placements); the experts run after a host wait in
// even calls and as a task queued after the dispatch in odd ones. Returns every call's outputs
// and counts, in order.
template <class Space, class T, class Comm>
std::vector<std::vector<T>> check_against_reference(Comm& comm, const weave::placement& where,
                                                    reference_case how = {},
                                                    std::vector<std::int64_t>* all_rows = nullptr) {
  const int num_experts = where.num_experts(); // the routing's, the placement's count
  const int rank = comm.rank(), D = comm.size();
  const moe_test::linear_experts f(num_experts, hidden, 11);
  weave::decode_options o = options();
  o.partial_sums = how.partial_sums;
  o.gathered_inputs = how.gathered_inputs;
  using exchange = exchange_in<Space, Comm, T>;
  weave::host_stream s("decode");
  std::unique_ptr<initialized_layer<exchange>> given;
  std::unique_ptr<exchange> taken;
  if (how.initialize)
    given = std::make_unique<initialized_layer<exchange>>(comm, where, s, o);
  else
    taken = std::make_unique<exchange>(comm, where, o);
  exchange& ex = given ? given->ex : *taken;
  std::vector<std::vector<T>> ys;
  for (int call = 0; call < 4; ++call) {
    CAPTURE(call);
    std::vector<moe_test::rank_input<T>> inputs;
    for (int r = 0; r < D; ++r) {
      std::mt19937 rng(static_cast<std::uint32_t>(100 * call + r));
      inputs.push_back(moe_test::random_input<T>(tokens_of(r, call), hidden, num_experts, k, rng));
    }
    std::vector<std::int64_t> rows;
    const auto& in = inputs[static_cast<std::size_t>(rank)];
    ys.push_back(decode_call(ex, in, f, s, &rows,
                             call % 2 == 0 ? experts_wait::host : experts_wait::queued));
    CHECK(bitwise_equal(ys.back(), expected(in, o, f, where, rank)));
    REQUIRE(rows.size() == static_cast<std::size_t>(where.slots_per_device() * D));
    std::int64_t total = 0, expected_total = 0;
    for (int l = 0; l < where.slots_per_device(); ++l) {
      const int e = where.expert_of_slot(rank * where.slots_per_device() + l);
      for (int src = 0; src < D; ++src) {
        const std::int64_t got = rows[static_cast<std::size_t>(l * D + src)];
        total += got;
        if (!where.replicated())
          CHECK(got == pairs_for(inputs[static_cast<std::size_t>(src)].ids, e));
        else
          CHECK((got >= 0 && got <= static_cast<std::int64_t>(max_tokens)));
      }
    }
    for (int src = 0; src < D; ++src)
      for (int l = 0; l < where.slots_per_device(); ++l)
        expected_total +=
            where.replicated()
                ? 0
                : pairs_for(inputs[static_cast<std::size_t>(src)].ids,
                            where.expert_of_slot(rank * where.slots_per_device() + l));
    if (!where.replicated())
      CHECK(total == expected_total);
    CHECK(total <= static_cast<std::int64_t>(max_tokens) * D * where.slots_per_device());
    if (all_rows != nullptr)
      all_rows->insert(all_rows->end(), rows.begin(), rows.end());
  }
  return ys;
}

// Three calls enqueued back to back on one stream, the experts as tasks reading the view, and
// one wait at the end: each output equals its reference (a call's queued work never sees the
// next call's state).
template <class Space, class Comm>
void check_queued_calls(Comm& comm) {
  const moe_test::linear_experts f(experts, hidden, 9);
  const auto where = weave::placement::contiguous(experts, comm.size());
  exchange_in<Space, Comm, float> ex(comm, where, options());
  weave::host_stream s("decode");
  std::vector<moe_test::rank_input<float>> inputs;
  std::vector<std::vector<float>> ys;
  for (int call = 0; call < 3; ++call) {
    std::mt19937 rng(static_cast<std::uint32_t>(10 * comm.rank() + call));
    inputs.push_back(
        moe_test::random_input<float>(tokens_of(comm.rank(), call), hidden, experts, k, rng));
    ys.emplace_back(inputs.back().x.rows() * hidden);
  }
  for (int call = 0; call < 3; ++call) {
    const auto& in = inputs[static_cast<std::size_t>(call)];
    auto h = ex.dispatch(in.x.elements(), in.ids, in.weights, s);
    s.submit([&f, D = comm.size(), xs = h.experts()] { run_linear_experts(xs, f, false, D); });
    ex.combine(h, std::span<float>(ys[static_cast<std::size_t>(call)]), s);
  }
  ex.synchronize(s);
  for (int call = 0; call < 3; ++call)
    CHECK(bitwise_equal(
        ys[static_cast<std::size_t>(call)],
        expected(inputs[static_cast<std::size_t>(call)], options(), f, where, comm.rank())));
}

// A layer destroyed while its last call is still queued (behind a gated task) waits for that
// call: the combine's output is complete when the destructor returns. A call that ran on the
// calling thread first leaves nothing queued, so the layer records no event for it; the queued
// call's must still be recorded.
template <class Space, class Comm>
void check_destroyed_while_queued(Comm& comm) {
  const moe_test::linear_experts f(experts, hidden, 3);
  const auto where = weave::placement::contiguous(experts, comm.size());
  weave::host_stream s("decode"); // outlives the layer
  std::vector<moe_test::rank_input<float>> inputs;
  for (int call = 0; call < 2; ++call) {
    std::mt19937 rng(static_cast<std::uint32_t>(20 * comm.rank() + call));
    inputs.push_back(
        moe_test::random_input<float>(tokens_of(comm.rank(), call), hidden, experts, k, rng));
  }
  std::vector<float> queued_y(inputs[1].x.rows() * hidden, -7.0f);
  std::promise<void> gate;
  std::thread opener;
  {
    exchange_in<Space, Comm, float> ex(comm, where, options());
    CHECK(bitwise_equal(decode_call(ex, inputs[0], f, s),
                        expected(inputs[0], options(), f, where, comm.rank())));
    s.submit([opened = gate.get_future().share()] { opened.wait(); });
    auto h = ex.dispatch(inputs[1].x.elements(), inputs[1].ids, inputs[1].weights, s);
    s.submit([&f, D = comm.size(), xs = h.experts()] { run_linear_experts(xs, f, false, D); });
    ex.combine(h, std::span<float>(queued_y), s);
    CHECK_FALSE(s.query()); // still queued behind the gate
    opener = std::thread([&gate] {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      gate.set_value();
    });
  } // waits for the queued call
  CHECK(bitwise_equal(queued_y, expected(inputs[1], options(), f, where, comm.rank())));
  opener.join();
  s.synchronize();
}

// Layers called inside the caller's own claim of the stream (`claim_if_idle`, held across a
// whole layer) join it: every step, the all-to-alls (small, on a communicator that runs them
// inline) and the experts run on the calling thread, so the output is complete before the
// claim ends. A step sent to the worker would not run until then (the worker starts nothing
// while the stream is held). The workspace is given before (its upload is queued; the stream
// is drained so that the claim finds it idle).
template <class Space, class Comm>
void check_inside_a_claim(Comm& comm) {
  const moe_test::linear_experts f(experts, hidden, 9);
  const auto where = weave::placement::contiguous(experts, comm.size());
  weave::host_stream s("decode");
  initialized_layer<exchange_in<Space, Comm, float>> layer(comm, where, s, options());
  s.synchronize();
  for (int call = 0; call < 3; ++call) {
    std::mt19937 rng(static_cast<std::uint32_t>(40 * comm.rank() + call));
    const auto in =
        moe_test::random_input<float>(tokens_of(comm.rank(), call), hidden, experts, k, rng);
    std::vector<float> y(in.x.rows() * hidden, -7.0f);
    {
      const auto claim = s.claim_if_idle();
      REQUIRE(static_cast<bool>(claim));
      auto h = layer.ex.dispatch(in.x.elements(), in.ids, in.weights, s);
      weave::run_inline_or_submit(
          s, [&f, D = comm.size(), xs = h.experts()] { run_linear_experts(xs, f, false, D); });
      layer.ex.combine(h, std::span<float>(y), s);
      CHECK(claim.all_ran_here());
      CHECK(bitwise_equal(y, expected(in, options(), f, where, comm.rank()))); // done here
    }
    layer.ex.synchronize(s);
  }
}

// How `bad` corrupts one rank's call.
enum class fault { none, too_many_tokens, bad_id, nan_weight, duplicate_expert, wrong_output };

// Rank `rank`'s input of a fail-stop case (4 tokens), with the fault `bad` put in it.
inline moe_test::rank_input<float> input_of(int rank, fault bad) {
  std::mt19937 rng(static_cast<std::uint32_t>(rank + 7));
  auto in = moe_test::random_input<float>(bad == fault::too_many_tokens ? max_tokens + 1 : 4,
                                          hidden, experts, k, rng);
  if (bad == fault::bad_id)
    in.ids[5] = experts;
  if (bad == fault::nan_weight) {
    in.ids[4] = 2;
    in.weights[4] = std::numeric_limits<float>::quiet_NaN();
  }
  if (bad == fault::duplicate_expert) {
    in.ids[3] = 1;
    in.ids[4] = 1;
  }
  return in;
}

// Rank `culprit` makes `bad` in its call (the experts after a host wait, or queued): the call
// throws `own` on it and peer_failure naming it on every other rank, all with `cause` in the
// message, at the exchange's one wait (on host streams the stream fails at the dispatch, on
// every rank); no output is handed out. Then a good call succeeds on every rank (nobody hangs,
// nothing is left half done, nothing stale is reported).
template <class Space, class Comm>
void check_fail_stop(Comm& comm, int culprit, fault bad, weave::errc own, const char* cause,
                     experts_wait wait) {
  using T = float;
  const int rank = comm.rank();
  const moe_test::linear_experts f(experts, hidden, 5);
  const auto where = weave::placement::contiguous(experts, comm.size());
  exchange_in<Space, Comm, T> ex(comm, where, options());
  weave::host_stream s("decode");
  const bool me = rank == culprit;
  const auto in = input_of(rank, me ? bad : fault::none);
  std::vector<T> y;
  const outcome got = outcome_of([&] {
    y = decode_call(ex, in, f, s, nullptr, wait, me && bad == fault::wrong_output ? hidden : 0);
  });
  INFO("rank ", rank, ": ", got.message);
  if (me) {
    CHECK(got.code == own);
  } else {
    CHECK(got.code == weave::errc::peer_failure);
    CHECK(got.message.find("rank " + std::to_string(culprit)) != std::string::npos);
  }
  CHECK(got.message.find(cause) != std::string::npos);
  CHECK(y.empty()); // the call threw: no output was handed out
  CHECK_NOTHROW(s.synchronize());
  std::mt19937 again(static_cast<std::uint32_t>(rank + 70));
  const auto good = moe_test::random_input<T>(3, hidden, experts, k, again);
  CHECK(bitwise_equal(decode_call(ex, good, f, s), expected(good, options(), f, where, rank)));
}

// A failed call's outputs hold no numbers: where host code runs at enqueue time the combine
// writes all-ones bytes (NaN) on every rank, read after the combine before the wait; on host
// streams the stream fails at the dispatch, so the combine never writes. The experts get no
// rows. The one wait reports it (rank 0 its own out_of_range, the peers peer_failure), once.
template <class Space, class Comm>
void check_failed_outputs(Comm& comm) {
  weave::host_stream s("decode");
  exchange_in<Space, Comm, float> ex(comm, weave::placement::contiguous(experts, comm.size()),
                                     options());
  std::mt19937 rng(static_cast<std::uint32_t>(comm.rank() + 17));
  auto in = moe_test::random_input<float>(5, hidden, experts, k, rng);
  if (comm.rank() == 0)
    in.ids[2] = -5;
  std::vector<float> y(in.x.rows() * hidden, 1.0f);
  auto h = ex.dispatch(in.x.elements(), in.ids, in.weights, s);
  s.submit([xs = h.experts()] {
    for (int l = 0; l < xs.local_experts(); ++l)
      CHECK(xs.rows(l) == 0); // a failed call hands the experts nothing
    CHECK(xs.busy().empty());
  });
  ex.combine(h, std::span<float>(y), s);
  const outcome stream = outcome_of([&] { s.synchronize(); });
  const outcome got = Space::runs_later ? stream : outcome_of([&] { ex.synchronize(s); });
  INFO("rank ", comm.rank(), ": ", got.message);
  CHECK(got.code == (comm.rank() == 0 ? weave::errc::out_of_range : weave::errc::peer_failure));
  if constexpr (Space::runs_later)
    CHECK(std::all_of(y.begin(), y.end(), [](float v) { return v == 1.0f; }));
  else
    CHECK(std::all_of(y.begin(), y.end(), [](float v) { return std::isnan(v); }));
  CHECK_NOTHROW(ex.synchronize(s)); // reported once
}

template <class Space, class Comm>
void check_every_fault(Comm& comm) {
  const int culprit = comm.size() - 1;
  using weave::errc;
  // On host streams the culprit's own check names the pair; where host code runs at enqueue
  // time the steps flag it, and the peers rebuild the message from the flags.
  constexpr bool host = Space::runs_later;
  for (const auto wait : {experts_wait::host, experts_wait::queued}) {
    CAPTURE(static_cast<int>(wait));
    check_fail_stop<Space>(comm, culprit, fault::too_many_tokens, errc::invalid_argument,
                           "exceeds max_tokens_per_rank", wait);
    check_fail_stop<Space>(comm, culprit, fault::bad_id, errc::out_of_range,
                           host ? "expert id 8" : "expert id outside [-1, 8)", wait);
    check_fail_stop<Space>(comm, culprit, fault::nan_weight, errc::invalid_argument,
                           host ? "weight nan" : "non-finite gate weight", wait);
    check_fail_stop<Space>(comm, culprit, fault::duplicate_expert, errc::invalid_argument, "twice",
                           wait);
    check_fail_stop<Space>(comm, 0, fault::wrong_output, errc::size_mismatch, "an output of", wait);
  }
  check_failed_outputs<Space>(comm);
}

// Rank 0 drops its dispatched handle without the combine: that aborts the communicator, so
// rank 1, already in the combine, fails with the cause instead of waiting for ever.
template <class Space, class Comm>
outcome check_dropped_handle(Comm& comm) {
  weave::host_stream s("decode");
  auto ex = std::make_unique<exchange_in<Space, Comm, float>>(
      comm, weave::placement::contiguous(experts, comm.size()), options());
  const auto in = input_of(comm.rank(), fault::none);
  std::vector<float> y(in.x.rows() * hidden);
  const outcome got = outcome_of([&] {
    auto h = ex->dispatch(in.x.elements(), in.ids, in.weights, s);
    if (comm.rank() == 0) {
      s.synchronize();
      h.reset(); // the peers wait in this call's combine: the world is aborted
      return;
    }
    ex->combine(h, std::span<float>(y), s);
    ex->synchronize(s);
  });
  try {
    s.synchronize(); // nothing queued outlives the layer
  } catch (const weave::error&) {
  }
  return got;
}

// Rank 0 destroys its layer between a dispatch and its combine, the handle outliving it (it
// goes stale: using it throws, dropping it does nothing); the destruction aborts the
// communicator, so rank 1, in the combine, fails with the cause at once.
template <class Space, class Comm>
outcome check_destroyed_layer(Comm& comm, bool& stale) {
  using exchange = exchange_in<Space, Comm, float>;
  weave::host_stream s("decode");
  auto ex = std::make_unique<exchange>(comm, weave::placement::contiguous(experts, comm.size()),
                                       options());
  const auto in = input_of(comm.rank(), fault::none);
  std::vector<float> y(in.x.rows() * hidden);
  typename exchange::handle h; // outlives the layer on rank 0
  const outcome got = outcome_of([&] {
    h = ex->dispatch(in.x.elements(), in.ids, in.weights, s);
    if (comm.rank() == 0) {
      ex.reset(); // waits for its queued work, aborts: its peers wait in the combine
      stale = weave_test::code_of([&] { (void)h.experts(); }) == weave::errc::invalid_state;
      return;
    }
    ex->combine(h, std::span<float>(y), s);
    ex->synchronize(s);
  });
  try {
    s.synchronize();
  } catch (const weave::error&) {
  }
  return got;
}

// The same calls through the exchange in host_space and in emulated_gpu_space, one after the
// other on one communicator: outputs and per-(slot, source) counts bitwise equal (the serial
// steps of host streams and the GPU's per-index steps compute one function), each equal to the
// naive reference.
template <class T, class Comm>
void check_spaces_agree(Comm& comm, const weave::placement& where, reference_case how) {
  std::vector<std::int64_t> host_rows, emulated_rows;
  const auto host = check_against_reference<weave::host_space, T>(comm, where, how, &host_rows);
  const auto emulated =
      check_against_reference<weave::emulated_gpu_space, T>(comm, where, how, &emulated_rows);
  REQUIRE(host.size() == emulated.size());
  for (std::size_t call = 0; call < host.size(); ++call)
    CHECK(bitwise_equal(host[call], emulated[call]));
  CHECK(host_rows == emulated_rows);
}

// --- FP8 dispatch ---------------------------------------------------------------------------

constexpr std::size_t fp8_hidden = 256; // two blocks of 128

// Row length and block of an FP8 case (the default: two blocks of 128).
struct fp8_shape {
  std::size_t hidden = fp8_hidden, block = 128;
};

inline weave::decode_options fp8_options(bool dequantized, fp8_shape shape = {},
                                         bool partial_sums = true) {
  weave::decode_options o = options();
  o.partial_sums = partial_sums;
  o.hidden = shape.hidden;
  o.fp8_dispatch = weave::fp8_dispatch_options{
      weave::dtype::e4m3, {shape.block, weave::scale_rounding::exact, 1e-4f}, dequantized};
  return o;
}

// `in` with every row replaced by its brute-force quantisation (block_quant_reference.hpp),
// dequantised: T(decode(code) * scale), what the experts must compute on.
template <class T>
moe_test::rank_input<T> brute_force_dequantized(moe_test::rank_input<T> in, fp8_shape shape = {}) {
  const fp8_ref::table table(fp8_ref::e4m3);
  const weave::block_quantization q{shape.block, weave::scale_rounding::exact, 1e-4f};
  std::vector<float> row(shape.hidden);
  for (std::size_t t = 0; t < in.x.rows(); ++t) {
    for (std::size_t j = 0; j < shape.hidden; ++j)
      row[j] = static_cast<float>(in.x(t, j));
    const auto ref = fp8_ref::quantize_row(row.data(), shape.hidden, q, table);
    for (std::size_t j = 0; j < shape.hidden; ++j)
      in.x(t, j) =
          T(static_cast<float>(fp8_ref::decode(table.f, ref.codes[j])) * ref.scales[j / q.block]);
  }
  return in;
}

// The experts on one FP8 row: from its dequantised input, or (codes only) by decoding its codes
// and scales here with the brute-force decoder. Counts in `misaligned` a scales pointer a GPU
// could not load a float from.
template <class T>
void apply_fp8(const moe_test::linear_experts& f, int e, const T* input, const std::byte* codes,
               const float* scales, T* out, fp8_shape shape, int& misaligned) {
  if (reinterpret_cast<std::uintptr_t>(scales) % alignof(float) != 0)
    ++misaligned;
  if (input != nullptr)
    return f.apply(e, input, out);
  const fp8_ref::table table(fp8_ref::e4m3);
  std::vector<T> x(shape.hidden);
  for (std::size_t j = 0; j < shape.hidden; ++j)
    x[j] = T(static_cast<float>(fp8_ref::decode(table.f, static_cast<std::uint8_t>(codes[j]))) *
             scales[j / shape.block]);
  f.apply(e, x.data(), out);
}

// Several calls with an FP8 dispatch in `Space`, the experts queued after the dispatch: each
// output equals the naive reference on brute-force quantised-and-dequantised inputs, bitwise;
// the experts read the codes and scales (and the dequantised rows, or refused without them);
// the dispatch sends about half the bytes of an unquantised one (bf16 rows).
template <class Space, class T, class Comm>
void check_fp8_decode(Comm& comm, bool dequantized, fp8_shape shape = {},
                      bool partial_sums = true) {
  const int D = comm.size();
  const std::size_t H = shape.hidden;
  const moe_test::linear_experts f(experts, H, 13);
  const auto where = weave::placement::contiguous(experts, D);
  const auto o = fp8_options(dequantized, shape, partial_sums);
  weave::host_stream s("decode");
  initialized_layer<exchange_in<Space, Comm, T>> layer(comm, where, s, o);
  if (sizeof(T) == 2 && H == fp8_hidden) { // tiny rows are mostly padding
    // 2 bytes per element -> 1 byte and 4 bytes per 128: about half of what the same exchange
    // dispatches unquantised (headers, the records' choices and the gate weights of partial
    // sums, 4 bytes per (token, choice), stay as they are).
    weave::decode_options plain = o;
    plain.fp8_dispatch.reset();
    const exchange_in<Space, Comm, T> unquantised(comm, where, plain);
    const double weights = o.partial_sums ? double(max_tokens * k * sizeof(float)) : 0.0;
    CHECK(layer.ex.dispatch_bytes_per_peer() <
          0.56 * double(unquantised.dispatch_bytes_per_peer()) + weights);
  }
  for (int call = 0; call < 3; ++call) {
    CAPTURE(call);
    std::mt19937 rng(static_cast<std::uint32_t>(50 * call + comm.rank()));
    const auto in = moe_test::random_input<T>(tokens_of(comm.rank(), call), H, experts, k, rng);
    const auto want = expected(brute_force_dequantized(in, shape), o, f, where, comm.rank());
    std::vector<T> y(in.x.rows() * H);
    int misaligned = 0;
    auto h = layer.ex.dispatch(in.x.elements(), in.ids, in.weights, s);
    s.submit([&f, &misaligned, shape, H, dequantized, xs = h.experts()] {
      CHECK((xs.input_pool() == nullptr) == !dequantized);
      for (int l = 0; l < xs.local_experts(); ++l) {
        if (!dequantized)
          CHECK(outcome_of([&] { (void)xs.input(l); }).code == weave::errc::invalid_state);
        const auto codes = xs.input_codes(l);
        const auto scales = xs.input_scales(l);
        CHECK(codes.rows() == static_cast<std::size_t>(xs.rows(l)));
        CHECK(scales.rows() == static_cast<std::size_t>(xs.rows(l)));
        for (std::int64_t r = 0; r < xs.rows(l) && static_cast<std::size_t>(r) < codes.rows();
             ++r) {
          const auto i = static_cast<std::size_t>(r);
          apply_fp8(f, xs.expert(l), dequantized ? xs.input(l).data() + i * H : nullptr,
                    codes.row(i), reinterpret_cast<const float*>(scales.row(i)),
                    xs.output(l).data() + i * H, shape, misaligned);
        }
      }
    });
    layer.ex.combine(h, std::span<T>(y), s);
    layer.ex.synchronize(s);
    CHECK(misaligned == 0);
    CHECK(bitwise_equal(y, want));
  }
}

// A token holding a NaN on one rank fails the FP8 call on every rank (own invalid_argument,
// peers peer_failure naming the rank); the next call works.
template <class Space, class Comm>
void check_fp8_nonfinite(Comm& comm) {
  const int culprit = comm.size() - 1;
  const bool me = comm.rank() == culprit;
  const moe_test::linear_experts f(experts, fp8_hidden, 3);
  const auto where = weave::placement::contiguous(experts, comm.size());
  weave::host_stream s("decode");
  exchange_in<Space, Comm, float> ex(comm, where, fp8_options(true));
  std::mt19937 rng(static_cast<std::uint32_t>(comm.rank() + 5));
  auto in = moe_test::random_input<float>(4, fp8_hidden, experts, k, rng);
  if (me)
    in.x(2, 200) = std::numeric_limits<float>::quiet_NaN();
  for (const auto wait : {experts_wait::host, experts_wait::queued}) {
    const outcome got = outcome_of([&] { (void)decode_call(ex, in, f, s, nullptr, wait); });
    INFO("rank ", comm.rank(), ": ", got.message);
    CHECK(got.code == (me ? weave::errc::invalid_argument : weave::errc::peer_failure));
    CHECK(got.message.find("NaN") != std::string::npos);
    if (!me)
      CHECK(got.message.find("rank " + std::to_string(culprit)) != std::string::npos);
    CHECK_NOTHROW(s.synchronize());
  }
  in.x(2, 200) = 1.0f;
  const auto want = expected(brute_force_dequantized(in), fp8_options(true), f, where, comm.rank());
  CHECK(bitwise_equal(decode_call(ex, in, f, s), want));
}

} // namespace decode_test
