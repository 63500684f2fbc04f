// docs/getting-started.md's complete program: one MoE layer, forward and backward, on 2 MPI
// ranks (`mpirun -np 2 build/default/examples/getting_started`), over the program's own
// tensor type, checked against a dense computation of the same layer. Exits 0 when every
// output and gradient matches.
//! [program]
#include <cmath>
#include <cstdio>
#include <vector>
#include <weave/comm/mpi_communicator.hpp>
#include <weave/overlap/moe_exchange.hpp>

struct matrix { // the program's own tensor type: row-major floats
  std::vector<float> v;
  long rows, cols;
};
template <> // how weave sees it (see step 3)
struct weave::tensor_traits<matrix> {
  static void* data(matrix& m) { return m.v.data(); }
  static const void* data(const matrix& m) { return m.v.data(); }
  static long rows(const matrix& m) { return m.rows; }
  static long cols(const matrix& m) { return m.cols; }
  static weave::dtype element_type(const matrix&) { return weave::dtype::f32; }
  static weave::memory_space space(const matrix&) { return weave::memory_space::host; }
};

int main(int argc, char** argv) {
  int provided = 0, bad = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  {
    weave::mpi_communicator comm(MPI_COMM_WORLD);
    const int E = 4, k = 2, r = comm.rank(); // experts, choices per token, this rank
    const long T = 6, H = 4;                 // tokens per rank, hidden size
    matrix x{std::vector<float>(T * H), T, H}, y = x, dy = x, dx = x;
    std::vector<std::int32_t> ids;
    std::vector<float> w, dw(T * k);
    for (long t = 0; t < T; ++t) { // token t goes to experts t % E and (t + r + 1) % E
      for (long h = 0; h < H; ++h)
        x.v[t * H + h] = float(r + t) + 0.1f * h, dy.v[t * H + h] = 1.0f - 0.2f * h;
      ids.insert(ids.end(), {int(t % E), int((t + r + 1) % E)});
      w.insert(w.end(), {0.75f, 0.25f});
    }
    // Two chunks: chunk 1 is dispatched while chunk 0's experts run.
    const weave::moe_options o{
        .k = k, .hidden = H, .max_tokens = T, .chunks = 2, .save_for_backward = true};
    weave::moe_exchange<weave::mpi_communicator> layer(
        comm, weave::placement::contiguous(E, comm.size()), o);
    weave::host_stream compute, stream;
    // Expert e multiplies its rows by e + 1 (so does its backward): your grouped GEMM goes here.
    const auto scale = [](weave::const_token_view in, weave::token_view out, auto offsets,
                          auto experts) {
      for (std::size_t l = 0; l < experts.size(); ++l)
        for (auto i = offsets[l]; i < offsets[l + 1]; ++i)
          for (long h = 0; h < H; ++h)
            out.row_as<float>(i)[h] = in.row_as<float>(i)[h] * float(experts[l] + 1);
    };
    auto handle = layer.dispatch(x, ids, w, compute, stream);
    for (auto chunk : layer.chunks(handle)) // each chunk's experts, as a task on `compute`
      compute.submit([=] {
        const auto b = chunk.experts();
        scale(b.input, b.output, b.expert_offsets, b.experts);
      });
    layer.combine(handle, y, compute, stream);
    layer.combine_backward(handle, dy, compute, stream);
    for (auto chunk : layer.chunks(handle))
      compute.submit([=] {
        const auto b = chunk.experts_grad();
        scale(b.grad_output, b.grad_input, b.expert_offsets, b.experts);
      });
    layer.dispatch_backward(handle, dx, dw, compute, stream);
    compute.synchronize();
    stream.synchronize();
    for (long t = 0; t < T; ++t) { // dense: y = g x, dx = g dy, dw_j = (e_j + 1) <dy, x>
      double g = 0, dot = 0;       // g = sum_j w_j (e_j + 1)
      for (int j = 0; j < k; ++j)
        g += w[t * k + j] * (ids[t * k + j] + 1.0);
      for (long i = t * H; i < (t + 1) * H; ++i) {
        dot += dy.v[i] * x.v[i];
        bad += std::abs(y.v[i] - g * x.v[i]) > 1e-4 || std::abs(dx.v[i] - g * dy.v[i]) > 1e-4;
      }
      for (int j = 0; j < k; ++j)
        bad += std::abs(dw[t * k + j] - (ids[t * k + j] + 1.0) * dot) > 1e-4;
    }
    std::printf("rank %d: forward and backward %s the dense reference\n", r,
                bad == 0 ? "match" : "DO NOT MATCH");
  }
  MPI_Finalize();
  return bad == 0 ? 0 : 1;
}
//! [program]
