// Elastic expert parallelism on local_world: a rank is lost at some point of a training step
// (before it, in a chunk's producer while the dispatch runs, in the experts after the dispatch,
// in a chunk's consumer while the combine runs, in the backward, or by stopping without a word);
// the survivors shrink the world, plan the new placement from the copies they hold
// (plan_after_loss), carry the expert weights the plan moves (move_expert_state), rebuild the
// layer and redo the step. The reference: a fresh layer of the same shrunk placement on a fresh
// world, its weights made from the expert ids, fed the same inputs; the next 10 steps' outputs,
// input gradients and gate gradients must be bitwise equal. Also two losses in a row, and a loss
// the placement cannot survive, which ends every survivor with errc::experts_lost.
#include <doctest/doctest.h>

#include <weave/comm/local_world.hpp>
#include <weave/comm/shrink.hpp>
#include <weave/core/host_matrix.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/overlap/decode_exchange.hpp>
#include <weave/overlap/expert_state_moves.hpp>
#include <weave/overlap/moe_exchange.hpp>
#include <weave/placement/after_loss.hpp>
#include <weave/placement/survivable.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace std::chrono_literals;
using comm_type = weave::local_communicator;
using layer_type = weave::moe_exchange<comm_type>;

constexpr std::size_t H = 8, T = 24;
constexpr int K = 2, compared_steps = 10;

enum class loss_at { between_steps, producer, experts, consumer, backward, stopped };

const char* name_of(loss_at p) {
  switch (p) {
  case loss_at::between_steps:
    return "between steps";
  case loss_at::producer:
    return "during the dispatch (a chunk's producer)";
  case loss_at::experts:
    return "after the dispatch (the experts)";
  case loss_at::consumer:
    return "during the combine (a chunk's consumer)";
  case loss_at::backward:
    return "during the backward";
  case loss_at::stopped:
    return "stopped without a word";
  }
  return "?";
}

// Expert e's weights: H x H values exact in float, different for every expert.
std::vector<float> weights_of(int e) {
  std::vector<float> w(H * H);
  for (std::size_t o = 0; o < H; ++o)
    for (std::size_t i = 0; i < H; ++i)
      w[o * H + i] =
          static_cast<float>(static_cast<int>((e * 131 + o * 17 + i * 7) % 23) - 11) / 32.0f;
  return w;
}

// One rank's expert state: the weights of each local slot (as the trainer holds them).
struct slot_weights {
  std::vector<std::vector<float>> w;
  slot_weights(const weave::placement& p, int rank) {
    for (int l = 0; l < p.slots_per_device(); ++l) {
      const int e = p.expert_of_slot(rank * p.slots_per_device() + l);
      w.push_back(e == weave::placement::empty_slot ? std::vector<float>(H * H, 0.0f)
                                                    : weights_of(e));
    }
  }
};

// The inputs of `step` on the rank whose first rank was `identity`.
struct step_input {
  weave::host_matrix<float> x{T, H}, dy{T, H};
  std::vector<std::int32_t> ids = std::vector<std::int32_t>(T * K);
  std::vector<float> w = std::vector<float>(T * K);
  step_input(int step, int identity, int experts) {
    std::mt19937 rng(static_cast<std::uint32_t>(step * 7919 + identity * 104729 + 1));
    std::uniform_real_distribution<float> v(-1.0f, 1.0f), g(0.1f, 1.0f);
    std::uniform_int_distribution<int> pick(0, experts - 1);
    for (std::size_t t = 0; t < T; ++t) {
      for (std::size_t i = 0; i < H; ++i) {
        x(t, i) = v(rng);
        dy(t, i) = v(rng);
      }
      const int a = pick(rng);
      int b = pick(rng);
      while (b == a)
        b = pick(rng);
      ids[t * K] = a;
      ids[t * K + 1] = b;
      w[t * K] = g(rng);
      w[t * K + 1] = g(rng);
    }
  }
};

