// cuda_moe_exchange on one GPU: several ranks through cuda_local_world and one rank through NCCL,
// against the dense double-precision reference and the same layer on host streams (forward
// outputs and input gradients bitwise, gate gradients to rounding: the device sums a row's
// products in warp order), every chunking bitwise identical to one chunk, dynamic and static
// shapes, a static-shape layer captured in a CUDA graph and replayed, and flagged bad input.
// Reports skipped without a GPU.
#include <doctest/doctest.h>

#include "cuda_buffers.hpp"
#include "moe_test_support.hpp"

#include <weave/comm/cuda_local_world.hpp>
#include <weave/comm/local_world.hpp>
#include <weave/comm/nccl_communicator.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/overlap/cuda_exchange.cuh>
#include <weave/overlap/cuda_pipeline_timing.hpp>
#include <weave/overlap/moe_exchange.hpp>

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

using weave_test::dev;
using weave_test::stream_holder;
using weave_test::to_host;

namespace {

// Expert "scale by 2" over every row of the batch's capacity (a capturable kernel).
struct double_rows {
  const float* in;
  float* out;
  __host__ __device__ void operator()(std::int64_t i) const { out[i] = 2.0f * in[i]; }
};

// Token t's output element h under experts y = 2x with k = 2: its kept choices' weights times
// 2 x, summed in choice order (what one rank's exchange computes, bitwise).
float doubled_output(const moe_test::rank_input<float>& in, std::size_t t, std::size_t h) {
  float acc = 0.0f;
  for (std::size_t j = 0; j < 2; ++j)
    if (in.ids[t * 2 + j] >= 0)
      acc = acc + in.weights[t * 2 + j] * (2.0f * in.x(t, h));
  return acc;
}

template <class T>
struct cuda_type {
  using type = T;
};
template <>
struct cuda_type<weave::bfloat16> {
  using type = __nv_bfloat16;
};

// Linear experts y = W_e x on the device, one thread per (EPD row, output), the row's sum in
// input order with one rounding per step: the host linear_experts' arithmetic exactly.
template <class T>
__global__ void linear_kernel(const std::byte* in, std::byte* out, std::size_t stride,
                              const std::int64_t* offsets, int L, const std::int32_t* experts,
                              const float* w, int H, std::int64_t capacity, bool transpose) {
  using U = typename cuda_type<T>::type;
  const std::int64_t rows = offsets[L] < capacity ? offsets[L] : capacity;
  const std::int64_t n = rows * H;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = i / H;
    const int o = static_cast<int>(i % H);
    int l = 0;
    while (l + 1 < L && offsets[l + 1] <= r)
      ++l;
    const float* W = w + static_cast<std::size_t>(experts[l]) * H * H;
    const U* x = reinterpret_cast<const U*>(in + static_cast<std::size_t>(r) * stride);
    float acc = 0.0f;
    for (int j = 0; j < H; ++j)
      acc = __fadd_rn(
          acc, __fmul_rn(transpose ? W[j * H + o] : W[o * H + j], weave::detail::cuda_load(x[j])));
    reinterpret_cast<U*>(out + static_cast<std::size_t>(r) * stride)[o] =
        weave::detail::cuda_store<U>(acc);
  }
}

template <class T>
void run_linear(weave::cuda_stream_ref s, const weave::const_token_view& in,
                const weave::token_view& out, std::span<const std::int64_t> offsets,
                const std::int32_t* experts, const float* w, int H, bool transpose) {
  const auto L = static_cast<int>(offsets.size()) - 1;
  linear_kernel<T><<<256, 256, 0, s.get()>>>(in.data(), out.data(), in.row_stride(), offsets.data(),
                                             L, experts, w, H, static_cast<std::int64_t>(in.rows()),
                                             transpose);
  WEAVE_CUDA_CHECK(cudaGetLastError());
}

struct rank_output {
  std::vector<std::byte> y, dx;
  std::vector<float> dw;
  weave::moe_stats stats{};
};

template <class T>
std::vector<std::byte> bytes_of(const weave::host_matrix<T>& m) {
  std::vector<std::byte> out(m.rows() * m.cols() * sizeof(T));
  if (!out.empty())
    std::memcpy(out.data(), m.data(), out.size());
  return out;
}

