// Training a small MoE transformer block with libtorch and weave, one MPI process per rank.
//
// The block is out = x + moe(layer_norm(x)): a top-k softmax gate (torch ops, replicated on
// every rank, gradients all-reduced) picks k of E experts per token; each expert is a 2-layer
// ReLU MLP owned by exactly one rank (E / world per rank, placed by a weave placement). weave's
// moe_exchange dispatches the tokens to their experts and combines the results through handles,
// pipelined over chunks, with the layer's own expert compute between; each step's tokens are
// two micro-batches in flight together (the second's communication overlaps the first's
// computation), inside a torch::autograd::Function, so the loss gradient reaches the gate
// through the gate-weight gradients (dw) and the expert parameters through the experts'
// backward.
//
// Every step, every rank also trains a dense single-process copy of the same model (same
// initialisation, all ranks' tokens, every token through its k experts by masking) and checks
// that the two losses agree. With --replace-every=N the trainer re-places the experts every N
// steps from co-activation statistics (place_collaborative), migrates weights and optimizer
// state between ranks (plan_migration, MPI point to point), and checks that the losses are
// bitwise those of a second run that never re-places.
//
// Elastic (--ranks=N --lose-rank=R --lose-step=S): the ranks are threads of one process on a
// `local_world`, the experts are placed survivably (two copies of each on distinct ranks, their
// gradients summed over the copies), and rank R is lost in its experts' backward at step S. The
// survivors shrink the world, re-place the experts on themselves (plan_after_loss), receive the
// weights and optimizer state of the copies they lack from the survivors holding them
// (move_expert_state), rebuild the layer and redo the step; the dense copy goes on with the
// survivors' tokens, and the losses must still agree at every step.
//
// Exits 0 only if the losses agree at every step and the loss decreased; `--help` lists the
// options (`--name=value` or `--name value`) and their ranges, and a bad option ends every rank
// with one line on stderr and status 2.
#include "command_line.hpp"
#include "torch_tensor.hpp"

#include <mpi.h>
#include <torch/torch.h>

#include <weave/comm/local_world.hpp>
#include <weave/comm/mpi_communicator.hpp>
#include <weave/comm/shrink.hpp>
#include <weave/core/checked.hpp>
#include <weave/core/mpi_error.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/overlap/expert_state_moves.hpp>
#include <weave/overlap/moe_exchange.hpp>
#include <weave/placement.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace {

struct settings {
  int steps = 300;
  std::int64_t tokens = 64; // per rank
  std::int64_t hidden = 32;
  std::int64_t ffn = 64;
  int experts = 8;
  int k = 2;
  int chunks = 2;
  double lr = 0.2;
  double momentum = 0.9;
  int seed = 7;
  double tolerance = 1e-5; // relative, distributed vs dense loss
  int replace_every = 0;   // 0: never re-place
  int print_every = 25;
  int ranks = 0;      // > 0: in-process ranks instead of MPI processes
  int lose_rank = -1; // >= 0: this rank is lost (in-process only)
  int lose_step = -1;
};

// Torch's default generator is one per process: in-process ranks take turns with it.
std::mutex& rng_mutex() {
  static std::mutex m;
  return m;
}

// Parses the options; false for --help. The ranges keep the dense reference copy, which every
// rank holds for all ranks' tokens, within a few GiB.
bool parse(int argc, char** argv, settings& s) {
  cli::options o("moe_trainer",
                 "Trains a small MoE block with libtorch and weave over MPI ranks (run under "
                 "mpirun) and checks it\nagainst a dense copy. --k at most --experts; --experts a "
                 "multiple of the ranks; --experts x --hidden\nx --ffn at most 2^26.\n");
  o.number("steps", s.steps, 1, 100000, "training steps");
  o.number("tokens", s.tokens, std::int64_t{1}, std::int64_t{1} << 16, "tokens per rank and step");
  o.number("hidden", s.hidden, std::int64_t{1}, std::int64_t{4096}, "hidden size");
  o.number("ffn", s.ffn, std::int64_t{1}, std::int64_t{16384}, "expert MLP hidden size");
  o.number("experts", s.experts, 1, 1024, "experts");
  o.number("k", s.k, 1, 64, "experts per token");
  o.number("chunks", s.chunks, 1, 64, "pipeline chunks");
  o.number("lr", s.lr, 1e-9, 10.0, "learning rate (SGD with momentum)");
  o.number("tolerance", s.tolerance, 0.0, 1.0, "relative loss gap allowed against the dense copy");
  o.number("replace-every", s.replace_every, 0, 100000,
           "re-place the experts every N steps (0: never)");
  o.number("print-every", s.print_every, 1, 100000, "print the loss every N steps");
  o.number("seed", s.seed, 0, std::numeric_limits<int>::max(), "seed");
  o.number("ranks", s.ranks, 0, 64, "in-process ranks (0: one MPI process per rank)");
  o.number("lose-rank", s.lose_rank, -1, 63, "in-process: the rank lost (-1: none)");
  o.number("lose-step", s.lose_step, -1, 100000, "the step it is lost in");
  if (!o.parse(argc, argv))
    return false;
  if (s.lose_rank >= 0 && (s.ranks < 2 || s.lose_rank >= s.ranks))
    throw cli::bad_option("--lose-rank: " + std::to_string(s.lose_rank) +
                          " needs --ranks of 2 or more, above it");
  if (s.lose_rank >= 0 && s.replace_every > 0)
    throw cli::bad_option("--lose-rank: not with --replace-every");
  if (s.k > s.experts)
    throw cli::bad_option("--k: " + std::to_string(s.k) + " exceeds --experts " +
                          std::to_string(s.experts));
  if (s.experts * s.hidden * s.ffn > (std::int64_t{1} << 26))
    throw cli::bad_option("--experts x --hidden x --ffn exceeds 2^26");
  return true;
}