// The survivors' side of a re-placement: the weights of the copies `plan` makes, from the
// ranks holding them (`where` is the placement before, `rank` this rank's place in it).
void carry_weights(comm_type& survivors, weave::host_stream& s, const weave::migration_plan& plan,
                   const weave::placement& where, int rank, slot_weights& sw) {
  const std::vector<std::vector<float>> before = sw.w; // sources stay apart from destinations
  weave::move_expert_state(
      survivors, s, plan, H * H * sizeof(float),
      [&](int e) {
        for (int l = 0; l < where.slots_per_device(); ++l)
          if (where.expert_of_slot(rank * where.slots_per_device() + l) == e)
            return std::as_bytes(std::span<const float>(before[static_cast<std::size_t>(l)]));
        throw std::logic_error("asked for an expert this rank does not hold");
      },
      [&](int slot, int) {
        return std::as_writable_bytes(std::span<float>(sw.w[static_cast<std::size_t>(slot)]));
      });
}

// What one step produced on one rank, compared bitwise.
struct step_output {
  std::vector<float> y, dx, dw;
  bool operator==(const step_output& o) const {
    const auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
      return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
    };
    return same(y, o.y) && same(dx, o.dx) && same(dw, o.dw);
  }
};

struct injected_loss : std::runtime_error {
  injected_loss()
      : std::runtime_error("injected loss of this rank") {}
};

// One forward (chunk producers write the inputs, consumers read the outputs) and backward. The
// `fail` point throws on this rank (a lost device's last act).
step_output run_step(layer_type& layer, const slot_weights& sw, const step_input& in,
                     weave::host_stream& compute, weave::host_stream& comm, loss_at fail,
                     bool victim) {
  weave::host_matrix<float> x(T, H), y(T, H), dx(T, H);
  std::vector<std::int32_t> ids(T * K);
  std::vector<float> w(T * K), dw(T * K);
  weave::moe_chunk_hooks hooks;
  hooks.produce = [&](std::size_t first, std::size_t count) {
    if (victim && fail == loss_at::producer && first > 0)
      throw injected_loss(); // chunk 0's dispatch is in flight
    std::memcpy(x.data() + first * H, in.x.data() + first * H, count * H * sizeof(float));
    std::copy_n(in.ids.begin() + static_cast<std::ptrdiff_t>(first * K), count * K,
                ids.begin() + static_cast<std::ptrdiff_t>(first * K));
    std::copy_n(in.w.begin() + static_cast<std::ptrdiff_t>(first * K), count * K,
                w.begin() + static_cast<std::ptrdiff_t>(first * K));
  };
  hooks.consume = [&](std::size_t first, std::size_t) {
    if (victim && fail == loss_at::consumer && first == 0)
      throw injected_loss(); // chunk 1's combine is in flight
  };
  const auto apply = [&sw](int slot, std::span<const float> a, std::span<float> b, bool transpose) {
    const std::vector<float>& m = sw.w[static_cast<std::size_t>(slot)];
    for (std::size_t o = 0; o < H; ++o) {
      float acc = 0.0f;
      for (std::size_t i = 0; i < H; ++i)
        acc += (transpose ? m[i * H + o] : m[o * H + i]) * a[i];
      b[o] = acc;
    }
  };
  layer.forward(
      x.view(), ids, w, y.view(),
      [&](const weave::expert_batch& b) {
        if (victim && fail == loss_at::experts && b.chunk == 0)
          throw injected_loss();
        for (std::size_t l = 0; l + 1 < b.expert_offsets.size(); ++l)
          for (auto r = b.expert_offsets[l]; r < b.expert_offsets[l + 1]; ++r)
            apply(static_cast<int>(l), b.input.row_as<float>(static_cast<std::size_t>(r)),
                  b.output.row_as<float>(static_cast<std::size_t>(r)), false);
      },
      compute, comm, &hooks);
  layer.backward(
      in.dy.view(), dx.view(), dw,
      [&](const weave::expert_grad_batch& b) {
        if (victim && fail == loss_at::backward)
          throw injected_loss();
        for (std::size_t l = 0; l + 1 < b.expert_offsets.size(); ++l)
          for (auto r = b.expert_offsets[l]; r < b.expert_offsets[l + 1]; ++r)
            apply(static_cast<int>(l), b.grad_output.row_as<float>(static_cast<std::size_t>(r)),
                  b.grad_input.row_as<float>(static_cast<std::size_t>(r)), true);
      },
      compute, comm);
  layer.synchronize(compute, comm);
  return {std::vector<float>(y.data(), y.data() + T * H),
          std::vector<float>(dx.data(), dx.data() + T * H), dw};
}

