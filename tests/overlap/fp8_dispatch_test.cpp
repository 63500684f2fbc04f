// The FP8 dispatch (`moe_options::fp8_dispatch`) of the MoE exchange over local_world, each case
// written once and run in host_space and in emulated_gpu_space (the CUDA path's control flow on
// host streams): every expert row's codes and scales equal the brute-force quantisation
// (tests/support/block_quant_reference.hpp) of the token a naive routing loop sends to that
// expert, bit for bit; dequantised rows equal the codes times their scales and lie within the FP8
// rounding bound of the original element; outputs equal the weighted sum of those rows to the
// rounding of the merges; chunking, the handle API and static shapes are bitwise neutral; at
// hidden sizes that are not a multiple of 4 every scale the exchange quantises into or reads is
// aligned for a float; forward and backward equal the plain exchange on pre-dequantised rows
// (itself checked against the dense reference); bad settings are typed errors at construction; a
// non-finite token travels as NaN, poisons only its own output and is reported on its rank.
#include <doctest/doctest.h>

#include "aligned_buffer.hpp"
#include "block_quant_reference.hpp"
#include "moe_test_support.hpp"

#include <weave/comm/local_world.hpp>
#include <weave/exec/emulated_gpu_space.hpp>
#include <weave/exec/host_space.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/overlap/moe_exchange.hpp>
#include <weave/routing/host_quant_moves.hpp>
#include <weave/routing/host_row_moves.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

using weave_test::aligned_buffer;

namespace {

// Scale rows whose address is not aligned for a float: a GPU faults on those
// (cudaErrorMisalignedAddress), x86 hides them.
std::atomic<int> misaligned_scales{0};

void check_scales(const weave::const_token_view& scales) {
  for (std::size_t i = 0; i < scales.rows(); ++i)
    if (reinterpret_cast<std::uintptr_t>(scales.row(i)) % alignof(float) != 0)
      ++misaligned_scales;
}

// `Base` (host_space or emulated_gpu_space) whose quantisation primitives count the scale rows
// they write or read that are not aligned for a float; everything else is `Base`'s.
template <class Base>
struct aligned_scales : Base {};

} // namespace

template <class Base>
struct weave::row_moves<aligned_scales<Base>> : weave::row_moves<Base> {};

template <class Base>
struct weave::quant_moves<aligned_scales<Base>> {
  using base = weave::quant_moves<Base>;
  static void quantize(weave::host_stream& s, weave::const_token_view src, weave::token_view dst,
                       weave::token_view scales, const std::int64_t* index,
                       const std::int64_t* count, const weave::block_quantization& q,
                       std::int64_t* status) {
    check_scales(scales);
    base::quantize(s, src, dst, scales, index, count, q, status);
  }
  static void dequantize(weave::host_stream& s, weave::const_token_view src,
                         weave::const_token_view scales, weave::token_view dst,
                         const std::int64_t* index, const std::int64_t* count,
                         const weave::block_quantization& q) {
    check_scales(scales);
    base::dequantize(s, src, scales, dst, index, count, q);
  }
};

namespace {

// The layer in `Space`, as users build it.
template <class Space>
using layer_in = weave::basic_moe_exchange<Space, weave::local_communicator>;
// The layer in `Space` with its scale rows checked for alignment (`aligned_scales`).
template <class Space>
using checked_layer = weave::basic_moe_exchange<aligned_scales<Space>, weave::local_communicator>;

// The caller's expert work `f(batch)` on every chunk of `h`, as `Space`'s contract says: on host
// streams a chunk's rows are read in a task of the compute stream (once the chunk was opened);
// where host code runs at enqueue time the batch is taken now and `f` enqueues its work on the
// batch's stream.
template <class Exchange, class F>
void each_chunk(Exchange& ex, typename Exchange::handle& h, weave::host_stream& compute,
                const F& f) {
  for (const auto chunk : ex.chunks(h)) {
    if constexpr (Exchange::space::runs_later)
      compute.submit([chunk, &f] { f(chunk.experts()); });
    else
      f(chunk.experts());
  }
}

// Machine epsilon and smallest positive (subnormal) value of the row types, for the output bound.
template <class T>
constexpr double epsilon_of() {
  if constexpr (std::is_same_v<T, float>)
    return 0x1p-23;
  else if constexpr (std::is_same_v<T, weave::bfloat16>)
    return 0x1p-7;
  else
    return 0x1p-10; // half
}
template <class T>
constexpr double smallest_of() {
  if constexpr (std::is_same_v<T, float>)
    return 0x1p-149;
  else if constexpr (std::is_same_v<T, weave::bfloat16>)
    return 0x1p-133;
  else
    return 0x1p-24; // half
}

struct fp8_case {
  int ranks = 2, experts = 8, k = 2;
  std::size_t hidden = 256;
  std::vector<std::size_t> tokens{23, 17};
  weave::dtype format = weave::dtype::e4m3;
  weave::block_quantization blocks{};
  bool dequantized = true;
  bool fixed = false; // static shapes
  std::uint32_t seed = 1;
};

// One expert row as the experts saw it: its expert and the (rank, token) it came from.
using seen_row = std::tuple<int, int, std::size_t>;

// Every token of every rank quantised by the brute-force reference, found by its bytes.
template <class T>
struct reference {
  const fp8_case& c;
  const std::vector<moe_test::rank_input<T>>& in;
  fp8_ref::table table;
  std::map<std::string, std::pair<int, std::size_t>> by_bytes; // codes + scales -> (rank, token)

