// Elastic expert parallelism, end to end: an MoE layer trained on in-process ranks (momentum
// SGD, gradients of replicated experts summed over the world) loses a rank mid-step and goes
// on from the survivors, without a restart:
//   1. the survivors catch the failure (a peer_error naming the lost rank, or a timeout);
//   2. shrink: they agree on who is left and get a smaller communicator;
//   3. plan_after_loss: the new placement from the copies they hold (survivable again when
//      the slots allow) and the copies to make;
//   4. move_expert_state: weights and optimizer state of those copies, from a survivor that
//      holds them (the lost rank's state is not needed: every expert had a copy elsewhere);
//   5. the layer is rebuilt on the new communicator (its agreement re-run), the step redone.
// Prints the loss per step, the time of each recovery phase (the slowest survivor's) and checks
// that every copy of every expert holds the same weights and optimizer state afterwards.
//
//   elastic_moe [--ranks N] [--experts E] [--hidden H] [--tokens T] [--steps S]
//               [--lose-rank R] [--lose-step S] [--lose-at backward|experts|silent]
#include "command_line.hpp"

#include <weave/comm/local_world.hpp>
#include <weave/comm/shrink.hpp>
#include <weave/core/host_matrix.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/overlap/expert_state_moves.hpp>
#include <weave/overlap/moe_exchange.hpp>
#include <weave/placement/after_loss.hpp>
#include <weave/placement/survivable.hpp>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

using clock_type = std::chrono::steady_clock;
using comm_type = weave::local_communicator;
using layer_type = weave::moe_exchange<comm_type>;

struct settings {
  int ranks = 8, experts = 32, k = 2, steps = 10, lose_rank = 5, lose_step = 4;
  std::size_t hidden = 128, tokens = 256;
  std::string lose_at = "backward";
  int timeout_ms = 500;
};

struct lost_rank : std::runtime_error {
  lost_rank()
      : std::runtime_error("this rank's device was lost") {}
};

// One expert's state as the trainer keeps it: weights, then momentum (H x H each).
struct expert_state {
  std::vector<float> data;
  std::span<float> weights(std::size_t H) { return {data.data(), H * H}; }
  std::span<float> momentum(std::size_t H) { return {data.data() + H * H, H * H}; }
};

std::vector<float> initial_weights(int e, std::size_t H) {
  std::mt19937 rng(static_cast<std::uint32_t>(e) + 1);
  std::normal_distribution<float> n(0.0f, 1.0f / std::sqrt(static_cast<float>(H)));
  std::vector<float> w(2 * H * H, 0.0f); // momentum starts at zero
  for (std::size_t i = 0; i < H * H; ++i)
    w[i] = n(rng);
  return w;
}

// Recovery phases of one survivor, in seconds since the failure.
struct phases {
  double caught = 0, shrunk = 0, planned = 0, moved = 0, rebuilt = 0, first_good = 0;
};

struct shared_run {
  std::mutex m;
  std::atomic<std::int64_t> failed_at{0}; // clock ticks when the lost rank failed
  std::vector<phases> survivors;
  std::vector<double> loss;    // per step, the mean over the world's tokens
  std::vector<double> step_ms; // rank 0's steps before the loss
  std::size_t moves = 0, moved_bytes = 0;
  bool survivable_after = false;
  std::atomic<bool> done{false};
  // Every copy of every expert after the run: expert -> states seen.
  std::vector<std::vector<std::vector<float>>> copies;
};

double since(const shared_run& run) {
  return std::chrono::duration<double>(
             clock_type::now().time_since_epoch() -
             clock_type::duration(run.failed_at.load(std::memory_order_acquire)))
      .count();
}

// Waits for both streams, dropping their failures (the one that matters was caught).
void drain(weave::host_stream& a, weave::host_stream& b) {
  for (weave::host_stream* st : {&a, &b})
    try {
      st->synchronize();
    } catch (...) {
    }
}

