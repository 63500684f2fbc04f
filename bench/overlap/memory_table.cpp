// weave-memory: the bytes an MoE layer's exchange holds per rank at a model's shape after a
// call, on host streams (the received rows sized for every peer sending every token, the expert
// rows from each call's counts) and on the CUDA path (the whole receive side sized from each
// call's counts), beside the bytes of the rows a call really uses. The layers are built for real
// over an in-process world of `--ranks` ranks (their workspace queries are the layers' own); what a
// call receives comes from uniformly random top-k routing of `--tokens` tokens per rank, counted
// exactly, and the sizes a call allocates for it are the layer's own (`receive_bytes_for`,
// `grown`). Prints a markdown table (one row per layer kind); `--help` lists the options and their
// ranges, and a bad option ends it with one line on stderr and status 2.
#include "command_line.hpp"

#include <weave/comm/local_world.hpp>
#include <weave/exec/emulated_gpu_space.hpp>
#include <weave/exec/host_space.hpp>
#include <weave/overlap/decode_exchange.hpp>
#include <weave/overlap/moe_exchange.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <string_view>
#include <vector>

namespace {

struct shape {
  std::string name = "custom";
  std::size_t hidden = 7168, tokens = 4096;
  int experts = 256, k = 8, ranks = 64, chunks = 1;
  double capacity = 0.0;
  std::uint32_t seed = 1;
};

shape parse_args(int argc, char** argv, bool& help) {
  shape s;
  cli::options o("weave-memory",
                 "Bytes an MoE layer's exchange holds per rank at a model's shape (docs/gpu.md). "
                 "--k at most --experts,\n--experts a multiple of --ranks. Options apply in "
                 "order: --preset replaces the shape given before it.\n");
  o.custom("preset", "deepseek-v3|mixtral", "a model's shape (default: the options' defaults)",
           [&s](std::string_view value) {
             if (value == "deepseek-v3")
               s = shape{"DeepSeek-V3", 7168, 4096, 256, 8, 64, 1, 0.0, s.seed};
             else if (value == "mixtral")
               s = shape{"Mixtral-8x7B", 4096, 4096, 8, 2, 8, 1, 0.0, s.seed};
             else
               throw cli::bad_option("--preset: expected deepseek-v3 or mixtral, got '" +
                                     cli::printable(value) + "'");
           });
  o.number("hidden", s.hidden, std::size_t{1}, std::size_t{1} << 20, "hidden size (bf16)");
  o.number("tokens", s.tokens, std::size_t{1}, std::size_t{1} << 20, "tokens per rank");
  o.number("experts", s.experts, 1, 1 << 16, "experts");
  o.number("k", s.k, 1, 64, "experts per token");
  o.number("ranks", s.ranks, 1, 256, "ranks (an in-process world)");
  o.number("chunks", s.chunks, 1, 64, "pipeline chunks");
  o.number("capacity", s.capacity, 0.0, 64.0, "capacity factor (0 = dropless)");
  o.number("seed", s.seed, std::uint32_t{0}, std::numeric_limits<std::uint32_t>::max(),
           "routing seed");
  help = !o.parse(argc, argv);
  if (help)
    return s;
  if (s.k > s.experts)
    throw cli::bad_option("--k must not exceed --experts");
  if (s.experts % s.ranks != 0)
    throw cli::bad_option("--experts must be a multiple of --ranks (one contiguous placement)");
  return s;
}

// What one rank receives per chunk under uniformly random routing: rows (one per token and
// device), EPD rows (one per token and expert); and what it sends (rows) per chunk.
struct traffic {
  std::vector<std::vector<std::size_t>> rows, pairs, sent; // [rank][chunk]
};

traffic route(const shape& s) {
  const auto R = static_cast<std::size_t>(s.ranks), C = static_cast<std::size_t>(s.chunks);
  const int spd = s.experts / s.ranks;
  traffic t{std::vector(R, std::vector<std::size_t>(C)),
            std::vector(R, std::vector<std::size_t>(C)),
            std::vector(R, std::vector<std::size_t>(C))};
  std::mt19937_64 rng(s.seed);
  std::vector<int> ids(static_cast<std::size_t>(s.experts));
  std::vector<int> per_device(R);
  for (std::size_t src = 0; src < R; ++src)
    for (std::size_t tok = 0; tok < s.tokens; ++tok) {
      std::size_t c = 0; // the chunk whose range [T c / C, T (c + 1) / C) holds tok
      while (tok >= s.tokens * (c + 1) / C)
        ++c;
      std::iota(ids.begin(), ids.end(), 0);
      for (int j = 0; j < s.k; ++j) // a partial Fisher-Yates draw: k distinct experts
        std::swap(
            ids[static_cast<std::size_t>(j)],
            ids[static_cast<std::size_t>(j) + rng() % (ids.size() - static_cast<std::size_t>(j))]);
      std::fill(per_device.begin(), per_device.end(), 0);
      for (int j = 0; j < s.k; ++j)
        ++per_device[static_cast<std::size_t>(ids[static_cast<std::size_t>(j)] / spd)];
      for (std::size_t d = 0; d < R; ++d)
        if (per_device[d] > 0) {
          ++t.rows[d][c];
          t.pairs[d][c] += static_cast<std::size_t>(per_device[d]);
          ++t.sent[src][c];
        }
    }
  return t;
}

std::string gib(double bytes) {
  char b[32];
  if (bytes >= 1024.0 * 1024.0 * 1024.0)
    std::snprintf(b, sizeof b, "%.2f GiB", bytes / (1024.0 * 1024.0 * 1024.0));
  else
    std::snprintf(b, sizeof b, "%.1f MiB", bytes / (1024.0 * 1024.0));
  return b;
}

int run(int argc, char** argv) {
  bool help = false;
  const shape s = parse_args(argc, argv, help);
  if (help)
    return 0;
  const traffic t = route(s);
  weave::moe_options o;
  o.k = s.k;
  o.hidden = s.hidden;
  o.element = weave::dtype::bf16;
  o.max_tokens = s.tokens;
  o.chunks = s.chunks;
  if (s.capacity > 0.0)
    o.capacity = {s.capacity, weave::drop_order::position, weave::capacity_rounding::ceil};
  const std::size_t row = s.hidden * 2;
  const auto where = weave::placement::contiguous(s.experts, s.ranks);
  struct row_out {
    std::size_t host = 0, after = 0, fixed = 0, used = 0, sent = 0;
  };
  std::vector<row_out> dynamic(static_cast<std::size_t>(s.ranks)),
      with_backward(static_cast<std::size_t>(s.ranks)), fixed(static_cast<std::size_t>(s.ranks)),
      fixed_capped(static_cast<std::size_t>(s.ranks));
  std::vector<std::size_t> decode128(static_cast<std::size_t>(s.ranks)), decode256(decode128),
      gathered128(decode128), gathered256(decode128);
  weave::local_world world(s.ranks);
  world.run([&](weave::local_communicator& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    for (const bool grads : {false, true}) {
      weave::moe_options d = o;
      d.save_for_backward = grads;
      weave::basic_moe_exchange<weave::host_space, weave::local_communicator> on_host(comm, where,
                                                                                      d);
      weave::basic_moe_exchange<weave::emulated_gpu_space, weave::local_communicator> after(
          comm, where, d);
      row_out& out = grads ? with_backward[r] : dynamic[r];
      out.host = on_host.workspace_size();
      out.after = after.workspace_size();
      // not rows: the workspace less what a chunk sends and gets back (2 row buffers per chunk)
      out.fixed =
          out.after - 2 * after.send_rows_capacity() * static_cast<std::size_t>(s.chunks) * row;
      std::size_t most_epd = 0;
      for (std::size_t c = 0; c < static_cast<std::size_t>(s.chunks); ++c) {
        const std::size_t rows = std::max<std::size_t>(t.rows[r][c], 1);
        const std::size_t epd = std::max<std::size_t>(t.pairs[r][c], 1);
        out.after += after.receive_bytes_for(after.grown(rows), after.grown(epd));
        out.host += on_host.receive_bytes_for(0, on_host.grown(epd)); // its expert rows
        most_epd = std::max(most_epd, epd);
        // send + returned, recv + back, expert inputs + outputs (+ the backward's two)
        out.used += (2 * t.sent[r][c] + 2 * t.rows[r][c] + 2 * t.pairs[r][c]) * row;
      }
      if (grads) {
        out.after += after.backward_bytes_for(after.grown(most_epd));
        out.host += on_host.backward_bytes_for(on_host.grown(most_epd));
        out.used += 2 * most_epd * row;
      }
    }
    for (const bool capped : {false, true}) {
      weave::moe_options st = o;
      st.static_shape = true;
      if (capped)
        st.capacity = {1.25, weave::drop_order::position, weave::capacity_rounding::ceil};
      weave::basic_moe_exchange<weave::emulated_gpu_space, weave::local_communicator> ex(comm,
                                                                                         where, st);
      row_out& out = capped ? fixed_capped[r] : fixed[r];
      out.after = ex.workspace_size();
      out.sent = ex.send_rows_capacity() * static_cast<std::size_t>(s.chunks) * row;
    }
    for (const std::size_t m : {std::size_t{128}, std::size_t{256}}) {
      weave::decode_options dec;
      dec.k = s.k;
      dec.hidden = s.hidden;
      dec.max_tokens_per_rank = m;
      using decode = weave::decode_exchange<weave::local_communicator, weave::bfloat16>;
      const auto ranks = static_cast<std::size_t>(s.ranks);
      const auto slots = static_cast<std::size_t>(where.slots_per_device());
      // sized, not built (64 ranks in one process): the same workspace in every space
      (m == 128 ? decode128 : decode256)[r] = decode::workspace_size(ranks, slots, dec);
      dec.gathered_inputs = true;
      (m == 128 ? gathered128 : gathered256)[r] = decode::workspace_size(ranks, slots, dec);
    }
  });
  const auto worst = [](const std::vector<row_out>& v) {
    return *std::max_element(v.begin(), v.end(),
                             [](const row_out& a, const row_out& b) { return a.after < b.after; });
  };
  const row_out dyn = worst(dynamic), bwd = worst(with_backward), fix = worst(fixed),
                fix_capped = worst(fixed_capped);
  const auto size = [](std::size_t b) { return gib(static_cast<double>(b)); };
  const auto ratio = [](std::size_t a, std::size_t b) {
    return static_cast<double>(a) / static_cast<double>(std::max<std::size_t>(b, 1));
  };
  std::printf("%s: H = %zu bf16, E = %d, k = %d, %d ranks, %zu tokens per rank, %d chunk%s%s\n\n",
              s.name.c_str(), s.hidden, s.experts, s.k, s.ranks, s.tokens, s.chunks,
              s.chunks == 1 ? "" : "s",
              s.capacity > 0.0 ? (", capacity " + std::to_string(s.capacity)).c_str() : "");
  std::printf("| layer (the rank holding most) | host streams: held after a call | CUDA: held "
              "after a call | rows the call used | CUDA / used | CUDA, not rows |\n"
              "|---|---|---|---|---|---|\n");
  for (const auto& [what, v] :
       {std::pair{"dynamic forward", dyn}, std::pair{"dynamic + save_for_backward", bwd}})
    std::printf("| %s | %s | %s | %s | %.2f | %s |\n", what, size(v.host).c_str(),
                size(v.after).c_str(), size(v.used).c_str(), ratio(v.after, v.used),
                size(v.fixed).c_str());
  for (const auto& [what, v] :
       {std::pair{"static, dropless", fix}, std::pair{"static, capacity 1.25", fix_capped}})
    std::printf("| %s (sends %s per call) | | %s | %s | %.2f | |\n", what, size(v.sent).c_str(),
                size(v.after).c_str(), size(dyn.used).c_str(), ratio(v.after, dyn.used));
  std::printf("| decode, 128 / 256 tokens per rank | %s / %s | %s / %s | | | |\n",
              size(*std::max_element(decode128.begin(), decode128.end())).c_str(),
              size(*std::max_element(decode256.begin(), decode256.end())).c_str(),
              size(*std::max_element(decode128.begin(), decode128.end())).c_str(),
              size(*std::max_element(decode256.begin(), decode256.end())).c_str());
  std::printf("| decode, gathered inputs, 128 / 256 tokens per rank | %s / %s | %s / %s | | | |\n",
              size(*std::max_element(gathered128.begin(), gathered128.end())).c_str(),
              size(*std::max_element(gathered256.begin(), gathered256.end())).c_str(),
              size(*std::max_element(gathered128.begin(), gathered128.end())).c_str(),
              size(*std::max_element(gathered256.begin(), gathered256.end())).c_str());
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  return cli::run_main("weave-memory", [&] { return run(argc, argv); });
}