// --- parameters -------------------------------------------------------------------------------

// One expert's parameters and optimizer state, each one flat tensor so that migrating an expert
// is sending two buffers. `grad` accumulates over the backward's chunks.
//! [expert_state]
struct expert_state {
  torch::Tensor weights, velocity, grad;
};
//! [expert_state]

struct expert_views {
  torch::Tensor w1, b1, w2, b2; // (H, F), (F), (F, H), (H)
};

std::int64_t expert_size(const settings& s) {
  return 2 * s.hidden * s.ffn + s.ffn + s.hidden;
}

expert_views unpack(const torch::Tensor& flat, const settings& s) {
  const std::int64_t H = s.hidden, F = s.ffn;
  return {flat.narrow(0, 0, H * F).view({H, F}), flat.narrow(0, H * F, F),
          flat.narrow(0, H * F + F, F * H).view({F, H}), flat.narrow(0, 2 * H * F + F, H)};
}

// Expert `e`'s initial weights depend only on (seed, e): any rank, and the dense reference,
// can create any expert without communication.
torch::Tensor initial_expert(int e, const settings& s) {
  std::lock_guard lock(rng_mutex());
  torch::manual_seed(static_cast<std::uint64_t>(s.seed) * 1000 + static_cast<std::uint64_t>(e));
  const auto w1 = torch::randn({s.hidden, s.ffn}) / std::sqrt(static_cast<double>(s.hidden));
  const auto w2 = torch::randn({s.ffn, s.hidden}) / std::sqrt(static_cast<double>(s.ffn));
  return torch::cat({w1.flatten(), torch::zeros({s.ffn}), w2.flatten(), torch::zeros({s.hidden})});
}

expert_state make_expert_state(torch::Tensor weights) {
  return {weights, torch::zeros_like(weights), torch::zeros_like(weights)};
}

torch::Tensor initial_gate(const settings& s) {
  std::lock_guard lock(rng_mutex());
  torch::manual_seed(static_cast<std::uint64_t>(s.seed) * 1000 + 999);
  const auto w = torch::randn({s.hidden, s.experts}) * 0.1;
  return torch::cat({w.flatten(), torch::zeros({s.experts})});
}

std::pair<torch::Tensor, torch::Tensor> gate_views(const torch::Tensor& flat, const settings& s) {
  const std::int64_t H = s.hidden, E = s.experts;
  return {flat.narrow(0, 0, H * E).view({H, E}), flat.narrow(0, H * E, E)};
}

torch::Tensor expert_forward(const expert_views& p, const torch::Tensor& x) {
  return torch::relu(x.mm(p.w1) + p.b1).mm(p.w2) + p.b2;
}

// The expert backward written out (the dense reference uses autograd instead, so the two
// gradients are computed independently). Adds the parameter gradients to `grad` and returns
// the input gradient.
torch::Tensor expert_backward(const expert_views& p, const expert_views& grad,
                              const torch::Tensor& x, const torch::Tensor& dy) {
  const auto a = x.mm(p.w1) + p.b1;
  const auto h = torch::relu(a);
  const auto da = dy.mm(p.w2.t()) * (a > 0).to(dy.scalar_type());
  grad.w1.add_(x.t().mm(da));
  grad.b1.add_(da.sum(0));
  grad.w2.add_(h.t().mm(dy));
  grad.b2.add_(dy.sum(0));
  return da.mm(p.w1.t());
}

// Momentum SGD, in place.
void sgd_step(torch::Tensor& weights, torch::Tensor& velocity, const torch::Tensor& grad,
              const settings& s) {
  torch::NoGradGuard no_grad;
  velocity.mul_(s.momentum).add_(grad);
  weights.sub_(velocity * s.lr);
}

