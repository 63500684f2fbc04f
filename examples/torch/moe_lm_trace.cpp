// Records a learned routing trace: trains a small byte-level MoE language model with libtorch on
// a real text corpus (the fortune cookies Debian's `fortunes` package installs), then writes the
// routing of every MoE layer on held-out text (token -> top-k experts and their gate scores) as
// a weave trace (format version 2).
//
// The model: byte embedding + learned positions, `layers` pre-norm blocks of causal
// self-attention and an MoE feed-forward (E experts, each a 2-layer GELU MLP; a softmax gate
// picks the top k, weights are the unrenormalised probabilities as in OLMoE; an expert takes
// at most capacity · N·k / E of a batch's N·k choices, as GShard and Switch train), tied output
// projection. Training: AdamW on next-byte cross entropy plus the Switch/GShard load-balancing
// loss (coefficient 0.01), for a number of steps or a wall-clock budget. Recording (dropless):
// each layer's gate logits go through weave's own `top_k_gate` (softmax, top-k), checked
// against torch's top-k.
//
//   moe_lm_trace --out FILE [--corpus DIR] [--steps N | --minutes M] [--experts E] [--k K]
//                [--layers L] [--dim D] [--expert-dim F] [--context C] [--batch B]
//                [--capacity F] [--tokens N] [--seed S]
// (`--name=value` works too; `--help` lists the ranges; a bad option ends it with one line on
// stderr and status 2.)
//
// examples/torch/record_trace.sh installs the corpus and regenerates the shipped trace.
#include "command_line.hpp"
#include "torch_tensor.hpp"

#include <torch/torch.h>

#include <weave/placement/trace_io.hpp>
#include <weave/routing/gate.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace {

struct settings {
  std::string corpus = "/usr/share/games/fortunes";
  std::string out;
  double minutes = 4.0; // training budget when `steps` is 0
  int steps = 0;        // training steps (deterministic), or 0 for the time budget
  int experts = 64, k = 8, layers = 4;
  std::int64_t dim = 64, expert_dim = 64, heads = 4, context = 64, batch = 16;
  std::size_t tokens = 8192; // recorded per layer (half to profile, half to evaluate)
  double lr = 3e-3, aux = 0.01;
  double capacity = 2.0; // expert capacity factor while training
  int seed = 1;
};

// Parses the options; false for --help.
bool parse(int argc, char** argv, settings& s) {
  cli::options o("moe_lm_trace",
                 "Trains a small byte-level MoE language model on a text corpus and writes the "
                 "routing of its MoE\nlayers on held-out text as a weave trace (version 2). --out "
                 "is required; --k at most --experts;\n--dim a multiple of 4 (the heads).\n");
  o.text("out", s.out, "FILE", "the trace to write");
  o.text("corpus", s.corpus, "DIR", "fortune files (Debian's fortunes package)");
  o.number("minutes", s.minutes, 1e-3, 10080.0, "training time budget when --steps is 0");
  o.number("steps", s.steps, 0, 10000000, "training steps (0: the time budget)");
  o.number("experts", s.experts, 1, 1024, "experts per layer");
  o.number("k", s.k, 1, 64, "experts per token");
  o.number("layers", s.layers, 1, 64, "transformer blocks");
  o.number("dim", s.dim, std::int64_t{4}, std::int64_t{4096}, "model width");
  o.number("expert-dim", s.expert_dim, std::int64_t{1}, std::int64_t{16384}, "expert MLP width");
  o.number("context", s.context, std::int64_t{1}, std::int64_t{4096}, "context length, bytes");
  o.number("batch", s.batch, std::int64_t{1}, std::int64_t{4096}, "sequences per step");
  o.number("tokens", s.tokens, std::size_t{2}, std::size_t{1} << 24, "tokens recorded per layer");
  o.number("capacity", s.capacity, 0.01, 64.0, "expert capacity factor while training");
  o.number("seed", s.seed, 0, std::numeric_limits<int>::max(), "seed");
  if (!o.parse(argc, argv))
    return false;
  if (s.out.empty())
    throw cli::bad_option("--out FILE is required");
  if (s.k > s.experts)
    throw cli::bad_option("--k: " + std::to_string(s.k) + " exceeds --experts " +
                          std::to_string(s.experts));
  if (s.dim % s.heads != 0)
    throw cli::bad_option("--dim: " + std::to_string(s.dim) + " is not a multiple of the " +
                          std::to_string(s.heads) + " heads");
  return true;
}

