// The device decode exchange's test cases in host_space, written once for any host-stream
// communicator (the local_world test runs them on threads, the MPI test on processes). Every
// call is checked bitwise against the naive per-token reference and against the host
// decode_exchange on the same inputs (outputs and per-(slot, source) counts); each function is
// one rank's side.
#pragma once

#include "aligned_buffer.hpp"
#include "block_quant_reference.hpp"
#include "decode_cases.hpp"
#include "error_code.hpp"

#include <weave/exec/host_space.hpp>
#include <weave/overlap/device_decode_exchange.hpp>
#include <weave/routing/host_quant_moves.hpp>
#include <weave/routing/host_row_moves.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

namespace decode_test {

template <class Comm, class T>
using device_decode = weave::basic_device_decode_exchange<weave::host_space, Comm, T>;

// A device decode exchange with its workspace (which must outlive the calls' queued steps).
template <class Comm, class T>
struct device_layer {
  device_layer(Comm& comm, const weave::placement& where, weave::host_stream& s,
               weave::decode_options o = options())
      : ex(comm, where, o) {
    ws = std::make_unique<weave_test::aligned_buffer>(ex.workspace_size());
    // Memory of the space is not cleared: garbage that no step may read (an index read past
    // its array once found it).
    std::memset(ws->ptr, 0x5A, ws->size);
    ex.initialize(ws->ptr, ws->size, s);
  }
  std::unique_ptr<weave_test::aligned_buffer> ws; // declared first: destroyed after the layer
  device_decode<Comm, T> ex;
};

// One call: dispatch, the linear experts as a task reading the view (no host wait between the
// phases), combine, then check_errors (the one wait). `rows[l * D + s]` gets the counts.
template <class T, class Exchange>
std::vector<T> device_decode_call(Exchange& ex, const moe_test::rank_input<T>& in,
                                  const moe_test::linear_experts& f, weave::host_stream& s,
                                  std::vector<std::int64_t>* rows = nullptr,
                                  std::size_t extra_outputs = 0) {
  const std::size_t H = f.hidden;
  std::vector<T> y(in.x.rows() * H + extra_outputs, T(-7.0f));
  auto h = ex.dispatch(in.x.elements(), in.ids, in.weights, s);
  s.submit([&f, xs = h.experts(), rows, H] {
    for (int l = 0; l < xs.local_experts; ++l) {
      for (std::int64_t r = 0; r < xs.rows[l]; ++r)
        f.apply(xs.experts[static_cast<std::size_t>(l)], xs.input_of(l) + r * std::int64_t(H),
                xs.output_of(l) + r * std::int64_t(H));
      if (rows != nullptr)
        for (int src = 0; src < xs.sources; ++src)
          rows->push_back(xs.source_rows[l * xs.sources + src]);
    }
  });
  ex.combine(h, std::span<T>(y), s);
  ex.check_errors(s);
  return y;
}

// Several calls (zero tokens, full slots, sizes between, -1 ids): each output equals the naive
// reference (with `partial_sums`, its per-device form) and the host decode_exchange's bitwise,
// and so do the per-(slot, source) counts.
template <class T, class Comm>
void check_device_against_host(Comm& comm, const weave::placement& where,
                               bool partial_sums = false) {
  const int rank = comm.rank(), D = comm.size();
  const moe_test::linear_experts f(experts, hidden, 11);
  weave::host_stream s("device decode"), hs("host decode");
  weave::decode_options o = options();
  o.partial_sums = partial_sums;
  device_layer<Comm, T> dev(comm, where, s, o);
  weave::decode_exchange<Comm, T> host(comm, where, o);
  for (int call = 0; call < 4; ++call) {
    std::vector<moe_test::rank_input<T>> inputs;
    for (int r = 0; r < D; ++r) {
      std::mt19937 rng(static_cast<std::uint32_t>(100 * call + r));
      inputs.push_back(moe_test::random_input<T>(tokens_of(r, call), hidden, experts, k, rng));
    }
    const auto& in = inputs[static_cast<std::size_t>(rank)];
    std::vector<std::int64_t> rows, host_rows;
    const auto y = device_decode_call(dev.ex, in, f, s, &rows);
    CHECK(bitwise_equal(y, expected(in, o, f, where, rank)));
    CHECK(bitwise_equal(y, decode_call(host, in, f, hs, &host_rows)));
    CHECK(rows == host_rows);
    std::int64_t total = 0;
    for (int l = 0; l < where.slots_per_device(); ++l)
      for (int src = 0; src < D; ++src) {
        const std::int64_t got = rows[static_cast<std::size_t>(l * D + src)];
        total += got;
        if (!where.replicated())
          CHECK(got == pairs_for(inputs[static_cast<std::size_t>(src)].ids,
                                 where.expert_of_slot(rank * where.slots_per_device() + l)));
      }
    CHECK(total <= static_cast<std::int64_t>(max_tokens) * D * where.slots_per_device());
  }
}

// Three calls queued back to back and one check at the end: each output equals its reference.
template <class Comm>
void check_device_queued_calls(Comm& comm) {
  const moe_test::linear_experts f(experts, hidden, 9);
  weave::host_stream s("device decode");
  const auto where = weave::placement::contiguous(experts, comm.size());
  device_layer<Comm, float> dev(comm, where, s);
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
    auto h = dev.ex.dispatch(in.x.elements(), in.ids, in.weights, s);
    s.submit([&f, xs = h.experts()] {
      for (int l = 0; l < xs.local_experts; ++l)
        for (std::int64_t r = 0; r < xs.rows[l]; ++r)
          f.apply(xs.experts[static_cast<std::size_t>(l)],
                  xs.input_of(l) + r * static_cast<std::int64_t>(hidden),
                  xs.output_of(l) + r * static_cast<std::int64_t>(hidden));
    });
    dev.ex.combine(h, std::span<float>(ys[static_cast<std::size_t>(call)]), s);
  }
  dev.ex.check_errors(s);
  for (int call = 0; call < 3; ++call)
    CHECK(bitwise_equal(
        ys[static_cast<std::size_t>(call)],
        expected(inputs[static_cast<std::size_t>(call)], options(), f, where, comm.rank())));
}