// "[0 1 2 3 | 4 5 6 7]": the experts of each device.
std::string describe(const weave::placement& p) {
  std::string out = "[";
  for (int slot = 0; slot < p.num_devices() * p.slots_per_device(); ++slot) {
    if (slot > 0)
      out += slot % p.slots_per_device() == 0 ? " | " : " ";
    const int e = p.expert_of_slot(slot);
    out += e == weave::placement::empty_slot ? std::string("-") : std::to_string(e);
  }
  return out + "]";
}

// --- the task -------------------------------------------------------------------------------

struct batch {
  torch::Tensor x, target; // all ranks' tokens, rank-major
};

// A synthetic regression: the target is x + 0.5 tanh(layer_norm(x) A) for a fixed A.
batch make_batch(int step, int world, const settings& s, const torch::Tensor& teacher) {
  std::lock_guard lock(rng_mutex());
  torch::manual_seed(static_cast<std::uint64_t>(s.seed) * 7919 + static_cast<std::uint64_t>(step));
  auto x = torch::randn({world * s.tokens, s.hidden});
  auto h = torch::layer_norm(x, {s.hidden});
  return {x, x + 0.5 * torch::tanh(h.mm(teacher))};
}

struct routing {
  torch::Tensor weights, ids; // (T, k) f32 differentiable, (T, k) int32
};

routing route(const torch::Tensor& h, const torch::Tensor& gate_flat, const settings& s) {
  const auto [wg, bg] = gate_views(gate_flat, s);
  const auto probs = torch::softmax(h.mm(wg) + bg, 1);
  const auto [top, ids] = probs.topk(s.k, 1);
  return {top / top.sum(1, true), ids.to(torch::kInt32).contiguous()};
}

// --- the distributed layer --------------------------------------------------------------------

// Thrown by the rank `--lose-rank` names: its device is gone.
struct lost_device : std::runtime_error {
  lost_device()
      : std::runtime_error("this rank's device was lost") {}
};

// One rank's share of the MoE layer: the exchange, its two streams, and the experts it holds.
template <class Comm>
class moe_layer {
 public:
  using exchange_type = weave::moe_exchange<Comm>;

  moe_layer(Comm& comm, weave::placement where, const settings& s)
      : comm_(&comm)
      , s_(s) {
    const int spd = where.slots_per_device();
    for (int l = 0; l < spd; ++l) {
      const int e = where.expert_of_slot(comm.rank() * spd + l);
      if (e == weave::placement::empty_slot)
        continue;
      experts_.emplace(e, make_expert_state(initial_expert(e, s)));
    }
    rebuild(std::move(where));
  }

  const weave::placement& where() const { return where_; }
  std::map<int, expert_state>& experts() { return experts_; }
  weave::host_stream& comm_stream() { return comm_stream_; }

  // One micro-batch's input to the layer: token rows, gate weights, expert ids.
  struct micro_batch {
    torch::Tensor h, weights, ids;
  };

  // The forward of two micro-batches in flight, DualPipe-style: the second one's dispatch is
  // issued before the first one's experts, so it travels while they compute, and the first one's
  // combine travels while the second one's experts compute. The handles stay alive (two slots
  // of the exchange) until `backward_pair`.
  //! [forward_pair]
  std::array<torch::Tensor, 2> forward_pair(const std::array<micro_batch, 2>& in) {
    std::array<torch::Tensor, 2> y;
    for (int i = 0; i < 2; ++i) {
      inputs_[i] = {in[i].h.contiguous(), in[i].weights.contiguous(), in[i].ids.contiguous()};
      handles_[i] = exchange_->dispatch(inputs_[i].h, inputs_[i].ids, inputs_[i].weights, compute_,
                                        comm_stream_);
    }
    for (int i = 0; i < 2; ++i) {
      run_experts(handles_[i], /*backward=*/false);
      y[i] = torch::empty_like(inputs_[i].h);
      exchange_->combine(handles_[i], y[i], compute_, comm_stream_);
    }
    synchronize();
    return y;
  }
  //! [forward_pair]

  // dL/dh and dL/dweights of both micro-batches from their dL/dy, overlapped the same way; the
  // experts' parameter gradients accumulate in `grad`.
  std::array<std::pair<torch::Tensor, torch::Tensor>, 2>
  backward_pair(const std::array<torch::Tensor, 2>& dy_in) {
    std::array<torch::Tensor, 2> dy;
    std::array<std::pair<torch::Tensor, torch::Tensor>, 2> out;
    for (int i = 0; i < 2; ++i) {
      dy[i] = dy_in[i].contiguous();
      exchange_->combine_backward(handles_[i], dy[i], compute_, comm_stream_);
    }
    for (int i = 0; i < 2; ++i) {
      run_experts(handles_[i], /*backward=*/true);
      out[i] = {torch::empty_like(dy[i]), torch::empty({dy[i].size(0), s_.k})};
      exchange_->dispatch_backward(handles_[i], out[i].first, out[i].second, compute_,
                                   comm_stream_);
    }
    synchronize();
    for (auto& h : handles_)
      h.reset();
    return out;
  }

