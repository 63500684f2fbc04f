//! \file
//! Cost models the planner and the simulator price operations with: the alpha-beta model of an
//! all-to-all (latency + bytes / bandwidth), an affine per-row model of a kernel, and
//! least-squares fitting of both from measurements (weave's own microbenchmarks, or a trainer's
//! profiler). All times are microseconds.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/float_bits.hpp"

#include <cmath>
#include <cstddef>
#include <span>

WEAVE_NAMESPACE_BEGIN
namespace plan {

//! All-to-all time as `alpha_us + us_per_byte * bytes`, bytes counted per rank (max of sent
//! and received, as the field reports a2a).
struct a2a_cost {
  double alpha_us = 0.0;    //!< fixed latency per call (setup, synchronisation, first byte)
  double us_per_byte = 0.0; //!< inverse bandwidth

  //! Time of one call moving `bytes` per rank.
  constexpr double at(double bytes) const noexcept { return alpha_us + us_per_byte * bytes; }

  //! The model for a link of `gigabytes_per_s` (1e9 bytes/s) with `alpha_us` latency.
  static a2a_cost from_bandwidth(double alpha_us, double gigabytes_per_s) {
    WEAVE_EXPECT(weave::detail::is_finite(gigabytes_per_s) && gigabytes_per_s > 0.0,
                 errc::invalid_argument, "bandwidth ", gigabytes_per_s, " GB/s is not positive");
    WEAVE_EXPECT(weave::detail::is_finite(alpha_us) && alpha_us >= 0.0, errc::invalid_argument,
                 "alpha ", alpha_us, " us is negative or not finite");
    return {alpha_us, 1e-3 / gigabytes_per_s};
  }
};

//! Kernel time as `fixed_us + us_per_row * rows` (launch overhead + per-token work).
struct kernel_cost {
  double fixed_us = 0.0;   //!< launch and setup overhead, paid once per call (per chunk)
  double us_per_row = 0.0; //!< marginal cost of one row (token)

  //! Time of one call over `rows` rows.
  constexpr double at(double rows) const noexcept { return fixed_us + us_per_row * rows; }
};

//! Result of an ordinary least-squares line fit `y = intercept + slope * x`.
struct line_fit {
  double intercept = 0.0;
  double slope = 0.0;
  double rms_residual = 0.0; //!< root mean square of `y - fit(x)`, in the units of y
};

//! Fits `y = intercept + slope * x` by least squares. Throws `errc::size_mismatch` when the
//! spans differ in length, `errc::invalid_argument` for fewer than two points, a non-finite
//! value, or all x equal (the slope is then undetermined).
inline line_fit fit_line(std::span<const double> x, std::span<const double> y) {
  WEAVE_EXPECT(x.size() == y.size(), errc::size_mismatch, x.size(), " x values but ", y.size(),
               " y values");
  WEAVE_EXPECT(x.size() >= 2, errc::invalid_argument, "a line fit needs at least 2 points, got ",
               x.size());
  const double n = static_cast<double>(x.size());
  double mean_x = 0.0, mean_y = 0.0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    WEAVE_EXPECT(weave::detail::is_finite(x[i]) && weave::detail::is_finite(y[i]),
                 errc::invalid_argument, "measurement ", i, " is not finite (x = ", x[i],
                 ", y = ", y[i], ")");
    mean_x += x[i];
    mean_y += y[i];
  }
  mean_x /= n;
  mean_y /= n;
  // Centred sums: the raw normal equations lose everything to cancellation when x is in bytes.
  double sxx = 0.0, sxy = 0.0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    sxx += (x[i] - mean_x) * (x[i] - mean_x);
    sxy += (x[i] - mean_x) * (y[i] - mean_y);
  }
  WEAVE_EXPECT(sxx > 0.0, errc::invalid_argument, "all x values are equal (", mean_x,
               "): the slope is undetermined");
  line_fit fit;
  fit.slope = sxy / sxx;
  fit.intercept = mean_y - fit.slope * mean_x;
  double sse = 0.0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double r = y[i] - (fit.intercept + fit.slope * x[i]);
    sse += r * r;
  }
  fit.rms_residual = std::sqrt(sse / n);
  return fit;
}

//! Fits the alpha-beta model to measured (bytes per rank, time in us) pairs.
inline a2a_cost fit_a2a(std::span<const double> bytes, std::span<const double> time_us) {
  const line_fit f = fit_line(bytes, time_us);
  return {f.intercept, f.slope};
}

//! Fits the per-row kernel model to measured (rows, time in us) pairs.
inline kernel_cost fit_kernel(std::span<const double> rows, std::span<const double> time_us) {
  const line_fit f = fit_line(rows, time_us);
  return {f.intercept, f.slope};
}

} // namespace plan
WEAVE_NAMESPACE_END
