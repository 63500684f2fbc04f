// The handle API (dispatch -> chunks -> combine, combine_backward -> chunks ->
// dispatch_backward) of the MoE exchange on a local_world, each case written once and run in
// `host_space` and in `emulated_gpu_space`: equal to the dense reference and bitwise equal to
// the callback form; the (token, choice) -> expert row map against the inputs; several handles
// in flight (1F1B, DualPipe-style interleavings) bitwise equal to running the micro-batches one
// by one; misuse and failures as typed errors.
#include <doctest/doctest.h>

#include "handle_support.hpp"

#include <weave/comm/local_world.hpp>
#include <weave/exec/emulated_gpu_space.hpp>
#include <weave/exec/host_space.hpp>

#include <algorithm>
#include <random>

using handle_test::mb_result;

namespace {

struct setup {
  int ranks = 2, experts = 8, k = 2;
  std::size_t hidden = 8;
  int micro_batches = 4;
  std::size_t max_tokens = 24;
  weave::capacity_policy capacity{};
  std::uint32_t seed = 11;
};

weave::moe_options options_of(const setup& s, int chunks, int in_flight) {
  weave::moe_options o;
  o.k = s.k;
  o.hidden = s.hidden;
  o.max_tokens = s.max_tokens;
  o.chunks = chunks;
  o.capacity = s.capacity;
  o.save_for_backward = true;
  o.max_in_flight = in_flight;
  return o;
}

// Every rank's micro-batches (token counts vary, one may be empty).
std::vector<std::vector<moe_test::rank_input<float>>> make_inputs(const setup& s) {
  std::mt19937 rng(s.seed);
  std::vector<std::vector<moe_test::rank_input<float>>> all(static_cast<std::size_t>(s.ranks));
  for (auto& mbs : all)
    for (int i = 0; i < s.micro_batches; ++i) {
      const std::size_t T = (i == 2 && &mbs == &all.back()) ? 0 : s.max_tokens - 3 * i;
      mbs.push_back(moe_test::random_input<float>(T, s.hidden, s.experts, s.k, rng));
    }
  return all;
}

// Runs `f(layer, comm, compute, stream)` on every rank of a fresh world, the layer in `Space`.
template <class Space, class F>
void on_every_rank(const setup& s, const weave::moe_options& o, F&& f) {
  weave::local_world world(s.ranks, {std::chrono::seconds(30), {}});
  world.run([&](weave::local_communicator& comm) {
    weave::host_stream compute("compute"), stream("comm");
    handle_test::layer<weave::local_communicator, Space> l(
        comm, weave::placement::contiguous(s.experts, s.ranks), o, compute);
    try {
      f(l, comm, compute, stream);
    } catch (...) { // the queued work refers to the layer: let it drain before the layer goes
      handle_test::drain(compute, stream);
      throw;
    }
  });
}

template <class Space>
void check_one_f_one_b(const setup& s, int chunks) {
  const auto inputs = make_inputs(s);
  const moe_test::linear_experts lin(s.experts, s.hidden, s.seed + 1);
  const auto where = weave::placement::contiguous(s.experts, s.ranks);
  std::vector<std::vector<mb_result>> want(inputs.size()), got(inputs.size());
  on_every_rank<Space>(s, options_of(s, chunks, 1), [&](auto& l, auto& comm, auto& c, auto& st) {
    const auto r = static_cast<std::size_t>(comm.rank());
    want[r] = handle_test::run_one_by_one(l, inputs[r], lin, c, st);
  });
  on_every_rank<Space>(s, options_of(s, chunks, 2), [&](auto& l, auto& comm, auto& c, auto& st) {
    const auto r = static_cast<std::size_t>(comm.rank());
    got[r] = handle_test::run_schedule(l, inputs[r], handle_test::one_f_one_b, lin, c, st);
  });
  for (std::size_t r = 0; r < inputs.size(); ++r)
    for (std::size_t i = 0; i < inputs[r].size(); ++i) {
      CAPTURE(r);
      CAPTURE(i);
      CHECK(handle_test::same(got[r][i], want[r][i]));
      CHECK(got[r][i].stats.sent_rows == want[r][i].stats.sent_rows);
      moe_test::check_rank_against_dense(static_cast<int>(r), where, s.k, s.experts, s.capacity,
                                         inputs[r][i], lin, got[r][i].y, &got[r][i].dx,
                                         &got[r][i].dw, got[r][i].stats, 1e-4);
    }
}

} // namespace