  // The layer's own expert compute on every chunk of a handle's phase, each chunk a task on the
  // compute stream (it reads the chunk's rows once the stream got there).
  //! [own_experts]
  void run_experts(typename exchange_type::handle& h, bool backward) {
    for (const auto chunk : exchange_->chunks(h))
      compute_.submit([this, chunk, backward] {
        torch::NoGradGuard no_grad;
        if (backward)
          experts_backward(chunk.experts_grad());
        else
          experts_forward(chunk.experts());
      });
  }

  void experts_forward(const weave::expert_batch& b) {
    const auto in = weave_torch::as_tensor(b.input);
    auto out = weave_torch::as_tensor(b.output);
    for (std::size_t l = 0; l + 1 < b.expert_offsets.size(); ++l) {
      const auto first = b.expert_offsets[l], rows = b.expert_offsets[l + 1] - first;
      if (rows == 0)
        continue;
      const auto p = unpack(experts_.at(b.experts[l]).weights, s_);
      out.narrow(0, first, rows).copy_(expert_forward(p, in.narrow(0, first, rows)));
    }
  }
  //! [own_experts]

  void experts_backward(const weave::expert_grad_batch& b) {
    if (lose_now_)
      throw lost_device();
    const auto x = weave_torch::as_tensor(b.saved_input);
    const auto g = weave_torch::as_tensor(b.grad_output);
    auto gx = weave_torch::as_tensor(b.grad_input);
    for (std::size_t l = 0; l + 1 < b.expert_offsets.size(); ++l) {
      const auto first = b.expert_offsets[l], rows = b.expert_offsets[l + 1] - first;
      if (rows == 0)
        continue;
      expert_state& e = experts_.at(b.experts[l]);
      gx.narrow(0, first, rows)
          .copy_(expert_backward(unpack(e.weights, s_), unpack(e.grad, s_),
                                 x.narrow(0, first, rows), g.narrow(0, first, rows)));
    }
  }

  // Moves to the placement `plan.target` on `comm` (after a loss: the survivors' communicator,
  // whose ranks the plan numbers): experts arriving on this rank receive their weights and
  // optimizer state from a rank holding them, departing ones are dropped.
  //! [migrate]
  void migrate(const weave::migration_plan& plan, Comm& comm) {
    const std::int64_t P = expert_size(s_);
    const std::size_t bytes =
        weave::checked_mul(static_cast<std::size_t>(2 * P), sizeof(float), "expert state bytes");
    std::map<int, torch::Tensor> held, arriving; // weights then velocity, one tensor each
    for (const auto& [e, st] : experts_)
      held[e] = torch::cat({st.weights, st.velocity});
    const auto bytes_of = [P](torch::Tensor& t) {
      return std::as_writable_bytes(
          std::span<float>(t.data_ptr<float>(), static_cast<std::size_t>(2 * P)));
    };
    weave::move_expert_state(
        comm, comm_stream_, plan, bytes,
        [&](int e) { return std::span<const std::byte>(bytes_of(held.at(e))); },
        [&](int, int e) { return bytes_of(arriving[e] = torch::empty({2 * P})); });
    std::map<int, expert_state> next;
    const int spd = plan.target.slots_per_device();
    for (int l = 0; l < spd; ++l) {
      const int e = plan.target.expert_of_slot(comm.rank() * spd + l);
      if (e == weave::placement::empty_slot)
        continue;
      if (const auto it = arriving.find(e); it != arriving.end()) {
        expert_state st = make_expert_state(it->second.narrow(0, 0, P).clone());
        st.velocity = it->second.narrow(0, P, P).clone();
        next.emplace(e, std::move(st));
      } else {
        next.emplace(e, std::move(experts_.at(e)));
      }
    }
    experts_ = std::move(next);
    comm_ = &comm;
    rebuild(plan.target);
  }
  //! [migrate]
  void migrate(const weave::migration_plan& plan) { migrate(plan, *comm_); }

  // After a failed step: ends its calls (the exchange first, so the handles are stale) and
  // drops the partial gradients.
  void drop_step() {
    exchange_.reset();
    for (auto& h : handles_)
      h.reset();
    for (weave::host_stream* st : {&compute_, &comm_stream_})
      try {
        st->synchronize();
      } catch (...) {
      }
    for (auto& [e, state] : experts_)
      state.grad.zero_();
  }

