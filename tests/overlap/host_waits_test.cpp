// Where the device algorithms block the host, they block in the communicator's watched wait:
// with a communicator that fails as NCCL does (an operation whose peer never arrives waits for
// good; only `synchronize` gives up, after its watch, and aborts), a rank whose peer never shows
// up ends with a typed error within the watch, not after the world's own (long) timeout. The MoE
// and decode exchanges' cases are written once and run in host_space and in emulated_gpu_space,
// which blocks the host where cuda_space does: a copy into pageable host memory (a host mirror
// that is not pinned) would wait for the stuck operation outside the watch. Every host read of
// the exchanges is covered: layer construction (the agreement), a dynamic chunk's count
// exchange, check_errors and stats, the decode layer's check_errors and synchronize.
#include <doctest/doctest.h>

#include "aligned_buffer.hpp"
#include "moe_test_support.hpp"
#include "watched_communicator.hpp"

#include <weave/comm/local_world.hpp>
#include <weave/exec/emulated_gpu_space.hpp>
#include <weave/exec/host_space.hpp>
#include <weave/overlap/decode_exchange.hpp>
#include <weave/overlap/moe_exchange.hpp>
#include <weave/routing/host_quant_moves.hpp>
#include <weave/routing/host_row_moves.hpp>

#include <chrono>
#include <future>
#include <memory>
#include <random>
#include <span>
#include <vector>

using namespace std::chrono_literals;
using weave_test::watched_communicator;