// Rank `culprit` makes `bad`: check_errors throws `own` on it and peer_failure naming it (with
// `cause`) on every other rank; every rank's output is NaN (all-ones bytes), not numbers; then
// a good call succeeds everywhere.
template <class Comm>
void check_device_fail_stop(Comm& comm, int culprit, fault bad, weave::errc own,
                            const char* cause) {
  using T = float;
  const int rank = comm.rank();
  const moe_test::linear_experts f(experts, hidden, 5);
  weave::host_stream s("device decode");
  const auto where = weave::placement::contiguous(experts, comm.size());
  device_layer<Comm, T> dev(comm, where, s);
  const bool me = rank == culprit;
  const auto in = input_of(rank, me ? bad : fault::none);
  std::vector<T> y;
  const outcome got = outcome_of([&] {
    y = device_decode_call(dev.ex, in, f, s, nullptr,
                           me && bad == fault::wrong_output ? hidden : 0);
  });
  INFO("rank ", rank, ": ", got.message);
  if (me) {
    CHECK(got.code == own);
  } else {
    CHECK(got.code == weave::errc::peer_failure);
    CHECK(got.message.find("rank " + std::to_string(culprit)) != std::string::npos);
  }
  CHECK(got.message.find(cause) != std::string::npos);
  s.synchronize();
  CHECK(y.empty()); // the call threw: no output was handed out
  // The exchange and the communicator still work, and report nothing stale.
  std::mt19937 again(static_cast<std::uint32_t>(rank + 70));
  const auto good = moe_test::random_input<T>(3, hidden, experts, k, again);
  CHECK(bitwise_equal(device_decode_call(dev.ex, good, f, s),
                      expected(good, options(), f, where, rank)));
}

// A failed call's outputs are NaN on every rank (read after the combine, before the check).
template <class Comm>
void check_device_failed_outputs_are_nan(Comm& comm) {
  const moe_test::linear_experts f(experts, hidden, 5);
  weave::host_stream s("device decode");
  device_layer<Comm, float> dev(comm, weave::placement::contiguous(experts, comm.size()), s);
  std::mt19937 rng(static_cast<std::uint32_t>(comm.rank() + 17));
  auto in = moe_test::random_input<float>(5, hidden, experts, k, rng);
  if (comm.rank() == 0)
    in.ids[2] = -5;
  std::vector<float> y(in.x.rows() * hidden, 1.0f);
  auto h = dev.ex.dispatch(in.x.elements(), in.ids, in.weights, s);
  s.submit([xs = h.experts()] {
    for (int l = 0; l < xs.local_experts; ++l)
      CHECK(xs.rows[l] == 0); // a failed call hands the experts nothing
  });
  dev.ex.combine(h, std::span<float>(y), s);
  s.synchronize();
  CHECK(std::all_of(y.begin(), y.end(), [](float v) { return std::isnan(v); }));
  const outcome got = outcome_of([&] { dev.ex.check_errors(s); });
  CHECK(got.code == (comm.rank() == 0 ? weave::errc::out_of_range : weave::errc::peer_failure));
  CHECK_NOTHROW(dev.ex.check_errors(s)); // reported once
}