  // Sums the gradients of every expert's copies over the ranks (replicated placements), so that
  // every copy takes the same step.
  void sum_replica_gradients() {
    if (!where().replicated())
      return;
    const std::int64_t P = expert_size(s_);
    auto all = torch::zeros({s_.experts * P});
    for (auto& [e, state] : experts_)
      all.narrow(0, e * P, P).copy_(state.grad);
    std::span<float> flat(all.data_ptr<float>(), static_cast<std::size_t>(all.numel()));
    comm_->all_reduce(comm_stream_, std::span<const float>(flat), flat, weave::reduce_op::sum);
    comm_stream_.synchronize();
    for (auto& [e, state] : experts_)
      state.grad.copy_(all.narrow(0, e * P, P));
  }

  // The lost rank's last act: its next backward throws in the experts.
  void lose_device_in_backward() { lose_now_ = true; }

 private:
  void rebuild(weave::placement where) {
    weave::moe_options o;
    o.k = s_.k;
    o.hidden = static_cast<std::size_t>(s_.hidden);
    o.max_tokens = static_cast<std::size_t>(s_.tokens); // a micro-batch holds at most all
    o.chunks = s_.chunks;
    o.save_for_backward = true;
    o.max_in_flight = 2; // two micro-batches from forward to backward
    exchange_.reset();
    where_ = std::move(where);
    exchange_ = std::make_unique<exchange_type>(*comm_, where_, o);
  }

  void synchronize() { exchange_->synchronize(compute_, comm_stream_); }

  Comm* comm_;
  weave::placement where_; // the layer's placement (kept while the exchange is rebuilt)
  bool lose_now_ = false;
  settings s_;
  std::map<int, expert_state> experts_;
  weave::host_stream compute_{"compute"}, comm_stream_{"comm"};
  std::unique_ptr<exchange_type> exchange_;
  std::array<micro_batch, 2> inputs_; // borrowed by the exchange until synchronized
  std::array<typename exchange_type::handle, 2> handles_; // from forward_pair to backward_pair
};

// weave's exchange as an autograd node over two micro-batches: inputs (h, gate weights, ids) of
// each and the layer; outputs y of each.
//! [autograd]
template <class Comm>
class moe_pair_function : public torch::autograd::Function<moe_pair_function<Comm>> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                torch::Tensor h0, torch::Tensor w0,
                                                torch::Tensor ids0, torch::Tensor h1,
                                                torch::Tensor w1, torch::Tensor ids1,
                                                moe_layer<Comm>* layer) {
    ctx->saved_data["layer"] = reinterpret_cast<std::int64_t>(layer);
    const auto y = layer->forward_pair({{{h0, w0, ids0}, {h1, w1, ids1}}});
    return {y[0], y[1]};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* layer = reinterpret_cast<moe_layer<Comm>*>(ctx->saved_data["layer"].toInt());
    const auto g = layer->backward_pair({grads[0], grads[1]});
    return {g[0].first, g[0].second, {}, g[1].first, g[1].second, {}, {}};
  }
};
//! [autograd]

// --- the dense reference --------------------------------------------------------------------

// The same model in one process: every expert, every rank's tokens, plain torch autograd.
struct dense_model {
  torch::Tensor gate, gate_velocity;
  std::vector<torch::Tensor> experts, velocities;

  explicit dense_model(const settings& s)
      : gate(initial_gate(s).requires_grad_())
      , gate_velocity(torch::zeros_like(gate)) {
    for (int e = 0; e < s.experts; ++e) {
      experts.push_back(initial_expert(e, s).requires_grad_());
      velocities.push_back(torch::zeros_like(experts.back()));
    }
  }

  double step(const batch& b, const settings& s) {
    const auto h = torch::layer_norm(b.x, {s.hidden});
    const auto r = route(h, gate, s);
    auto y = torch::zeros_like(h);
    for (int e = 0; e < s.experts; ++e)
      for (int j = 0; j < s.k; ++j) {
        const auto rows = (r.ids.select(1, j) == e).nonzero().squeeze(1);
        if (rows.numel() == 0)
          continue;
        const auto out = expert_forward(unpack(experts[static_cast<std::size_t>(e)], s),
                                        h.index_select(0, rows));
        y = y.index_add(0, rows, out * r.weights.select(1, j).index_select(0, rows).unsqueeze(1));
      }
    const auto loss = (b.x + y - b.target).pow(2).sum() / static_cast<double>(b.x.numel());
    loss.backward();
    sgd_step(gate, gate_velocity, gate.grad(), s);
    gate.mutable_grad().zero_();
    for (std::size_t e = 0; e < experts.size(); ++e) {
      if (experts[e].grad().defined()) {
        sgd_step(experts[e], velocities[e], experts[e].grad(), s);
        experts[e].mutable_grad().zero_();
      } else {
        sgd_step(experts[e], velocities[e], torch::zeros_like(experts[e]), s);
      }
    }
    return loss.item<double>();
  }
};