void train_rank(const settings& s, comm_type& first, shared_run& run) {
  const std::size_t H = s.hidden, T = s.tokens;
  const int identity = first.rank();
  comm_type* comm = &first;
  std::unique_ptr<comm_type> owned;
  const std::vector<double> loads(static_cast<std::size_t>(s.experts), 1.0);
  weave::placement where = weave::place_survivable(loads, weave::topology::flat(s.ranks));
  const auto S = static_cast<std::size_t>(where.slots_per_device());
  std::vector<expert_state> slots(S);
  for (std::size_t l = 0; l < S; ++l) {
    const int e = where.expert_of_slot(comm->rank() * static_cast<int>(S) + static_cast<int>(l));
    slots[l].data = e < 0 ? std::vector<float>(2 * H * H, 0.0f) : initial_weights(e, H);
  }
  weave::moe_options o;
  o.k = s.k;
  o.hidden = H;
  o.max_tokens = T;
  o.chunks = 2;
  o.save_for_backward = true;
  auto compute = std::make_unique<weave::host_stream>("compute");
  auto comm_stream = std::make_unique<weave::host_stream>("comm");
  auto layer = std::make_unique<layer_type>(*comm, where, o);
  phases ph;
  bool recovering = false;
  for (int step = 0; step < s.steps;) {
    const bool victim = identity == s.lose_rank && step == s.lose_step;
    if (victim && s.lose_at == "silent") { // neither works nor leaves until the others finish
      run.failed_at = clock_type::now().time_since_epoch().count();
      while (!run.done.load())
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      return;
    }
    std::mt19937 rng(static_cast<std::uint32_t>(step * 7919 + identity));
    std::normal_distribution<float> v(0.0f, 1.0f);
    std::uniform_int_distribution<int> pick(0, s.experts - 1);
    weave::host_matrix<float> x(T, H), y(T, H), dy(T, H), dx(T, H);
    std::vector<std::int32_t> ids(T * static_cast<std::size_t>(s.k));
    std::vector<float> gate(ids.size(), 1.0f / static_cast<float>(s.k)), dgate(ids.size());
    for (std::size_t t = 0; t < T; ++t) {
      for (std::size_t i = 0; i < H; ++i)
        x(t, i) = v(rng);
      for (int j = 0; j < s.k; ++j) { // k distinct experts
        std::int32_t e = pick(rng);
        for (int i = 0; i < j; ++i)
          if (ids[t * static_cast<std::size_t>(s.k) + static_cast<std::size_t>(i)] == e)
            e = (e + 1) % s.experts, i = -1;
        ids[t * static_cast<std::size_t>(s.k) + static_cast<std::size_t>(j)] = e;
      }
    }
    std::vector<float> grads(static_cast<std::size_t>(s.experts) * H * H, 0.0f);
    const auto step_start = clock_type::now();
    try {
      layer->forward(
          x.view(), ids, gate, y.view(),
          [&](const weave::expert_batch& b) {
            for (std::size_t l = 0; l + 1 < b.expert_offsets.size(); ++l)
              for (auto r = b.expert_offsets[l]; r < b.expert_offsets[l + 1]; ++r) {
                const auto in = b.input.row_as<float>(static_cast<std::size_t>(r));
                const auto out = b.output.row_as<float>(static_cast<std::size_t>(r));
                const auto w = slots[l].weights(H);
                for (std::size_t a = 0; a < H; ++a) {
                  float acc = 0.0f;
                  for (std::size_t c = 0; c < H; ++c)
                    acc += w[a * H + c] * in[c];
                  out[a] = acc;
                }
              }
            if (victim && s.lose_at == "experts" && b.chunk == 0) {
              run.failed_at = clock_type::now().time_since_epoch().count();
              throw lost_rank();
            }
          },
          *compute, *comm_stream);
      layer->synchronize(*compute, *comm_stream); // y, before the loss
      double loss = 0;                            // 0.5 |y - x|^2: learn the identity
      for (std::size_t t = 0; t < T; ++t)
        for (std::size_t i = 0; i < H; ++i) {
          dy(t, i) = y(t, i) - x(t, i);
          loss += 0.5 * static_cast<double>(dy(t, i)) * dy(t, i);
        }
      layer->backward(
          dy.view(), dx.view(), dgate,
          [&](const weave::expert_grad_batch& b) {
            if (victim && s.lose_at == "backward") {
              run.failed_at = clock_type::now().time_since_epoch().count();
              throw lost_rank();
            }
            for (std::size_t l = 0; l + 1 < b.expert_offsets.size(); ++l) {
              const int e = b.experts[l];
              for (auto r = b.expert_offsets[l]; r < b.expert_offsets[l + 1]; ++r) {
                const auto in = b.saved_input.row_as<float>(static_cast<std::size_t>(r));
                const auto go = b.grad_output.row_as<float>(static_cast<std::size_t>(r));
                const auto gi = b.grad_input.row_as<float>(static_cast<std::size_t>(r));
                const auto w = slots[l].weights(H);
                float* g = grads.data() + static_cast<std::size_t>(e) * H * H;
                for (std::size_t c = 0; c < H; ++c) {
                  float acc = 0.0f;
                  for (std::size_t a = 0; a < H; ++a)
                    acc += w[a * H + c] * go[a];
                  gi[c] = acc;
                }
                for (std::size_t a = 0; a < H; ++a)
                  for (std::size_t c = 0; c < H; ++c)
                    g[a * H + c] += go[a] * in[c];
              }
            }
          },
          *compute, *comm_stream);
      layer->synchronize(*compute, *comm_stream);
      // Every copy of an expert takes the gradient summed over the world: copies stay equal.
      std::vector<double> total_loss{loss};
      comm->all_reduce(*comm_stream, std::span<const float>(grads), std::span<float>(grads),
                       weave::reduce_op::sum);
      total_loss[0] /= static_cast<double>(T) * comm->size(); // per token of the world
      comm->all_reduce(*comm_stream, std::span<const double>(total_loss),
                       std::span<double>(total_loss), weave::reduce_op::sum);
      weave::wait_watched(*comm, *comm_stream);
      for (std::size_t l = 0; l < S; ++l) {
        const int e =
            where.expert_of_slot(comm->rank() * static_cast<int>(S) + static_cast<int>(l));
        if (e < 0)
          continue;
        const float* g = grads.data() + static_cast<std::size_t>(e) * H * H;
        auto w = slots[l].weights(H);
        auto mo = slots[l].momentum(H);
        for (std::size_t i = 0; i < H * H; ++i) {
          mo[i] = 0.9f * mo[i] + g[i] / static_cast<float>(T * static_cast<std::size_t>(s.ranks));
          w[i] -= 0.05f * mo[i];
        }
      }
      if (recovering) {
        ph.first_good = since(run);
        std::lock_guard lock(run.m);
        run.survivors.push_back(ph);
        recovering = false;
      }
      if (comm->rank() == 0) {
        std::lock_guard lock(run.m);
        run.loss.push_back(total_loss[0]);
        if (step < s.lose_step)
          run.step_ms.push_back(
              std::chrono::duration<double, std::milli>(clock_type::now() - step_start).count());
      }
      ++step;
    } catch (const lost_rank&) {
      drain(*compute, *comm_stream);
      throw; // the lost rank's thread ends here (its world learns it: run_collect aborts it)
    } catch (const weave::error& e) {
      drain(*compute, *comm_stream);
      ph.caught = since(run);
      //! [recovery]
      // 1. Agree on who is left: a smaller communicator of the survivors.
      auto next = comm->shrink();
      ph.shrunk = since(run);
      // 2. The new placement, from the copies the survivors hold (every rank plans alike;
      //    errc::experts_lost if some expert had every copy on the lost rank).
      const weave::loss_recovery rec = weave::plan_after_loss(where, next.lost, loads);
      ph.planned = since(run);
      layer.reset(); // the old layer and streams go first: they use the old communicator
      compute = std::make_unique<weave::host_stream>("compute");
      comm_stream = std::make_unique<weave::host_stream>("comm");
      // 3. Weights and optimizer state of the copies the plan makes, from survivors that hold
      //    them (new rank numbers). Sources are read from a copy: a slot may send its expert
      //    away and receive another in the same move.
      const std::vector<expert_state> before = slots;
      weave::move_expert_state(
          *next.comm, *comm_stream, rec.plan, 2 * H * H * sizeof(float),
          [&](int expert) { // this rank's state of an expert it holds
            for (std::size_t l = 0; l < S; ++l)
              if (where.expert_of_slot(comm->rank() * static_cast<int>(S) + static_cast<int>(l)) ==
                  expert)
                return std::as_bytes(std::span<const float>(before[l].data));
            throw std::logic_error("a move from a rank that does not hold the expert");
          },
          [&](int slot, int) { // where a received copy goes
            return std::as_writable_bytes(
                std::span<float>(slots[static_cast<std::size_t>(slot)].data));
          });
      ph.moved = since(run);
      // 4. The layer on the survivors (its agreement runs again); then the step is redone.
      where = rec.plan.target;
      owned = std::move(next.comm);
      comm = owned.get();
      layer = std::make_unique<layer_type>(*comm, where, o);
      //! [recovery]
      ph.rebuilt = since(run);
      recovering = true;
      if (comm->rank() == 0) {
        std::lock_guard lock(run.m);
        run.moves = rec.plan.moves.size();
        run.moved_bytes = rec.plan.moves.size() * 2 * H * H * sizeof(float);
        run.survivable_after = rec.survivable;
        std::printf("step %d: %s\n  survivors %s go on; %zu expert copies move\n", step, e.what(),
                    weave::detail::rank_list(next.survivors).c_str(), rec.plan.moves.size());
      }
    }
  }
  std::lock_guard lock(run.m);
  for (std::size_t l = 0; l < S; ++l) {
    const int e = where.expert_of_slot(comm->rank() * static_cast<int>(S) + static_cast<int>(l));
    if (e >= 0)
      run.copies[static_cast<std::size_t>(e)].push_back(slots[l].data);
  }
}