// The corpus: every fortune file (not the .dat indexes or .u8 links), split into cookies at
// the "%" lines, shuffled with the seed; the last tenth is held out for recording.
struct corpus {
  std::string train, held_out;
};

corpus load_corpus(const settings& s) {
  std::vector<std::filesystem::path> files;
  for (const auto& entry : std::filesystem::directory_iterator(s.corpus))
    if (entry.is_regular_file() && !entry.is_symlink() && entry.path().extension() != ".dat")
      files.push_back(entry.path());
  std::sort(files.begin(), files.end());
  std::vector<std::string> cookies;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    std::string line, cookie;
    while (std::getline(in, line)) {
      if (line == "%") {
        if (!cookie.empty())
          cookies.push_back(cookie);
        cookie.clear();
      } else {
        cookie += line + '\n';
      }
    }
    if (!cookie.empty())
      cookies.push_back(cookie);
  }
  if (cookies.size() < 100)
    throw std::runtime_error(std::to_string(cookies.size()) + " texts under " + s.corpus +
                             " (install Debian's fortunes)");
  std::mt19937 rng(static_cast<unsigned>(s.seed));
  std::shuffle(cookies.begin(), cookies.end(), rng);
  corpus c;
  const std::size_t held = cookies.size() / 10;
  for (std::size_t i = 0; i < cookies.size(); ++i)
    (i < cookies.size() - held ? c.train : c.held_out) += cookies[i] + "\n";
  std::printf("corpus: %zu files, %zu texts, %zu bytes to train on, %zu held out\n", files.size(),
              cookies.size(), c.train.size(), c.held_out.size());
  return c;
}

// [B, T] byte windows starting at `starts`, as int64.
torch::Tensor windows(const std::string& text, const std::vector<std::size_t>& starts,
                      std::int64_t len) {
  auto t = torch::empty({static_cast<std::int64_t>(starts.size()), len}, torch::kInt64);
  auto a = t.accessor<std::int64_t, 2>();
  for (std::size_t b = 0; b < starts.size(); ++b)
    for (std::int64_t i = 0; i < len; ++i)
      a[static_cast<std::int64_t>(b)][i] =
          static_cast<unsigned char>(text[starts[b] + static_cast<std::size_t>(i)]);
  return t;
}

// One MoE feed-forward: gate + E experts (stacked weights), computed expert by expert.
struct moe_ffn : torch::nn::Module {
  moe_ffn(const settings& s)
      : s_(s) {
    const double in = 1.0 / std::sqrt(static_cast<double>(s.dim));
    const double mid = 1.0 / std::sqrt(static_cast<double>(s.expert_dim));
    gate = register_parameter("gate", torch::randn({s.dim, s.experts}) * in);
    w1 = register_parameter("w1", torch::randn({s.experts, s.dim, s.expert_dim}) * in);
    w2 = register_parameter("w2", torch::randn({s.experts, s.expert_dim, s.dim}) * mid);
  }

