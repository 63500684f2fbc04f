// The examples of docs/exchange.md, compiled and checked: one MoE layer, forward and backward,
// pipelined in 2 chunks on 4 in-process ranks, through the callback form and through handles
// with two micro-batches in flight, against a per-token reference computed here; each example
// written once and run in `host_space` and in `emulated_gpu_space`.
#include <doctest/doctest.h>

#include <weave/comm/local_world.hpp>
#include <weave/exec/emulated_gpu_space.hpp>
#include <weave/exec/host_space.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/overlap/moe_exchange.hpp>

#include <cstdint>
#include <random>
#include <utility>
#include <vector>

namespace {

// Expert e multiplies its rows by (e + 1): simple enough to check by hand.
void scale_rows(const weave::const_token_view& in, const weave::token_view& out, std::int64_t first,
                std::int64_t last, float factor) {
  for (auto r = first; r < last; ++r) {
    const auto i = in.row_as<float>(static_cast<std::size_t>(r));
    const auto o = out.row_as<float>(static_cast<std::size_t>(r));
    for (std::size_t h = 0; h < i.size(); ++h)
      o[h] = factor * i[h];
  }
}

struct rank_data {
  std::vector<float> x, y, dy, dx, dw;
  std::vector<std::int32_t> ids;
  std::vector<float> weights;
};

constexpr int ranks = 4, experts = 8, k = 2;
constexpr std::size_t tokens = 32, hidden = 16;

std::vector<rank_data> make_data(std::uint32_t seed) {
  std::vector<rank_data> data(ranks);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (rank_data& d : data) {
    for (std::size_t i = 0; i < tokens * hidden; ++i) {
      d.x.push_back(u(rng));
      d.dy.push_back(u(rng));
    }
    for (std::size_t t = 0; t < tokens; ++t) {
      const auto e0 = static_cast<std::int32_t>(rng() % experts);
      const auto e1 = static_cast<std::int32_t>((e0 + 1 + rng() % (experts - 1)) % experts);
      d.ids.insert(d.ids.end(), {e0, e1});
      d.weights.insert(d.weights.end(), {0.75f, 0.25f});
    }
    d.y.assign(tokens * hidden, 0.0f);
    d.dx.assign(tokens * hidden, 0.0f);
    d.dw.assign(tokens * k, -1.0f);
  }
  return data;
}

// y = sum_j w_j (e_j + 1) x;  dx = sum_j w_j (e_j + 1) dy;  dw_j = <dy, (e_j + 1) x>.
void check_reference(const std::vector<rank_data>& data) {
  for (const rank_data& d : data)
    for (std::size_t t = 0; t < tokens; ++t) {
      double dot = 0;
      for (std::size_t h = 0; h < hidden; ++h)
        dot += static_cast<double>(d.dy[t * hidden + h]) * d.x[t * hidden + h];
      double scale = 0;
      for (int j = 0; j < k; ++j) {
        const std::size_t p = t * k + static_cast<std::size_t>(j);
        const double f = d.ids[p] + 1.0;
        scale += d.weights[p] * f;
        CHECK(d.dw[p] == doctest::Approx(f * dot).epsilon(1e-5));
      }
      for (std::size_t h = 0; h < hidden; ++h) {
        CHECK(d.y[t * hidden + h] == doctest::Approx(scale * d.x[t * hidden + h]).epsilon(1e-5));
        CHECK(d.dx[t * hidden + h] == doctest::Approx(scale * d.dy[t * hidden + h]).epsilon(1e-5));
      }
    }
}

// The experts of every chunk of a handle's phase, each chunk a task on the compute stream that
// reads the chunk's rows when it runs: forward (`grad = false`) or backward.
template <class Layer, class Handle>
void compute_experts(Layer& layer, Handle& h, weave::host_stream& compute, bool grad) {
  for (const auto chunk : layer.chunks(h))
    compute.submit([chunk, grad] {
      if (grad) {
        const auto b = chunk.experts_grad();
        for (std::size_t l = 0; l + 1 < b.expert_offsets.size(); ++l)
          scale_rows(b.grad_output, b.grad_input, b.expert_offsets[l], b.expert_offsets[l + 1],
                     static_cast<float>(b.experts[l] + 1));
      } else {
        const auto b = chunk.experts();
        for (std::size_t l = 0; l + 1 < b.expert_offsets.size(); ++l)
          scale_rows(b.input, b.output, b.expert_offsets[l], b.expert_offsets[l + 1],
                     static_cast<float>(b.experts[l] + 1));
      }
    });
}

} // namespace