// --- training ---------------------------------------------------------------------------------

struct run_result {
  std::vector<double> losses;
  double worst_relative_gap = 0; // distributed vs dense
  int failed_step = -1;          // first step beyond tolerance
  int migrations = 0, moved_experts = 0;
  int recovered_at = -1;      // the step redone after a loss
  std::vector<int> survivors; // first ranks of the ranks left after it
};

template <class Comm>
run_result train(Comm& world_comm, const settings& s, bool check_dense) {
  const int identity = world_comm.rank(), world = world_comm.size();
  Comm* comm = &world_comm;
  std::unique_ptr<Comm> owned; // the survivors' communicator, after a loss
  std::vector<int> alive(static_cast<std::size_t>(world)); // first rank of each current rank
  std::iota(alive.begin(), alive.end(), 0);
  torch::Tensor teacher;
  {
    std::lock_guard lock(rng_mutex());
    torch::manual_seed(static_cast<std::uint64_t>(s.seed));
    teacher = torch::randn({s.hidden, s.hidden});
  }
  const auto topo = weave::topology::flat(world);
  const bool elastic = s.lose_rank >= 0;
  const std::vector<double> equal(static_cast<std::size_t>(s.experts), 1.0);

  moe_layer<Comm> layer(*comm,
                        elastic ? weave::place_survivable(equal, topo)
                                : weave::placement::contiguous(s.experts, world),
                        s);
  torch::Tensor gate = initial_gate(s).requires_grad_();
  torch::Tensor gate_velocity = torch::zeros_like(gate);
  std::unique_ptr<dense_model> dense;
  if (check_dense)
    dense = std::make_unique<dense_model>(s);
  weave::expert_statistics stats(s.experts);

  run_result result;
  std::vector<float> reduced(static_cast<std::size_t>(gate.numel()) + 1);
  for (int step = 0; step < s.steps;) {
    batch all = make_batch(step, world, s, teacher);
    if (static_cast<int>(alive.size()) < world) { // the tokens of the ranks left
      std::vector<std::int64_t> rows;
      for (const int r : alive)
        for (std::int64_t t = 0; t < s.tokens; ++t)
          rows.push_back(r * s.tokens + t);
      const auto index = torch::tensor(rows);
      all = {all.x.index_select(0, index), all.target.index_select(0, index)};
    }
    const int rank = comm->rank();
    const auto x = all.x.narrow(0, rank * s.tokens, s.tokens);
    const auto target = all.target.narrow(0, rank * s.tokens, s.tokens);
    const bool lost_here = identity == s.lose_rank && step == s.lose_step;
    if (lost_here)
      layer.lose_device_in_backward();
    double global_loss = 0;
    try {
      // Forward and backward through weave; the loss is normalised by the global token count
      // so that summing the ranks' gradients gives the gradient of the global loss.
      //! [model]
      const auto h = torch::layer_norm(x, {s.hidden});
      const routing r = route(h, gate, s); // softmax, top-k, renormalised weights; ids as int32
      stats.decay(0.9);
      stats.accumulate(std::span<const std::int32_t>(r.ids.data_ptr<std::int32_t>(), r.ids.numel()),
                       s.k);
      const std::int64_t half = s.tokens / 2; // two micro-batches in flight through the layer
      const auto ys = moe_pair_function<Comm>::apply(
          h.narrow(0, 0, half), r.weights.narrow(0, 0, half), r.ids.narrow(0, 0, half),
          h.narrow(0, half, s.tokens - half), r.weights.narrow(0, half, s.tokens - half),
          r.ids.narrow(0, half, s.tokens - half), &layer);
      const auto y = torch::cat({ys[0], ys[1]});
      const auto loss = (x + y - target).pow(2).sum() / static_cast<double>(all.x.numel());
      loss.backward();
      //! [model]
      layer.sum_replica_gradients(); // copies of one expert take one step

      // Shared parameters (the gate): all-reduce the gradient, with the loss riding along.
      const auto g = gate.grad().contiguous();
      std::memcpy(reduced.data(), g.data_ptr<float>(), static_cast<std::size_t>(g.numel()) * 4);
      reduced.back() = loss.template item<float>();
      //! [reduce]
      comm->all_reduce(layer.comm_stream(), std::span<const float>(reduced),
                       std::span<float>(reduced), weave::reduce_op::sum);
      layer.comm_stream().synchronize();
      //! [reduce]
      global_loss = reduced.back();
    } catch (const std::exception& e) {
      if (!elastic || lost_here)
        throw; // the lost rank ends here
      // A rank was lost: the survivors agree on who is left, re-place on themselves, receive
      // the state of the copies they lack, and redo the step.
      //! [lost]
      if (gate.grad().defined())
        gate.mutable_grad().zero_();
      layer.drop_step();
      auto next = comm->shrink();
      const weave::loss_recovery rec = weave::plan_after_loss(layer.where(), next.lost);
      layer.migrate(rec.plan, *next.comm);
      //! [lost]
      std::vector<int> left;
      for (const int r : next.survivors)
        left.push_back(alive[static_cast<std::size_t>(r)]);
      alive = left;
      owned = std::move(next.comm);
      comm = owned.get();
      result.recovered_at = step;
      result.survivors = alive;
      result.moved_experts += static_cast<int>(rec.plan.moves.size());
      if (comm->rank() == 0)
        std::printf("step %4d  lost a rank: %s\n           survivors %s go on with placement "
                    "%s (%zu expert copies moved)\n",
                    step, e.what(), weave::detail::rank_list(alive).c_str(),
                    describe(layer.where()).c_str(), rec.plan.moves.size());
      continue;
    }
    const auto global_grad = torch::from_blob(reduced.data(), {gate.numel()}).clone();
    sgd_step(gate, gate_velocity, global_grad, s);
    gate.mutable_grad().zero_();
    // Expert parameters: each holder already has the gradient from every rank's tokens.
    for (auto& [e, state] : layer.experts()) {
      sgd_step(state.weights, state.velocity, state.grad, s);
      state.grad.zero_();
    }
    result.losses.push_back(global_loss);

    if (dense) {
      const double reference = dense->step(all, s);
      const double gap = std::abs(global_loss - reference) / std::max(std::abs(reference), 1e-12);
      result.worst_relative_gap = std::max(result.worst_relative_gap, gap);
      if (gap > s.tolerance && result.failed_step < 0)
        result.failed_step = step;
      if (comm->rank() == 0 && (step % s.print_every == 0 || step + 1 == s.steps))
        std::printf("step %4d  loss %.6f  dense %.6f  gap %.1e  placement %s\n", step, global_loss,
                    reference, gap, describe(layer.where()).c_str());
    }

    // Periodic re-placement from the co-activation statistics of all ranks.
    if (s.replace_every > 0 && (step + 1) % s.replace_every == 0 && step + 1 < s.steps) {
      auto raw = stats.raw();
      weave::expert_statistics merged = stats;
      comm->all_reduce(layer.comm_stream(), std::span<const double>(raw), merged.raw(),
                       weave::reduce_op::sum);
      layer.comm_stream().synchronize();
      //! [replace]
      const auto next = weave::place_collaborative(merged, topo);
      const auto plan = weave::plan_migration(layer.where(), next, topo);
      layer.migrate(plan);
      //! [replace]
      ++result.migrations;
      result.moved_experts += static_cast<int>(plan.moves.size());
    }
    ++step;
  }
  return result;
}

