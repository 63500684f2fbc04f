// host_space's own behaviour, beside the algorithms tested in their modules: a step enqueued from
// within a task of its stream runs there, in place (so `launch` runs a stage as one task); the
// stable counting sort against std::stable_sort over every key width; memory freed in stream
// order even on a failed stream (the ASan run finds a leak otherwise); and which spaces are
// serial.
#include <doctest/doctest.h>

#include <weave/exec/emulated_gpu_space.hpp>
#include <weave/exec/host_space.hpp>
#include <weave/exec/host_stream.hpp>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

TEST_CASE("runs_here is true only on a thread running one of the stream's tasks") {
  weave::host_stream a("a"), b("b");
  CHECK_FALSE(a.runs_here());
  bool in_a = false, b_in_a = true, inline_here = false;
  a.submit([&] {
    in_a = a.runs_here();
    b_in_a = b.runs_here();
  });
  a.synchronize();
  CHECK(in_a);
  CHECK_FALSE(b_in_a);
  CHECK(a.run_inline_or_submit([&] { inline_here = a.runs_here(); })); // idle: runs here
  CHECK(inline_here);
  CHECK_FALSE(a.runs_here()); // and no longer once it returned
}

TEST_CASE("steps enqueued from within a task of their stream run in place, in order") {
  weave::host_stream s("s");
  std::vector<int> order;
  // A launched stage enqueues three steps; a task submitted after the launch (from this thread)
  // must run after all of them, as it would after the kernels of a CUDA launch.
  weave::host_space::launch(s, [&](weave::host_stream& ls) {
    order.push_back(1);
    weave::host_space::for_each(ls, 2,
                                [&](std::int64_t i) { order.push_back(2 + static_cast<int>(i)); });
    weave::host_space::fill(ls, &order[0], 0, 0); // nothing to fill: a no-op, not a task
    weave::host_space::launch(ls, [&](weave::host_stream&) { order.push_back(4); });
    weave::host_space::on_host(ls, [&] { order.push_back(5); });
  });
  s.submit([&] { order.push_back(6); });
  s.synchronize();
  CHECK(order == std::vector<int>{1, 2, 3, 4, 5, 6});
}

TEST_CASE("a step that throws within a launched stage fails the stage and the stream") {
  weave::host_stream s("s");
  bool after = false, next_task = false;
  weave::host_space::launch(s, [&](weave::host_stream& ls) {
    weave::host_space::for_each(ls, 1, [](std::int64_t) { throw std::runtime_error("step"); });
    after = true; // not reached: the stage ends at the failing step
  });
  s.submit([&] { next_task = true; });
  CHECK_THROWS_WITH(s.synchronize(), "step");
  CHECK_FALSE(after);
  CHECK_FALSE(next_task);
}

TEST_CASE("sort_pairs is a stable sort by the low bits of the keys, for every key width") {
  std::mt19937 rng(3);
  for (const int bits : {1, 2, 7, 11, 12, 21, 22, 23, 31, 32}) {
    for (const std::int64_t n : {0, 1, 2, 17, 1000, 5000}) {
      CAPTURE(bits);
      CAPTURE(n);
      const std::uint32_t mask = bits == 32 ? ~0u : (1u << bits) - 1u;
      std::vector<std::uint32_t> keys(static_cast<std::size_t>(n)), keys_out(keys.size(), 7);
      std::vector<std::int32_t> values(keys.size()), values_out(keys.size(), -7);
      for (std::size_t i = 0; i < keys.size(); ++i) {
        // Few distinct sort keys (stability shows), and garbage above the sorted bits, which
        // the sort must ignore and keep.
        keys[i] = (static_cast<std::uint32_t>(rng()) & ~mask) |
                  (static_cast<std::uint32_t>(rng() % 9) & mask);
        values[i] = static_cast<std::int32_t>(i);
      }
      std::vector<std::size_t> order(keys.size());
      std::iota(order.begin(), order.end(), std::size_t{0});
      std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
        return (keys[a] & mask) < (keys[b] & mask);
      });
      weave::host_stream s("sort");
      weave::host_space::sort_pairs(s, keys.data(), keys_out.data(), values.data(),
                                    values_out.data(), n, bits, nullptr, 0);
      s.synchronize();
      for (std::size_t i = 0; i < order.size(); ++i) {
        REQUIRE(keys_out[i] == keys[order[i]]);
        REQUIRE(values_out[i] == values[order[i]]);
      }
    }
  }
}

TEST_CASE("memory freed on a stream is released even when the stream has failed") {
  weave::host_stream s("s");
  void* p = weave::host_space::allocate_async(4096, s);
  s.submit([] { throw std::runtime_error("failed"); });
  weave::host_space::free_async(p, 4096, &s); // a skipped task would leak it (ASan's leak check)
  CHECK_THROWS_WITH(s.synchronize(), "failed");
  s.submit([] {}); // the stream is usable again
  s.synchronize();
}

TEST_CASE("host_space is serial, the emulated CUDA space is not") {
  CHECK(weave::serial_space<weave::host_space>);
  CHECK_FALSE(weave::serial_space<weave::emulated_gpu_space>);
}