namespace {

template <class Space>
using exchange = weave::basic_moe_exchange<Space, watched_communicator>;
template <class Space>
using decode = weave::basic_decode_exchange<Space, watched_communicator, float>;

constexpr auto watch = 300ms;
constexpr auto world_timeout = 30s; // what a wait outside the watch would take
constexpr auto bound = 5s;          // a generous bound on a watched failure

weave::moe_options options(bool fixed) {
  weave::moe_options o;
  o.k = 2;
  o.hidden = 8;
  o.max_tokens = 12;
  o.chunks = 2;
  o.static_shape = fixed;
  return o;
}

// Rank 0 runs `step` (given its watched communicator and a "ready" signal for the part both ranks
// share); rank 1 takes part in `shared` only, then never arrives, staying alive until rank 0 is
// done. Returns rank 0's error code and how long `step` took after the shared part.
template <class Shared, class Step>
std::pair<weave::errc, std::chrono::steady_clock::duration> stuck_peer(Shared&& shared,
                                                                       Step&& step) {
  weave::local_world world(
      2, {std::chrono::duration_cast<std::chrono::milliseconds>(world_timeout), {}});
  std::promise<void> done;
  std::shared_future<void> finished = done.get_future().share();
  weave::errc code{};
  std::chrono::steady_clock::duration took{};
  (void)world.run_collect([&](weave::local_communicator& local) {
    watched_communicator comm(local, watch);
    weave::host_stream compute("compute"), comm_stream("comm");
    auto state = shared(comm, compute, comm_stream);
    if (comm.rank() == 1) {
      finished.wait(); // never arrives at rank 0's next collective
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    try {
      step(comm, compute, comm_stream, *state);
    } catch (const weave::error& e) {
      code = e.code();
    }
    took = std::chrono::steady_clock::now() - start;
    done.set_value();
    for (weave::host_stream* s : {&compute, &comm_stream}) // observe the streams' failures
      try {
        s->synchronize();
      } catch (const weave::error&) {
      }
  });
  return {code, took};
}

void expect_watched(const std::pair<weave::errc, std::chrono::steady_clock::duration>& got) {
  CHECK((got.first == weave::errc::timeout || got.first == weave::errc::peer_failure));
  CHECK(got.second < bound);
}

template <class Space>
struct layer {
  layer(watched_communicator& comm, weave::host_stream& s, bool fixed)
      : ex(comm, weave::placement::contiguous(4, 2), options(fixed))
      , ws(ex.workspace_size()) {
    ex.initialize(ws.ptr, ws.size, s);
    std::mt19937 rng(static_cast<unsigned>(comm.rank()) + 1);
    in = moe_test::random_input<float>(12, 8, 4, 2, rng);
  }
  void forward(weave::host_stream& compute, weave::host_stream& comm) {
    ex.forward(
        in.x.view(), in.ids, in.weights, y.view(), [](const weave::basic_expert_batch<Space>&) {},
        compute, comm);
  }
  exchange<Space> ex;
  weave_test::aligned_buffer ws;
  moe_test::rank_input<float> in;
  weave::host_matrix<float> y{12, 8};
};

} // namespace

TEST_CASE_TEMPLATE("a peer that never constructs the layer: the agreement ends in the watched wait",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  const auto got =
      stuck_peer([](watched_communicator&, weave::host_stream&,
                    weave::host_stream&) { return std::make_unique<int>(0); },
                 [](watched_communicator& comm, weave::host_stream&, weave::host_stream&, int&) {
                   exchange<Space> ex(comm, weave::placement::contiguous(4, 2), options(false));
                 });
  expect_watched(got);
}

TEST_CASE_TEMPLATE("a peer that never calls: a dynamic chunk's count exchange ends in the watched "
                   "wait",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  const auto got = stuck_peer(
      [](watched_communicator& comm, weave::host_stream& compute, weave::host_stream&) {
        return std::make_unique<layer<Space>>(comm, compute, false);
      },
      [](watched_communicator&, weave::host_stream& compute, weave::host_stream& comm,
         layer<Space>& l) {
        l.forward(compute, comm);
        l.ex.synchronize(compute, comm);
      });
  expect_watched(got);
}

TEST_CASE_TEMPLATE("a peer that never calls: check_errors and stats end in the watched wait", Space,
                   weave::host_space, weave::emulated_gpu_space) {
  for (const bool stats : {false, true}) {
    CAPTURE(stats);
    const auto got = stuck_peer(
        [](watched_communicator& comm, weave::host_stream& compute, weave::host_stream&) {
          return std::make_unique<layer<Space>>(comm, compute, true);
        },
        [stats](watched_communicator&, weave::host_stream& compute, weave::host_stream& comm,
                layer<Space>& l) {
          l.forward(compute, comm); // static shapes: enqueues without a host wait
          compute.wait(comm.record());
          if (stats)
            (void)l.ex.stats(compute);
          else
            l.ex.check_errors(compute);
        });
    expect_watched(got);
  }
}

TEST_CASE_TEMPLATE("a peer that never calls: the decode layer's check_errors and synchronize end "
                   "in the watched wait",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  // The workspace given by `initialize` (its upload waits for the stream: both ranks share it)
  // or taken at the first call (rank 0's upload, before any collective).
  struct decode_layer {
    decode_layer(watched_communicator& comm, weave::host_stream& s, bool given)
        : ex(comm, weave::placement::contiguous(4, 2), opts()) {
      ws = std::make_unique<weave_test::aligned_buffer>(ex.workspace_size());
      if (given)
        ex.initialize(ws->ptr, ws->size, s);
    }
    static weave::decode_options opts() {
      weave::decode_options o;
      o.k = 2;
      o.hidden = 8;
      o.max_tokens_per_rank = 4;
      return o;
    }
    std::unique_ptr<weave_test::aligned_buffer> ws; // declared first: destroyed after the layer
    decode<Space> ex;
  };
  for (const bool given : {true, false})
    for (const bool check : {true, false}) {
      CAPTURE(given);
      CAPTURE(check);
      const auto got = stuck_peer(
          [given](watched_communicator& comm, weave::host_stream& s, weave::host_stream&) {
            return std::make_unique<decode_layer>(comm, s, given);
          },
          [check](watched_communicator&, weave::host_stream& s, weave::host_stream&,
                  decode_layer& l) {
            std::vector<float> x(4 * 8, 1.0f), y(4 * 8);
            std::vector<std::int32_t> ids{0, 1, 2, 3, 1, 2, 0, 3};
            std::vector<float> w(8, 0.5f);
            auto h = l.ex.dispatch(x, ids, w, s);
            l.ex.combine(h, std::span<float>(y), s);
            if (check)
              l.ex.check_errors(s);
            else
              l.ex.synchronize(s);
          });
      expect_watched(got);
    }
}