TEST_CASE_TEMPLATE("handles: 4 micro-batches in 1F1B order equal running them one by one", Space,
                   weave::host_space, weave::emulated_gpu_space) {
  setup s;
  for (const int chunks : {1, 3}) {
    CAPTURE(chunks);
    check_one_f_one_b<Space>(s, chunks);
  }
  s.ranks = 3;
  s.experts = 6;
  s.k = 3;
  s.capacity = {1.0, weave::drop_order::batch_prioritized};
  s.seed = 5;
  check_one_f_one_b<Space>(s, 2);
}

TEST_CASE_TEMPLATE("handles: DualPipe-style interleavings equal the sequential calls", Space,
                   weave::host_space, weave::emulated_gpu_space) {
  // Two micro-batches: both dispatches before either's experts (the second's dispatch under the
  // first's compute), chunk by chunk alternation of two forwards, and a forward interleaved
  // chunk by chunk with another micro-batch's backward.
  setup s;
  s.micro_batches = 3;
  const auto inputs = make_inputs(s);
  const moe_test::linear_experts lin(s.experts, s.hidden, 3);
  for (const int chunks : {1, 2, 4}) {
    CAPTURE(chunks);
    std::vector<std::vector<mb_result>> want(inputs.size()), got(inputs.size());
    on_every_rank<Space>(s, options_of(s, chunks, 1), [&](auto& l, auto& comm, auto& c, auto& st) {
      const auto r = static_cast<std::size_t>(comm.rank());
      want[r] = handle_test::run_one_by_one(l, inputs[r], lin, c, st);
    });
    on_every_rank<Space>(s, options_of(s, chunks, 3), [&](auto& l, auto& comm, auto& c, auto& st) {
      const auto r = static_cast<std::size_t>(comm.rank());
      const auto& mb = inputs[r];
      auto& out = got[r];
      out.resize(mb.size());
      for (std::size_t i = 0; i < mb.size(); ++i) {
        out[i].y = weave::host_matrix<float>(mb[i].x.rows(), s.hidden);
        out[i].dx = weave::host_matrix<float>(mb[i].x.rows(), s.hidden);
        out[i].dw.assign(mb[i].ids.size(), -1.0f);
      }
      // One chunk's experts: a task of the compute stream reads the chunk's rows when it runs.
      const auto step = [&](auto& range, auto& it, bool backward) {
        const auto chunk = *it;
        c.submit([chunk, &lin, backward] {
          if (backward)
            lin.backward<float>(chunk.experts_grad());
          else
            lin.operator()<float>(chunk.experts());
        });
        ++it;
        (void)range;
      };
      // Two forwards: dispatch A, dispatch B, then their chunks alternately.
      auto a = l.ex.dispatch(mb[0].x, mb[0].ids, mb[0].weights, c, st);
      auto b = l.ex.dispatch(mb[1].x, mb[1].ids, mb[1].weights, c, st);
      auto ra = l.ex.chunks(a);
      auto rb = l.ex.chunks(b, out[1].y.view()); // b's finishes as its chunks go
      auto ia = ra.begin();
      auto ib = rb.begin();
      while (ia != ra.end() || ib != rb.end()) {
        if (ia != ra.end())
          step(ra, ia, false);
        if (ib != rb.end())
          step(rb, ib, false);
      }
      l.ex.combine(a, out[0].y, c, st);
      l.ex.combine(b, out[1].y, c, st);
      // A's backward interleaved with C's forward, chunk by chunk.
      l.ex.combine_backward(a, mb[0].x, c, st);
      auto h = l.ex.dispatch(mb[2].x, mb[2].ids, mb[2].weights, c, st);
      auto rg = l.ex.chunks(a, out[0].dx, out[0].dw); // a tensor and a vector
      auto rh = l.ex.chunks(h);
      auto ig = rg.begin();
      auto ih = rh.begin();
      while (ig != rg.end() || ih != rh.end()) {
        if (ih != rh.end())
          step(rh, ih, false);
        if (ig != rg.end())
          step(rg, ig, true);
      }
      l.ex.dispatch_backward(a, out[0].dx, out[0].dw, c, st);
      l.ex.combine(h, out[2].y, c, st);
      // Then the backwards of B and C, B's dispatched before C's.
      l.ex.combine_backward(b, mb[1].x, c, st);
      l.ex.combine_backward(h, mb[2].x, c, st);
      handle_test::compute_experts(l.ex, b, lin, c, true);
      handle_test::compute_experts(l.ex, h, lin, c, true);
      l.ex.dispatch_backward(b, out[1].dx, out[1].dw, c, st);
      l.ex.dispatch_backward(h, out[2].dx, out[2].dw, c, st);
      c.synchronize();
      st.synchronize();
    });
    for (std::size_t r = 0; r < inputs.size(); ++r)
      for (std::size_t i = 0; i < inputs[r].size(); ++i) {
        CAPTURE(r);
        CAPTURE(i);
        CHECK(handle_test::same(got[r][i], want[r][i]));
      }
  }
}