// The loss trend and the gap to the dense copy, printed when `print`; true when the loss halved
// and the two agreed at every step (every rank judges the same global losses alike).
bool summarize(const run_result& run, const settings& s, bool print = true) {
  const auto mean = [](std::span<const double> v) {
    double t = 0;
    for (double x : v)
      t += x;
    return t / static_cast<double>(v.size());
  };
  const std::size_t window = std::min<std::size_t>(10, run.losses.size());
  const double first = mean(std::span(run.losses).first(window));
  const double last = mean(std::span(run.losses).last(window));
  const bool decreased = last < 0.5 * first;
  const bool matched = run.failed_step < 0;
  if (!print)
    return decreased && matched;
  std::printf("loss %.6f -> %.6f (mean of first/last %zu steps): %s\n", first, last, window,
              decreased ? "decreased" : "DID NOT HALVE");
  std::printf("distributed vs dense loss: worst relative gap %.2e (tolerance %.0e): %s\n",
              run.worst_relative_gap, s.tolerance, matched ? "match at every step" : "MISMATCH");
  if (!matched)
    std::printf("first mismatch at step %d\n", run.failed_step);
  return decreased && matched;
}

// In-process ranks on a local_world (--ranks), losing one where --lose-rank says.
int run_in_process(const settings& s) {
  torch::set_num_threads(1);
  std::printf("MoE block: %d in-process ranks, %lld tokens per rank, hidden %lld, %d experts (MLP "
              "%lld), top-%d, %d chunks, %d steps%s\n",
              s.ranks, static_cast<long long>(s.tokens), static_cast<long long>(s.hidden),
              s.experts, static_cast<long long>(s.ffn), s.k, s.chunks, s.steps,
              s.lose_rank >= 0 ? "; survivable placement, one rank lost" : "");
  weave::local_world world(s.ranks, {.timeout = std::chrono::seconds(60)});
  std::vector<std::optional<run_result>> runs(static_cast<std::size_t>(s.ranks));
  const auto failures = world.run_collect([&](weave::local_communicator& c) {
    runs[static_cast<std::size_t>(c.rank())] = train(c, s, true);
  });
  bool ok = true;
  for (int r = 0; r < s.ranks; ++r)
    if (failures[static_cast<std::size_t>(r)] && r != s.lose_rank) {
      std::fprintf(stderr, "moe_trainer: rank %d: %s\n", r,
                   weave::what_of(failures[static_cast<std::size_t>(r)]).c_str());
      ok = false;
    }
  const int witness = s.lose_rank == 0 ? 1 : 0;
  if (!ok || !runs[static_cast<std::size_t>(witness)])
    return 1;
  const run_result& run = *runs[static_cast<std::size_t>(witness)];
  const bool lost_as_planned =
      s.lose_rank < 0 || s.lose_step >= s.steps ||
      (failures[static_cast<std::size_t>(s.lose_rank)] && run.recovered_at == s.lose_step &&
       run.survivors.size() == static_cast<std::size_t>(s.ranks - 1));
  if (s.lose_rank >= 0)
    std::printf("rank %d lost at step %d: %s\n", s.lose_rank, s.lose_step,
                lost_as_planned ? "the survivors went on" : "NOT RECOVERED");
  return summarize(run, s) && lost_as_planned &&
                 run.losses.size() == static_cast<std::size_t>(s.steps)
             ? 0
             : 1;
}

} // namespace