// One rank's layer on the GPU over `comm`: inputs uploaded, forward and backward, outputs back.
template <class T, class Comm>
rank_output run_rank(Comm& comm, const weave::placement& where, weave::moe_options o,
                     const moe_test::rank_input<T>& in, const moe_test::linear_experts& experts) {
  stream_holder compute, comm_stream;
  const std::size_t T_ = in.x.rows(), H = o.hidden;
  dev<T> x(std::vector<T>(in.x.elements().begin(), in.x.elements().end()));
  dev<T> y(T_ * H), dx(T_ * H);
  dev<std::int32_t> ids(in.ids);
  dev<float> weights(in.weights), dw(in.ids.size()), w(experts.w);
  weave::cuda_moe_exchange<Comm> ex(comm, where, o);
  dev<std::byte> ws(ex.workspace_size());
  ex.initialize(ws.ptr, ws.size, compute.ref());
  const auto view = [H](dev<T>& b, std::size_t rows) {
    return weave::token_view(reinterpret_cast<std::byte*>(b.ptr), rows, H, weave::dtype_of_v<T>,
                             weave::memory_space::device, 0);
  };
  // The logical expert of each local slot, for the expert kernel to read on the device.
  const int spd = where.slots_per_device();
  std::vector<std::int32_t> held(static_cast<std::size_t>(spd));
  for (int l = 0; l < spd; ++l)
    held[static_cast<std::size_t>(l)] = where.expert_of_slot(comm.rank() * spd + l);
  dev<std::int32_t> held_d(held);
  ex.forward(
      weave::const_token_view(view(x, T_)), ids.cspan(), weights.cspan(), view(y, T_),
      [&](const weave::cuda_expert_batch& b) {
        run_linear<T>(b.stream, b.input, b.output, b.expert_offsets, held_d.ptr, w.ptr,
                      static_cast<int>(H), false);
      },
      compute.ref(), comm_stream.ref());
  ex.backward(
      weave::const_token_view(view(x, T_)), view(dx, T_), dw.span(), // dL/dy = x
      [&](const weave::cuda_expert_grad_batch& b) {
        run_linear<T>(b.stream, b.grad_output, b.grad_input, b.expert_offsets, held_d.ptr, w.ptr,
                      static_cast<int>(H), true);
      },
      compute.ref(), comm_stream.ref());
  compute.ref().synchronize();
  comm_stream.ref().synchronize();
  ex.check_errors(compute.ref());
  // The backward's stages, timed by the pipeline's events.
  const weave::pipeline_timing timing = weave::measure(ex.pipeline());
  CHECK(timing.makespan_ms > 0);
  CHECK(timing.compute_busy_ms > 0);
  CHECK(timing.makespan_ms >= timing.compute_busy_ms * 0.999);
  rank_output out;
  const auto yh = to_host(y.cspan()), dxh = to_host(dx.cspan());
  out.y.resize(yh.size() * sizeof(T));
  out.dx.resize(dxh.size() * sizeof(T));
  if (!yh.empty()) {
    std::memcpy(out.y.data(), yh.data(), out.y.size());
    std::memcpy(out.dx.data(), dxh.data(), out.dx.size());
  }
  out.dw = to_host(dw.cspan());
  out.stats = ex.stats(compute.ref());
  return out;
}

// The same layer on host streams (`moe_exchange`, host_space) on the same problem.
template <class T>
std::vector<rank_output> run_host(int ranks, const weave::placement& where, weave::moe_options o,
                                  const std::vector<moe_test::rank_input<T>>& in,
                                  const moe_test::linear_experts& experts) {
  o.static_shape = false;
  std::vector<rank_output> out(static_cast<std::size_t>(ranks));
  weave::local_world world(ranks);
  world.run([&](weave::local_communicator& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    weave::host_matrix<T> y(in[r].x.rows(), o.hidden), dx(in[r].x.rows(), o.hidden);
    out[r].dw.assign(in[r].ids.size(), 0.0f);
    weave::moe_exchange<weave::local_communicator> ex(comm, where, o);
    weave::host_stream compute("compute"), comm_stream("comm");
    ex.forward(
        in[r].x.view(), in[r].ids, in[r].weights, y.view(),
        [&](const weave::expert_batch& b) { experts.template operator()<T>(b); }, compute,
        comm_stream);
    ex.backward(
        in[r].x.view(), dx.view(), out[r].dw,
        [&](const weave::expert_grad_batch& b) { experts.template backward<T>(b); }, compute,
        comm_stream);
    ex.synchronize(compute, comm_stream);
    out[r].y = bytes_of(y);
    out[r].dx = bytes_of(dx);
    out[r].stats = ex.stats(compute);
  });
  return out;
}

