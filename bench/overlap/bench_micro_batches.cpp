// Two micro-batches through an MoE block on the emulated link at the balanced ratio (expert
// compute = dispatch + combine link time), every overlap strategy side by side in one run, each
// measured and predicted by the planner's simulator (weave::plan):
//   forward of two micro-batches' blocks (producer op, MoE layer, consumer op), one after the
//   other: unpipelined (C = 1), chunked inside the layer (Tutel, C = 4), and with the producer and
//   consumer as chunk hooks (Lancet, C = 4); both at once, DualPipe-style (DeepSeek-V3: the
//   second's dispatch under the first's experts, the first's combine under the second's
//   experts): unchunked, and combined with chunk hooks (C = 4);
//   a forward of one micro-batch and the backward of another (layers only): one after the
//   other (C = 1, C = 4), and overlapped (C = 1, C = 4).
// Every strategy is written once (`issue`) against two backends: the exchange's handle API, and
// a model that records the same calls as a plan::graph in the exchange's issue order (dispatch:
// P0 D0 P1 D1; chunk c: X(c) B(c) P(c + 2) D(c + 2) F(c - 1), the outputs being given to
// `chunks`; combine: the last finish), priced with
// per-stage costs fitted from the one-after-the-other runs (C = 1 and C = 4) just before each
// row is measured (per rank: their expert rows differ; a collective's cost is its transfer, the
// shortest rank's duration, the waits being the simulator's), plus one hand-off time per task
// fitted to those runs' makespans, and simulated on the 4 ranks with plan::make_schedule and
// plan::simulate.
//
// 4 in-process ranks, 2 micro-batches of 1024 tokens per rank, E = 32, k = 4, hidden 256 bf16,
// 0.05 GB/s emulated link per rank pair; experts and the around-ops sleep (the around-ops of a
// block cost as much as its experts). Reported: rank 0's mean makespan (manual time) and
// counters median_ms (median makespan over the 15 iterations), compute_ms (compute-stream busy),
// exposed_comm_ms (makespan - compute busy), predicted_ms and predicted_exposed_ms (the
// simulator's), error_pct (predicted vs median measured makespan), handoff_us (the fitted
// hand-off). WEAVE_BENCH_VERBOSE=1 also prints each stage's measured and modelled duration.
#include <benchmark/benchmark.h>

#include "moe_bench_setup.hpp"

#include <weave/comm/local_world.hpp>
#include <weave/overlap/moe_exchange.hpp>
#include <weave/overlap/pipeline_timing.hpp>
#include <weave/plan/graph.hpp>
#include <weave/plan/schedule.hpp>
#include <weave/plan/timeline.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <numeric>
#include <thread>
#include <vector>

