// The handle API's failure cases (handle_faults.hpp) on local_world, 2 and 4 ranks, for the MoE
// exchange in every execution space CI has (host_space, emulated_gpu_space): every rank ends with
// a typed error naming the cause within seconds (the world's default timeout is 60 s), or
// computes the right result; nothing crashes (ASan) or races (TSan).
#include <doctest/doctest.h>

#include "corrupting_communicator.hpp"
#include "handle_faults.hpp"

#include <weave/comm/local_world.hpp>

#include <array>
#include <cstdio>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace {

using handle_faults::fault;

template <class Space>
void run_all(int ranks) {
  for (const fault f : handle_faults::all_faults) {
    const std::string layer = handle_faults::space_name<Space>(), what = handle_faults::name(f);
    CAPTURE(layer);
    CAPTURE(what);
    CAPTURE(ranks);
    const int culprit = ranks - 1;
    std::vector<handle_faults::outcome> seen(static_cast<std::size_t>(ranks));
    std::vector<std::shared_ptr<void>> kept;
    std::mutex kept_mutex;
    weave::local_world world(ranks); // the default timeouts
    world.run([&](weave::local_communicator& comm) {
      seen[static_cast<std::size_t>(comm.rank())] =
          handle_faults::run_case<Space>(comm, f, culprit, [&](std::shared_ptr<void> p) {
            std::lock_guard lock(kept_mutex);
            kept.push_back(std::move(p));
          });
    });
    for (int r = 0; r < ranks; ++r) {
      CAPTURE(r);
      const auto& o = seen[static_cast<std::size_t>(r)];
      CHECK(o.seconds < 5.0); // well inside the world's 60 s timeout
      const bool guilty = r == culprit;
      switch (f) {
      case fault::swapped_equal_sizes:
      case fault::swapped_other_sizes:
        // Its own finding, or a peer's that failed the world first (naming both calls).
        CHECK(
            (o.code == weave::errc::call_mismatch ||
             (o.code == weave::errc::peer_failure && o.origin_code == weave::errc::call_mismatch)));
        break;
      case fault::destroyed_in_flight:
      case fault::destroyed_after_sync:
      case fault::destroyed_before_handle:
        if (guilty) {
          CHECK(o.code == weave::errc{});
        } else {
          CHECK(o.code == weave::errc::peer_failure);
          CHECK(o.origin == culprit);
          CHECK(o.origin_code == weave::errc::invalid_state);
        }
        break;
      case fault::combine_twice:
        if (guilty) {
          CHECK(o.code == weave::errc::invalid_state);
        } else if (o.code == weave::errc{}) {
          // The culprit had issued every collective of both calls (iterating past a handle's
          // last chunk issues its combine): a peer may finish both, right, before the abort.
          CHECK(o.outputs_right);
        } else {
          CHECK(o.code == weave::errc::peer_failure);
          CHECK(o.origin == culprit);
          CHECK(o.origin_code == weave::errc::invalid_state);
        }
        break;
      case fault::recovery:
        if (guilty) {
          CHECK(o.code == weave::errc::out_of_range);
        } else {
          CHECK(o.code == weave::errc::peer_failure);
          CHECK(o.origin == culprit);
          CHECK(o.origin_code == weave::errc::out_of_range);
        }
        CHECK(o.handles_stale);
        CHECK(o.outputs_right);
        break;
      }
    }
  }
}

using untagged_comm = weave_test::corrupting_communicator;
static_assert(!weave::has_tagged_collectives<untagged_comm>);
using keep_fn = std::function<void(std::shared_ptr<void>)>;

// Runs `side(comm, compute, stream, o, keep)` on every rank of a local_world, each behind a
// communicator without tags (a local_world rank behind a wrapper without the tagged overloads, as
// NCCL's collectives carry none). `side` records its outputs in `o` and `keep`s what must outlive
// its streams' work (its layers, inputs and outputs, as a caller's must); its error is recorded,
// the streams are drained, and the kept objects released before the communicators.
template <class Side>
std::vector<handle_faults::outcome> on_untagged_world(int ranks, Side&& side) {
  std::vector<handle_faults::outcome> seen(static_cast<std::size_t>(ranks));
  std::vector<std::unique_ptr<untagged_comm>> comms(static_cast<std::size_t>(ranks));
  std::vector<std::shared_ptr<void>> kept;
  std::mutex kept_mutex;
  weave::local_world world(ranks);
  world.run([&](weave::local_communicator& local) {
    const int rank = local.rank();
    auto& comm = comms[static_cast<std::size_t>(rank)];
    comm = std::make_unique<untagged_comm>(local);
    auto& o = seen[static_cast<std::size_t>(rank)];
    auto compute = std::make_shared<weave::host_stream>("compute");
    auto stream = std::make_shared<weave::host_stream>("comm");
    std::vector<std::shared_ptr<void>> mine{compute, stream};
    const auto start = std::chrono::steady_clock::now();
    try {
      side(*comm, *compute, *stream, o,
           keep_fn([&](std::shared_ptr<void> p) { mine.push_back(p); }));
    } catch (...) {
      handle_faults::record(o, std::current_exception());
    }
    o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    handle_faults::drain(*compute, *stream);
    std::lock_guard lock(kept_mutex);
    kept.insert(kept.end(), mine.begin(), mine.end());
  });
  kept.clear(); // layers before the communicators they use
  return seen;
}