weave::moe_options layer_options() {
  weave::moe_options o;
  o.k = K;
  o.hidden = H;
  o.max_tokens = T;
  o.chunks = 2;
  o.save_for_backward = true;
  return o;
}

// A layer and the streams its work runs on (the layer goes first).
struct epoch {
  weave::host_stream compute{"compute"}, comm{"comm"};
  std::unique_ptr<layer_type> layer;
};

// One planned loss: the rank whose first rank is `identity` is lost at `point` of `step`.
struct planned_loss {
  int identity = 0;
  int step = 0;
  loss_at point = loss_at::between_steps;
};

// What an elastic run recorded: each identity's outputs per step, and the world it ended in.
struct elastic_run {
  std::mutex m;
  std::map<std::pair<int, int>, step_output> out; // (identity, step)
  std::vector<int> final_identities;              // identity of each final rank
  weave::placement final_placement;
  int last_recovery_step = -1;
  std::vector<std::exception_ptr> failures;
  std::vector<std::string> survivor_errors; // recovery failures (what() of each)
};

// Runs `steps` steps on `ranks` ranks from `start`, losing ranks as `losses` says and
// recovering on the survivors.
void run_elastic(elastic_run& run, int ranks, int experts, const weave::placement& start,
                 const std::vector<planned_loss>& losses, int steps,
                 std::chrono::milliseconds timeout) {
  weave::local_world world(ranks, {.timeout = timeout});
  std::atomic<int> survivors_done{0};
  const std::vector<double> loads = [&] {
    std::vector<double> l;
    for (int e = 0; e < experts; ++e)
      l.push_back(1.0 + e % 3);
    return l;
  }();
  run.failures = world.run_collect([&](comm_type& first) {
    const int identity = first.rank();
    comm_type* comm = &first;
    std::unique_ptr<comm_type> owned;
    weave::placement where = start;
    slot_weights sw(where, comm->rank());
    auto ep = std::make_unique<epoch>();
    ep->layer = std::make_unique<layer_type>(*comm, where, layer_options());
    int step = 0;
    while (step < steps) {
      const planned_loss* mine = nullptr;
      for (const planned_loss& l : losses)
        if (l.identity == identity && l.step == step)
          mine = &l;
      if (mine != nullptr && mine->point == loss_at::between_steps)
        throw injected_loss();
      if (mine != nullptr && mine->point == loss_at::stopped) {
        // Silent: neither works nor leaves until the survivors finished.
        while (survivors_done.load() == 0)
          std::this_thread::sleep_for(1ms);
        return;
      }
      try {
        const step_input in(step, identity, experts);
        step_output o = run_step(*ep->layer, sw, in, ep->compute, ep->comm,
                                 mine ? mine->point : loss_at::between_steps, mine != nullptr);
        std::lock_guard lock(run.m);
        run.out[{identity, step}] = std::move(o);
        ++step;
      } catch (const weave::error&) {
        if (mine != nullptr)
          throw;
        // A peer is lost: agree on the survivors, re-place, carry the weights, rebuild.
        try {
          auto next = comm->shrink();
          const weave::loss_recovery rec =
              weave::plan_after_loss(ep->layer->where(), next.lost, loads);
          ep.reset();
          ep = std::make_unique<epoch>();
          carry_weights(*next.comm, ep->compute, rec.plan, where, comm->rank(), sw);
          where = rec.plan.target;
          owned = std::move(next.comm);
          comm = owned.get();
          ep->layer = std::make_unique<layer_type>(*comm, where, layer_options());
          std::lock_guard lock(run.m);
          run.last_recovery_step = step;
        } catch (const weave::error& e) {
          std::lock_guard lock(run.m);
          run.survivor_errors.push_back(e.what());
          throw;
        }
      }
    }
    std::lock_guard lock(run.m);
    if (run.final_identities.size() < static_cast<std::size_t>(comm->size()))
      run.final_identities.resize(static_cast<std::size_t>(comm->size()), -1);
    run.final_identities[static_cast<std::size_t>(comm->rank())] = identity;
    run.final_placement = where;
    // Every slot holds its expert's weights: the moves carried what the plan says.
    for (int l = 0; l < where.slots_per_device(); ++l) {
      const int e = where.expert_of_slot(comm->rank() * where.slots_per_device() + l);
      if (e != weave::placement::empty_slot)
        CHECK(sw.w[static_cast<std::size_t>(l)] == weights_of(e));
    }
    ++survivors_done;
  });
}