TEST_CASE_TEMPLATE("handles: the (token, choice) -> expert row map names each pair's row", Space,
                   weave::host_space, weave::emulated_gpu_space) {
  // Every kept pair served on this rank maps to an expert input row equal to its token's row;
  // the others are marked none (id -1), dropped (capacity) or remote, as the inputs say.
  for (const int ranks : {1, 3}) {
    setup s;
    s.ranks = ranks;
    s.experts = 6;
    s.k = 3;
    s.micro_batches = 1;
    s.capacity = {0.75, weave::drop_order::position};
    const auto inputs = make_inputs(s);
    const auto where = weave::placement::contiguous(s.experts, s.ranks);
    for (const int chunks : {1, 3}) {
      CAPTURE(ranks);
      CAPTURE(chunks);
      on_every_rank<Space>(
          s, options_of(s, chunks, 1), [&](auto& l, auto& comm, auto& c, auto& st) {
            const int rank = comm.rank();
            const auto& in = inputs[static_cast<std::size_t>(rank)][0];
            const auto keep = moe_test::naive_keep(in.ids, in.weights, s.k, s.experts, s.capacity);
            auto h = l.ex.dispatch(in.x, in.ids, in.weights, c, st);
            std::vector<std::vector<std::int64_t>> maps;
            std::vector<std::vector<std::vector<float>>> rows; // per chunk, per mapped pair
            for (const auto chunk : l.ex.chunks(h)) {
              // The chunk's rows are ready once the compute stream got here (in either space).
              c.synchronize();
              const auto map = chunk.expert_rows();
              maps.emplace_back(map.begin(), map.end());
              const auto batch = chunk.experts();
              auto& got = rows.emplace_back();
              for (const std::int64_t row : map)
                if (row >= 0) {
                  const auto v = batch.input.template row_as<float>(static_cast<std::size_t>(row));
                  got.emplace_back(v.begin(), v.end());
                }
            }
            weave::host_matrix<float> y(in.x.rows(), s.hidden);
            l.ex.combine(h, y, c, st);
            c.synchronize();
            st.synchronize();
            const std::size_t tokens = in.x.rows();
            const auto k = static_cast<std::size_t>(s.k);
            for (int ch = 0; ch < chunks; ++ch) {
              const std::size_t first = tokens * static_cast<std::size_t>(ch) / chunks;
              const auto& map = maps[static_cast<std::size_t>(ch)];
              REQUIRE(map.size() % k == 0);
              std::size_t mapped = 0;
              for (std::size_t p = 0; p < map.size(); ++p) {
                const std::size_t t = first + p / k, j = p % k;
                const std::int32_t e = in.ids[t * k + j];
                CAPTURE(t);
                CAPTURE(j);
                if (e < 0) {
                  CHECK(map[p] == weave::expert_row_none);
                } else if (!keep[t * k + j]) {
                  CHECK(map[p] == weave::expert_row_dropped);
                } else if (where.device_of_slot(where.slot_for(e, t, rank)) != rank) {
                  CHECK(map[p] == weave::expert_row_remote);
                } else {
                  REQUIRE(map[p] >= 0);
                  const auto& row = rows[static_cast<std::size_t>(ch)][mapped++];
                  CHECK(std::equal(row.begin(), row.end(), in.x.row(t).begin()));
                }
              }
            }
          });
    }
  }
}

