// Adapting a tensor type weave has never seen: specialise weave::tensor_traits once, then every
// weave API that takes token rows accepts it — here a whole MoE layer on two in-process ranks.
#include <weave/comm/local_world.hpp>
#include <weave/core/tensor.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/overlap/moe_exchange.hpp>

#include <cmath>
#include <cstdio>
#include <utility>
#include <vector>

namespace mylib {
// A minimal framework tensor: row-major fp32 with a shape.
struct tensor {
  std::vector<float> values;
  long shape[2];
};
} // namespace mylib

//! [traits]
template <>
struct weave::tensor_traits<mylib::tensor> {
  static void* data(mylib::tensor& t) { return t.values.data(); }
  static const void* data(const mylib::tensor& t) { return t.values.data(); }
  static long rows(const mylib::tensor& t) { return t.shape[0]; }
  static long cols(const mylib::tensor& t) { return t.shape[1]; }
  static weave::dtype element_type(const mylib::tensor&) { return weave::dtype::f32; }
  static weave::memory_space space(const mylib::tensor&) { return weave::memory_space::host; }
  // optional: device(t), row_stride_bytes(t)
};
//! [traits]

int main() {
  mylib::tensor t{std::vector<float>(6 * 3, 1.5f), {6, 3}};
  weave::token_view rows = weave::make_token_view(t);
  float total = 0;
  for (std::size_t r = 0; r < rows.rows(); ++r)
    for (float x : rows.row_as<float>(r))
      total += x;
  std::printf("%zu tokens x %zu, sum %.1f\n", rows.rows(), rows.cols(), total);

  // An MoE layer over mylib tensors: 2 ranks, 4 experts (expert e multiplies by e + 1), top-2
  // with weights 0.5, so token t of rank r comes back as x * (e0 + e1 + 2) / 2.
  bool exact_on[2] = {true, true}; // one flag per rank thread
  weave::local_world world(2);
  world.run([&](weave::local_communicator& comm) {
    const long tokens = 5, hidden = 3;
    mylib::tensor x{std::vector<float>(tokens * hidden), {tokens, hidden}};
    mylib::tensor y{std::vector<float>(tokens * hidden), {tokens, hidden}};
    std::vector<std::int32_t> ids;
    std::vector<float> weights;
    for (long i = 0; i < tokens; ++i) {
      for (long h = 0; h < hidden; ++h)
        x.values[static_cast<std::size_t>(i * hidden + h)] = static_cast<float>(comm.rank() + i);
      ids.insert(ids.end(),
                 {static_cast<std::int32_t>(i % 4), static_cast<std::int32_t>((i + 1) % 4)});
      weights.insert(weights.end(), {0.5f, 0.5f});
    }
    weave::moe_options options;
    options.k = 2;
    options.hidden = hidden;
    options.max_tokens = tokens;
    weave::moe_exchange<weave::local_communicator> layer(
        comm, weave::placement::contiguous(4, comm.size()), options);
    weave::host_stream compute, stream;
    layer.forward(
        weave::make_token_view(std::as_const(x)), ids, weights, weave::make_token_view(y),
        [](const weave::expert_batch& b) {
          for (std::size_t l = 0; l + 1 < b.expert_offsets.size(); ++l)
            for (auto r = b.expert_offsets[l]; r < b.expert_offsets[l + 1]; ++r) {
              const auto in = b.input.row_as<float>(static_cast<std::size_t>(r));
              const auto out = b.output.row_as<float>(static_cast<std::size_t>(r));
              for (std::size_t h = 0; h < in.size(); ++h)
                out[h] = in[h] * static_cast<float>(b.experts[l] + 1);
            }
        },
        compute, stream);
    compute.synchronize();
    stream.synchronize();
    bool& exact = exact_on[comm.rank()];
    for (long i = 0; i < tokens; ++i) {
      const float want =
          static_cast<float>(comm.rank() + i) * static_cast<float>(i % 4 + (i + 1) % 4 + 2) / 2.0f;
      for (long h = 0; h < hidden; ++h)
        exact = exact && y.values[static_cast<std::size_t>(i * hidden + h)] == want;
    }
  });
  const bool exact = exact_on[0] && exact_on[1];
  std::printf("MoE layer over mylib::tensor on 2 ranks: %s\n", exact ? "exact" : "WRONG");
  return total == 27.0f && exact ? 0 : 1;
}