  // h: [N, D]. Returns the output and adds the load-balancing loss to `aux`; keeps the gate
  // logits of the last call for recording.
  torch::Tensor forward(const torch::Tensor& h, torch::Tensor& aux) {
    logits = h.mm(gate);
    const auto probs = torch::softmax(logits, 1);
    const auto [top, ids] = probs.topk(s_.k, 1);
    // Batched with a capacity (GShard/Switch): the (token, choice) pairs sorted by expert into
    // an [E, C, D] block, C = capacity · pairs / E; pairs past an expert's C are dropped (zero
    // output) while training. Two batched matmuls, then the gate-weighted outputs summed back.
    const auto flat_ids = ids.flatten();
    const auto order = std::get<1>(flat_ids.sort(c10::optional<bool>(true), 0, false));
    const auto sorted = flat_ids.index_select(0, order);
    const auto counts = torch::bincount(flat_ids, {}, s_.experts);
    const auto first = counts.cumsum(0) - counts;
    // Recording (eval mode) is dropless: C is the busiest expert's count.
    const auto C = is_training()
                       ? static_cast<std::int64_t>(std::ceil(
                             s_.capacity * static_cast<double>(flat_ids.numel()) / s_.experts))
                       : counts.max().item<std::int64_t>();
    const auto pos = torch::arange(order.numel(), torch::kInt64) - first.index_select(0, sorted);
    const auto kept = (pos < C).nonzero().squeeze(1);
    const auto slot = (sorted * C + pos).index_select(0, kept);
    const auto pair = order.index_select(0, kept);
    const auto token = pair.div(s_.k, "floor");
    const auto x =
        torch::zeros({s_.experts * C, s_.dim}).index_copy(0, slot, h.index_select(0, token));
    const auto mid = torch::gelu(x.view({s_.experts, C, s_.dim}).bmm(w1));
    const auto out = mid.bmm(w2).view({s_.experts * C, s_.dim}).index_select(0, slot);
    const auto y = torch::zeros_like(h).index_add(
        0, token, out * top.flatten().index_select(0, pair).unsqueeze(1));
    dropped += flat_ids.numel() - kept.numel();
    // Switch/GShard: E * sum_e (fraction of choices routed to e) * (mean probability of e).
    const auto fraction = counts.to(torch::kFloat32) / static_cast<double>(flat_ids.numel());
    aux = aux + s_.experts * (fraction * probs.mean(0)).sum();
    return y;
  }

  settings s_;
  torch::Tensor gate, w1, w2, logits;
  std::int64_t dropped = 0; // pairs past capacity, since the last reset
};

struct block : torch::nn::Module {
  block(const settings& s)
      : s_(s) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({s.dim})));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({s.dim})));
    qkv = register_module("qkv", torch::nn::Linear(s.dim, 3 * s.dim));
    proj = register_module("proj", torch::nn::Linear(s.dim, s.dim));
    moe = register_module("moe", std::make_shared<moe_ffn>(s));
  }

  torch::Tensor forward(const torch::Tensor& x, torch::Tensor& aux) {
    const std::int64_t B = x.size(0), T = x.size(1), D = s_.dim, H = s_.heads;
    const auto parts = qkv(ln1(x)).view({B, T, 3, H, D / H}).permute({2, 0, 3, 1, 4});
    auto att = parts[0].matmul(parts[1].transpose(-2, -1)) / std::sqrt(static_cast<double>(D / H));
    const auto mask = torch::ones({T, T}, torch::kBool).triu(1);
    att = torch::softmax(att.masked_fill(mask, -1e9), -1);
    const auto a = att.matmul(parts[2]).transpose(1, 2).reshape({B, T, D});
    auto y = x + proj(a);
    return y + moe->forward(ln2(y).view({B * T, D}), aux).view({B, T, D});
  }

  settings s_;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr};
  std::shared_ptr<moe_ffn> moe;
};