namespace {

using namespace moe_bench;
using exchange = weave::moe_exchange<weave::local_communicator>;
using handle = exchange::handle;
namespace plan = weave::plan;
constexpr std::size_t tokens = 1024; // per micro-batch and rank
constexpr int wide = 4;              // chunks of the chunked strategies
constexpr int calibration_runs = 7;  // of each one-after-the-other strategy

enum class strategy : int {
  unpipelined,
  chunked,
  hooks,
  two_micro_batches,
  two_micro_batches_hooks,
  fb_sequential,
  fb_sequential_chunked,
  fb_overlapped,
  fb_overlapped_chunked,
};

int chunks_of(strategy s) {
  switch (s) {
  case strategy::unpipelined:
  case strategy::two_micro_batches:
  case strategy::fb_sequential:
  case strategy::fb_overlapped:
    return 1;
  default:
    return wide;
  }
}

bool fb(strategy s) {
  return static_cast<int>(s) >= static_cast<int>(strategy::fb_sequential);
}

// The strategies, written once against a backend `io` (the exchange, or the model).
template <class Io>
void issue(strategy s, Io& io) {
  switch (s) {
  case strategy::unpipelined:
  case strategy::chunked:
    for (int m : {0, 1}) {
      io.produce(m);
      auto& h = io.dispatch(m, false);
      io.experts(h);
      io.combine(h);
      io.consume(m);
    }
    break;
  case strategy::hooks:
    for (int m : {0, 1}) {
      auto& h = io.dispatch(m, true);
      io.experts(h);
      io.combine(h);
    }
    break;
  case strategy::two_micro_batches: {
    io.produce(0);
    auto& a = io.dispatch(0, false);
    io.produce(1); // under a's dispatch
    auto& b = io.dispatch(1, false);
    io.experts(a); // b's dispatch under a's experts
    io.experts(b); // a's combine under b's experts
    io.combine(a);
    io.consume(0);
    io.combine(b);
    io.consume(1);
    break;
  }
  case strategy::two_micro_batches_hooks: {
    auto& a = io.dispatch(0, true);
    auto& b = io.dispatch(1, true);
    io.experts(a, &b); // chunks alternately
    io.combine(a);
    io.combine(b);
    break;
  }
  case strategy::fb_sequential:
  case strategy::fb_sequential_chunked: { // micro-batch 0's forward ran before: its backward
    auto& b = io.dispatch(1, false);
    io.experts(b);
    io.combine(b);
    io.combine_backward(io.pending());
    io.experts(io.pending());
    io.dispatch_backward(io.pending());
    break;
  }
  case strategy::fb_overlapped:
  case strategy::fb_overlapped_chunked: {
    auto& b = io.dispatch(1, false);
    io.combine_backward(io.pending());
    io.experts(b, &io.pending());
    io.combine(b);
    io.dispatch_backward(io.pending());
    break;
  }
  }
}

// --- the exchange backend ---------------------------------------------------------------------

struct measured {
  double makespan_ms = 0, compute_ms = 0;
  // Mean duration of each (stage, backward) at each chunk count, for the model's costs.
  std::map<std::tuple<int, bool, int>, std::pair<double, int>> stages;
  double around_ms_per_token = 0;
};

using ms = std::chrono::duration<double, std::milli>;

struct exchange_io {
  exchange& ex;
  weave::host_stream &compute, &comm;
  std::array<rank_data, 2>& data;
  std::array<weave::host_matrix<row_t>, 2>& dx;
  double expert_ns, around_ns;
  std::array<weave::moe_chunk_hooks, 2> hooks;
  std::vector<std::pair<weave::host_event, weave::host_event>> around; // whole-batch around ops
  std::vector<std::pair<handle*, bool>> phases;                        // for the timings
  std::vector<std::pair<std::unique_ptr<handle>, int>> handles;        // and their micro-batch
  handle* pending_ = nullptr;
  std::array<std::vector<float>, 2> dw;

  exchange_io(exchange& e, weave::host_stream& c, weave::host_stream& s,
              std::array<rank_data, 2>& d, std::array<weave::host_matrix<row_t>, 2>& g,
              double expert, double around_op_ns)
      : ex(e)
      , compute(c)
      , comm(s)
      , data(d)
      , dx(g)
      , expert_ns(expert)
      , around_ns(around_op_ns) {
    for (std::size_t m : {0u, 1u}) {
      rank_data* rd = &data[m];
      hooks[m] = {[rd, this](std::size_t f, std::size_t n) { around_op(rd->x, f, n, around_ns); },
                  [rd, this](std::size_t f, std::size_t n) { around_op(rd->y, f, n, around_ns); }};
      dw[m].resize(data[m].ids.size());
    }
  }

  handle& dispatch(int m, bool hooked) {
    auto& d = data[static_cast<std::size_t>(m)];
    handles.emplace_back(std::make_unique<handle>(
                             ex.dispatch(d.x, d.ids, d.weights, compute, comm,
                                         hooked ? &hooks[static_cast<std::size_t>(m)] : nullptr)),
                         m);
    phases.emplace_back(handles.back().first.get(), false);
    return *handles.back().first;
  }
  handle& pending() { return *pending_; }
  std::size_t mb_of(const handle& h) const {
    for (const auto& [p, m] : handles)
      if (p.get() == &h)
        return static_cast<std::size_t>(m);
    return 0;
  }