  reference(const fp8_case& cs, const std::vector<moe_test::rank_input<T>>& inputs)
      : c(cs)
      , in(inputs)
      , table(cs.format == weave::dtype::e4m3 ? fp8_ref::e4m3 : fp8_ref::e5m2) {
    for (std::size_t r = 0; r < in.size(); ++r)
      for (std::size_t t = 0; t < in[r].x.rows(); ++t) {
        const auto q = fp8_ref::quantize_row(original(static_cast<int>(r), t).data(), c.hidden,
                                             c.blocks, table);
        by_bytes[key(q.codes.data(), q.scales.data())] = {static_cast<int>(r), t};
      }
  }
  std::vector<float> original(int r, std::size_t t) const {
    std::vector<float> x(c.hidden);
    for (std::size_t j = 0; j < c.hidden; ++j)
      x[j] = static_cast<float>(in[static_cast<std::size_t>(r)].x(t, j));
    return x;
  }
  std::string key(const void* codes, const void* scales) const {
    std::string k(static_cast<const char*>(codes), c.hidden);
    k.append(static_cast<const char*>(scales), c.hidden / c.blocks.block * sizeof(float));
    return k;
  }

  // (expert, rank, token) of every row the naive routing loop sends to `device`, sorted.
  std::vector<seen_row> routed_to(const weave::placement& where, int device) const {
    std::vector<seen_row> out;
    const auto k = static_cast<std::size_t>(c.k);
    for (std::size_t r = 0; r < in.size(); ++r)
      for (std::size_t t = 0; t < in[r].x.rows(); ++t)
        for (std::size_t j = 0; j < k; ++j) {
          const std::int32_t e = in[r].ids[t * k + j];
          if (e >= 0 && where.device_of_slot(where.slot_for(e, static_cast<std::int64_t>(t),
                                                            static_cast<int>(r))) == device)
            out.emplace_back(e, static_cast<int>(r), t);
        }
    std::sort(out.begin(), out.end());
    return out;
  }

  // Rows rank r sends: one per token and device its choices reach (dropless).
  std::int64_t sent_rows(const weave::placement& where, int r) const {
    const auto& mine = in[static_cast<std::size_t>(r)];
    const auto k = static_cast<std::size_t>(c.k);
    std::int64_t rows = 0;
    for (std::size_t t = 0; t < mine.x.rows(); ++t) {
      std::vector<int> devices;
      for (std::size_t j = 0; j < k; ++j)
        if (const std::int32_t e = mine.ids[t * k + j]; e >= 0)
          devices.push_back(
              where.device_of_slot(where.slot_for(e, static_cast<std::int64_t>(t), r)));
      std::sort(devices.begin(), devices.end());
      rows += std::unique(devices.begin(), devices.end()) - devices.begin();
    }
    return rows;
  }

  // Elements of rank r's output `y` that differ from the sum, over the token's choices, of the
  // weight times the row `visit` writes (its reference dequantisation in T) by more than the
  // merges' roundings: in f32 per addend and in T twice (on the expert device, then at home).
  int output_errors(int r, const weave::host_matrix<T>& y) const {
    const auto& mine = in[static_cast<std::size_t>(r)];
    const auto k = static_cast<std::size_t>(c.k);
    int errors = 0;
    for (std::size_t t = 0; t < mine.x.rows(); ++t) {
      double w = 0;
      for (std::size_t j = 0; j < k; ++j)
        w += mine.ids[t * k + j] >= 0 ? mine.weights[t * k + j] : 0.0;
      const auto x = original(r, t);
      const auto q = fp8_ref::quantize_row(x.data(), c.hidden, c.blocks, table);
      for (std::size_t j = 0; j < c.hidden; ++j) {
        const float scale = q.scales[j / c.blocks.block];
        const double row =
            static_cast<float>(T(static_cast<float>(fp8_ref::decode(table.f, q.codes[j])) * scale));
        const double want = w * row;
        const double bound =
            (2.0 * c.k + 4.0) * epsilon_of<T>() * std::fabs(want) + 4.0 * smallest_of<T>();
        if (!(std::fabs(static_cast<double>(static_cast<float>(y(t, j))) - want) <= bound))
          ++errors;
      }
    }
    return errors;
  }