struct language_model : torch::nn::Module {
  language_model(const settings& s)
      : s_(s) {
    embed = register_parameter("embed", torch::randn({256, s.dim}) * 0.02);
    position = register_parameter("position", torch::randn({s.context, s.dim}) * 0.02);
    for (int l = 0; l < s.layers; ++l)
      blocks.push_back(register_module("block" + std::to_string(l), std::make_shared<block>(s)));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({s.dim})));
  }

  // bytes: [B, T]. Returns next-byte logits [B, T, 256] and the summed load-balancing loss.
  std::pair<torch::Tensor, torch::Tensor> forward(const torch::Tensor& bytes) {
    const std::int64_t T = bytes.size(1);
    auto x = embed.index_select(0, bytes.flatten()).view({bytes.size(0), T, s_.dim}) +
             position.narrow(0, 0, T);
    auto aux = torch::zeros({});
    for (auto& b : blocks)
      x = b->forward(x, aux);
    return {norm(x).matmul(embed.t()), aux};
  }

  settings s_;
  torch::Tensor embed, position;
  std::vector<std::shared_ptr<block>> blocks;
  torch::nn::LayerNorm norm{nullptr};
};

int run(int argc, char** argv) {
  settings s;
  if (!parse(argc, argv, s))
    return 0; // --help
  torch::manual_seed(static_cast<std::uint64_t>(s.seed));
  const corpus text = load_corpus(s);
  if (text.train.size() < static_cast<std::size_t>(s.context) + 2)
    throw cli::bad_option("--context: " + std::to_string(s.context) + " exceeds the " +
                          std::to_string(text.train.size()) + " bytes to train on");
  // Checked before training, which may take minutes: the held-out windows the recording reads.
  const std::size_t windows_needed =
      (s.tokens + static_cast<std::size_t>(s.context) - 1) / static_cast<std::size_t>(s.context);
  if (windows_needed * static_cast<std::size_t>(s.context) > text.held_out.size())
    throw cli::bad_option("--tokens: the " + std::to_string(text.held_out.size()) +
                          " held-out bytes are too few for " + std::to_string(s.tokens) +
                          " tokens");
  language_model model(s);
  torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(s.lr).weight_decay(0.01));
  std::mt19937_64 rng(static_cast<std::uint64_t>(s.seed));
  std::uniform_int_distribution<std::size_t> pick(0, text.train.size() -
                                                         static_cast<std::size_t>(s.context) - 2);
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  std::printf("model: %d layers, dim %lld, %d experts (MLP %lld), top-%d, context %lld, batch "
              "%lld\n",
              s.layers, static_cast<long long>(s.dim), s.experts,
              static_cast<long long>(s.expert_dim), s.k, static_cast<long long>(s.context),
              static_cast<long long>(s.batch));
  int step = 0;
  double smoothed = 0;
  for (; s.steps > 0 ? step < s.steps : elapsed() < 60.0 * s.minutes; ++step) {
    std::vector<std::size_t> starts(static_cast<std::size_t>(s.batch));
    for (auto& x : starts)
      x = pick(rng);
    const auto seq = windows(text.train, starts, s.context + 1);
    const auto [logits, aux] = model.forward(seq.narrow(1, 0, s.context));
    const auto ce = torch::cross_entropy_loss(logits.reshape({-1, 256}),
                                              seq.narrow(1, 1, s.context).reshape({-1}));
    const auto loss = ce + s.aux * aux / s.layers;
    opt.zero_grad();
    loss.backward();
    opt.step();
    const double bits = ce.item<double>() / std::log(2.0);
    smoothed = step == 0 ? bits : 0.98 * smoothed + 0.02 * bits;
    if (step % 100 == 0) {
      std::int64_t dropped = 0;
      for (auto& b : model.blocks)
        dropped += std::exchange(b->moe->dropped, 0);
      const double pairs = static_cast<double>(s.layers) * static_cast<double>(s.batch) *
                           static_cast<double>(s.context * s.k) * (step == 0 ? 1 : 100);
      std::printf("step %5d  %6.0f s  bits/byte %.3f (smoothed %.3f)  balance loss %.3f  "
                  "dropped %.1f %%\n",
                  step, elapsed(), bits, smoothed, aux.item<double>() / s.layers,
                  100.0 * static_cast<double>(dropped) / pairs);
    }
  }
  std::printf("trained %d steps (%zu bytes seen) in %.0f s\n", step,
              static_cast<std::size_t>(step) * static_cast<std::size_t>(s.batch * s.context),
              elapsed());

  // Record: consecutive held-out windows, every layer's gate through weave's top_k_gate.
  torch::NoGradGuard no_grad;
  model.eval();
  weave::layered_trace trace;
  trace.layers.resize(static_cast<std::size_t>(s.layers));
  trace.scores.resize(static_cast<std::size_t>(s.layers));
  for (auto& t : trace.layers) {
    t.num_experts = s.experts;
    t.k = s.k;
  }
  double held_bits = 0;
  std::size_t mismatched = 0, recorded = 0;
  weave::gate_options gate;
  gate.k = s.k;
  weave::gate_scratch scratch;
  for (std::size_t w = 0; w < windows_needed; w += static_cast<std::size_t>(s.batch)) {
    std::vector<std::size_t> starts;
    for (std::size_t i = w; i < std::min(windows_needed, w + static_cast<std::size_t>(s.batch));
         ++i)
      starts.push_back(i * static_cast<std::size_t>(s.context));
    const auto seq = windows(text.held_out, starts, s.context + 1);
    const auto [logits, aux] = model.forward(seq.narrow(1, 0, s.context));
    held_bits += torch::cross_entropy_loss(logits.reshape({-1, 256}),
                                           seq.narrow(1, 1, s.context).reshape({-1}))
                     .item<double>() *
                 static_cast<double>(starts.size());
    const std::size_t n =
        std::min(s.tokens - recorded, starts.size() * static_cast<std::size_t>(s.context));
    for (int l = 0; l < s.layers; ++l) {
      const auto g = model.blocks[static_cast<std::size_t>(l)]
                         ->moe->logits.narrow(0, 0, static_cast<std::int64_t>(n))
                         .contiguous();
      std::vector<std::int32_t> ids(n * static_cast<std::size_t>(s.k));
      std::vector<float> scores(ids.size());
      weave::top_k_gate(weave::make_token_view(g), gate, ids, scores, scratch);
      const auto torch_ids =
          std::get<1>(torch::softmax(g, 1).topk(s.k, 1)).to(torch::kInt32).contiguous();
      const std::int32_t* tid = torch_ids.data_ptr<std::int32_t>();
      auto& t = trace.layers[static_cast<std::size_t>(l)];
      auto& sc = trace.scores[static_cast<std::size_t>(l)];
      for (std::size_t i = 0; i < ids.size(); ++i) {
        mismatched += ids[i] != tid[i];
        t.ids.push_back(ids[i]);
        sc.push_back(std::round(scores[i] * 1e4f) / 1e4f); // 4 decimals keep the file small
      }
    }
    recorded += n;
  }
  std::printf("held-out bits/byte %.3f; recorded %zu tokens x %d layers; weave's gate and torch's "
              "top-k disagree on %zu of %zu choices (ties)\n",
              held_bits / static_cast<double>(windows_needed) / std::log(2.0), recorded, s.layers,
              mismatched, recorded * static_cast<std::size_t>(s.k * s.layers));
  for (int l = 0; l < s.layers; ++l) {
    std::vector<double> load(static_cast<std::size_t>(s.experts), 0.0);
    for (const auto e : trace.layers[static_cast<std::size_t>(l)].ids)
      load[static_cast<std::size_t>(e)] += 1;
    const double mean = static_cast<double>(recorded * static_cast<std::size_t>(s.k)) / s.experts;
    std::printf("layer %d: expert load max/mean %.2f, min/mean %.2f\n", l,
                *std::max_element(load.begin(), load.end()) / mean,
                *std::min_element(load.begin(), load.end()) / mean);
  }
  weave::write_trace_layers_file(s.out, trace);
  std::printf("wrote %s\n", s.out.c_str());
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  return cli::run_main("moe_lm_trace", [&] { return run(argc, argv); });
}
