//! \file
//! `emulated_link`: a latency + bandwidth model of one directed link, used by `local_world` to
//! delay the completion of transfers in wall time (by sleeping, so the CPU stays free for the
//! compute that is supposed to overlap the communication).
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/float_bits.hpp"

#include <chrono>
#include <cmath>
#include <cstdint>

WEAVE_NAMESPACE_BEGIN

//! A directed link: a message of b bytes arrives `latency + b / bytes_per_second` after it
//! starts. Links of different peer pairs are independent (each pair has its own wire).
struct emulated_link {
  //! Fixed cost of every message, including empty ones.
  std::chrono::nanoseconds latency{0};
  //! Payload rate; 0 means unlimited.
  double bytes_per_second = 0;

  //! True when the link delays anything.
  constexpr bool enabled() const noexcept { return latency.count() > 0 || bytes_per_second > 0; }

  //! Wall time a message of `bytes` bytes takes on this link.
  std::chrono::nanoseconds transfer_time(std::int64_t bytes) const {
    WEAVE_EXPECT(bytes >= 0, errc::invalid_argument, "emulated_link: negative size ", bytes);
    WEAVE_EXPECT(bytes_per_second >= 0 && weave::detail::is_finite(bytes_per_second),
                 errc::invalid_argument, "emulated_link: bandwidth must be finite and >= 0, got ",
                 bytes_per_second);
    std::chrono::nanoseconds t = latency;
    if (bytes_per_second > 0)
      t += std::chrono::nanoseconds(static_cast<std::int64_t>(
          std::ceil(static_cast<double>(bytes) * 1e9 / bytes_per_second)));
    return t;
  }

  //! A link of `gbytes_per_second` GB/s (10^9 bytes) and `latency`.
  static emulated_link gbps(double gbytes_per_second,
                            std::chrono::nanoseconds latency = std::chrono::nanoseconds(0)) {
    return {latency, gbytes_per_second * 1e9};
  }
};

WEAVE_NAMESPACE_END