template <class Comm>
void check_device_every_fault(Comm& comm) {
  const int culprit = comm.size() - 1;
  using weave::errc;
  check_device_fail_stop(comm, culprit, fault::too_many_tokens, errc::invalid_argument,
                         "exceeds max_tokens_per_rank");
  check_device_fail_stop(comm, culprit, fault::bad_id, errc::out_of_range,
                         "expert id outside [-1, 8)");
  check_device_fail_stop(comm, culprit, fault::nan_weight, errc::invalid_argument,
                         "non-finite gate weight");
  check_device_fail_stop(comm, culprit, fault::duplicate_expert, errc::invalid_argument, "twice");
  check_device_fail_stop(comm, 0, fault::wrong_output, errc::size_mismatch, "an output of");
  check_device_failed_outputs_are_nan(comm);
}

} // namespace decode_test

namespace decode_test {

// The exchange of a test's layer: a device_layer's, or the object itself.
template <class Layer>
auto& exchange_of(Layer& layer) {
  if constexpr (requires { layer.ex; })
    return layer.ex;
  else
    return layer;
}

// Rank 0 drops its dispatched handle without the combine: that aborts the communicator, so
// rank 1, already in the combine, fails with the cause instead of waiting for ever. `make`
// makes one layer (host or device) on a stream; `finish` waits for a call and checks it.
template <class Comm, class Make, class Finish>
outcome check_dropped_handle(Comm& comm, Make&& make, Finish&& finish) {
  weave::host_stream s("decode");
  auto layer = make(comm, s);
  auto& ex = exchange_of(*layer);
  const auto in = input_of(comm.rank(), fault::none);
  std::vector<float> y(in.x.rows() * hidden);
  const outcome got = outcome_of([&] {
    auto h = ex.dispatch(in.x.elements(), in.ids, in.weights, s);
    if (comm.rank() == 0) {
      s.synchronize();
      h.reset(); // the peers wait in this call's combine: the world is aborted
      return;
    }
    ex.combine(h, std::span<float>(y), s);
    finish(ex, s);
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
template <class Comm, class Make, class Finish>
outcome check_destroyed_layer(Comm& comm, Make&& make, Finish&& finish, bool& stale) {
  weave::host_stream s("decode");
  auto layer = make(comm, s);
  auto& ex = exchange_of(*layer);
  using handle = typename std::remove_reference_t<decltype(ex)>::handle;
  const auto in = input_of(comm.rank(), fault::none);
  std::vector<float> y(in.x.rows() * hidden);
  handle h; // outlives the layer on rank 0
  const outcome got = outcome_of([&] {
    h = ex.dispatch(in.x.elements(), in.ids, in.weights, s);
    if (comm.rank() == 0) {
      layer.reset(); // waits for its queued work, aborts: its peers wait in the combine
      stale = weave_test::code_of([&] { (void)h.experts(); }) == weave::errc::invalid_state;
      return;
    }
    ex.combine(h, std::span<float>(y), s);
    finish(ex, s);
  });
  try {
    s.synchronize();
  } catch (const weave::error&) {
  }
  return got;
}

} // namespace decode_test

// --- FP8 dispatch in both decode exchanges --------------------------------------------------

namespace decode_test {

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

// Several calls of both decode exchanges with an FP8 dispatch: each output equals the naive
// reference on brute-force quantised-and-dequantised inputs and the other exchange's, bitwise;
// the dispatch sends about half the bytes of the combine (bf16 rows).
template <class T, class Comm>
void check_fp8_decode(Comm& comm, bool dequantized, fp8_shape shape = {},
                      bool partial_sums = true) {
  const int D = comm.size();
  const std::size_t H = shape.hidden;
  const moe_test::linear_experts f(experts, H, 13);
  const auto where = weave::placement::contiguous(experts, D);
  const auto o = fp8_options(dequantized, shape, partial_sums);
  weave::host_stream s("device decode"), hs("host decode");
  device_layer<Comm, T> dev(comm, where, s, o);
  weave::decode_exchange<Comm, T> host(comm, where, o);
  if (sizeof(T) == 2 && H == fp8_hidden) { // tiny rows are mostly padding
    // 2 bytes per element -> 1 byte and 4 bytes per 128: about half of what the same exchanges
    // dispatch unquantised (counts, headers, the device layout's choices and the gate weights of
    // partial sums, 4 bytes per (token, choice), stay as they are).
    weave::decode_options plain = o;
    plain.fp8_dispatch.reset();
    const device_decode<Comm, T> dev_plain(comm, where, plain);
    const weave::decode_exchange<Comm, T> host_plain(comm, where, plain);
    const double weights = o.partial_sums ? double(max_tokens * k * sizeof(float)) : 0.0;
    CHECK(host.dispatch_bytes_per_peer() <
          0.56 * double(host_plain.dispatch_bytes_per_peer()) + weights);
    CHECK(dev.ex.dispatch_bytes_per_peer() <
          0.56 * double(dev_plain.dispatch_bytes_per_peer()) + weights);
  }
  for (int call = 0; call < 3; ++call) {
    std::mt19937 rng(static_cast<std::uint32_t>(50 * call + comm.rank()));
    const auto in = moe_test::random_input<T>(tokens_of(comm.rank(), call), H, experts, k, rng);
    const auto want = expected(brute_force_dequantized(in, shape), o, f, where, comm.rank());
    std::vector<T> y_dev(in.x.rows() * H), y_host(y_dev.size());
    int misaligned = 0;
    auto h = dev.ex.dispatch(in.x.elements(), in.ids, in.weights, s);
    s.submit([&f, &misaligned, shape, H, xs = h.experts()] {
      const auto blocks = static_cast<std::int64_t>(H / shape.block);
      for (int l = 0; l < xs.local_experts; ++l)
        for (std::int64_t r = 0; r < xs.rows[l]; ++r)
          apply_fp8(f, xs.experts[static_cast<std::size_t>(l)],
                    xs.input == nullptr ? nullptr : xs.input_of(l) + r * H, xs.codes_of(l) + r * H,
                    xs.scales_of(l) + r * blocks, xs.output_of(l) + r * H, shape, misaligned);
    });
    dev.ex.combine(h, std::span<T>(y_dev), s);
    dev.ex.check_errors(s);
    auto hh = host.dispatch(in.x.elements(), in.ids, in.weights, hs);
    hs.synchronize();
    const auto xs = hh.experts();
    for (int l = 0; l < xs.local_experts(); ++l) {
      if (!dequantized)
        CHECK(outcome_of([&] { (void)xs.input(l); }).code == weave::errc::invalid_state);
      const auto codes = xs.input_codes(l);
      const auto scales = xs.input_scales(l);
      for (std::int64_t r = 0; r < xs.rows(l); ++r) {
        const auto i = static_cast<std::size_t>(r);
        apply_fp8(f, xs.expert(l), dequantized ? xs.input(l).data() + i * H : nullptr, codes.row(i),
                  reinterpret_cast<const float*>(scales.row(i)), xs.output(l).data() + i * H, shape,
                  misaligned);
      }
    }
    host.combine(hh, std::span<T>(y_host), hs);
    hs.synchronize();
    CHECK(misaligned == 0);
    CHECK(bitwise_equal(y_dev, want));
    CHECK(bitwise_equal(y_host, want));
  }
}

// A token holding a NaN on one rank fails the FP8 call on every rank (own invalid_argument,
// peers peer_failure naming the rank), in both exchanges; the next call works.
template <class Comm>
void check_fp8_nonfinite(Comm& comm) {
  const int culprit = comm.size() - 1;
  const bool me = comm.rank() == culprit;
  const moe_test::linear_experts f(experts, fp8_hidden, 3);
  const auto where = weave::placement::contiguous(experts, comm.size());
  weave::host_stream s("device decode"), hs("host decode");
  device_layer<Comm, float> dev(comm, where, s, fp8_options(true));
  weave::decode_exchange<Comm, float> host(comm, where, fp8_options(true));
  std::mt19937 rng(static_cast<std::uint32_t>(comm.rank() + 5));
  auto in = moe_test::random_input<float>(4, fp8_hidden, experts, k, rng);
  if (me)
    in.x(2, 200) = std::numeric_limits<float>::quiet_NaN();
  const auto ends = [&](const outcome& got) {
    INFO("rank ", comm.rank(), ": ", got.message);
    CHECK(got.code == (me ? weave::errc::invalid_argument : weave::errc::peer_failure));
    CHECK(got.message.find("NaN") != std::string::npos);
    if (!me)
      CHECK(got.message.find("rank " + std::to_string(culprit)) != std::string::npos);
  };
  ends(outcome_of([&] { (void)device_decode_call(dev.ex, in, f, s); }));
  ends(outcome_of([&] { (void)decode_call(host, in, f, hs); }));
  in.x(2, 200) = 1.0f;
  const auto want = expected(brute_force_dequantized(in), fp8_options(true), f, where, comm.rank());
  CHECK(bitwise_equal(device_decode_call(dev.ex, in, f, s), want));
  CHECK(bitwise_equal(decode_call(host, in, f, hs), want));
}

} // namespace decode_test
