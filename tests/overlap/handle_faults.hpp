// The handle API's failure cases beside the fault matrix, written once for any host-stream
// communicator (the local_world test runs them on threads, the MPI test on processes) and every
// execution space CI has (host_space; emulated_gpu_space, which runs the CUDA path's control
// flow): call order broken (one rank iterates two handles' chunks in the other order, with equal
// and with different message sizes), the layer destroyed in flight, after its streams were
// synchronized, or before its handles, combine twice uncaught, and recovery after an in-band
// failure with two handles in flight. Each function is one rank's side and returns what that rank
// saw; the culprit is the rank given.
#pragma once

#include "aligned_buffer.hpp"
#include "moe_test_support.hpp"

#include <weave/core/host_matrix.hpp>
#include <weave/exec/emulated_gpu_space.hpp>
#include <weave/exec/host_space.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/overlap/moe_exchange.hpp>
#include <weave/routing/host_quant_moves.hpp>
#include <weave/routing/host_row_moves.hpp>

#include <chrono>
#include <cmath>
#include <memory>
#include <random>
#include <span>
#include <type_traits>
#include <vector>

namespace handle_faults {

enum class fault {
  swapped_equal_sizes,     // the culprit iterates b's chunks before a's, sizes alike
  swapped_other_sizes,     // the same, b smaller than a
  destroyed_in_flight,     // the culprit destroys its layer right after a dispatch
  destroyed_after_sync,    // ... after synchronizing its streams, the handle alive
  destroyed_before_handle, // ... its handle declared before the layer, so outliving it
  combine_twice,           // the culprit combines a handle twice and lets the error escape
  recovery,                // the culprit's first call has a bad id; two handles in flight
};

inline const fault all_faults[] = {fault::swapped_equal_sizes,
                                   fault::swapped_other_sizes,
                                   fault::destroyed_in_flight,
                                   fault::destroyed_after_sync,
                                   fault::destroyed_before_handle,
                                   fault::combine_twice,
                                   fault::recovery};

inline const char* name(fault f) {
  switch (f) {
  case fault::swapped_equal_sizes:
    return "swapped chunk order, equal sizes";
  case fault::swapped_other_sizes:
    return "swapped chunk order, other sizes";
  case fault::destroyed_in_flight:
    return "layer destroyed in flight";
  case fault::destroyed_after_sync:
    return "layer destroyed after its streams were synchronized, a handle alive";
  case fault::destroyed_before_handle:
    return "layer destroyed before its handle";
  case fault::combine_twice:
    return "combine twice, uncaught";
  case fault::recovery:
    return "recovery after an in-band failure";
  }
  return "?";
}

// The space under test, named for the messages.
template <class Space>
const char* space_name() {
  return std::is_same_v<Space, weave::host_space> ? "host_space" : "emulated GPU";
}

constexpr int experts_per_rank = 2, k = 2, chunks = 2;
constexpr std::size_t hidden = 8, tokens = 12;

// One rank's layer in `Space`, given a workspace poisoned with 0xFF bytes (nothing may read what
// it did not write) before its first call.
template <class Comm, class Space>
struct layer {
  using exchange = weave::basic_moe_exchange<Space, Comm>;
  // Shared: after an abort under MPI an abandoned collective may still write into the layer's
  // buffers until MPI_Finalize, so the cases keep the workspace alive (`keep`).
  std::shared_ptr<weave_test::aligned_buffer> ws; // declared first: destroyed after the layer
  exchange ex;

