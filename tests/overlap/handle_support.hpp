// Shared pieces of the handle-API tests, written once for every execution space of the exchange
// (`host_space`, `emulated_gpu_space`): a layer wrapper with a poisoned workspace, the caller's
// expert compute on a chunk, and micro-batch schedules (1F1B) run with handles or with the
// callback form.
#pragma once

#include "aligned_buffer.hpp"
#include "moe_test_support.hpp"

#include <weave/exec/emulated_gpu_space.hpp>
#include <weave/exec/host_space.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/overlap/moe_exchange.hpp>
#include <weave/routing/host_quant_moves.hpp>
#include <weave/routing/host_row_moves.hpp>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace handle_test {

// Waits for both streams, ignoring their failures (on an error path).
inline void drain(weave::host_stream& a, weave::host_stream& b) {
  for (weave::host_stream* s : {&a, &b}) {
    try {
      s->synchronize();
    } catch (...) {
    }
  }
}

// One rank's exchange in `Space`, given a workspace poisoned with 0xFF bytes (nothing may read
// what it did not write) before its first call.
template <class Comm, class Space = weave::host_space>
struct layer {
  using exchange = weave::basic_moe_exchange<Space, Comm>;
  std::unique_ptr<weave_test::aligned_buffer>
      ws; // before `ex`: it outlives the work `ex` waits for
  exchange ex;

  layer(Comm& comm, const weave::placement& where, const weave::moe_options& o,
        weave::host_stream& stream)
      : ex(comm, where, o) {
    ws = std::make_unique<weave_test::aligned_buffer>(ex.workspace_size());
    ex.initialize(ws->ptr, ws->size, stream);
  }

  weave::moe_stats stats(const typename exchange::handle& h, weave::host_stream& compute) {
    return ex.stats(h, compute);
  }
};

// The caller's expert compute on every chunk of the handle's phase, each chunk a task on the
// compute stream that reads the chunk's rows when it runs (the host-stream contract).
template <class Exchange>
void compute_experts(Exchange& ex, typename Exchange::handle& h,
                     const moe_test::linear_experts& lin, weave::host_stream& compute,
                     bool backward = false) {
  for (const auto chunk : ex.chunks(h))
    compute.submit([chunk, &lin, backward] {
      if (backward)
        lin.backward<float>(chunk.experts_grad());
      else
        lin.operator()<float>(chunk.experts());
    });
}

// One micro-batch's results (forward output, input and gate gradients, statistics).
struct mb_result {
  weave::host_matrix<float> y, dx;
  std::vector<float> dw;
  weave::moe_stats stats;
};

inline bool same(const weave::host_matrix<float>& a, const weave::host_matrix<float>& b) {
  return a.rows() == b.rows() &&
         (a.rows() == 0 || std::memcmp(a.data(), b.data(), a.rows() * a.cols() * 4) == 0);
}

inline bool same(const mb_result& a, const mb_result& b) {
  return same(a.y, b.y) && same(a.dx, b.dx) && a.dw == b.dw;
}

// Runs the micro-batches in `order` ("F0 F1 B0 ...": forward or backward of micro-batch i) with
// handles, the backward's upstream gradient being x (dL/dy = x, as the dense reference
// assumes). Calls only enqueue, except that a backward is waited for to read its micro-batch's
// statistics before its handle is released. Needs max_in_flight >= the handles alive at once
// (2 for 1F1B).
template <class Layer>
std::vector<mb_result> run_schedule(Layer& l, const std::vector<moe_test::rank_input<float>>& mbs,
                                    const std::vector<std::string>& order,
                                    const moe_test::linear_experts& lin,
                                    weave::host_stream& compute, weave::host_stream& comm) {
  using handle = typename Layer::exchange::handle;
  std::vector<mb_result> out(mbs.size());
  std::vector<handle> handles(mbs.size());
  for (const std::string& step : order) {
    const auto i = static_cast<std::size_t>(std::stoi(step.substr(1)));
    const auto& in = mbs[i];
    mb_result& r = out[i];
    if (step[0] == 'F') {
      r.y = weave::host_matrix<float>(in.x.rows(), in.x.cols());
      handles[i] = l.ex.dispatch(in.x, in.ids, in.weights, compute, comm);
      compute_experts(l.ex, handles[i], lin, compute);
      l.ex.combine(handles[i], r.y, compute, comm);
    } else {
      r.dx = weave::host_matrix<float>(in.x.rows(), in.x.cols());
      r.dw.assign(in.ids.size(), -1.0f);
      l.ex.combine_backward(handles[i], in.x, compute, comm);
      compute_experts(l.ex, handles[i], lin, compute, /*backward=*/true);
      l.ex.dispatch_backward(handles[i], r.dx, r.dw, compute, comm);
      // Its statistics (given once its forward ran), then its slot back.
      compute.synchronize();
      comm.synchronize();
      r.stats = l.stats(handles[i], compute);
      handles[i].reset();
    }
  }
  compute.synchronize();
  comm.synchronize();
  return out;
}

// The same micro-batches one by one with the callback form (forward, then its backward).
template <class Layer>
std::vector<mb_result> run_one_by_one(Layer& l, const std::vector<moe_test::rank_input<float>>& mbs,
                                      const moe_test::linear_experts& lin,
                                      weave::host_stream& compute, weave::host_stream& comm) {
  std::vector<mb_result> out(mbs.size());
  for (std::size_t i = 0; i < mbs.size(); ++i) {
    const auto& in = mbs[i];
    mb_result& r = out[i];
    r.y = weave::host_matrix<float>(in.x.rows(), in.x.cols());
    r.dx = weave::host_matrix<float>(in.x.rows(), in.x.cols());
    r.dw.assign(in.ids.size(), -1.0f);
    l.ex.forward(
        in.x.view(), in.ids, in.weights, r.y.view(),
        [&](const auto& b) { moe_test::run_experts<float>(lin, b); }, compute, comm);
    l.ex.backward(
        in.x.view(), r.dx.view(), r.dw,
        [&](const auto& b) { moe_test::run_experts<float>(lin, b); }, compute, comm);
    compute.synchronize();
    comm.synchronize();
    r.stats = l.ex.stats(compute);
  }
  return out;
}

// 4 micro-batches in interleaved 1F1B order: forward of i + 1 before the backward of i.
inline const std::vector<std::string> one_f_one_b = {"F0", "F1", "B0", "F2",
                                                     "B1", "F3", "B2", "B3"};

} // namespace handle_test