template <class T>
weave::host_matrix<T> matrix_of(const std::vector<std::byte>& bytes, std::size_t hidden) {
  weave::host_matrix<T> m(bytes.size() / (hidden * sizeof(T)), hidden);
  if (!bytes.empty())
    std::memcpy(m.data(), bytes.data(), bytes.size());
  return m;
}

template <class T>
void check_local_world(int ranks, int experts_count, int k, std::size_t hidden,
                       std::vector<std::size_t> tokens, weave::capacity_policy capacity, bool fixed,
                       std::optional<weave::placement> placed = std::nullopt,
                       std::optional<weave::fp8_dispatch_options> fp8 = std::nullopt) {
  std::mt19937 rng(17);
  std::vector<moe_test::rank_input<T>> in;
  for (int r = 0; r < ranks; ++r)
    in.push_back(moe_test::random_input<T>(tokens[static_cast<std::size_t>(r)], hidden,
                                           experts_count, k, rng));
  const moe_test::linear_experts experts(experts_count, hidden, 5);
  const auto where = placed ? *placed : weave::placement::contiguous(experts_count, ranks);
  weave::moe_options o;
  o.k = k;
  o.hidden = hidden;
  o.element = weave::dtype_of_v<T>;
  o.max_tokens = *std::max_element(tokens.begin(), tokens.end());
  o.capacity = capacity;
  o.save_for_backward = true;
  o.static_shape = fixed;
  o.fp8_dispatch = fp8;
  const auto want = run_host<T>(ranks, where, o, in, experts);
  std::vector<rank_output> base;
  for (const int chunks : {1, 2, 3}) {
    CAPTURE(chunks);
    o.chunks = chunks;
    std::vector<rank_output> got(static_cast<std::size_t>(ranks));
    weave::cuda_local_world world(ranks);
    world.run([&](weave::cuda_local_communicator& comm) {
      const auto r = static_cast<std::size_t>(comm.rank());
      got[r] = run_rank<T>(comm, where, o, in[r], experts);
    });
    for (std::size_t r = 0; r < got.size(); ++r) {
      CAPTURE(r);
      if (!fp8) { // the dense double-precision reference (an FP8 dispatch rounds its inputs)
        const auto y = matrix_of<T>(got[r].y, hidden), dx = matrix_of<T>(got[r].dx, hidden);
        moe_test::check_rank_against_dense(static_cast<int>(r), where, k, experts_count, capacity,
                                           in[r], experts, y, &dx, &got[r].dw, got[r].stats,
                                           std::is_same_v<T, float> ? 1e-4 : 3e-2);
      }
      CHECK(got[r].y == want[r].y);
      CHECK(got[r].dx == want[r].dx);
      for (std::size_t i = 0; i < got[r].dw.size(); ++i)
        CHECK(got[r].dw[i] == doctest::Approx(want[r].dw[i]).epsilon(1e-4).scale(1.0));
      CHECK(got[r].stats.sent_rows == want[r].stats.sent_rows);
      CHECK(got[r].stats.received_rows == want[r].stats.received_rows);
      CHECK(got[r].stats.dropped_pairs == want[r].stats.dropped_pairs);
      CHECK(got[r].stats.routed_pairs == want[r].stats.routed_pairs);
      if (chunks > 1)
        CHECK(got[r].dw == base[r].dw); // every chunking bitwise equal to one chunk
    }
    if (chunks == 1)
      base = got;
  }
}

} // namespace

TEST_CASE("cuda_moe_exchange over cuda_local_world equals the dense reference and the host "
          "layer") {
  for (const bool fixed : {false, true}) {
    CAPTURE(fixed);
    check_local_world<float>(1, 4, 2, 16, {33}, {}, fixed);
    check_local_world<float>(2, 8, 2, 16, {40, 23}, {}, fixed);
    check_local_world<weave::bfloat16>(4, 16, 4, 32, {64, 0, 37, 50}, {}, fixed);
    check_local_world<float>(3, 6, 3, 8, {30, 30, 29}, {1.0, weave::drop_order::position}, fixed);
    check_local_world<float>(2, 8, 2, 8, {41, 40}, {1.25, weave::drop_order::batch_prioritized},
                             fixed);
    // Replicas of experts 0 and 2 on both ranks.
    check_local_world<float>(2, 4, 2, 8, {35, 36}, {}, fixed,
                             weave::placement(4, 2, {0, 1, 2, 3, 0, 2}));
  }
}