// A fresh layer of `where` on a fresh world whose rank i is `identities[i]`: its outputs.
std::map<std::pair<int, int>, step_output> run_fresh(const weave::placement& where,
                                                     const std::vector<int>& identities,
                                                     int experts, int first_step, int steps) {
  std::map<std::pair<int, int>, step_output> out;
  std::mutex m;
  weave::local_world world(where.num_devices());
  world.run([&](comm_type& c) {
    const int identity = identities[static_cast<std::size_t>(c.rank())];
    const slot_weights sw(where, c.rank());
    epoch ep;
    ep.layer = std::make_unique<layer_type>(c, where, layer_options());
    for (int s = first_step; s < first_step + steps; ++s) {
      step_output o = run_step(*ep.layer, sw, step_input(s, identity, experts), ep.compute, ep.comm,
                               loss_at::between_steps, false);
      std::lock_guard lock(m);
      out[{identity, s}] = std::move(o);
    }
  });
  return out;
}

// Checks a run that recovered: the lost ranks failed, the others did not, and the steps after
// the last recovery equal the fresh layer's bitwise.
void check_recovered(elastic_run& run, int ranks, int experts,
                     const std::vector<planned_loss>& losses) {
  for (int r = 0; r < ranks; ++r) {
    bool lost = false, stopped = false;
    for (const planned_loss& l : losses)
      if (l.identity == r) {
        lost = true;
        stopped = l.point == loss_at::stopped;
      }
    CAPTURE(r);
    CHECK(static_cast<bool>(run.failures[static_cast<std::size_t>(r)]) == (lost && !stopped));
  }
  REQUIRE(run.survivor_errors.empty());
  REQUIRE(run.final_identities.size() == static_cast<std::size_t>(ranks) - losses.size());
  REQUIRE(run.last_recovery_step >= 0);
  const auto fresh = run_fresh(run.final_placement, run.final_identities, experts,
                               run.last_recovery_step, compared_steps);
  int compared = 0;
  for (const int identity : run.final_identities)
    for (int s = run.last_recovery_step; s < run.last_recovery_step + compared_steps; ++s) {
      CAPTURE(identity);
      CAPTURE(s);
      REQUIRE(run.out.count({identity, s}) == 1);
      CHECK(run.out[{identity, s}] == fresh.at({identity, s}));
      ++compared;
    }
  CHECK(compared == static_cast<int>(run.final_identities.size()) * compared_steps);
}

} // namespace