  void enqueue(const exchange::chunk& c, bool backward) {
    const double ns = expert_ns;
    compute.submit([c, ns, backward] {
      if (backward) {
        const auto b = c.experts_grad();
        emulated_experts(b.grad_output, b.grad_input, b.expert_offsets, ns);
      } else {
        const auto b = c.experts();
        emulated_experts(b.input, b.output, b.expert_offsets, ns);
      }
    });
  }

  // A handle's chunks, its output given up front (chunk c's finish runs after chunk c + 1).
  weave::moe_chunk_range<exchange> chunks(handle& h) {
    const std::size_t m = mb_of(h);
    if (h.phase() == weave::moe_phase::gradients_dispatched)
      return ex.chunks(h, dx[m].view(), dw[m]);
    return ex.chunks(h, data[m].y.view());
  }

  // The experts of every chunk of `a` (and of `b`, alternately, chunk by chunk).
  void experts(handle& a, handle* b = nullptr) {
    auto ra = chunks(a);
    auto ia = ra.begin();
    const bool a_back = a.phase() == weave::moe_phase::gradients_dispatched;
    const bool b_back = b != nullptr && b->phase() == weave::moe_phase::gradients_dispatched;
    auto rb = b != nullptr ? chunks(*b) : ra;
    auto ib = rb.begin();
    while (ia != ra.end() || (b != nullptr && ib != rb.end())) {
      if (ia != ra.end()) {
        enqueue(*ia, a_back);
        ++ia;
      }
      if (b != nullptr && ib != rb.end()) {
        enqueue(*ib, b_back);
        ++ib;
      }
    }
  }

  void combine(handle& h) { ex.combine(h, data[mb_of(h)].y, compute, comm); }
  void combine_backward(handle& h) {
    ex.combine_backward(h, data[mb_of(h)].x, compute, comm);
    phases.emplace_back(&h, true);
  }
  void dispatch_backward(handle& h) {
    ex.dispatch_backward(h, dx[mb_of(h)], dw[mb_of(h)], compute, comm);
  }

  void around_whole(weave::host_matrix<row_t>& rows) {
    auto& ev = around.emplace_back();
    compute.record(ev.first);
    compute.submit([&rows, ns = around_ns] { around_op(rows, 0, rows.rows(), ns); });
    compute.record(ev.second);
  }
  void produce(int m) { around_whole(data[static_cast<std::size_t>(m)].x); }
  void consume(int m) { around_whole(data[static_cast<std::size_t>(m)].y); }

  // Busy time of the compute stream: its stages in every phase issued, and the around-ops.
  void collect(measured& out, int chunks) const {
    for (const auto& [h, backward] : phases) {
      const auto& p = ex.pipeline(*h, backward);
      for (int c = 0; c < p.chunks(); ++c)
        for (int st = 0; st < weave::pipeline_stage_count; ++st) {
          const auto stage = static_cast<weave::pipeline_stage>(st);
          const double d =
              ms(p.ended(stage, c).completed_at() - p.began(stage, c).completed_at()).count();
          if (!weave::on_comm_stream(stage))
            out.compute_ms += d;
          auto& [sum, n] = out.stages[{st, backward, chunks}];
          sum += d;
          ++n;
        }
    }
    for (const auto& [b, e] : around) {
      const double d = ms(e.completed_at() - b.completed_at()).count();
      out.compute_ms += d;
      out.around_ms_per_token +=
          d / static_cast<double>(tokens) / static_cast<double>(around.size());
    }
  }
};

// --- the model backend ------------------------------------------------------------------------

// Per-stage costs, affine in the chunk's tokens (fixed part per chunk + per token).
struct stage_costs {
  std::map<std::pair<int, bool>, std::pair<double, double>> fit; // (stage, bwd) -> (fixed, per)
  double around_us_per_token = 0;
  // The hand-off every task pays beyond its stage's own time (a stream thread waking up for an
  // event of the other stream; scheduling on a shared machine), fitted to the makespans.
  double handoff_us = 0;
  double at(weave::pipeline_stage s, bool backward, double chunk_tokens) const {
    const auto& [fixed, per] = fit.at({static_cast<int>(s), backward});
    return std::max(0.0, fixed + per * chunk_tokens);
  }
};

// What one op of the model is: a stage of a chunk (its tokens; whether hooks ride in it), or a
// whole-batch operator around the layer (stage -1). Priced per rank when simulated.
struct op_desc {
  int stage = -1;
  bool backward = false, hooked = false;
  double chunk_tokens = 0;