TEST_CASE("cuda_moe_exchange's FP8 dispatch equals the host layer's") {
  // The experts read the dequantised rows; the host layer's FP8 dispatch is itself checked
  // against a brute-force reference (fp8_dispatch_test.cpp).
  for (const bool fixed : {false, true}) {
    CAPTURE(fixed);
    check_local_world<weave::bfloat16>(2, 8, 2, 256, {40, 23}, {}, fixed, std::nullopt,
                                       weave::fp8_dispatch_options{weave::dtype::e4m3, {}, true});
    check_local_world<float>(
        4, 16, 4, 128, {64, 0, 37, 50}, {}, fixed, std::nullopt,
        weave::fp8_dispatch_options{
            weave::dtype::e5m2, {64, weave::scale_rounding::power_of_two, 1e-4f}, true});
  }
}

TEST_CASE("a static-shape cuda_moe_exchange over NCCL runs inside a CUDA graph") {
  ncclComm_t raw = nullptr;
  int device = 0;
  WEAVE_CUDA_CHECK(cudaGetDevice(&device));
  WEAVE_NCCL_CHECK(ncclCommInitAll(&raw, 1, &device));
  {
    weave::nccl_communicator comm(raw);
    std::mt19937 rng(8);
    const std::size_t T = 96, H = 64;
    const auto in = moe_test::random_input<float>(T, H, 8, 2, rng);
    const auto where = weave::placement::contiguous(8, 1);
    stream_holder compute, comm_stream;
    dev<float> x(std::vector<float>(in.x.elements().begin(), in.x.elements().end()));
    dev<float> y(T * H);
    dev<std::int32_t> ids(in.ids);
    dev<float> weights(in.weights);
    const auto view = [H, T](dev<float>& b) {
      return weave::token_view(reinterpret_cast<std::byte*>(b.ptr), T, H, weave::dtype::f32,
                               weave::memory_space::device, 0);
    };
    const weave::const_token_view x_rows = view(x);
    const weave::token_view y_rows = view(y);
    //! [graph]
    weave::moe_options o;
    o.k = 2;
    o.hidden = H;
    o.max_tokens = T;
    o.chunks = 2;
    o.static_shape = true; // fixed-size slots, counts stay on the device: capturable
    weave::cuda_moe_exchange<weave::nccl_communicator> ex(comm, where, o);
    dev<std::byte> ws(ex.workspace_size()); // device memory, allocated once
    ex.initialize(ws.ptr, ws.size, compute.ref());
    // Experts enqueue kernels on the batch's stream; the per-expert offsets are device memory.
    const auto experts = [&](const weave::cuda_expert_batch& b) {
      weave::cuda_space::for_each(b.stream, static_cast<std::int64_t>(b.input.rows() * H),
                                  double_rows{reinterpret_cast<const float*>(b.input.data()),
                                              reinterpret_cast<float*>(b.output.data())});
    };
    // One eager call first: it loads the kernels (module loading cannot happen in a capture).
    ex.forward(x_rows, ids.cspan(), weights.cspan(), y_rows, experts, compute.ref(),
               comm_stream.ref());
    compute.ref().synchronize();
    cudaGraph_t graph = nullptr;
    WEAVE_CUDA_CHECK(cudaStreamBeginCapture(compute.raw, cudaStreamCaptureModeThreadLocal));
    ex.forward(x_rows, ids.cspan(), weights.cspan(), y_rows, experts, compute.ref(),
               comm_stream.ref());
    WEAVE_CUDA_CHECK(cudaStreamEndCapture(compute.raw, &graph));
    cudaGraphExec_t exec = nullptr;
    WEAVE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    WEAVE_CUDA_CHECK(cudaGraphLaunch(exec, compute.raw)); // the whole layer, both streams
    ex.check_errors(compute.ref()); // waits; throws for flagged ids, weights or full slots
    //! [graph]
    const auto replayed = to_host(y.cspan());
    for (int replay = 0; replay < 2; ++replay) {
      y.poison();
      WEAVE_CUDA_CHECK(cudaGraphLaunch(exec, compute.raw));
      compute.ref().synchronize();
      CHECK(to_host(y.cspan()) == replayed);
    }
    y.poison();
    ex.forward(x_rows, ids.cspan(), weights.cspan(), y_rows, experts, compute.ref(),
               comm_stream.ref());
    compute.ref().synchronize();
    const auto eager = to_host(y.cspan());
    CHECK(eager == replayed);
    // One device: y[t] = the sum over its choices, in rank order, of w * (2 x[t]).
    for (std::size_t t = 0; t < T; ++t)
      for (std::size_t h = 0; h < H; ++h)
        REQUIRE(eager[t * H + h] == doubled_output(in, t, h));
    WEAVE_CUDA_CHECK(cudaGraphExecDestroy(exec));
    WEAVE_CUDA_CHECK(cudaGraphDestroy(graph));
  }
  WEAVE_NCCL_CHECK(ncclCommDestroy(raw));
}