TEST_CASE("elastic: a 4- and an 8-rank layer survives the loss of a rank at any point of a step") {
  for (const int ranks : {4, 8}) {
    const int experts = 2 * ranks;
    std::vector<double> loads;
    for (int e = 0; e < experts; ++e)
      loads.push_back(1.0 + e % 3);
    const weave::placement start = weave::place_survivable(loads, weave::topology::flat(ranks));
    REQUIRE(weave::check_losses(start, weave::topology::flat(ranks)).survives_any_device());
    for (const loss_at point : {loss_at::between_steps, loss_at::producer, loss_at::experts,
                                loss_at::consumer, loss_at::backward, loss_at::stopped})
      for (int victim = 0; victim < ranks; ++victim) {
        if (point == loss_at::stopped && victim != ranks - 1 && victim != 0)
          continue; // each stop waits out a timeout
        CAPTURE(ranks);
        CAPTURE(victim);
        INFO("lost " << name_of(point));
        const std::vector<planned_loss> losses{{victim, 2, point}};
        elastic_run run;
        run_elastic(run, ranks, experts, start, losses, 2 + compared_steps,
                    point == loss_at::stopped ? 400ms : 20s);
        check_recovered(run, ranks, experts, losses);
        CHECK(run.last_recovery_step == 2);
      }
  }
}

namespace {

// 8 experts in 4 slots of 8 ranks: four copies of each, so any two losses leave a copy.
void check_two_losses(const std::vector<planned_loss>& losses, int last_loss_step) {
  const int ranks = 8, experts = 8;
  const std::vector<double> loads(experts, 1.0);
  weave::survivable_options o;
  o.slots_per_device = 4;
  const weave::placement start = weave::place_survivable(loads, weave::topology::flat(ranks), o);
  elastic_run run;
  run_elastic(run, ranks, experts, start, losses, last_loss_step + compared_steps, 20s);
  check_recovered(run, ranks, experts, losses);
  CHECK(run.last_recovery_step == last_loss_step);
  CHECK(run.final_placement.num_devices() == 6);
}

} // namespace

TEST_CASE("elastic: two losses in a row, where the placement allows it") {
  // After the first loss the survivors' 28 slots hold a survivable placement again.
  check_two_losses({{5, 2, loss_at::experts}, {1, 4, loss_at::backward}}, 4);
}

TEST_CASE("elastic: two ranks lost in one step, where the placement allows it") {
  check_two_losses({{2, 3, loss_at::experts}, {6, 3, loss_at::backward}}, 3);
}

TEST_CASE("elastic: a loss the placement cannot survive ends every survivor with experts_lost") {
  const int ranks = 4, experts = 8;
  const weave::placement start = weave::placement::contiguous(experts, ranks); // one copy each
  const weave::loss_report report = weave::check_losses(start, weave::topology::flat(ranks));
  CHECK(report.fatal_devices() == std::vector<int>{0, 1, 2, 3});
  elastic_run run;
  run_elastic(run, ranks, experts, start, {{1, 2, loss_at::experts}}, 6, 20s);
  REQUIRE(run.survivor_errors.size() == 3);
  for (const std::string& e : run.survivor_errors) {
    CHECK(e.find("weave experts_lost") == 0);
    CHECK(e.find("{2, 3}") != std::string::npos); // rank 1 held experts 2 and 3 alone
  }
  for (int r = 0; r < ranks; ++r)
    CHECK(run.failures[static_cast<std::size_t>(r)]);
}