// Every rank ended within seconds with `call_mismatch` (its own finding, or a peer's abort
// naming it), or with `also` where that is allowed.
void check_call_mismatch(const std::vector<handle_faults::outcome>& seen,
                         weave::errc also = weave::errc::call_mismatch) {
  for (std::size_t r = 0; r < seen.size(); ++r) {
    CAPTURE(r);
    const auto& o = seen[r];
    const int code = static_cast<int>(o.code), origin_code = static_cast<int>(o.origin_code);
    CAPTURE(code);
    CAPTURE(origin_code);
    CHECK(o.seconds < 5.0); // well inside the world's 60 s timeout
    const auto is = [&](weave::errc e) {
      return o.code == e || (o.code == weave::errc::peer_failure && o.origin_code == e);
    };
    CHECK((is(weave::errc::call_mismatch) || is(also)));
  }
}

// Two layers on one communicator without tags, called in another order by the culprit: the
// exchange's count exchanges carry the call's tag (its layer) in their own blocks, so every rank
// ends with `call_mismatch` before any row of the wrong layer is exchanged, whether or not the
// sizes agree; with static shapes (every message one slot) at `synchronize`'s check of the flags.
template <class Space>
void run_untagged_layers(int ranks, bool equal_sizes, bool static_shape = false) {
  using layer_t = handle_faults::layer<untagged_comm, Space>;
  const std::string layer = handle_faults::space_name<Space>();
  CAPTURE(layer);
  CAPTURE(ranks);
  CAPTURE(equal_sizes);
  CAPTURE(static_shape);
  check_call_mismatch(on_untagged_world(ranks, [&](untagged_comm& comm, weave::host_stream& compute,
                                                   weave::host_stream& stream,
                                                   handle_faults::outcome& o, const keep_fn& keep) {
    const int rank = comm.rank();
    struct io {
      moe_test::rank_input<float> a, b;
      weave::host_matrix<float> ya, yb;
    };
    const auto b_tokens = equal_sizes ? handle_faults::tokens : handle_faults::tokens / 2;
    auto d = std::make_shared<io>(io{handle_faults::input_of(rank, ranks, handle_faults::tokens, 1),
                                     handle_faults::input_of(rank, ranks, b_tokens, 2),
                                     {handle_faults::tokens, handle_faults::hidden},
                                     {b_tokens, handle_faults::hidden}});
    keep(d);
    auto first = std::make_shared<layer_t>(comm, compute, static_shape);
    keep(first);
    auto second = std::make_shared<layer_t>(comm, compute, static_shape);
    keep(second);
    const bool guilty = rank == ranks - 1;
    auto& one = guilty ? second->ex : first->ex; // the culprit calls the second layer first
    auto& two = guilty ? first->ex : second->ex;
    auto h1 = one.dispatch(d->a.x, d->a.ids, d->a.weights, compute, stream);
    auto h2 = two.dispatch(d->b.x, d->b.ids, d->b.weights, compute, stream);
    handle_faults::experts(one, h1, compute);
    handle_faults::experts(two, h2, compute);
    one.combine(h1, d->ya, compute, stream);
    two.combine(h2, d->yb, compute, stream);
    one.synchronize(compute, stream);
    two.synchronize(compute, stream);
    o.outputs_right = handle_faults::doubled(d->a, d->ya) && handle_faults::doubled(d->b, d->yb);
  }));
}