  // Checks one chunk's expert rows against the reference, records where each came from, and
  // writes each row's dequantised value (by the reference) as the expert's output. Reads the
  // batch, so runs where its rows are ready (in stream order).
  template <class Batch>
  void visit(const Batch& b, std::vector<seen_row>& seen, std::mutex& m,
             std::atomic<int>& bad) const {
    for (std::size_t l = 0; l + 1 < b.expert_offsets.size(); ++l)
      for (auto i = b.expert_offsets[l]; i < b.expert_offsets[l + 1]; ++i) {
        const auto row = static_cast<std::size_t>(i);
        const auto* codes = reinterpret_cast<const std::uint8_t*>(b.input_codes.row(row));
        const auto* scales = reinterpret_cast<const float*>(b.input_scales.row(row));
        if (reinterpret_cast<std::uintptr_t>(scales) % alignof(float) != 0) {
          ++bad; // a GPU faults on a misaligned float
          continue;
        }
        const auto found = by_bytes.find(key(codes, scales));
        if (found == by_bytes.end()) {
          ++bad;
          continue;
        }
        const auto [r, t] = found->second;
        const auto x = original(r, t);
        T* out = reinterpret_cast<T*>(b.output.row(row));
        for (std::size_t j = 0; j < c.hidden; ++j) {
          const float scale = scales[j / c.blocks.block];
          const float want = static_cast<float>(fp8_ref::decode(table.f, codes[j])) * scale;
          out[j] = T(want);
          if (c.dequantized) {
            const T got = reinterpret_cast<const T*>(b.input.row(row))[j];
            if (std::memcmp(&got, &out[j], sizeof(T)) != 0)
              ++bad;
          }
          // The f32 dequantised value (of which the row holds T's rounding, checked above)
          // within the FP8 rounding bound of the original element: half an FP8 ulp at the
          // scaled magnitude times the scale, plus a few f32 roundings.
          const double scaled = std::fabs(static_cast<double>(x[j]) / scale);
          const double bound =
              0.5 * table.ulp(scaled) * scale + 8 * 0x1p-24 * (std::fabs(x[j]) + std::fabs(want));
          if (!(std::fabs(static_cast<double>(want) - x[j]) <= bound))
            ++bad;
        }
        if (!c.dequantized && b.input.rows() != 0)
          ++bad;
        const std::lock_guard lock(m);
        seen.emplace_back(b.experts[l], r, t);
      }
  }
};

weave::moe_options options_of(const fp8_case& c, weave::dtype element, int chunks) {
  weave::moe_options o;
  o.k = c.k;
  o.hidden = c.hidden;
  o.element = element;
  o.max_tokens = *std::max_element(c.tokens.begin(), c.tokens.end());
  o.chunks = chunks;
  o.fp8_dispatch = weave::fp8_dispatch_options{c.format, c.blocks, c.dequantized};
  o.static_shape = c.fixed;
  return o;
}

template <class T>
std::vector<moe_test::rank_input<T>> inputs_of(const fp8_case& c) {
  std::mt19937 rng(c.seed);
  std::vector<moe_test::rank_input<T>> in;
  for (int r = 0; r < c.ranks; ++r)
    in.push_back(moe_test::random_input<T>(c.tokens[static_cast<std::size_t>(r)], c.hidden,
                                           c.experts, c.k, rng));
  // Blocks of very different magnitudes, and small elements (FP8 subnormals after scaling).
  for (auto& rank : in)
    for (std::size_t t = 0; t < rank.x.rows(); ++t)
      for (std::size_t j = 0; j < c.hidden; ++j) {
        const int shift = static_cast<int>((t * 7 + j / c.blocks.block * 5) % 17) - 8;
        const float tiny = (t + j) % 11 == 0 ? 0x1p-9f : 1.0f;
        rank.x(t, j) = T(static_cast<float>(rank.x(t, j)) * std::ldexp(tiny, shift));
      }
  return in;
}

template <class T>
struct run_result {
  std::vector<weave::host_matrix<T>> y;
  std::vector<std::vector<seen_row>> seen; // per device, sorted
  std::vector<weave::moe_stats> stats;
  int bad = 0;
};

// One forward of every rank in `Space` with the callback form or with a handle and chunk
// iteration, on a workspace poisoned with 0xFF bytes (nothing may read what it did not write).
template <class T, class Space, bool Handles>
run_result<T> run(const fp8_case& c, const weave::placement& where, int chunks,
                  const std::vector<moe_test::rank_input<T>>& in, const reference<T>& ref) {
  weave::local_world world(c.ranks, {std::chrono::seconds(20), {}});
  const auto n = static_cast<std::size_t>(c.ranks);
  run_result<T> out{std::vector<weave::host_matrix<T>>(n), std::vector<std::vector<seen_row>>(n),
                    std::vector<weave::moe_stats>(n), 0};
  std::atomic<int> bad{0};
  std::vector<std::mutex> locks(n);
  world.run([&](weave::local_communicator& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    const weave::moe_options o = options_of(c, weave::dtype_of_v<T>, chunks);
    std::unique_ptr<aligned_buffer> ws; // outlives the streams' tasks, even on an error path
    weave::host_stream compute("compute"), comm_stream("comm");
    out.y[r] = weave::host_matrix<T>(in[r].x.rows(), c.hidden);
    checked_layer<Space> ex(comm, where, o);
    ws = std::make_unique<aligned_buffer>(ex.workspace_size());
    ex.initialize(ws->ptr, ws->size, compute);
    // The batch is read where its rows are ready: in the task the callback runs in on host
    // streams, in a task of its stream where host code runs at enqueue time.
    const auto experts = [&](const auto& b) {
      weave::host_space::enqueue(b.stream, [&, b] { ref.visit(b, out.seen[r], locks[r], bad); });
    };
    if constexpr (Handles) {
      auto h = ex.dispatch(in[r].x.view(), in[r].ids, in[r].weights, compute, comm_stream);
      each_chunk(ex, h, compute, experts);
      ex.combine(h, out.y[r].view(), compute, comm_stream);
      ex.synchronize(compute, comm_stream);
      out.stats[r] = ex.stats(h, compute);
    } else {
      ex.forward(in[r].x.view(), in[r].ids, in[r].weights, out.y[r].view(), experts, compute,
                 comm_stream);
      ex.synchronize(compute, comm_stream);
      out.stats[r] = ex.stats(compute);
    }
    std::sort(out.seen[r].begin(), out.seen[r].end());
  });
  out.bad = bad.load() + misaligned_scales.exchange(0);
  return out;
}

// Every mode in `Space` against the reference, and against the unchunked callback form bitwise.
template <class T, class Space>
void check_case(const fp8_case& c, const weave::placement& where) {
  const auto in = inputs_of<T>(c);
  const reference<T> ref(c, in);
  const auto want = run<T, Space, false>(c, where, 1, in, ref);
  for (int r = 0; r < c.ranks; ++r) {
    CAPTURE(r);
    CHECK(ref.output_errors(r, want.y[static_cast<std::size_t>(r)]) == 0);
  }
  const auto layout = weave::quantized_row_layout::of(c.hidden, c.blocks.block);
  const auto check = [&](const run_result<T>& got, const std::string& mode, int chunks) {
    CAPTURE(mode);
    CAPTURE(chunks);
    CHECK(got.bad == 0);
    for (std::size_t d = 0; d < static_cast<std::size_t>(c.ranks); ++d) {
      CAPTURE(d);
      CHECK(got.seen[d] == ref.routed_to(where, static_cast<int>(d)));
      REQUIRE(moe_test::bitwise_equal(got.y[d], want.y[d]));
      CHECK(got.stats[d].dispatch_row_bytes == layout.stride);
      CHECK(got.stats[d].row_bytes == c.hidden * sizeof(T));
      CHECK(got.stats[d].sent_rows == want.stats[d].sent_rows);
      CHECK(got.stats[d].sent_rows == ref.sent_rows(where, static_cast<int>(d)));
    }
  };
  check(want, "callback", 1);
  for (const int chunks : {1, 3}) {
    check(run<T, Space, false>(c, where, chunks, in, ref), "callback", chunks);
    check(run<T, Space, true>(c, where, chunks, in, ref), "handles", chunks);
    fp8_case fixed = c;
    fixed.fixed = true;
    check(run<T, Space, false>(fixed, where, chunks, in, ref), "static", chunks);
    check(run<T, Space, true>(fixed, where, chunks, in, ref), "static handles", chunks);
  }
}

} // namespace