  double cost_us(const stage_costs& c) const {
    if (stage < 0)
      return c.around_us_per_token * static_cast<double>(tokens);
    const auto st = static_cast<weave::pipeline_stage>(stage);
    double us = c.at(st, backward, chunk_tokens);
    if (hooked && (st == weave::pipeline_stage::prepare || st == weave::pipeline_stage::finish))
      us += c.around_us_per_token * chunk_tokens; // the producer / consumer hook
    return us;
  }
};

struct model_io {
  struct model_handle {
    int chunks = 1;
    bool hooked = false, backward = false;
    int current = 0, prepared = 0, finished = 0;
    std::vector<plan::op_id> D, X, B;
  };

  int chunks;
  plan::graph g;
  std::vector<op_desc> ops; // by op id
  std::vector<std::unique_ptr<model_handle>> handles;
  model_handle* pending_ = nullptr;

  double chunk_tokens(const model_handle& h) const {
    return static_cast<double>(tokens) / static_cast<double>(h.chunks);
  }
  plan::op_id add(weave::pipeline_stage s, const model_handle& h, std::vector<plan::op_id> deps) {
    ops.push_back({static_cast<int>(s), h.backward, h.hooked, chunk_tokens(h)});
    const char* name = weave::to_string(s);
    return weave::on_comm_stream(s) ? g.add_a2a(name, 0, plan::op_cost{}, std::move(deps))
                                    : g.add_compute(name, plan::op_cost{}, std::move(deps));
  }
  void prepare(model_handle& h) {
    const plan::op_id p = add(weave::pipeline_stage::prepare, h, {});
    h.D.push_back(add(weave::pipeline_stage::dispatch, h, {p}));
    ++h.prepared;
  }
  void start(model_handle& h) {
    h.current = h.prepared = h.finished = 0;
    h.D.clear();
    h.X.clear();
    h.B.clear();
    prepare(h);
    if (h.chunks > 1)
      prepare(h);
  }
  model_handle& dispatch(int, bool hooked) {
    auto& h = *handles.emplace_back(std::make_unique<model_handle>());
    h.chunks = chunks;
    h.hooked = hooked;
    start(h);
    return h;
  }
  model_handle& pending() {
    if (pending_ == nullptr) { // micro-batch 0's forward ran before the timed part
      pending_ = handles.emplace_back(std::make_unique<model_handle>()).get();
      pending_->chunks = chunks;
    }
    return *pending_;
  }
  void chunk(model_handle& h) {
    const auto c = static_cast<std::size_t>(h.current++);
    h.X.push_back(add(weave::pipeline_stage::experts, h, {h.D[c]}));
    h.B.push_back(add(weave::pipeline_stage::combine, h, {h.X[c]}));
    if (h.prepared < h.chunks)
      prepare(h);
    if (c >= 1) // outputs are given up front: chunk c - 1 finishes now
      finish_one(h);
  }
  void experts(model_handle& a, model_handle* b = nullptr) {
    while (a.current < a.chunks || (b != nullptr && b->current < b->chunks)) {
      if (a.current < a.chunks)
        chunk(a);
      if (b != nullptr && b->current < b->chunks)
        chunk(*b);
    }
  }
  void finish_one(model_handle& h) {
    const auto c = static_cast<std::size_t>(h.finished++);
    add(weave::pipeline_stage::finish, h, {h.B[c]});
  }
  void finish(model_handle& h) {
    while (h.finished < h.chunks)
      finish_one(h);
  }
  void combine(model_handle& h) { finish(h); }
  void combine_backward(model_handle& h) {
    h.backward = true;
    start(h);
  }
  void dispatch_backward(model_handle& h) { finish(h); }
  void around() {
    ops.push_back({});
    g.add_compute("around", plan::op_cost{});
  }
  void produce(int) { around(); }
  void consume(int) { around(); }
};

struct prediction {
  double makespan_ms = 0, compute_ms = 0;
};

// Simulates the strategy on every rank with that rank's costs (its expert rows differ: load
// imbalance); an all-to-all starts when every rank can start it.
prediction predict(strategy s, const std::array<stage_costs, ranks>& costs) {
  model_io io{chunks_of(s), {}, {}, {}, nullptr};
  issue(s, io);
  std::vector<plan::op_id> order(io.g.size());
  std::iota(order.begin(), order.end(), plan::op_id{0});
  const auto sched = plan::make_schedule(io.g, plan::partition_plan::unpartitioned(order));
  const auto t = plan::simulate(sched, ranks, [&](std::size_t r, std::size_t i) {
    return io.ops[sched[i].op].cost_us(costs[r]) + costs[r].handoff_us;
  });
  const auto st = plan::analyze(sched, t, 0);
  return {st.makespan_us / 1e3, st.compute_busy_us / 1e3};
}

// --- the ranks --------------------------------------------------------------------------------

// Persistent ranks, each with an exchange per chunk count (2 handles in flight each); `step(s)`
// runs strategy s once on every rank and returns rank 0's measurements.
class micro_batch_ranks {
 public:
  micro_batch_ranks()
      : world_(ranks, {std::chrono::seconds(60), link()})
      , start_(ranks + 1)
      , done_(ranks + 1) {
    std::mt19937 rng(7);
    for (int r = 0; r < ranks; ++r)
      for (auto& d : data_[static_cast<std::size_t>(r)])
        d = make_rank_data(tokens, rng);
    for (int r = 0; r < ranks; ++r)
      threads_.emplace_back([this, r] { serve(r); });
    step(strategy::unpipelined); // sizes the emulated compute from the link time
    calibrated_ = true;
    for (int i = 0; i < 2; ++i) // warm up at the calibrated costs
      step(strategy::unpipelined);
  }

