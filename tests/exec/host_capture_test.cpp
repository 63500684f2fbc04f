// Stream capture on host streams refuses what a CUDA graph capture refuses (host_capture.hpp),
// and `emulated_gpu_space` copies as the CUDA runtime does: pageable copies block or are
// refused while capturing, pinned ones are stream-ordered.
#include <doctest/doctest.h>

#include <weave/core/error.hpp>
#include <weave/exec/emulated_gpu_space.hpp>
#include <weave/exec/host_mirror.hpp>
#include <weave/exec/host_stream.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <future>
#include <string>
#include <thread>
#include <vector>

using namespace std::chrono_literals;

namespace {

// The message of the weave::error `f` throws with `errc::invalid_state` ("" when none).
template <class F>
std::string refusal(F&& f) {
  try {
    f();
  } catch (const weave::error& e) {
    REQUIRE(e.code() == weave::errc::invalid_state);
    return e.what();
  }
  return "";
}

bool mentions(const std::string& text, const char* what) {
  return text.find(what) != std::string::npos;
}

} // namespace

TEST_CASE("a fork joined back ends the capture cleanly, and the work ran") {
  weave::host_stream origin("origin"), side("side");
  std::atomic<int> ran{0};
  origin.begin_capture();
  CHECK(origin.capturing());
  CHECK_FALSE(side.capturing());
  origin.submit([&] { ++ran; });
  side.wait(origin.record()); // joins
  CHECK(side.capturing());
  side.submit([&] { ++ran; });
  origin.wait(side.record()); // joined back
  origin.submit([&] { ++ran; });
  origin.end_capture();
  CHECK_FALSE(origin.capturing());
  CHECK_FALSE(side.capturing());
  origin.synchronize();
  side.synchronize();
  CHECK(ran == 3);
}

TEST_CASE("a joined stream whose last work is not joined back fails end_capture") {
  weave::host_stream origin("origin"), side("side");
  origin.begin_capture();
  side.wait(origin.record());
  side.submit([] {});
  weave::host_event early = side.record();
  side.submit([] {}); // after the event the origin waits for
  origin.wait(early);
  const std::string why = refusal([&] { origin.end_capture(); });
  CHECK(mentions(why, "cudaErrorStreamCaptureUnjoined"));
  CHECK(mentions(why, "side"));
  CHECK_FALSE(side.capturing()); // the capture is over either way
}

TEST_CASE("a join back through a third stream counts (dependencies are transitive)") {
  weave::host_stream origin("origin"), a("a"), b("b");
  origin.begin_capture();
  a.wait(origin.record());
  a.submit([] {});
  b.wait(a.record());
  b.submit([] {});
  origin.wait(b.record()); // b's event covers a's work too
  CHECK_NOTHROW(origin.end_capture());
}

TEST_CASE("waiting in a capture for an event recorded outside it is refused") {
  weave::host_stream origin("origin"), other("other");
  weave::host_event outside = other.record();
  origin.begin_capture();
  const std::string why = refusal([&] { origin.wait(outside); });
  CHECK(mentions(why, "cudaErrorStreamCaptureIsolation"));
  CHECK(mentions(why, "invalidated"));
  const std::string end = refusal([&] { origin.end_capture(); });
  CHECK(mentions(end, "cudaErrorStreamCaptureIsolation"));
  CHECK_FALSE(origin.capturing());
}

TEST_CASE("waiting for an event of another capture is refused") {
  weave::host_stream a("a"), b("b");
  a.begin_capture();
  b.begin_capture();
  weave::host_event of_b = b.record();
  CHECK(mentions(refusal([&] { a.wait(of_b); }), "cudaErrorStreamCaptureMerge"));
  CHECK_THROWS(a.end_capture());
  CHECK_NOTHROW(b.end_capture());
}