TEST_CASE_TEMPLATE("fp8 dispatch: expert rows are the reference quantisation of the naively "
                   "routed tokens",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  for (const auto format : {weave::dtype::e4m3, weave::dtype::e5m2})
    for (const bool dequantized : {true, false}) {
      CAPTURE(format);
      CAPTURE(dequantized);
      fp8_case c;
      c.format = format;
      c.dequantized = dequantized;
      check_case<float, Space>(c, weave::placement::contiguous(8, 2));
      check_case<weave::bfloat16, Space>(c, weave::placement::contiguous(8, 2));
      c.ranks = 4;
      c.experts = 16;
      c.k = 4;
      c.hidden = 384;
      c.tokens = {19, 0, 11, 26};
      c.seed = 7;
      c.blocks.rounding = weave::scale_rounding::power_of_two;
      // Replicas: experts 0, 3, 5 and 12 on two devices, chosen per token as the exchange does.
      std::vector<std::int32_t> slots(20);
      for (int i = 0; i < 20; ++i)
        slots[static_cast<std::size_t>(i)] =
            i < 16 ? (i * 7) % 16 : std::array{3, 5, 12, 0}[i - 16];
      check_case<float, Space>(c, weave::placement(16, 4, slots));
      c.blocks = {64, weave::scale_rounding::exact, 1e-4f};
      check_case<weave::half, Space>(c, weave::placement::contiguous(16, 4));
    }
}