  // Fits the model's stage costs now (each benchmark row does, just before it is measured: the
  // machine is shared, and its speed drifts between rows).
  void calibrate() {
    // The model's stage costs, from the one-after-the-other runs at C = 1 and C = 4: per rank
    // and stage, the median over runs of the stage's mean duration (the machine is shared;
    // medians resist outliers). A collective's duration on a rank includes its wait for the
    // last rank to arrive, so its cost is the shortest rank's (the transfer itself), the same
    // for every rank; the simulator adds the waits.
    std::map<std::tuple<int, bool, int>, std::array<std::vector<double>, ranks>> runs;
    std::array<std::vector<double>, ranks> around;
    std::map<strategy, std::vector<double>> makespans;
    for (const strategy s : {strategy::unpipelined, strategy::chunked, strategy::fb_sequential,
                             strategy::fb_sequential_chunked})
      for (int i = 0; i < calibration_runs; ++i) {
        makespans[s].push_back(step(s).makespan_ms);
        for (std::size_t r = 0; r < ranks; ++r) {
          for (const auto& [key, v] : results_[r].stages)
            runs[key][r].push_back(v.first / v.second);
          if (results_[r].around_ms_per_token > 0)
            around[r].push_back(results_[r].around_ms_per_token);
        }
      }
    const auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    const auto cost_ms = [&](int st, bool backward, int c, std::size_t r) {
      const auto& per_rank = runs.at({st, backward, c});
      if (!weave::on_comm_stream(static_cast<weave::pipeline_stage>(st)))
        return median(per_rank[r]);
      std::vector<double> shortest(per_rank[0].size());
      for (std::size_t run = 0; run < shortest.size(); ++run) {
        shortest[run] = per_rank[0][run];
        for (const auto& v : per_rank)
          shortest[run] = std::min(shortest[run], v[run]);
      }
      return median(shortest);
    };
    for (std::size_t r = 0; r < ranks; ++r) {
      for (int st = 0; st < weave::pipeline_stage_count; ++st)
        for (const bool backward : {false, true}) {
          const double at1 = 1e3 * cost_ms(st, backward, 1, r);
          const double at4 = 1e3 * cost_ms(st, backward, wide, r);
          const double t1 = static_cast<double>(tokens), t4 = t1 / wide;
          const double per = (at1 - at4) / (t1 - t4);
          costs_[r].fit[{st, backward}] = {at1 - per * t1, per};
        }
      costs_[r].around_us_per_token = 1e3 * median(around[r]);
    }
    // The hand-off: the value that best predicts the calibration runs' own makespans (least
    // squares of the relative errors, on a 10 us grid).
    double best = 0, best_error = -1;
    for (double h = 0; h <= 3000; h += 10) {
      for (auto& c : costs_)
        c.handoff_us = h;
      double error = 0;
      for (const auto& [s, made] : makespans) {
        const double e = predict(s, costs_).makespan_ms / median(made) - 1.0;
        error += e * e;
      }
      if (best_error < 0 || error < best_error) {
        best = h;
        best_error = error;
      }
    }
    for (auto& c : costs_)
      c.handoff_us = best;
  }

