// What a count exchange receives (per peer: its counts, then its status): the host status
// exchange's decision (`peer_failure_in` over `decode_failure`), the MoE exchange's
// (`device_counts_with_status`: per peer also the call's tag; failure records or device flags,
// in host_space and with cuda_space's control flow in emulated_gpu_space; a tag other than this
// rank's is `errc::call_mismatch`, whatever else the block holds), and the receive layout planned
// from the counts (`receive_displacements`, what the MoE exchange sums). Any
// block is decided (healthy, a peer's failure naming a rank of the world, or `errc::protocol`) and
// any counts are laid out within the bound or refused, without overflow.
#include "fuzz_support.hpp"

#include <fuzzer/FuzzedDataProvider.h>
#include <weave/comm/device_status_exchange.hpp>
#include <weave/comm/status_exchange.hpp>
#include <weave/core/failure.hpp>
#include <weave/exec/emulated_gpu_space.hpp>
#include <weave/exec/host_space.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <span>
#include <vector>

namespace {

// One word of a block: often what a sender writes, else anything.
std::int64_t word(FuzzedDataProvider& in, int ranks) {
  switch (in.ConsumeIntegralInRange<int>(0, 4)) {
  case 0:
    return in.ConsumeIntegral<std::int64_t>();
  case 1: // a failure record's status word
    return std::int64_t{in.ConsumeIntegralInRange<int>(0, ranks + 1)} << 32 |
           std::int64_t{in.ConsumeIntegralInRange<int>(0, 1)} << 16 |
           in.ConsumeIntegralInRange<int>(0, 15);
  case 2: // a device flags status
    return std::int64_t{in.ConsumeIntegralInRange<int>(0, ranks + 1)} << 32 |
           weave::detail::device_flags_status;
  case 3:
    return in.ConsumeIntegralInRange<std::int64_t>(-2, 70000);
  default:
    return 0;
  }
}

// A decision is healthy, a peer_error naming a rank of the world, or a protocol error.
void check_decision(const std::exception_ptr& failure, int ranks, int self, bool own_allowed) {
  if (!failure)
    return;
  try {
    std::rethrow_exception(failure);
  } catch (const weave::peer_error& e) {
    WEAVE_FUZZ_CHECK(e.origin().rank >= 0 && e.origin().rank < ranks);
    WEAVE_FUZZ_CHECK(weave::detail::is_errc(static_cast<std::int64_t>(e.origin().code)));
  } catch (const weave::error& e) {
    WEAVE_FUZZ_CHECK(e.code() == weave::errc::protocol || own_allowed);
    WEAVE_FUZZ_CHECK(weave::detail::is_errc(static_cast<std::int64_t>(e.code())));
  }
}

// The MoE exchange's flags: each known bit names an error.
weave::failure_record describe_flags(int rank, std::uint32_t flags) {
  return weave::record_of_call(rank, [&] {
    WEAVE_EXPECT((flags & 0xFFFFu) == 0, weave::errc::out_of_range, "plan flags ", flags);
    WEAVE_EXPECT(flags == 0, weave::errc::size_overflow, "exchange flags ", flags >> 16);
  });
}
constexpr std::uint32_t known_flags = 1 | 2 | 4 | 1u << 16;

// The MoE exchange's decision on `block` (laid out with tags), checked against the tags:
// a mismatch exactly when this rank's tag is set and a peer's differs.
template <class Space>
std::exception_ptr device_decision(const std::vector<std::int64_t>& block, int ranks, int self,
                                   bool raise, int width) {
  weave::device_counts_with_status<Space> exchange(ranks, self, raise, "fuzz", describe_flags,
                                                   width, known_flags);
  weave::device_status_block<Space> b;
  exchange.size_block(b);
  WEAVE_FUZZ_CHECK(b.host.size() == block.size());
  std::copy(block.begin(), block.end(), b.host.begin());
  const auto stride = static_cast<std::size_t>(weave::detail::status_block_stride(width));
  const auto tag = [&](int r) {
    return block[static_cast<std::size_t>(r) * stride + static_cast<std::size_t>(width)];
  };
  bool differs = false;
  for (int r = 0; r < ranks; ++r)
    differs = differs || (tag(self) != 0 && tag(r) != tag(self));
  const std::exception_ptr mismatch = exchange.call_mismatch(b);
  WEAVE_FUZZ_CHECK(differs == static_cast<bool>(mismatch));
  if (mismatch) {
    try {
      std::rethrow_exception(mismatch);
    } catch (const weave::error& e) {
      WEAVE_FUZZ_CHECK(e.code() == weave::errc::call_mismatch);
    }
    return nullptr;
  }
  if constexpr (Space::runs_later)
    return exchange.peer_failure(b);
  else
    return exchange.failure(b);
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  const int ranks = in.ConsumeIntegralInRange<int>(1, 8);
  const int self = in.ConsumeIntegralInRange<int>(0, ranks - 1);
  const int width = in.ConsumeIntegralInRange<int>(1, 2);
  const bool raise = in.ConsumeBool();
  const std::size_t stride = static_cast<std::size_t>(width) + weave::failure_words;
  std::vector<std::int64_t> block(stride * static_cast<std::size_t>(ranks));
  for (std::int64_t& w : block)
    w = word(in, ranks);

  // The host status exchange: its decision names only what decode_failure reads.
  const std::exception_ptr host =
      weave::detail::peer_failure_in(block, static_cast<std::size_t>(width), ranks, self, "fuzz",
                                     weave::detail::status_decoder(ranks));
  check_decision(host, ranks, self, false);
  if (!host)
    for (int r = 0; r < ranks; ++r)
      if (r != self)
        WEAVE_FUZZ_CHECK(!weave::decode_failure(
            std::span<const std::int64_t>(block).subspan(static_cast<std::size_t>(r) * stride +
                                                             static_cast<std::size_t>(width),
                                                         weave::failure_words),
            r, ranks));
  // The MoE exchange's, on the stream (peers only) and with CUDA's control flow (own too):
  // the same block with each peer's call tag after its counts (mostly this rank's, so that the
  // statuses are decided too).
  const std::int64_t own_tag = in.ConsumeBool() ? 0 : in.ConsumeIntegral<std::int64_t>();
  std::vector<std::int64_t> tagged;
  for (std::size_t r = 0; r < static_cast<std::size_t>(ranks); ++r) {
    const auto from = block.begin() + static_cast<std::ptrdiff_t>(r * stride);
    tagged.insert(tagged.end(), from, from + width);
    tagged.push_back(static_cast<int>(r) == self || in.ConsumeIntegralInRange<int>(0, 7) != 0
                         ? own_tag
                         : in.ConsumeIntegral<std::int64_t>());
    tagged.insert(tagged.end(), from + width, from + static_cast<std::ptrdiff_t>(stride));
  }
  check_decision(device_decision<weave::host_space>(tagged, ranks, self, raise, width), ranks, self,
                 false);
  check_decision(device_decision<weave::emulated_gpu_space>(tagged, ranks, self, raise, width),
                 ranks, self, true);

  // The receive layout from the first count of each peer.
  std::vector<std::int64_t> counts(static_cast<std::size_t>(ranks)), displs(counts.size());
  for (std::size_t r = 0; r < counts.size(); ++r)
    counts[r] = block[r * stride];
  const auto bound = in.ConsumeIntegral<std::size_t>() >> in.ConsumeIntegralInRange<int>(0, 63);
  std::size_t total = 0;
  if (weave_fuzz::accepted({weave::errc::size_mismatch}, [&] {
        total = weave::detail::receive_displacements(counts, displs, bound, "fuzz");
      })) {
    WEAVE_FUZZ_CHECK(total <= bound);
    std::size_t at = 0;
    for (std::size_t r = 0; r < counts.size(); ++r) {
      WEAVE_FUZZ_CHECK(counts[r] >= 0 && displs[r] == static_cast<std::int64_t>(at));
      at += static_cast<std::size_t>(counts[r]);
    }
    WEAVE_FUZZ_CHECK(at == total);
  }
  return 0;
}