TEST_CASE_TEMPLATE("fp8 dispatch at hidden sizes that are not a multiple of 4: aligned scales, "
                   "same rows",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  const std::pair<std::size_t, std::size_t> shapes[] = {{6, 2}, {6, 3}, {130, 2}};
  for (const auto& shape : shapes) {
    // Plain variables, not a structured binding: CAPTURE's lambda cannot capture a binding
    // before C++20's P1091 (clang 16).
    const std::size_t hidden = shape.first, block = shape.second;
    CAPTURE(hidden);
    CAPTURE(block);
    fp8_case c;
    c.hidden = hidden;
    c.blocks.block = block;
    check_case<float, Space>(c, weave::placement::contiguous(8, 2));
    c.format = weave::dtype::e5m2;
    c.dequantized = false;
    check_case<weave::bfloat16, Space>(c, weave::placement::contiguous(8, 2));
  }
}

TEST_CASE_TEMPLATE("fp8 dispatch: bad settings are typed errors at construction", Space,
                   weave::host_space, weave::emulated_gpu_space) {
  weave::local_world world(2);
  world.run([&](weave::local_communicator& comm) {
    fp8_case c;
    const auto where = weave::placement::contiguous(8, 2);
    const auto code_of = [&](const weave::moe_options& o) {
      return moe_test::error_code_of([&] { layer_in<Space>{comm, where, o}; });
    };
    weave::moe_options o = options_of(c, weave::dtype::bf16, 1);
    CHECK(code_of(o) == weave::errc{});
    o.hidden = 200; // not a multiple of 128
    CHECK(code_of(o) == weave::errc::invalid_argument);
    o.hidden = 256;
    o.fp8_dispatch->blocks.block = 0;
    CHECK(code_of(o) == weave::errc::invalid_argument);
    o.fp8_dispatch->blocks.block = 128;
    o.fp8_dispatch->format = weave::dtype::bf16; // not an FP8 format
    CHECK(code_of(o) == weave::errc::invalid_argument);
    o.fp8_dispatch->format = weave::dtype::e5m2;
    o.fp8_dispatch->blocks.min_amax = 0.0f;
    CHECK(code_of(o) == weave::errc::invalid_argument);
    // What the senders quantise with must agree on every rank; dequantising on arrival need not.
    weave::moe_options mine = options_of(c, weave::dtype::bf16, 1);
    mine.fp8_dispatch->dequantized_inputs = comm.rank() == 1;
    CHECK(code_of(mine) == weave::errc{});
    if (comm.rank() == 1)
      mine.fp8_dispatch->blocks.block = 64;
    CHECK(code_of(mine) == weave::errc::config_mismatch);
    if (comm.rank() == 1)
      mine.fp8_dispatch.reset();
    CHECK(code_of(mine) == weave::errc::config_mismatch);
  });
}