int run(int argc, char** argv) {
  settings s;
  cli::options o("elastic_moe", "An MoE layer trained on in-process ranks loses one and goes on "
                                "from the survivors (see the file comment).\n");
  o.number("ranks", s.ranks, 3, 64, "in-process ranks");
  o.number("experts", s.experts, 2, 1024, "experts");
  o.number("hidden", s.hidden, std::size_t{1}, std::size_t{4096}, "hidden size");
  o.number("tokens", s.tokens, std::size_t{1}, std::size_t{1} << 16, "tokens per rank");
  o.number("steps", s.steps, 1, 10000, "training steps");
  o.number("lose-rank", s.lose_rank, 0, 63, "the rank that is lost");
  o.number("lose-step", s.lose_step, 0, 10000, "the step it is lost in");
  o.choice("lose-at", s.lose_at, {"backward", "experts", "silent"},
           "where: in its backward, in its experts (after the dispatch), or silently (found by "
           "the timeout)");
  o.number("timeout-ms", s.timeout_ms, 1, 600000, "the world's timeout, ms");
  if (!o.parse(argc, argv))
    return 0;
  if (s.lose_rank >= s.ranks)
    throw cli::bad_option("--lose-rank: " + std::to_string(s.lose_rank) + " is not below --ranks");
  if (s.k > s.experts)
    throw cli::bad_option("--experts: fewer than k = 2");
  shared_run run;
  run.copies.resize(static_cast<std::size_t>(s.experts));
  const weave::placement start =
      weave::place_survivable(std::vector<double>(static_cast<std::size_t>(s.experts), 1.0),
                              weave::topology::flat(s.ranks));
  std::printf("elastic_moe: %d in-process ranks, %d experts in %d slots per device (two copies "
              "each or more), hidden %zu, %zu tokens per rank, top-%d; rank %d lost at step %d "
              "(%s)\n",
              s.ranks, s.experts, start.slots_per_device(), s.hidden, s.tokens, s.k, s.lose_rank,
              s.lose_step, s.lose_at.c_str());
  weave::local_world world(s.ranks, {.timeout = std::chrono::milliseconds(s.timeout_ms)});
  const auto failures = world.run_collect([&](comm_type& c) {
    train_rank(s, c, run);
    if (c.rank() != s.lose_rank)
      run.done = true;
  });
  int failed = 0;
  for (int r = 0; r < s.ranks; ++r)
    if (failures[static_cast<std::size_t>(r)] && r != s.lose_rank) {
      std::fprintf(stderr, "rank %d: %s\n", r,
                   weave::what_of(failures[static_cast<std::size_t>(r)]).c_str());
      ++failed;
    }
  for (std::size_t i = 0; i < run.loss.size(); ++i)
    std::printf("  step %2zu  loss %.4f\n", i, run.loss[i]);
  bool consistent = true;
  for (const auto& copies : run.copies)
    for (const auto& c : copies)
      consistent = consistent && c == copies.front();
  if (s.lose_step < s.steps && !run.survivors.empty()) {
    phases slowest;
    for (const phases& p : run.survivors) {
      slowest.caught = std::max(slowest.caught, p.caught);
      slowest.shrunk = std::max(slowest.shrunk, p.shrunk);
      slowest.planned = std::max(slowest.planned, p.planned);
      slowest.moved = std::max(slowest.moved, p.moved);
      slowest.rebuilt = std::max(slowest.rebuilt, p.rebuilt);
      slowest.first_good = std::max(slowest.first_good, p.first_good);
    }
    const auto ms = [](double sec) { return sec * 1e3; };
    std::printf("recovery, ms after the failure (slowest of %zu survivors):\n",
                run.survivors.size());
    std::printf("  detected            %8.2f\n", ms(slowest.caught));
    std::printf("  agreed (shrink)     %8.2f\n", ms(slowest.shrunk));
    std::printf("  re-placed (plan)    %8.2f\n", ms(slowest.planned));
    std::printf("  state moved         %8.2f  (%zu copies, %zu bytes)\n", ms(slowest.moved),
                run.moves, run.moved_bytes);
    std::printf("  layer rebuilt       %8.2f\n", ms(slowest.rebuilt));
    std::printf("  first good step     %8.2f\n", ms(slowest.first_good));
    std::printf("new placement survives another loss: %s\n", run.survivable_after ? "yes" : "no");
    if (run.step_ms.size() > 1) // the first step warms up
      std::printf("a step before the loss took %.2f ms on average\n",
                  std::accumulate(run.step_ms.begin() + 1, run.step_ms.end(), 0.0) /
                      static_cast<double>(run.step_ms.size() - 1));
  }
  std::printf("every copy of every expert equal (weights and momentum): %s\n",
              consistent ? "yes" : "NO");
  const bool recovered =
      s.lose_step >= s.steps || run.survivors.size() == static_cast<std::size_t>(s.ranks - 1);
  return failed == 0 && consistent && recovered &&
                 run.loss.size() == static_cast<std::size_t>(s.steps)
             ? 0
             : 1;
}

} // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const cli::bad_option& e) {
    std::fprintf(stderr, "elastic_moe: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "elastic_moe: %s\n", e.what());
    return 1;
  }
}