  layer(Comm& comm, weave::host_stream& s, bool static_shape = false)
      : layer(comm, s, options(static_shape)) {}
  layer(Comm& comm, weave::host_stream& s, const weave::moe_options& o)
      : ex(comm, weave::placement::contiguous(experts_per_rank * comm.size(), comm.size()), o) {
    ws = std::make_shared<weave_test::aligned_buffer>(ex.workspace_size());
    ex.initialize(ws->ptr, ws->size, s);
  }
  static weave::moe_options options(bool static_shape) {
    weave::moe_options o;
    o.static_shape = static_shape; // slots of max_tokens x k rows per peer
    o.k = k;
    o.hidden = hidden;
    o.max_tokens = tokens;
    o.chunks = chunks;
    o.max_in_flight = 2;
    return o;
  }
};

// out = 2 in on the first `rows` rows (the cases' experts, and their backward).
template <class In, class Out>
void double_rows(const In& in, const Out& out, std::size_t rows) {
  for (std::size_t r = 0; r < rows; ++r) {
    const auto from = in.template row_as<float>(r);
    const auto to = out.template row_as<float>(r);
    for (std::size_t i = 0; i < from.size(); ++i)
      to[i] = 2.0f * from[i];
  }
}

// The caller's experts on a chunk: y = 2x, a task on the compute stream that reads the chunk's
// rows when it runs (the handle API's contract on host streams).
template <class Exchange>
void experts(Exchange& ex, typename Exchange::handle& h, weave::host_stream& compute) {
  for (const auto chunk : ex.chunks(h))
    compute.submit([chunk] {
      const auto b = chunk.experts();
      double_rows(b.input, b.output, static_cast<std::size_t>(b.expert_offsets.back()));
    });
}

// The caller's backward on a chunk: dL/dx = 2 dL/dy (the experts' y = 2x).
template <class Exchange>
void experts_grad(Exchange& ex, typename Exchange::handle& h, weave::host_matrix<float>& dx,
                  std::span<float> dw, weave::host_stream& compute) {
  for (const auto chunk : ex.chunks(h, dx, dw))
    compute.submit([chunk] {
      const auto b = chunk.experts_grad();
      double_rows(b.grad_output, b.grad_input, static_cast<std::size_t>(b.expert_offsets.back()));
    });
}

// What one rank saw.
struct outcome {
  weave::errc code{};         // its error (errc{} when none)
  int origin = -1;            // the rank a peer_error names
  weave::errc origin_code{};  // and its code
  double seconds = 0;         // from the fault to the error (or the end)
  bool outputs_right = false; // the call's outputs are 2x (recovery: the next call's)
  bool handles_stale = false; // recovery: the failed calls' handles throw invalid_state
};

inline void record(outcome& o, const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const weave::peer_error& p) {
    o.code = p.code();
    o.origin = p.origin().rank;
    o.origin_code = p.origin().code;
  } catch (const weave::error& w) {
    o.code = w.code();
  } catch (...) {
    o.code = weave::errc::internal;
  }
}

inline moe_test::rank_input<float> input_of(int rank, int ranks, std::size_t n, unsigned salt) {
  std::mt19937 rng(100 + static_cast<unsigned>(rank) + 7 * salt);
  return moe_test::random_input<float>(n, hidden, experts_per_rank * ranks, k, rng);
}

// Waits for both streams, ignoring their failures.
inline void drain(weave::host_stream& a, weave::host_stream& b) {
  for (weave::host_stream* s : {&a, &b})
    try {
      s->synchronize();
    } catch (...) {
    }
}

// True if `y` is 2x weighted by each token's kept choices (what the cases' experts compute).
inline bool doubled(const moe_test::rank_input<float>& in, const weave::host_matrix<float>& y) {
  bool right = true;
  for (std::size_t t = 0; t < in.x.rows(); ++t) {
    float w = 0.0f;
    for (int j = 0; j < k; ++j)
      if (in.ids[t * k + static_cast<std::size_t>(j)] >= 0)
        w += in.weights[t * k + static_cast<std::size_t>(j)];
    for (std::size_t i = 0; i < hidden; ++i) {
      const float want = 2.0f * w * in.x.view().row_as<float>(t)[i];
      right =
          right && std::abs(y.view().row_as<float>(t)[i] - want) <= 1e-5f * (1.0f + std::abs(want));
    }
  }
  return right;
}