// A token holding a NaN or an infinity, in every space as on the GPU: its blocks that hold one
// travel as NaN (scale and codes), so only its own output is poisoned; `synchronize` reports
// errc::invalid_argument on the sending rank, naming the token, and the peer's call succeeds. The
// failure travelled with no collective: the layer goes on, its next call equal to a clean one.
TEST_CASE_TEMPLATE("fp8 dispatch: a non-finite token is a typed error and poisons only its own "
                   "output",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  for (const float poison :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    CAPTURE(poison);
    fp8_case c;
    c.ranks = 2;
    c.tokens = {12, 12};
    const auto where = weave::placement::contiguous(8, 2);
    const auto clean_in = inputs_of<float>(c);
    const reference<float> ref(c, clean_in);
    const auto clean = run<float, Space, false>(c, where, 2, clean_in, ref);
    auto in = clean_in;
    in[0].x(5, 130) = poison;
    in[0].ids[10] = 6; // token 5's first choice: an expert of the other device
    in[0].ids[11] = -1;
    weave::local_world world(2, {std::chrono::seconds(20), {}});
    std::vector<weave::errc> codes(2);
    std::vector<std::string> messages(2);
    std::vector<char> usable(2); // not vector<bool>: each rank thread writes its own element
    std::vector<weave::host_matrix<float>> y(2), again(2);
    world.run([&](weave::local_communicator& comm) {
      const auto r = static_cast<std::size_t>(comm.rank());
      const weave::moe_options o = options_of(c, weave::dtype::f32, 2);
      weave::host_stream compute("compute"), comm_stream("comm");
      y[r] = weave::host_matrix<float>(12, c.hidden);
      again[r] = weave::host_matrix<float>(12, c.hidden);
      // Copies each input row to its output row (on the device: the capacity's rows, the unused
      // ones are not read), in stream order.
      const auto identity = [](const auto& b) {
        weave::host_space::enqueue(b.stream, [b] {
          for (std::size_t i = 0; i < b.input.rows(); ++i)
            std::memcpy(b.output.row(i), b.input.row(i), b.input.row_bytes());
        });
      };
      layer_in<Space> ex(comm, where, o);
      try {
        ex.forward(in[r].x.view(), in[r].ids, in[r].weights, y[r].view(), identity, compute,
                   comm_stream);
        ex.synchronize(compute, comm_stream);
      } catch (const weave::error& e) {
        codes[r] = e.code();
        messages[r] = e.what();
      }
      usable[r] = ex.usable();
      ex.forward(clean_in[r].x.view(), clean_in[r].ids, clean_in[r].weights, again[r].view(),
                 identity, compute, comm_stream);
      ex.synchronize(compute, comm_stream);
    });
    INFO("rank 0: ", messages[0]);
    CHECK(codes[0] == weave::errc::invalid_argument);
    CHECK(messages[0].find("token 5 ") != std::string::npos);
    CHECK(messages[0].find("NaN or an infinity") != std::string::npos);
    CHECK(codes[1] == weave::errc{});
    CHECK(usable == std::vector<char>{true, true});
    // The poisoned token's block is NaN on both of its devices' rows, the rest unchanged.
    for (std::size_t j = 0; j < c.hidden; ++j)
      CHECK(std::isnan(y[0](5, j)) == (j >= 128));
    for (std::size_t r = 0; r < 2; ++r) {
      for (std::size_t t = 0; t < 12; ++t) {
        if (r == 0 && t == 5)
          continue;
        CHECK(std::memcmp(y[r].row(t).data(), clean.y[r].row(t).data(), c.hidden * 4) == 0);
      }
      CHECK(moe_test::bitwise_equal(again[r], clean.y[r]));
    }
  }
}

namespace {

// The documentation's stand-in for an FP8 grouped GEMM: each expert is the identity on the
// dequantised rows.
void my_fp8_grouped_gemm(const weave::const_token_view& codes,
                         const weave::const_token_view& scales,
                         std::span<const std::int64_t> offsets, const weave::token_view& out) {
  const auto rows = static_cast<std::size_t>(offsets.back());
  weave::dequantize_rows(codes.subrows(0, rows), scales.subrows(0, rows), out.subrows(0, rows));
}

} // namespace