namespace {

using decode_type = weave::decode_exchange<comm_type, float>;

// One decode step: dispatch, the slot weights on every received row, combine. The victim
// throws between dispatch and combine (it never combines; its thread ends and aborts the world).
std::vector<float> decode_step(decode_type& layer, const slot_weights& sw, const step_input& in,
                               weave::host_stream& s, bool victim) {
  std::vector<float> y(T * H);
  auto h = layer.dispatch(std::span<const float>(in.x.data(), T * H), in.ids, in.w, s);
  s.synchronize();
  if (victim)
    throw injected_loss();
  const auto xs = h.experts();
  for (int l = 0; l < xs.local_experts(); ++l)
    for (std::size_t r = 0; r * H < xs.input(l).size(); ++r) {
      const std::vector<float>& m = sw.w[static_cast<std::size_t>(l)];
      for (std::size_t o = 0; o < H; ++o) {
        float acc = 0.0f;
        for (std::size_t i = 0; i < H; ++i)
          acc += m[o * H + i] * xs.input(l)[r * H + i];
        xs.output(l)[r * H + o] = acc;
      }
    }
  layer.combine(h, std::span<float>(y), s);
  s.synchronize();
  return y;
}

weave::decode_options decode_opts() {
  weave::decode_options o;
  o.k = K;
  o.hidden = H;
  o.max_tokens_per_rank = T;
  return o;
}

} // namespace

TEST_CASE("elastic serving: a decode layer loses a rank mid-call, the survivors go on unchanged") {
  const int ranks = 8, experts = 16, victim = 3, fail_step = 2;
  const std::vector<double> loads(experts, 1.0);
  const weave::placement start = weave::place_survivable(loads, weave::topology::flat(ranks));
  std::mutex m;
  std::map<std::pair<int, int>, std::vector<float>> out;
  std::vector<int> identities(ranks - 1, -1);
  weave::placement final_where;
  weave::local_world world(ranks, {.timeout = 20s});
  const auto failures = world.run_collect([&](comm_type& first) {
    const int identity = first.rank();
    comm_type* comm = &first;
    std::unique_ptr<comm_type> owned;
    weave::placement where = start;
    slot_weights sw(where, comm->rank());
    auto stream = std::make_unique<weave::host_stream>("decode");
    auto layer = std::make_unique<decode_type>(*comm, where, decode_opts());
    for (int step = 0; step < fail_step + compared_steps;) {
      try {
        auto y = decode_step(*layer, sw, step_input(step, identity, experts), *stream,
                             identity == victim && step == fail_step);
        std::lock_guard lock(m);
        out[{identity, step}] = std::move(y);
        ++step;
      } catch (const injected_loss&) {
        throw;
      } catch (const weave::error&) {
        auto next = comm->shrink();
        const auto rec = weave::plan_after_loss(where, next.lost, loads);
        layer.reset();
        stream = std::make_unique<weave::host_stream>("decode");
        carry_weights(*next.comm, *stream, rec.plan, where, comm->rank(), sw);
        where = rec.plan.target;
        owned = std::move(next.comm);
        comm = owned.get();
        layer = std::make_unique<decode_type>(*comm, where, decode_opts());
        CHECK(step == fail_step); // the failed call is issued again, nothing else
      }
    }
    std::lock_guard lock(m);
    identities[static_cast<std::size_t>(comm->rank())] = identity;
    final_where = where;
  });
  for (int r = 0; r < ranks; ++r)
    CHECK(static_cast<bool>(failures[static_cast<std::size_t>(r)]) == (r == victim));
  REQUIRE(final_where.num_devices() == ranks - 1);
  // A fresh decode layer of the same placement, fed the same tokens.
  weave::local_world fresh(ranks - 1);
  fresh.run([&](comm_type& c) {
    const int identity = identities[static_cast<std::size_t>(c.rank())];
    const slot_weights sw(final_where, c.rank());
    weave::host_stream stream("decode");
    decode_type layer(c, final_where, decode_opts());
    for (int step = fail_step; step < fail_step + compared_steps; ++step) {
      const auto y = decode_step(layer, sw, step_input(step, identity, experts), stream, false);
      std::lock_guard lock(m);
      CAPTURE(identity);
      CAPTURE(step);
      CHECK(std::memcmp(y.data(), out.at({identity, step}).data(), y.size() * sizeof(float)) == 0);
    }
  });
}