TEST_CASE("a capturing stream and a captured event cannot be queried or synchronized") {
  weave::host_stream s("s"), later("later");
  s.begin_capture();
  CHECK(mentions(refusal([&] { (void)s.query(); }), "cudaErrorStreamCaptureUnsupported"));
  CHECK_THROWS(s.end_capture()); // invalidated
  s.begin_capture();
  CHECK(mentions(refusal([&] { s.synchronize(); }), "cudaErrorStreamCaptureUnsupported"));
  CHECK_THROWS(s.end_capture());

  s.begin_capture();
  weave::host_event captured = s.record();
  CHECK(mentions(refusal([&] { (void)captured.query(); }), "cudaErrorCapturedEvent"));
  CHECK_THROWS(s.end_capture());

  s.begin_capture();
  captured = weave::host_event{};
  s.record(captured);
  s.end_capture();
  // Still a captured event once the capture ended: not queried, not waited for outside it.
  CHECK(mentions(refusal([&] { captured.synchronize(); }), "cudaErrorCapturedEvent"));
  CHECK(mentions(refusal([&] { later.wait(captured); }), "cudaErrorCapturedEvent"));
  CHECK_FALSE(later.capturing());
  s.record(captured); // recorded again outside a capture: an ordinary event
  CHECK_NOTHROW(captured.synchronize());
  CHECK_NOTHROW(later.wait(captured));
  later.synchronize();
}

TEST_CASE("capture calls out of turn are refused") {
  weave::host_stream origin("origin"), side("side");
  origin.begin_capture();
  CHECK_THROWS(origin.begin_capture());
  side.wait(origin.record());
  CHECK(mentions(refusal([&] { side.end_capture(); }), "did not begin"));
  origin.wait(side.record());
  CHECK_NOTHROW(origin.end_capture());
  CHECK_THROWS(origin.end_capture());
}

TEST_CASE("a host task may still wait for a captured point (no CUDA rule applies to it)") {
  weave::host_stream s("s"), t("t");
  s.begin_capture();
  std::atomic<int> value{0};
  s.submit([&] { value = 7; });
  weave::host_event e = s.record();
  std::promise<int> seen;
  t.submit([&] {
    CHECK_FALSE(e.outcome());
    seen.set_value(value.load());
  });
  CHECK(seen.get_future().get() == 7);
  s.end_capture();
  t.synchronize();
}

TEST_CASE("emulated_gpu_space: a copy to pageable memory blocks until the stream ran it") {
  weave::host_stream s("s");
  std::promise<void> gate;
  auto opened = gate.get_future().share();
  std::int64_t device_word = 0, host_word = -1;
  s.submit([&, opened] {
    opened.wait();
    device_word = 42;
  });
  std::thread opener([&] {
    std::this_thread::sleep_for(20ms);
    gate.set_value();
  });
  weave::emulated_gpu_space::copy_to_host(s, &host_word, &device_word, sizeof host_word);
  CHECK(host_word == 42); // the copy ran before the call returned, after the earlier task
  opener.join();
}

TEST_CASE("emulated_gpu_space: pinned copies are stream-ordered tasks, pageable ones are "
          "refused while capturing") {
  weave::host_stream s("s");
  weave::host_mirror<weave::emulated_gpu_space, std::int64_t> pinned(2);
  CHECK(weave::emulated_gpu_space::pinned(pinned.data(), 2 * sizeof(std::int64_t)));
  CHECK_FALSE(weave::emulated_gpu_space::pinned(pinned.data(), 3 * sizeof(std::int64_t)));
  std::int64_t device_word = 5, pageable = 0;
  s.begin_capture();
  weave::emulated_gpu_space::copy_to_host(s, pinned.data(), &device_word, sizeof device_word);
  weave::emulated_gpu_space::copy_from_host(s, &device_word, pinned.data() + 1, sizeof device_word);
  CHECK(mentions(refusal([&] {
                   weave::emulated_gpu_space::copy_to_host(s, &pageable, &device_word,
                                                           sizeof pageable);
                 }),
                 "pageable"));
  CHECK_THROWS(s.end_capture());
  s.synchronize();
  CHECK(pinned[0] == 5);
  CHECK(device_word == 0); // pinned[1] was value-initialised
}

TEST_CASE("emulated_gpu_space: a copy from pageable memory is staged at once") {
  weave::host_stream s("s");
  std::promise<void> gate;
  auto opened = gate.get_future().share();
  s.submit([opened] { opened.wait(); });
  std::int64_t device_word = 0;
  {
    std::int64_t pageable = 9;
    weave::emulated_gpu_space::copy_from_host(s, &device_word, &pageable, sizeof pageable);
    pageable = 1; // the caller may reuse its memory on return
  }
  gate.set_value();
  s.synchronize();
  CHECK(device_word == 9);
}
