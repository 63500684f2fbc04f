// The setup the MoE exchange benchmarks share: 4 in-process ranks on a slow emulated link (so
// that the emulated costs dominate the CPU work of a 2-core machine), E = 32, k = 4, hidden 256
// bf16; each rank's tokens with random distinct top-k choices; and the stand-in for the
// operators around the layer (it sleeps a given time per token and touches its rows).
#pragma once

#include <weave/comm/emulated_link.hpp>
#include <weave/core/dtype.hpp>
#include <weave/core/host_matrix.hpp>
#include <weave/overlap/moe_options.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

namespace moe_bench {

constexpr int ranks = 4, experts = 32, k = 4;
constexpr std::size_t hidden = 256;
constexpr double link_bytes_per_second = 0.05e9;
using row_t = weave::bfloat16;

inline weave::emulated_link link() {
  return weave::emulated_link{{}, link_bytes_per_second};
}

// The exchange's options for `tokens` tokens per call in `chunks` chunks.
inline weave::moe_options options(std::size_t tokens, int chunks) {
  weave::moe_options o;
  o.k = k;
  o.hidden = hidden;
  o.element = weave::dtype::bf16;
  o.max_tokens = tokens;
  o.chunks = chunks;
  return o;
}

// One rank's tokens: rows, top-k ids (distinct, uniform) and equal weights.
struct rank_data {
  weave::host_matrix<row_t> x, y;
  std::vector<std::int32_t> ids;
  std::vector<float> weights;
};

// `tokens` rows of `hidden` elements, each choosing `top_k` distinct uniform experts of `experts`.
inline rank_data random_tokens(std::size_t tokens, std::size_t hidden_size, int experts_count,
                               int top_k, std::mt19937& rng) {
  rank_data d{weave::host_matrix<row_t>(tokens, hidden_size),
              weave::host_matrix<row_t>(tokens, hidden_size),
              {},
              {}};
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (row_t& v : d.x.elements())
    v = row_t(n(rng));
  std::vector<int> all(static_cast<std::size_t>(experts_count));
  for (int e = 0; e < experts_count; ++e)
    all[static_cast<std::size_t>(e)] = e;
  for (std::size_t t = 0; t < tokens; ++t) {
    std::shuffle(all.begin(), all.end(), rng);
    for (int j = 0; j < top_k; ++j) {
      d.ids.push_back(all[static_cast<std::size_t>(j)]);
      d.weights.push_back(1.0f / static_cast<float>(top_k));
    }
  }
  return d;
}

inline rank_data make_rank_data(std::size_t tokens, std::mt19937& rng) {
  return random_tokens(tokens, hidden, experts, k, rng);
}

// A producer or consumer stand-in on tokens [first, first + count): touches the rows and
// sleeps `ns_per_token` per token (as an accelerator would leave the CPU free).
inline void around_op(weave::host_matrix<row_t>& rows, std::size_t first, std::size_t count,
                      double ns_per_token) {
  std::memmove(rows.data() + first * hidden, rows.data() + first * hidden,
               count * hidden * sizeof(row_t));
  std::this_thread::sleep_for(std::chrono::nanoseconds(
      static_cast<std::int64_t>(ns_per_token * static_cast<double>(count))));
}

// The expert stand-in: copies each expert row to its output (a cheap exact "expert") and sleeps
// `ns_per_row` per row.
inline void emulated_experts(weave::const_token_view in, weave::token_view out,
                             std::span<const std::int64_t> offsets, double ns_per_row) {
  for (std::size_t l = 0; l + 1 < offsets.size(); ++l)
    for (auto i = offsets[l]; i < offsets[l + 1]; ++i)
      std::memcpy(out.row(static_cast<std::size_t>(i)), in.row(static_cast<std::size_t>(i)),
                  in.row_bytes());
  std::this_thread::sleep_for(std::chrono::nanoseconds(
      static_cast<std::int64_t>(ns_per_row * static_cast<double>(offsets.back()))));
}

// The decode benchmarks' experts: each output row a copy of its input (no compute), so a layer's
// time is its exchange's.
inline void copy_experts(const weave::expert_batch& b) {
  std::memcpy(b.output.data(), b.input.data(), b.input.rows() * b.input.row_bytes());
}

// A decode layer's experts, copying their inputs to their outputs: one block per expert that
// received rows, or with gathered inputs (`decode_options::gathered_inputs`) each row from
// where it arrived.
template <class Experts>
void copy_decode_experts(const Experts& xs, bool gathered, std::size_t row_bytes) {
  for (const int l : xs.busy())
    if (gathered) {
      const auto rows = xs.input_rows(l);
      auto* out = reinterpret_cast<std::byte*>(xs.output(l).data());
      for (std::size_t i = 0; i < rows.size(); ++i)
        std::memcpy(out + i * row_bytes, rows[i], row_bytes);
    } else {
      std::memcpy(xs.output(l).data(), xs.input(l).data(), xs.input(l).size_bytes());
    }
}

} // namespace moe_bench
