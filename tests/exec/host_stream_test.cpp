// host_stream must behave as a CUDA stream: FIFO order, events that mark points, cross-stream
// waits, sticky failures that surface at synchronize() and never deadlock a waiter.
#include <doctest/doctest.h>

#include <weave/core/error.hpp>
#include <weave/exec/host_stream.hpp>

#include <atomic>
#include <chrono>
#include <future>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;

TEST_CASE("tasks run in submission order") {
  weave::host_stream s;
  std::vector<int> order;
  for (int i = 0; i < 2000; ++i)
    s.submit([&order, i] { order.push_back(i); });
  s.synchronize();
  REQUIRE(order.size() == 2000);
  for (int i = 0; i < 2000; ++i)
    REQUIRE(order[static_cast<std::size_t>(i)] == i);
}

TEST_CASE("an event completes only when the stream reaches it") {
  weave::host_stream s;
  std::promise<void> gate;
  auto opened = gate.get_future().share();
  s.submit([opened] { opened.wait(); });
  weave::host_event e = s.record();
  std::this_thread::sleep_for(5ms);
  CHECK_FALSE(e.query());
  CHECK_FALSE(s.query());
  gate.set_value();
  e.synchronize();
  CHECK(e.query());
  s.synchronize();
  CHECK(s.query());
  CHECK(weave::host_event().query()); // never recorded: complete, as in CUDA
}

TEST_CASE("wait orders work across streams") {
  weave::host_stream producer("producer"), consumer("consumer");
  for (int round = 0; round < 50; ++round) {
    std::promise<void> gate;
    auto opened = gate.get_future().share();
    std::atomic<int> value{0};
    int seen = -1;
    producer.submit([opened, &value, round] {
      opened.wait();
      value.store(round + 1, std::memory_order_relaxed);
    });
    consumer.wait(producer.record());
    consumer.submit([&] { seen = value.load(std::memory_order_relaxed); });
    gate.set_value();
    consumer.synchronize();
    producer.synchronize();
    REQUIRE(seen == round + 1);
  }
}

TEST_CASE("re-recording an event does not move earlier waits") {
  weave::host_stream a("a"), b("b");
  weave::host_event e;
  std::promise<void> first_gate, second_gate;
  auto first = first_gate.get_future().share();
  auto second = second_gate.get_future().share();
  std::atomic<int> stage{0};
  a.submit([first, &stage] {
    first.wait();
    stage = 1;
  });
  a.record(e);
  int seen = -1;
  b.wait(e); // waits for stage 1 only
  b.submit([&] { seen = stage.load(); });
  a.submit([second, &stage] {
    second.wait();
    stage = 2;
  });
  a.record(e); // moves e past the second gate
  first_gate.set_value();
  b.synchronize(); // must finish although the second gate is still closed
  CHECK(seen == 1);
  CHECK_FALSE(e.query());
  second_gate.set_value();
  e.synchronize();
  a.synchronize();
}

TEST_CASE("a failing task surfaces at synchronize, skips later tasks, then the stream recovers") {
  weave::host_stream s;
  bool ran_after = false;
  s.submit([] { throw weave::error(weave::errc::out_of_range, "expert id 70 >= 64"); });
  s.submit([&] { ran_after = true; });
  try {
    s.synchronize();
    FAIL("synchronize did not rethrow");
  } catch (const weave::error& e) {
    CHECK(e.code() == weave::errc::out_of_range);
    CHECK(e.message() == "expert id 70 >= 64");
  }
  CHECK_FALSE(ran_after);
  s.submit([&] { ran_after = true; });
  CHECK_NOTHROW(s.synchronize());
  CHECK(ran_after);
}

TEST_CASE("a waiter on a failed stream fails instead of hanging or running on bad data") {
  weave::host_stream producer("producer"), consumer("consumer");
  producer.submit([] { throw std::runtime_error("dispatch failed"); });
  weave::host_event e = producer.record();
  bool consumer_ran = false;
  consumer.wait(e);
  consumer.submit([&] { consumer_ran = true; });
  CHECK_THROWS_WITH_AS(consumer.synchronize(), "dispatch failed", std::runtime_error);
  CHECK_FALSE(consumer_ran);
  CHECK_THROWS_WITH_AS(e.synchronize(), "dispatch failed", std::runtime_error);
  CHECK_THROWS_AS(producer.synchronize(), std::runtime_error);
  CHECK_NOTHROW(producer.synchronize()); // cleared
}