// One rank's side of fault `f` on a layer in `Space` over `comm`; `keep(layer)` takes layers
// that must outlive the case (MPI may still write into an abandoned collective's buffers).
template <class Space, class Comm, class Keep>
outcome run_case(Comm& comm, fault f, int culprit, Keep&& keep) {
  using layer_t = layer<Comm, Space>;
  using handle = typename layer_t::exchange::handle;
  const int rank = comm.rank(), ranks = comm.size();
  const bool guilty = rank == culprit;
  outcome o;
  auto compute = std::make_shared<weave::host_stream>("compute");
  auto stream = std::make_shared<weave::host_stream>("comm");
  keep(compute);
  keep(stream);
  auto start = std::chrono::steady_clock::now();
  const auto done = [&] {
    o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  const auto a = input_of(rank, ranks, tokens, 1);
  const auto b = input_of(rank, ranks, f == fault::swapped_other_sizes ? tokens / 2 : tokens,
                          f == fault::swapped_equal_sizes ? 1 : 2);
  weave::host_matrix<float> ya(tokens, hidden), yb(b.x.rows(), hidden);
  if (f == fault::destroyed_before_handle) {
    handle outliving; // declared before the layer: destroyed after it
    try {
      auto l = std::make_unique<layer_t>(comm, *compute);
      keep(l->ws);
      outliving = l->ex.dispatch(a.x, a.ids, a.weights, *compute, *stream);
      start = std::chrono::steady_clock::now();
      if (guilty) {
        l.reset(); // the handle is half issued: the layer aborts, the handle goes stale
        CHECK(outliving.valid());
        CHECK(moe_test::error_code_of([&] { (void)outliving.phase(); }) ==
              weave::errc::invalid_state);
        done();
        return o;
      }
      experts(l->ex, outliving, *compute);
      l->ex.combine(outliving, ya, *compute, *stream);
      l->ex.synchronize(*compute, *stream);
      keep(std::shared_ptr<layer_t>(std::move(l)));
    } catch (...) {
      record(o, std::current_exception());
    }
    drain(*compute, *stream);
    done();
    return o;
  }
  std::shared_ptr<layer_t> l;
  try { // a rank may still be constructing when a fast culprit has aborted the communicator
    l = std::make_shared<layer_t>(comm, *compute);
  } catch (...) {
    record(o, std::current_exception());
    done();
    return o;
  }
  keep(l->ws);
  const bool destroyed = f == fault::destroyed_in_flight || f == fault::destroyed_after_sync;
  if (!(guilty && destroyed))
    keep(l); // the culprit destroys its layer: that is the case
  auto& ex = l->ex;
  try {
    if (f == fault::recovery) {
      auto bad = a;
      if (guilty)
        bad.ids[5] = experts_per_rank * ranks; // out of range: fails the call on every rank
      start = std::chrono::steady_clock::now();
      handle h1, h2;
      try { // the failure surfaces at synchronize on host streams, at a call on the CUDA path
        h1 = ex.dispatch(bad.x, bad.ids, bad.weights, *compute, *stream);
        h2 = ex.dispatch(b.x, b.ids, b.weights, *compute, *stream);
        for (handle* h : {&h1, &h2}) {
          experts(ex, *h, *compute);
          ex.combine(*h, h == &h1 ? ya : yb, *compute, *stream);
        }
        ex.synchronize(*compute, *stream);
      } catch (...) {
        record(o, std::current_exception());
        done();
      }
      drain(*compute, *stream);
      o.handles_stale =
          moe_test::error_code_of([&] { (void)h1.phase(); }) == weave::errc::invalid_state &&
          moe_test::error_code_of([&] { (void)h2.phase(); }) == weave::errc::invalid_state;
      // The layer goes on: its next call works without releasing the stale handles first.
      CHECK(ex.usable());
      CHECK(ex.handles_in_flight() == 0); // the failed calls released their slots
      auto h3 = ex.dispatch(a.x, a.ids, a.weights, *compute, *stream);
      experts(ex, h3, *compute);
      ex.combine(h3, ya, *compute, *stream);
      ex.synchronize(*compute, *stream);
      o.outputs_right = doubled(a, ya);
      return o;
    }
    auto ha = ex.dispatch(a.x, a.ids, a.weights, *compute, *stream);
    auto hb = ex.dispatch(b.x, b.ids, b.weights, *compute, *stream);
    start = std::chrono::steady_clock::now();
    if (guilty && f == fault::destroyed_after_sync) {
      compute->synchronize();
      stream->synchronize();
    }
    if (guilty && destroyed) { // the handles (half issued) outlive it, and go stale
      l.reset();
      CHECK(moe_test::error_code_of([&] { (void)ha.phase(); }) == weave::errc::invalid_state);
      done();
      return o;
    }
    const bool swapped =
        guilty && (f == fault::swapped_equal_sizes || f == fault::swapped_other_sizes);
    handle* first = swapped ? &hb : &ha;
    handle* second = swapped ? &ha : &hb;
    experts(ex, *first, *compute);
    experts(ex, *second, *compute);
    ex.combine(ha, ya, *compute, *stream);
    if (guilty && f == fault::combine_twice)
      ex.combine(ha, ya, *compute, *stream); // uncaught: leaves the case
    ex.combine(hb, yb, *compute, *stream);
    ex.synchronize(*compute, *stream);
    o.outputs_right = doubled(a, ya) && doubled(b, yb);
  } catch (...) {
    record(o, std::current_exception());
  }
  done();
  drain(*compute, *stream);
  return o;
}

} // namespace handle_faults