TEST_CASE("fp8 dispatch: the documented example sends e4m3 rows and combines in bf16") {
  constexpr std::size_t tokens = 40, hidden = 256;
  const auto where = weave::placement::contiguous(8, 2);
  std::mt19937 rng(11);
  std::vector<moe_test::rank_input<weave::bfloat16>> in;
  for (int r = 0; r < 2; ++r)
    in.push_back(moe_test::random_input<weave::bfloat16>(tokens, hidden, 8, 2, rng));
  std::vector<weave::host_matrix<weave::bfloat16>> out(2);
  weave::local_world world(2, {std::chrono::seconds(20), {}});
  world.run([&](weave::local_communicator& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    const auto& x = in[r].x;
    const auto& ids = in[r].ids;
    const auto& weights = in[r].weights;
    auto& y = out[r] = weave::host_matrix<weave::bfloat16>(tokens, hidden);
    weave::host_stream compute("compute"), comm_stream("comm");
    //! [fp8_dispatch]
    weave::moe_options o;
    o.k = 2;
    o.hidden = hidden; // a multiple of the block (128)
    o.element = weave::dtype::bf16;
    o.max_tokens = tokens;
    // DeepSeek-V3 / DeepEP: e4m3 codes and one f32 scale per 1 x 128 block of each token.
    o.fp8_dispatch = weave::fp8_dispatch_options{weave::dtype::e4m3};
    weave::moe_exchange<weave::local_communicator> layer(comm, where, o);

    auto h = layer.dispatch(x, ids, weights, compute, comm_stream);
    for (auto chunk : layer.chunks(h))
      compute.submit([chunk] {
        const weave::expert_batch b = chunk.experts();
        // b.input_codes: e4m3 rows; b.input_scales: hidden / 128 f32 scales per row.
        my_fp8_grouped_gemm(b.input_codes, b.input_scales, b.expert_offsets, b.output);
      });
    layer.combine(h, y, compute, comm_stream); // combine in bf16
    //! [fp8_dispatch]
    layer.synchronize(compute, comm_stream);
  });
  // Identity experts: y = sum of the weights of the token's choices times its rows dequantised.
  for (std::size_t r = 0; r < 2; ++r) {
    weave::host_matrix<weave::fp8_e4m3> codes(tokens, hidden);
    weave::host_matrix<float> scales(tokens, hidden / 128), back(tokens, hidden);
    weave::quantize_rows(in[r].x.view(), codes.view(), scales.view());
    weave::dequantize_rows(codes.view(), scales.view(), back.view());
    for (std::size_t t = 0; t < tokens; ++t) {
      float w = 0;
      for (std::size_t j = 0; j < 2; ++j)
        w += in[r].ids[t * 2 + j] >= 0 ? in[r].weights[t * 2 + j] : 0.0f;
      for (std::size_t c = 0; c < hidden; ++c)
        REQUIRE(static_cast<float>(out[r](t, c)) ==
                doctest::Approx(
                    static_cast<double>(static_cast<float>(weave::bfloat16(back(t, c)))) * w)
                    .epsilon(0.02)
                    .scale(1e-3));
    }
  }
}

namespace {

template <class T>
struct trained {
  weave::host_matrix<T> y, dx;
  weave::host_matrix<float> dw;
  weave::moe_stats stats;
};

// Forward and backward of every rank in `Space` (dL/dy = `dy`), the experts linear on `input`.
template <class T, class Space>
std::vector<trained<T>> forward_backward(const fp8_case& c, const weave::placement& where,
                                         int chunks, bool fp8,
                                         const std::vector<moe_test::rank_input<T>>& in,
                                         const std::vector<moe_test::rank_input<T>>& dy,
                                         const moe_test::linear_experts& lin) {
  weave::local_world world(c.ranks, {std::chrono::seconds(20), {}});
  std::vector<trained<T>> out(static_cast<std::size_t>(c.ranks));
  std::atomic<int> bad_saved{0};
  world.run([&](weave::local_communicator& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    weave::moe_options o = options_of(c, weave::dtype_of_v<T>, chunks);
    o.save_for_backward = true;
    if (!fp8)
      o.fp8_dispatch.reset();
    std::unique_ptr<aligned_buffer> ws;
    weave::host_stream compute("compute"), comm_stream("comm");
    weave::host_matrix<T> y(in[r].x.rows(), c.hidden), dx(in[r].x.rows(), c.hidden);
    weave::host_matrix<float> dw(in[r].x.rows(), static_cast<std::size_t>(c.k));
    checked_layer<Space> ex(comm, where, o);
    ws = std::make_unique<aligned_buffer>(ex.workspace_size());
    ex.initialize(ws->ptr, ws->size, compute);
    ex.forward(
        in[r].x.view(), in[r].ids, in[r].weights, y.view(),
        [&](const auto& b) { moe_test::run_experts<T>(lin, b); }, compute, comm_stream);
    ex.backward(
        dy[r].x.view(), dx.view(), dw.elements(),
        [&](const auto& b) {
          weave::host_space::enqueue(b.stream, [&, b] {
            // The saved codes and scales are the forward's: they dequantise to the saved input.
            const auto rows = static_cast<std::size_t>(b.expert_offsets.back());
            if (fp8) {
              weave::host_matrix<T> again(rows, c.hidden);
              weave::dequantize_rows(b.saved_codes.subrows(0, rows),
                                     b.saved_scales.subrows(0, rows), again.view(), c.blocks);
              if (rows > 0 &&
                  std::memcmp(again.data(), b.saved_input.row(0), rows * c.hidden * sizeof(T)) != 0)
                ++bad_saved;
            }
            lin.backward<T>(b);
          });
        },
        compute, comm_stream);
    ex.synchronize(compute, comm_stream);
    const weave::moe_stats stats = ex.stats(compute);
    out[r] = {std::move(y), std::move(dx), std::move(dw), stats};
  });
  CHECK(bad_saved.load() == 0);
  CHECK(misaligned_scales.exchange(0) == 0);
  return out;
}

// Elements of one rank's forward output `y` (rows `in`, experts `lin`) farther from the dense
// reference in double than the roundings in T allow: the experts' outputs and the two merges each
// round to T (half an ulp), relative to the sum of the magnitudes of the terms (the rows span
// 2^16 in scale, so an output can be far smaller than its terms).
template <class T>
int dense_forward_errors(const moe_test::rank_input<T>& in, int k,
                         const moe_test::linear_experts& lin, const weave::host_matrix<T>& y) {
  const auto kk = static_cast<std::size_t>(k);
  const std::size_t hidden = in.x.cols();
  int errors = 0;
  for (std::size_t t = 0; t < in.x.rows(); ++t)
    for (std::size_t o = 0; o < hidden; ++o) {
      double want = 0, magnitude = 0;
      for (std::size_t j = 0; j < kk; ++j) {
        const std::int32_t e = in.ids[t * kk + j];
        if (e < 0)
          continue;
        double fx = 0, spread = 0;
        for (std::size_t i = 0; i < hidden; ++i) {
          const double term = lin.at(e, o, i) * static_cast<double>(static_cast<float>(in.x(t, i)));
          fx += term;
          spread += std::fabs(term);
        }
        want += in.weights[t * kk + j] * fx;
        magnitude += in.weights[t * kk + j] * spread;
      }
      const double bound = 2.0 * epsilon_of<T>() * magnitude + 4.0 * smallest_of<T>();
      if (!(std::fabs(static_cast<double>(static_cast<float>(y(t, o))) - want) <= bound))
        ++errors;
    }
  return errors;
}

} // namespace