TEST_CASE("cuda_moe_exchange fails every rank at the count exchange after a bad expert id") {
  // Dynamic shapes: the flags travel with the chunk's count exchange and the host reads them
  // there, so rank 0 throws its out_of_range and rank 1 a peer_error naming rank 0.
  weave::cuda_local_world world(2);
  std::vector<weave::errc> codes(2, weave::errc{});
  std::vector<int> origins(2, -1);
  world.run([&](weave::cuda_local_communicator& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    std::mt19937 rng(4 + static_cast<unsigned>(r));
    auto in = moe_test::random_input<float>(16, 8, 4, 2, rng);
    if (r == 0)
      in.ids[3] = 9;
    const moe_test::linear_experts experts(4, 8, 2);
    weave::moe_options o;
    o.k = 2;
    o.hidden = 8;
    o.max_tokens = 16;
    o.save_for_backward = true;
    try {
      run_rank<float>(comm, weave::placement::contiguous(4, 2), o, in, experts);
    } catch (const weave::peer_error& e) {
      codes[r] = e.code();
      origins[r] = e.origin().rank;
      CHECK(e.origin().code == weave::errc::out_of_range);
    } catch (const weave::error& e) {
      codes[r] = e.code();
    }
  });
  CHECK(codes[0] == weave::errc::out_of_range);
  CHECK(codes[1] == weave::errc::peer_failure);
  CHECK(origins[1] == 0);
}

namespace {

// A cuda_local_world rank whose collectives take no tag, as NCCL's: the layer must carry its
// calls' tags itself (device_call_tags.hpp).
class untagged_cuda_comm {
 public:
  using stream_type = weave::cuda_stream_ref;
  explicit untagged_cuda_comm(weave::cuda_local_communicator& c)
      : c_(&c) {}
  int rank() const noexcept { return c_->rank(); }
  int size() const noexcept { return c_->size(); }
  void all_to_all_v(stream_type s, const void* send, std::span<const std::int64_t> send_counts,
                    std::span<const std::int64_t> send_displs, void* recv,
                    std::span<const std::int64_t> recv_counts,
                    std::span<const std::int64_t> recv_displs, std::size_t unit) {
    c_->all_to_all_v(s, send, send_counts, send_displs, recv, recv_counts, recv_displs, unit);
  }
  void exchange_counts(stream_type s, std::span<const std::int64_t> send,
                       std::span<std::int64_t> recv) {
    c_->exchange_counts(s, send, recv);
  }
  void abort(const std::string& reason) { c_->abort(reason); }
  bool aborted() const { return c_->aborted(); }
  std::vector<std::int64_t> all_gather_now(std::span<const std::int64_t> mine) {
    return c_->all_gather_now(mine);
  }

 private:
  weave::cuda_local_communicator* c_;
};
static_assert(!weave::has_tagged_collectives<untagged_cuda_comm>);

} // namespace