TEST_CASE_TEMPLATE("handles: tensors of any type, and views, at the call site", Space,
                   weave::host_space, weave::emulated_gpu_space) {
  // host_matrix (a tensor_traits type), token views (rvalues are fine: they borrow), spans and
  // vectors give the same bits as the view-and-span overloads.
  setup s;
  s.micro_batches = 1;
  const auto inputs = make_inputs(s);
  const moe_test::linear_experts lin(s.experts, s.hidden, 2);
  on_every_rank<Space>(s, options_of(s, 2, 2), [&](auto& l, auto& comm, auto& c, auto& st) {
    const auto& in = inputs[static_cast<std::size_t>(comm.rank())][0];
    weave::host_matrix<float> y1(in.x.rows(), s.hidden), y2(in.x.rows(), s.hidden);
    auto h1 = l.ex.dispatch(in.x, in.ids, in.weights, c, st); // tensor, vector, vector
    handle_test::compute_experts(l.ex, h1, lin, c);
    l.ex.combine(h1, y1, c, st);
    auto h2 = l.ex.dispatch(in.x.view(), std::span(in.ids), std::span(in.weights), c, st);
    handle_test::compute_experts(l.ex, h2, lin, c);
    l.ex.combine(h2, y2.view(), c, st);
    c.synchronize();
    st.synchronize();
    CHECK(handle_test::same(y1, y2));
  });
}

TEST_CASE_TEMPLATE("handles: misuse is a typed error on the culprit, a peer_error on its peers",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  // Misuse that issues collectives out of turn leaves the peers waiting for this rank: the
  // layer aborts its communicator, so rank 0 gets its typed error and rank 1 (calling correctly)
  // a peer_error naming rank 0 and that error, at once (the world's timeout is 30 s).
  setup s;
  s.micro_batches = 1;
  const auto inputs = make_inputs(s);
  const moe_test::linear_experts lin(s.experts, s.hidden, 1);
  struct misuse {
    const char* name;
    weave::errc code;
  };
  const misuse cases[] = {
      {"combine before every chunk was iterated", weave::errc::invalid_state},
      {"combine_backward on a dispatched handle", weave::errc::invalid_state},
      {"combine twice", weave::errc::invalid_state},
      {"a dispatch past max_in_flight", weave::errc::invalid_state},
      {"combine with another output than chunks(h, y)", weave::errc::invalid_argument},
      {"a moved-from handle", weave::errc::invalid_state},
  };
  for (int m = 0; m < static_cast<int>(std::size(cases)); ++m) {
    CAPTURE(cases[m].name);
    weave::local_world world(s.ranks, {std::chrono::seconds(30), {}});
    std::vector<weave::errc> codes(static_cast<std::size_t>(s.ranks), weave::errc{});
    std::vector<int> origins(codes.size(), -1);
    std::vector<weave::errc> origin_codes(codes.size(), weave::errc{});
    const auto start = std::chrono::steady_clock::now();
    world.run_collect([&](weave::local_communicator& comm) {
      const auto r = static_cast<std::size_t>(comm.rank());
      weave::host_stream c("compute"), st("comm");
      handle_test::layer<weave::local_communicator, Space> l(
          comm, weave::placement::contiguous(s.experts, s.ranks), options_of(s, 3, 2), c);
      const auto& in = inputs[r][0];
      weave::host_matrix<float> y(in.x.rows(), s.hidden), other(in.x.rows(), s.hidden);
      try {
        auto h = l.ex.dispatch(in.x, in.ids, in.weights, c, st);
        typename std::remove_reference_t<decltype(l.ex)>::handle g;
        if (m == 3) // every rank holds max_in_flight = 2 handles
          g = l.ex.dispatch(in.x, in.ids, in.weights, c, st);
        CHECK(h.phase() == weave::moe_phase::dispatched);
        // A query issues nothing: a typed error (it aborts nothing).
        CHECK(moe_test::error_code_of([&] { (void)h.chunk(3); }) == weave::errc::out_of_range);
        if (r == 0) {
          if (m == 0) {
            l.ex.combine(h, y, c, st);
          } else if (m == 1) {
            l.ex.combine_backward(h, in.x, c, st);
          } else if (m == 2) {
            handle_test::compute_experts(l.ex, h, lin, c);
            l.ex.combine(h, y, c, st);
            l.ex.combine(h, y, c, st);
          } else if (m == 3) {
            auto third = l.ex.dispatch(in.x, in.ids, in.weights, c, st);
          } else if (m == 4) {
            for (const auto chunk : l.ex.chunks(h, y.view()))
              (void)chunk;
            l.ex.combine(h, other, c, st);
          } else {
            auto moved = std::move(h);
            l.ex.combine(h, y, c, st);
          }
        }
        // The correct sequence: this call (and the second), then the next.
        handle_test::compute_experts(l.ex, h, lin, c);
        l.ex.combine(h, y, c, st);
        if (m == 3) {
          handle_test::compute_experts(l.ex, g, lin, c);
          l.ex.combine(g, y, c, st);
          g.reset();
        }
        auto next = l.ex.dispatch(in.x, in.ids, in.weights, c, st);
        handle_test::compute_experts(l.ex, next, lin, c);
        l.ex.combine(next, y, c, st);
        l.ex.synchronize(c, st);
      } catch (const weave::peer_error& e) {
        codes[r] = e.code();
        origins[r] = e.origin().rank;
        origin_codes[r] = e.origin().code;
      } catch (const weave::error& e) {
        codes[r] = e.code();
      }
      handle_test::drain(c, st);
      CHECK_FALSE(l.ex.usable());
    });
    CHECK(codes[0] == cases[m].code);
    CHECK(codes[1] == weave::errc::peer_failure);
    CHECK(origins[1] == 0);
    CHECK(origin_codes[1] == cases[m].code);
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
  }
}