  ~micro_batch_ranks() {
    stop_ = true;
    start_.arrive_and_wait();
    for (auto& t : threads_)
      t.join();
  }

  // Runs strategy `s` once on every rank; returns rank 0's measurements.
  measured step(strategy s) {
    strategy_ = s;
    start_.arrive_and_wait();
    done_.arrive_and_wait();
    return results_[0];
  }

  const std::array<stage_costs, ranks>& costs() const { return costs_; }

 private:
  void serve(int r) {
    auto& comm = world_.comm(r);
    weave::moe_options o = options(tokens, 1);
    o.save_for_backward = true;
    o.max_in_flight = 2;
    const auto where = weave::placement::contiguous(experts, ranks);
    exchange narrow_ex(comm, where, o);
    o.chunks = wide;
    exchange wide_ex(comm, where, o);
    weave::host_stream compute("compute"), stream("comm");
    auto& data = data_[static_cast<std::size_t>(r)];
    std::array<weave::host_matrix<row_t>, 2> dx{weave::host_matrix<row_t>(tokens, hidden),
                                                weave::host_matrix<row_t>(tokens, hidden)};
    for (;;) {
      start_.arrive_and_wait();
      if (stop_)
        return;
      const strategy s = strategy_;
      exchange& ex = chunks_of(s) == 1 ? narrow_ex : wide_ex;
      const double ns = calibrated_ ? ns_per_row_.load() : 0.0;
      exchange_io io(ex, compute, stream, data, dx, ns, calibrated_ ? around_ns_.load() : 0.0);
      if (fb(s)) { // micro-batch 0's forward, untimed: its backward is pending
        io.pending_ = &io.dispatch(0, false);
        io.experts(*io.pending_);
        io.combine(*io.pending_);
        io.phases.clear();
        compute.synchronize();
        stream.synchronize();
      }
      const weave::host_event begin = compute.record();
      issue(s, io);
      const weave::host_event end = compute.record();
      compute.synchronize();
      stream.synchronize();
      if (!calibrated_ && r == 0) {
        // Experts of a micro-batch's layer cost its dispatch + combine link time; the
        // around-ops of a block cost as much as its experts.
        const weave::moe_stats st = ex.stats(compute);
        const double remote = static_cast<double>(st.sent_rows - st.local_rows) / (ranks - 1);
        const double link_s =
            2.0 * remote * static_cast<double>(st.row_bytes) / link_bytes_per_second;
        ns_per_row_ = link_s * 1e9 / static_cast<double>(st.expert_rows);
        around_ns_ =
            0.5 * ns_per_row_ * static_cast<double>(st.expert_rows) / static_cast<double>(tokens);
      }
      measured m;
      m.makespan_ms = ms(end.completed_at() - begin.completed_at()).count();
      io.collect(m, chunks_of(s));
      results_[static_cast<std::size_t>(r)] = std::move(m);
      done_.arrive_and_wait();
    }
  }