int main(int argc, char** argv) {
  // Every rank parses the same options, so a bad one ends every rank (status 2) before MPI.
  settings s;
  if (const int status = cli::run_main(
          "moe_trainer", [&] { return parse(argc, argv, s) ? 0 : -1; },
          cli::first_or_only_process()); // rank 0 says it for all
      status != 0)
    return status < 0 ? 0 : status; // -1: --help
  if (s.ranks > 0) {
    if (s.experts % s.ranks != 0 && s.lose_rank < 0) {
      std::fprintf(stderr, "moe_trainer: --experts must be a multiple of the ranks\n");
      return 2;
    }
    try {
      return run_in_process(s);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "moe_trainer: %s\n", e.what());
      return 1;
    }
  }
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  torch::set_num_threads(1); // one process per core
  int status = 0;
  try {
    weave::mpi_communicator comm(MPI_COMM_WORLD);
    const bool root = comm.rank() == 0;
    if (s.experts % comm.size() != 0) {
      if (root)
        std::fprintf(stderr, "moe_trainer: --experts must be a multiple of the ranks\n");
      status = 2;
    } else {
      if (root)
        std::printf(
            "MoE block: %d ranks, %lld tokens per rank, hidden %lld, %d experts (MLP %lld), "
            "top-%d, %d chunks, %d steps\n",
            comm.size(), static_cast<long long>(s.tokens), static_cast<long long>(s.hidden),
            s.experts, static_cast<long long>(s.ffn), s.k, s.chunks, s.steps);
      const run_result run = train(comm, s, true);
      // Re-placement must not change the training. For k <= 2 the losses are bitwise those of
      // a run that never re-places (a token's two contributions are added once, and addition
      // commutes); for k > 2 a token's sums may run in another order after a migration, so
      // only the tolerance applies.
      bool identical = true;
      if (s.replace_every > 0) {
        settings fixed = s;
        fixed.replace_every = 0;
        const run_result baseline = train(comm, fixed, false);
        int differing = 0;
        double worst = 0;
        for (std::size_t i = 0; i < run.losses.size(); ++i) {
          differing += run.losses[i] != baseline.losses[i];
          worst = std::max(worst, std::abs(run.losses[i] - baseline.losses[i]) /
                                      std::max(std::abs(baseline.losses[i]), 1e-12));
        }
        const bool bitwise = s.k <= 2;
        identical = bitwise ? differing == 0 : worst <= s.tolerance;
        if (root)
          std::printf("re-placement: %d migrations, %d experts moved; losses vs a run without "
                      "re-placement: %d of %zu steps differ, worst relative gap %.2e (required: "
                      "%s): %s\n",
                      run.migrations, run.moved_experts, differing, run.losses.size(), worst,
                      bitwise ? "bitwise identical" : "within tolerance",
                      identical ? "ok" : "FAILED");
      }
      status = summarize(run, s, root) && identical ? 0 : 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moe_trainer: %s\n", e.what());
    MPI_Abort(MPI_COMM_WORLD, 1); // the other ranks would wait for this one forever
  }
  MPI_Finalize();
  return status;
}