TEST_CASE_TEMPLATE("docs/exchange.md example: forward and backward of a pipelined layer", Space,
                   weave::host_space, weave::emulated_gpu_space) {
  std::vector<rank_data> data = make_data(7);

  weave::local_world world(ranks);
  world.run([&](weave::local_communicator& comm) {
    rank_data& d = data[static_cast<std::size_t>(comm.rank())];
    const auto x = weave::make_token_view(std::as_const(d.x), hidden);
    const auto y = weave::make_token_view(d.y, hidden);
    const auto dy = weave::make_token_view(std::as_const(d.dy), hidden);
    const auto dx = weave::make_token_view(d.dx, hidden);
    //! [layer]
    weave::moe_options o;
    o.k = k;           // experts per token
    o.hidden = hidden; // elements per token row
    o.element = weave::dtype::f32;
    o.max_tokens = tokens; // sizes every communication buffer, once
    o.chunks = 2;          // pipeline degree
    o.capacity = {};       // dropless; e.g. {1.25, weave::drop_order::batch_prioritized}
    o.save_for_backward = true;
    weave::basic_moe_exchange<Space, weave::local_communicator> layer(
        comm, weave::placement::contiguous(experts, comm.size()), o);

    weave::host_stream compute("compute"), comm_stream("comm");
    // Once per chunk: local slot l owns the rows [expert_offsets[l], expert_offsets[l + 1]) of
    // the EPD layout (a grouped GEMM's groups). The work goes on b.stream: on host streams the
    // callback runs in that stream, so it runs at once; where host code runs at enqueue time
    // (CUDA, emulated_gpu_space), when the stream gets there.
    layer.forward(
        x, d.ids, d.weights, y,
        [](const weave::basic_expert_batch<Space>& b) {
          weave::host_space::enqueue(b.stream, [b] {
            for (std::size_t l = 0; l + 1 < b.expert_offsets.size(); ++l)
              scale_rows(b.input, b.output, b.expert_offsets[l], b.expert_offsets[l + 1],
                         static_cast<float>(b.experts[l] + 1));
          });
        },
        compute, comm_stream);
    // The backward gets dL/d(expert output), already gate-scaled, and writes dL/d(expert input).
    layer.backward(
        dy, dx, d.dw,
        [](const weave::basic_expert_grad_batch<Space>& b) {
          weave::host_space::enqueue(b.stream, [b] {
            for (std::size_t l = 0; l + 1 < b.expert_offsets.size(); ++l)
              scale_rows(b.grad_output, b.grad_input, b.expert_offsets[l], b.expert_offsets[l + 1],
                         static_cast<float>(b.experts[l] + 1));
          });
        },
        compute, comm_stream);
    // Both calls were only enqueued until here: wait, and learn the root cause of any failure.
    layer.synchronize(compute, comm_stream);
    const weave::moe_stats stats = layer.stats(compute); // rows sent, copies per token, drops
    //! [layer]
    CHECK(stats.routed_pairs == static_cast<std::int64_t>(tokens * k));
    CHECK(stats.dropped_pairs == 0);
    CHECK(stats.copies_per_token() <= 2.0);
  });

  check_reference(data);
}

TEST_CASE_TEMPLATE("docs/exchange.md example: handles, two micro-batches in flight", Space,
                   weave::host_space, weave::emulated_gpu_space) {
  std::vector<rank_data> first = make_data(7), second = make_data(8);
  weave::local_world world(ranks);
  world.run([&](weave::local_communicator& comm) {
    rank_data& a = first[static_cast<std::size_t>(comm.rank())];
    rank_data& b = second[static_cast<std::size_t>(comm.rank())];
    weave::moe_options o;
    o.k = k;
    o.hidden = hidden;
    o.max_tokens = tokens;
    o.chunks = 2;
    o.save_for_backward = true;
    //! [handles]
    o.max_in_flight = 2; // two calls alive at once
    weave::basic_moe_exchange<Space, weave::local_communicator> layer(
        comm, weave::placement::contiguous(experts, comm.size()), o);
    weave::host_stream compute("compute"), comm_stream("comm");
    const auto rows = [](std::vector<float>& v) { return weave::make_token_view(v, hidden); };
    // Both dispatches first: b's all-to-all runs while a's experts compute.
    auto ha = layer.dispatch(rows(a.x), a.ids, a.weights, compute, comm_stream);
    auto hb = layer.dispatch(rows(b.x), b.ids, b.weights, compute, comm_stream);
    compute_experts(layer, ha, compute, /*grad=*/false); // a's combine runs under b's experts
    compute_experts(layer, hb, compute, /*grad=*/false);
    layer.combine(ha, rows(a.y), compute, comm_stream);
    layer.combine(hb, rows(b.y), compute, comm_stream);
    // The backward pair: dispatch the output gradients, compute the experts' backward, return
    // the input gradients and the gate-weight gradients.
    layer.combine_backward(ha, rows(a.dy), compute, comm_stream);
    layer.combine_backward(hb, rows(b.dy), compute, comm_stream);
    compute_experts(layer, ha, compute, /*grad=*/true);
    compute_experts(layer, hb, compute, /*grad=*/true);
    layer.dispatch_backward(ha, rows(a.dx), a.dw, compute, comm_stream);
    layer.dispatch_backward(hb, rows(b.dx), b.dw, compute, comm_stream);
    layer.synchronize(compute, comm_stream); // everything was only enqueued until here
    //! [handles]
    CHECK(layer.stats(ha, compute).routed_pairs == static_cast<std::int64_t>(tokens * k));
    CHECK(layer.stats(hb, compute).routed_pairs == static_cast<std::int64_t>(tokens * k));
  });
  check_reference(first);
  check_reference(second);
}
