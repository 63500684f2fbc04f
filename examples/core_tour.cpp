// A tour of weave's core vocabulary: borrow a tensor as token rows, run work on two host
// streams ordered by events (CUDA semantics on threads), and see a typed error surface.
#include <weave/weave.hpp>

#include <chrono>
#include <cstdio>
#include <thread>

int main() {
  using namespace std::chrono_literals;

  // 1. Token rows: 8 tokens of hidden size 4, bf16, owned by the caller.
  weave::host_matrix<weave::bfloat16> tokens(8, 4);
  for (std::size_t t = 0; t < tokens.rows(); ++t)
    for (std::size_t h = 0; h < tokens.cols(); ++h)
      tokens(t, h) = weave::bfloat16(static_cast<float>(t) + 0.25f * static_cast<float>(h));
  weave::const_token_view view = tokens.view();
  std::printf("token_view: %zu rows x %zu cols of %s, %zu bytes per row, in %s memory\n",
              view.rows(), view.cols(), weave::to_string(view.element_type()), view.row_bytes(),
              weave::to_string(view.space()));

  // 2. Streams: "communication" on one stream, "compute" on another, ordered by an event.
  //! [streams]
  weave::host_stream comm("comm"), compute("compute");
  weave::host_matrix<float> received(8, 4);
  weave::host_event sent = comm.record();
  comm.submit([&] {
    std::this_thread::sleep_for(10ms); // stands in for an all-to-all
    for (std::size_t t = 0; t < 8; ++t)
      for (std::size_t h = 0; h < 4; ++h)
        received(t, h) = static_cast<float>(tokens(t, h));
  });
  weave::host_event arrived = comm.record();
  compute.wait(arrived);
  float sum = 0;
  compute.submit([&] {
    for (float x : received.elements())
      sum += x;
  });
  compute.synchronize(); // rethrows the first failure of a task this stream ran or waited on
  //! [streams]
  std::printf("compute waited for comm: sum of received rows = %.2f (expected 124.00), "
              "comm took %.1f ms\n",
              sum, weave::host_event::elapsed_ms(sent, arrived));

  // 3. Errors are typed and name the offending value; a failed stream reports at synchronize.
  compute.submit([] {
    const int expert = 70, experts = 64;
    WEAVE_EXPECT(expert < experts, weave::errc::out_of_range, "expert id ", expert,
                 " >= number of experts ", experts);
  });
  try {
    compute.synchronize();
  } catch (const weave::error& e) {
    std::printf("caught weave::error [%s]: %s\n", weave::to_string(e.code()), e.message().c_str());
  }
  return sum == 124.0f ? 0 : 1;
}