// Two handles of one layer on a communicator without tags, dispatched in one order everywhere,
// whose combines (or backward passes) the culprit issues in another order: one chunk per call, so
// iterating a handle issues its combine alone, and no count exchange carries the call's tag. The
// layer exchanges those stages' call tags first (a word per peer, checked where the data lives),
// so every rank ends with `call_mismatch` naming both calls, or a peer's abort carrying it,
// instead of returning the other call's rows. Equal sizes: b routes as a (x scaled), so every
// message has the same size and only the tags differ. With other sizes the emulated GPU (the CUDA
// control flow) may meet the world's size check of the rows first: they were posted before the
// device's verdict was read, as on NCCL. Without the swap, every rank computes the right result.
template <class Space>
void run_untagged_combines(int ranks, bool equal_sizes, bool backward, bool swap = true,
                           bool strict = false) {
  using layer_t = handle_faults::layer<untagged_comm, Space>;
  using handle = typename layer_t::exchange::handle;
  const std::string layer = handle_faults::space_name<Space>();
  CAPTURE(layer);
  CAPTURE(ranks);
  CAPTURE(equal_sizes);
  CAPTURE(backward);
  CAPTURE(swap);
  CAPTURE(strict);
  const auto seen = on_untagged_world(ranks, [&](untagged_comm& comm, weave::host_stream& compute,
                                                 weave::host_stream& stream,
                                                 handle_faults::outcome& o, const keep_fn& keep) {
    const int rank = comm.rank();
    const std::size_t T = handle_faults::tokens, H = handle_faults::hidden;
    struct io {
      moe_test::rank_input<float> a, b;
      weave::host_matrix<float> ya, yb, dxa, dxb;
      std::vector<float> dwa, dwb;
    };
    const std::size_t b_tokens = equal_sizes ? T : T / 2;
    auto d =
        std::make_shared<io>(io{handle_faults::input_of(rank, ranks, T, 1),
                                handle_faults::input_of(rank, ranks, b_tokens, equal_sizes ? 1 : 2),
                                {T, H},
                                {b_tokens, H},
                                {T, H},
                                {b_tokens, H},
                                std::vector<float>(T * handle_faults::k),
                                std::vector<float>(b_tokens * handle_faults::k)});
    keep(d);
    if (equal_sizes) // b routes exactly as a
      for (std::size_t t = 0; t < b_tokens; ++t)
        for (float& v : d->b.x.view().template row_as<float>(t))
          v *= 3.0f;
    auto o_layer = layer_t::options(false);
    o_layer.chunks = 1;
    o_layer.save_for_backward = backward;
    o_layer.strict_call_order = strict;
    auto l = std::make_shared<layer_t>(comm, compute, o_layer);
    keep(l);
    auto& ex = l->ex;
    const bool guilty = swap && rank == ranks - 1;
    handle ha = ex.dispatch(d->a.x, d->a.ids, d->a.weights, compute, stream);
    handle hb = ex.dispatch(d->b.x, d->b.ids, d->b.weights, compute, stream);
    const auto order = [&](bool swapped) {
      return swapped ? std::array{&hb, &ha} : std::array{&ha, &hb};
    };
    for (handle* h : order(guilty && !backward)) {
      handle_faults::experts(ex, *h, compute); // issues the combine's collectives
      ex.combine(*h, h == &ha ? d->ya : d->yb, compute, stream);
    }
    if (backward) // dL/dy = y
      for (handle* h : order(guilty)) {
        const bool is_a = h == &ha;
        auto& dx = is_a ? d->dxa : d->dxb;
        auto& dw = is_a ? d->dwa : d->dwb;
        ex.combine_backward(*h, is_a ? d->ya : d->yb, compute, stream);
        handle_faults::experts_grad(ex, *h, dx, dw, compute);
        ex.dispatch_backward(*h, dx, dw, compute, stream);
      }
    ex.synchronize(compute, stream);
    o.outputs_right = handle_faults::doubled(d->a, d->ya) && handle_faults::doubled(d->b, d->yb);
  });
  if (swap) {
    // Only where host code runs at enqueue time (the emulated GPU), without the host's wait
    // (strict_call_order), are the rows posted before the verdict is read.
    check_call_mismatch(seen, !Space::runs_later && !equal_sizes && !strict
                                  ? weave::errc::size_mismatch
                                  : weave::errc::call_mismatch);
    return;
  }
  for (const auto& o : seen) { // the calls in one order: the tag exchanges pass
    CHECK(o.code == weave::errc{});
    CHECK(o.outputs_right);
  }
}

} // namespace

TEST_CASE_TEMPLATE("handle faults: the MoE exchange on local_world", Space, weave::host_space,
                   weave::emulated_gpu_space) {
  for (const int ranks : {2, 4})
    run_all<Space>(ranks);
}

TEST_CASE_TEMPLATE("handle faults: layers called in another order on a communicator without tags",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  for (const int ranks : {2, 4})
    for (const bool equal_sizes : {true, false})
      run_untagged_layers<Space>(ranks, equal_sizes);
  for (const int ranks : {2, 4})
    run_untagged_layers<Space>(ranks, false, true);
}

TEST_CASE_TEMPLATE("handle faults: combines and backward passes in another order without tags",
                   Space, weave::host_space, weave::emulated_gpu_space) {
  // Every rank ends with call_mismatch; in one order (3 ranks) the results are right.
  for (const int ranks : {2, 4})
    for (const bool equal_sizes : {true, false})
      for (const bool backward : {false, true})
        run_untagged_combines<Space>(ranks, equal_sizes, backward);
  for (const bool backward : {false, true})
    run_untagged_combines<Space>(3, false, backward, false);
  // moe_options::strict_call_order: where host code runs at enqueue time the host reads the tags
  // before it posts the rows, so other sizes fail with call_mismatch before any row moves (on
  // host streams the comm stream checks the tags before the rows anyway); in one order the
  // results are right.
  for (const int ranks : {2, 4})
    for (const bool backward : {false, true})
      run_untagged_combines<Space>(ranks, false, backward, true, true);
  run_untagged_combines<Space>(3, false, true, false, true);
}