TEST_CASE("cuda_moe_exchange without tags: two handles' combines in another order fail every "
          "rank with call_mismatch") {
  // b routes exactly as a (x scaled by 3), so every message has the same size and only the call
  // tags differ; one chunk per call, so iterating a handle issues its combine alone. The last
  // rank iterates and combines b before a. In one order every rank computes 2 x per choice.
  // With moe_options::strict_call_order b routes otherwise (other sizes): the host reads the
  // tags before it posts the rows, so every rank fails before any row moves.
  struct mode {
    bool fixed, swap, strict;
  };
  for (const mode m :
       {mode{false, false, false}, mode{false, true, false}, mode{true, false, false},
        mode{true, true, false}, mode{false, true, true}}) {
    const bool fixed = m.fixed, swap = m.swap;
    CAPTURE(fixed);
    CAPTURE(swap);
    CAPTURE(m.strict);
    const int ranks = 2;
    const std::size_t T = 24, H = 8;
    std::vector<weave::errc> codes(ranks, weave::errc{}), origin_codes(ranks, weave::errc{});
    std::vector<char> right(ranks, false); // not vector<bool>: written per rank thread
    weave::cuda_local_world world(ranks);
    world.run([&](weave::cuda_local_communicator& local) {
      untagged_cuda_comm comm(local);
      const auto r = static_cast<std::size_t>(comm.rank());
      std::mt19937 rng(31 + static_cast<unsigned>(r));
      const auto in = moe_test::random_input<float>(T, H, 4, 2, rng);
      const auto other = moe_test::random_input<float>(T, H, 4, 2, rng); // b's routes (strict)
      std::vector<float> xa(in.x.elements().begin(), in.x.elements().end()), xb = xa;
      for (float& v : xb)
        v *= 3.0f;
      stream_holder compute, comm_stream;
      dev<float> dxa(xa), dxb(xb), ya(T * H), yb(T * H);
      dev<std::int32_t> ids(in.ids), ids_b(m.strict ? other.ids : in.ids);
      dev<float> weights(in.weights), weights_b(m.strict ? other.weights : in.weights);
      const auto view = [&](dev<float>& b) {
        return weave::token_view(reinterpret_cast<std::byte*>(b.ptr), T, H, weave::dtype::f32,
                                 weave::memory_space::device, 0);
      };
      weave::moe_options o;
      o.k = 2;
      o.hidden = H;
      o.max_tokens = T;
      o.chunks = 1;
      o.max_in_flight = 2;
      o.static_shape = fixed;
      o.strict_call_order = m.strict;
      try {
        weave::basic_moe_exchange<weave::cuda_space, untagged_cuda_comm> ex(
            comm, weave::placement::contiguous(4, ranks), o);
        dev<std::byte> ws(ex.workspace_size());
        ex.initialize(ws.ptr, ws.size, compute.ref());
        auto ha = ex.dispatch(weave::const_token_view(view(dxa)), ids.cspan(), weights.cspan(),
                              compute.ref(), comm_stream.ref());
        auto hb = ex.dispatch(weave::const_token_view(view(dxb)), ids_b.cspan(), weights_b.cspan(),
                              compute.ref(), comm_stream.ref());
        const bool guilty = swap && r == ranks - 1;
        for (auto* h : guilty ? std::array{&hb, &ha} : std::array{&ha, &hb}) {
          for (const auto chunk : ex.chunks(*h)) {
            const auto b = chunk.experts();
            weave::cuda_space::for_each(b.stream, static_cast<std::int64_t>(b.input.rows() * H),
                                        double_rows{reinterpret_cast<const float*>(b.input.data()),
                                                    reinterpret_cast<float*>(b.output.data())});
          }
          ex.combine(*h, view(h == &ha ? ya : yb), compute.ref(), comm_stream.ref());
        }
        ex.synchronize(compute.ref(), comm_stream.ref());
        const auto got_a = to_host(ya.cspan()), got_b = to_host(yb.cspan());
        bool ok = true;
        for (std::size_t t = 0; t < T; ++t)
          for (std::size_t h = 0; h < H; ++h) {
            const float want = doubled_output(in, t, h);
            ok = ok && got_a[t * H + h] == want &&
                 got_b[t * H + h] == doctest::Approx(3.0f * want).epsilon(1e-5);
          }
        right[r] = ok;
      } catch (const weave::peer_error& e) {
        codes[r] = e.code();
        origin_codes[r] = e.origin().code;
      } catch (const weave::error& e) {
        codes[r] = e.code();
      }
    });
    for (int r = 0; r < ranks; ++r) {
      CAPTURE(r);
      const auto at = static_cast<std::size_t>(r);
      if (!swap) {
        CHECK(codes[at] == weave::errc{});
        CHECK(right[at]);
      } else {
        CHECK((codes[at] == weave::errc::call_mismatch ||
               (codes[at] == weave::errc::peer_failure &&
                origin_codes[at] == weave::errc::call_mismatch)));
      }
    }
  }
}