namespace {

// One call on every rank in which rank 1's own expert task throws (or, with `drop`, rank 1
// releases its handle before combining it): each rank's first error (from a call, where host code
// runs at enqueue time and waits for a chunk's counts, or from its streams), and whether the
// failed handle's statistics were then refused with `errc::invalid_state`.
struct failed_call {
  std::vector<weave::errc> codes;
  std::vector<int> stats_withheld; // one element per rank thread
};

template <class Space>
failed_call fail_one_call(bool drop) {
  setup s;
  s.micro_batches = 1;
  const auto inputs = make_inputs(s);
  weave::local_world world(s.ranks, {std::chrono::seconds(30), {}});
  failed_call out{std::vector<weave::errc>(static_cast<std::size_t>(s.ranks), weave::errc{}),
                  std::vector<int>(static_cast<std::size_t>(s.ranks), 0)};
  world.run_collect([&](weave::local_communicator& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    weave::host_stream compute("compute"), stream("comm");
    handle_test::layer<weave::local_communicator, Space> l(
        comm, weave::placement::contiguous(s.experts, s.ranks), options_of(s, 2, 1), compute);
    const auto& in = inputs[r][0];
    weave::host_matrix<float> y(in.x.rows(), s.hidden);
    const auto note = [&](const weave::error& e) {
      if (out.codes[r] == weave::errc{})
        out.codes[r] = e.code();
    };
    typename handle_test::layer<weave::local_communicator, Space>::exchange::handle h;
    try {
      h = l.ex.dispatch(in.x, in.ids, in.weights, compute, stream);
      if (drop && r == 1) {
        h.reset(); // its combine never comes
      } else {
        for (const auto chunk : l.ex.chunks(h))
          compute.submit([chunk, r, drop] {
            if (!drop && r == 1)
              throw weave::error(weave::errc::invalid_argument, "the experts failed");
            (void)chunk;
          });
        l.ex.combine(h, y, compute, stream);
      }
    } catch (const weave::error& e) {
      note(e);
    }
    for (weave::host_stream* st : {&compute, &stream}) {
      try {
        st->synchronize();
      } catch (const weave::error& e) {
        note(e);
      }
    }
    try {
      (void)l.ex.stats(h, compute);
    } catch (const weave::error& e) {
      out.stats_withheld[r] = e.code() == weave::errc::invalid_state;
    }
  });
  return out;
}

} // namespace

TEST_CASE_TEMPLATE("handles: a failing expert task or a dropped handle fails every rank", Space,
                   weave::host_space, weave::emulated_gpu_space) {
  // Rank 1's own expert task throws (or rank 1 releases a handle before combining it): its peers
  // get peer_failure instead of waiting in the collectives rank 1 will never enter.
  for (const bool drop : {false, true}) {
    CAPTURE(drop);
    const failed_call got = fail_one_call<Space>(drop);
    CHECK(got.codes[0] == weave::errc::peer_failure);
    if (!drop)
      CHECK(got.codes[1] == weave::errc::invalid_argument);
  }
}

// The failed handle returns no numbers (docs/exchange.md: "its `stats(h)` stay unavailable
// (`errc::invalid_state`)"): its forward never ran its last finish, which marks the counters
// complete.
TEST_CASE_TEMPLATE("handles: a failed call's statistics are withheld", Space, weave::host_space,
                   weave::emulated_gpu_space) {
  const failed_call got = fail_one_call<Space>(false);
  CHECK(got.stats_withheld[0]);
  CHECK(got.stats_withheld[1]);
}