// With dequantised inputs, the experts see T(code * scale): exactly what the plain exchange
// delivers for rows quantised and dequantised beforehand. So forward and backward must equal
// the plain exchange run on those rows, bit for bit (the backward sends gradients in T); the
// plain exchange's forward equals the dense reference on those rows.
TEST_CASE_TEMPLATE("fp8 dispatch: forward and backward equal the plain exchange on "
                   "pre-dequantised rows",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  fp8_case c;
  c.ranks = 3;
  c.experts = 6;
  c.k = 2;
  c.tokens = {14, 9, 12};
  const auto where = weave::placement::contiguous(6, 3);
  const auto in = inputs_of<weave::bfloat16>(c);
  auto dequantized = in;
  for (auto& rank : dequantized) {
    weave::host_matrix<weave::fp8_e4m3> codes(rank.x.rows(), c.hidden);
    weave::host_matrix<float> scales(rank.x.rows(), c.hidden / 128);
    weave::quantize_rows(rank.x.view(), codes.view(), scales.view());
    weave::dequantize_rows(codes.view(), scales.view(), rank.x.view());
  }
  fp8_case grads = c;
  grads.seed = 99;
  const auto dy = inputs_of<weave::bfloat16>(grads);
  const moe_test::linear_experts lin(c.experts, c.hidden, 5);
  const auto want =
      forward_backward<weave::bfloat16, Space>(c, where, 1, false, dequantized, dy, lin);
  for (std::size_t r = 0; r < 3; ++r) {
    CAPTURE(r);
    CHECK(dense_forward_errors(dequantized[r], c.k, lin, want[r].y) == 0);
    CHECK(want[r].stats.routed_pairs == std::count_if(dequantized[r].ids.begin(),
                                                      dequantized[r].ids.end(),
                                                      [](std::int32_t e) { return e >= 0; }));
  }
  for (const int chunks : {1, 3}) {
    CAPTURE(chunks);
    const auto got = forward_backward<weave::bfloat16, Space>(c, where, chunks, true, in, dy, lin);
    for (std::size_t r = 0; r < 3; ++r) {
      CAPTURE(r);
      CHECK(moe_test::bitwise_equal(got[r].y, want[r].y));
      CHECK(moe_test::bitwise_equal(got[r].dx, want[r].dx));
      CHECK(moe_test::bitwise_equal(got[r].dw, want[r].dw));
    }
  }
}