  weave::local_world world_;
  std::array<std::array<rank_data, 2>, ranks> data_;
  std::barrier<> start_, done_;
  std::vector<std::thread> threads_;
  std::atomic<double> ns_per_row_{0}, around_ns_{0};
  bool calibrated_ = false;
  std::atomic<bool> stop_{false};
  strategy strategy_ = strategy::unpipelined;
  std::array<measured, ranks> results_;
  std::array<stage_costs, ranks> costs_;
};

micro_batch_ranks& shared_ranks() {
  static micro_batch_ranks instance;
  return instance;
}

void micro_batches(benchmark::State& state) {
  const auto s = static_cast<strategy>(state.range(0));
  micro_batch_ranks& ranks_ = shared_ranks();
  ranks_.calibrate();
  std::vector<double> makespan, compute, exposed;
  for (auto _ : state) {
    const measured m = ranks_.step(s);
    state.SetIterationTime(m.makespan_ms / 1e3);
    makespan.push_back(m.makespan_ms);
    compute.push_back(m.compute_ms);
    exposed.push_back(std::max(0.0, m.makespan_ms - m.compute_ms));
  }
  // Medians: the machine is shared, and a rank delayed by another process stalls a collective.
  const auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const prediction p = predict(s, ranks_.costs());
  if (std::getenv("WEAVE_BENCH_VERBOSE") != nullptr) {
    const measured m = ranks_.step(s);
    for (const auto& [key, v] : m.stages) {
      const auto [st, backward, c] = key;
      std::fprintf(stderr, "strategy %d stage %d bwd %d C %d: measured %.2f ms, model %.2f ms\n",
                   static_cast<int>(s), st, backward ? 1 : 0, c, v.first / v.second,
                   ranks_.costs()[0].at(static_cast<weave::pipeline_stage>(st), backward,
                                        static_cast<double>(tokens) / c) /
                       1e3);
    }
  }
  state.counters["median_ms"] = median(makespan);
  state.counters["compute_ms"] = median(compute);
  state.counters["exposed_comm_ms"] = median(exposed);
  state.counters["predicted_ms"] = p.makespan_ms;
  state.counters["predicted_exposed_ms"] = std::max(0.0, p.makespan_ms - p.compute_ms);
  state.counters["error_pct"] = 100.0 * (p.makespan_ms - median(makespan)) / median(makespan);
  state.counters["chunks"] = chunks_of(s);
  state.counters["handoff_us"] = ranks_.costs()[0].handoff_us;
}

} // namespace

BENCHMARK(micro_batches)
    ->ArgName("strategy")
    ->DenseRange(0, static_cast<int>(strategy::fb_overlapped_chunked))
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(15);

BENCHMARK_MAIN();