TEST_CASE("submit_always runs on a failed stream, sees the failure and decides what stays") {
  weave::host_stream s;
  std::vector<int> ran;
  s.submit([] { throw std::runtime_error("first"); });
  s.submit([&] { ran.push_back(1); }); // skipped
  std::string seen;
  s.submit_always([&](std::exception_ptr failure) {
    try {
      std::rethrow_exception(failure);
    } catch (const std::exception& e) {
      seen = e.what();
    }
    return std::exception_ptr{}; // cleared: later tasks run again
  });
  s.submit([&] { ran.push_back(2); });
  s.submit_always([&](std::exception_ptr failure) {
    CHECK_FALSE(failure); // healthy here
    ran.push_back(3);
    return std::make_exception_ptr(std::runtime_error("second"));
  });
  const weave::host_event after = s.record();
  s.submit([&] { ran.push_back(4); }); // skipped: the failure the task returned stays
  s.submit_always([&](std::exception_ptr failure) {
    ran.push_back(5);
    return failure; // kept
  });
  try {
    s.synchronize();
    FAIL("the failure returned by submit_always was lost");
  } catch (const std::runtime_error& e) {
    CHECK(std::string(e.what()) == "second");
  }
  CHECK(seen == "first");
  CHECK(ran == std::vector<int>{2, 3, 5});
  CHECK_THROWS_AS(after.synchronize(), std::runtime_error); // events carry it
  s.submit_always(
      [](std::exception_ptr) -> std::exception_ptr { throw std::logic_error("thrown"); });
  CHECK_THROWS_AS(s.synchronize(), std::logic_error); // a throw fails the stream too
  s.synchronize();                                    // and synchronize cleared it
}

TEST_CASE("many threads may submit concurrently") {
  weave::host_stream s;
  std::atomic<int> executed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < 500; ++i)
        s.submit([&] { executed.fetch_add(1, std::memory_order_relaxed); });
    });
  for (auto& t : threads)
    t.join();
  s.synchronize();
  CHECK(executed.load() == 2000);
}

TEST_CASE("the destructor drains pending work") {
  std::atomic<int> executed{0};
  {
    weave::host_stream s;
    for (int i = 0; i < 100; ++i)
      s.submit([&] {
        std::this_thread::sleep_for(10us);
        executed.fetch_add(1);
      });
  }
  CHECK(executed.load() == 100);
}

TEST_CASE("event timestamps order with the stream and measure elapsed time") {
  weave::host_stream s;
  weave::host_event start = s.record();
  s.submit([] { std::this_thread::sleep_for(20ms); });
  weave::host_event end = s.record();
  s.synchronize();
  const double ms = weave::host_event::elapsed_ms(start, end);
  CHECK(ms >= 19.0); // a lower bound only: sleeping can overrun, never underrun
}

TEST_CASE("run_inline_or_submit runs on the caller's thread only when the stream is idle") {
  weave::host_stream s;
  const std::thread::id caller = std::this_thread::get_id();
  std::thread::id ran_on;
  CHECK(s.run_inline_or_submit([&] { ran_on = std::this_thread::get_id(); }));
  CHECK(ran_on == caller);
  CHECK(s.query()); // nothing left to run: it completed before returning

  // Busy: queued behind the running task, on the worker, in order.
  std::promise<void> gate;
  auto opened = gate.get_future().share();
  std::vector<int> order;
  s.submit([&, opened] {
    opened.wait();
    order.push_back(1);
  });
  CHECK_FALSE(s.run_inline_or_submit([&] {
    order.push_back(2);
    ran_on = std::this_thread::get_id();
  }));
  CHECK_FALSE(s.run_inline_or_submit_always([&](std::exception_ptr f) {
    order.push_back(3);
    return f;
  }));
  gate.set_value();
  s.synchronize();
  CHECK(order == std::vector<int>{1, 2, 3});
  CHECK(ran_on != caller);
}

TEST_CASE("the worker starts nothing submitted while an inline task runs until it returns") {
  weave::host_stream s;
  std::atomic<bool> inline_done{false};
  std::atomic<bool> later_saw_done{false};
  std::atomic<bool> later_ran{false};
  std::promise<void> submitted;
  auto was_submitted = submitted.get_future();
  CHECK(s.run_inline_or_submit([&] {
    std::thread other([&] {
      s.submit([&] {
        later_saw_done = inline_done.load();
        later_ran = true;
      });
      submitted.set_value();
    });
    was_submitted.wait();
    other.join();
    std::this_thread::sleep_for(5ms); // room for a wrongly started worker to run it
    CHECK_FALSE(later_ran.load());
    inline_done = true;
  }));
  weave::host_event after = s.record(); // queued behind the later task: not reached inline
  s.synchronize();
  CHECK(later_ran.load());
  CHECK(later_saw_done.load());
  CHECK(after.query());
}

TEST_CASE("inline tasks keep the stream's failure rules") {
  weave::host_stream s;
  // A throwing inline task fails the stream; the caller does not see the exception.
  CHECK(s.run_inline_or_submit([] { throw std::runtime_error("inline boom"); }));
  bool ran = false;
  CHECK(s.run_inline_or_submit([&] { ran = true; })); // idle but failed: skipped
  CHECK_FALSE(ran);
  weave::host_event e = s.record(); // reached at once, carrying the failure
  CHECK(e.query());
  CHECK_THROWS_WITH(e.synchronize(), "inline boom");
  std::exception_ptr seen;
  CHECK(s.run_inline_or_submit_always([&](std::exception_ptr f) {
    seen = f;
    return f; // keeps it
  }));
  CHECK(seen != nullptr);
  CHECK_THROWS_WITH(s.synchronize(), "inline boom");
  // Recovered: inline tasks run again, and one that clears a failure clears it.
  CHECK(s.run_inline_or_submit([&] { ran = true; }));
  CHECK(ran);
  CHECK(s.run_inline_or_submit([] { throw std::runtime_error("second"); }));
  CHECK(s.run_inline_or_submit_always([](std::exception_ptr) { return std::exception_ptr{}; }));
  CHECK_NOTHROW(s.synchronize());
}

TEST_CASE("idle says whether work is left, and record_unless_idle records only then") {
  weave::host_stream s;
  CHECK(s.idle());
  weave::host_event e = s.record(); // reached at once
  CHECK(e.query());
  weave::record_unless_idle(s, e); // nothing left: e keeps its reached point
  CHECK(e.query());
  std::promise<void> gate;
  s.submit([opened = gate.get_future().share()] { opened.wait(); });
  CHECK_FALSE(s.idle());
  weave::record_unless_idle(s, e); // behind the gated task
  CHECK_FALSE(e.query());
  gate.set_value();
  e.synchronize();
  s.synchronize();
  CHECK(s.idle());
  s.begin_capture(); // never idle while capturing (and no throw, unlike query)
  CHECK_FALSE(s.idle());
  s.end_capture();
  CHECK(s.idle());
}

TEST_CASE("a capturing stream never runs a task inline") {
  weave::host_stream s;
  s.begin_capture();
  std::thread::id ran_on;
  CHECK_FALSE(s.run_inline_or_submit([&] { ran_on = std::this_thread::get_id(); }));
  weave::host_event e = s.record();
  s.end_capture();
  s.synchronize();
  CHECK(ran_on != std::this_thread::get_id());
}

TEST_CASE("a claim runs its thread's steps here, in order with work other threads queue") {
  weave::host_stream s;
  const std::thread::id caller = std::this_thread::get_id();
  std::vector<int> order;
  std::vector<std::thread::id> ran_on;
  const auto step = [&](int n) {
    return [&, n] {
      order.push_back(n);
      ran_on.push_back(std::this_thread::get_id());
    };
  };
  {
    const auto claim = weave::claim_if_idle(s);
    REQUIRE(static_cast<bool>(claim));
    {
      const auto joined = s.claim_if_idle(); // held by this thread already: joins the hold
      CHECK(static_cast<bool>(joined));
      CHECK(joined.all_ran_here());
    }
    CHECK_FALSE(s.idle()); // leaving the joined claim ended nothing
    CHECK(s.run_inline_or_submit(step(1)));
    CHECK(s.run_inline_or_submit_always([&](std::exception_ptr f) {
      step(2)();
      return f;
    }));
    CHECK(claim.all_ran_here());
    CHECK_FALSE(s.idle());                          // held
    CHECK_THROWS_AS(s.synchronize(), weave::error); // would wait for itself
    std::thread other([&] { s.submit(step(3)); });  // another thread's work, queued meanwhile
    other.join();
    CHECK_FALSE(s.run_inline_or_submit(step(4))); // behind it: queued, not run here
    CHECK_FALSE(claim.all_ran_here());
    std::this_thread::sleep_for(5ms);       // room for a wrongly started worker
    CHECK(order == std::vector<int>{1, 2}); // the worker starts nothing while held
  }
  s.synchronize();
  CHECK(order == std::vector<int>{1, 2, 3, 4});
  CHECK(ran_on[0] == caller);
  CHECK(ran_on[1] == caller);
  CHECK(ran_on[3] != caller);
  CHECK(s.idle());

  // A step the chooser sends to the worker: every later step of the claim queues behind it.
  order.clear();
  {
    const auto claim = s.claim_if_idle();
    REQUIRE(static_cast<bool>(claim));
    CHECK_FALSE(s.run_inline_or_submit_always(
        [&](std::exception_ptr f) {
          order.push_back(1);
          return f;
        },
        [] { return false; }));
    CHECK_FALSE(s.run_inline_or_submit(step(2)));
  }
  s.synchronize();
  CHECK(order == std::vector<int>{1, 2});

  // Busy: no claim, steps queue as usual.
  std::promise<void> gate;
  auto opened = gate.get_future().share();
  s.submit([opened] { opened.wait(); });
  {
    const auto claim = s.claim_if_idle();
    CHECK_FALSE(static_cast<bool>(claim));
    CHECK_FALSE(claim.all_ran_here());
    CHECK_FALSE(s.run_inline_or_submit(step(5)));
  }
  gate.set_value();
  s.synchronize();
  CHECK(order.back() == 5);
}

TEST_CASE("a claimed step that fails the stream skips the claim's later steps") {
  weave::host_stream s;
  bool ran = false;
  {
    const auto claim = s.claim_if_idle();
    CHECK(s.run_inline_or_submit([] { throw std::runtime_error("claimed boom"); }));
    CHECK(s.run_inline_or_submit([&] { ran = true; }));
  }
  CHECK_FALSE(ran);
  CHECK_THROWS_WITH(s.synchronize(), "claimed boom");
  CHECK(s.run_inline_or_submit([&] { ran = true; }));
  CHECK(ran);
}
