#include <doctest/doctest.h>

#include <weave/plan/cost_model.hpp>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

TEST_CASE("fit_a2a recovers alpha and beta exactly from noiseless measurements") {
  const weave::plan::a2a_cost truth = weave::plan::a2a_cost::from_bandwidth(8.0, 40.0);
  std::vector<double> bytes, time;
  for (double b = 1024; b <= 64.0 * 1024 * 1024; b *= 2) {
    bytes.push_back(b);
    time.push_back(truth.alpha_us + b * truth.us_per_byte); // the model, written out
  }
  const auto fit = weave::plan::fit_a2a(bytes, time);
  CHECK(fit.alpha_us == doctest::Approx(8.0).epsilon(1e-6));
  CHECK(fit.us_per_byte == doctest::Approx(1e-3 / 40.0).epsilon(1e-9));
}

TEST_CASE("fit_a2a and fit_kernel recover their parameters from noisy measurements") {
  std::mt19937_64 rng(20261202);
  for (int trial = 0; trial < 20; ++trial) {
    std::uniform_real_distribution<double> alpha_d(5.0, 50.0), gbps_d(5.0, 200.0);
    const double alpha = alpha_d(rng), gbps = gbps_d(rng);
    const double beta = 1e-3 / gbps; // us per byte
    // Sizes where latency and bandwidth both matter (as a2a microbenchmarks sweep them), each
    // measured 5 times with 2% multiplicative and 0.5 us additive Gaussian noise.
    std::normal_distribution<double> rel(0.0, 0.02), abs_noise(0.0, 0.5);
    std::vector<double> bytes, time;
    for (double b = 256; b <= 4.0 * alpha * gbps * 1e3; b *= 1.5)
      for (int rep = 0; rep < 5; ++rep) {
        const double t = alpha + beta * b;
        bytes.push_back(b);
        time.push_back(t * (1.0 + rel(rng)) + abs_noise(rng));
      }
    const auto fit = weave::plan::fit_a2a(bytes, time);
    CHECK(fit.alpha_us == doctest::Approx(alpha).epsilon(0.15));
    CHECK(fit.us_per_byte == doctest::Approx(beta).epsilon(0.05));

    std::uniform_real_distribution<double> launch_d(2.0, 10.0), row_d(0.001, 0.05);
    const double launch = launch_d(rng), per_row = row_d(rng);
    std::vector<double> rows, ktime;
    for (double r = 16; r <= 16384; r *= 2)
      for (int rep = 0; rep < 5; ++rep) {
        rows.push_back(r);
        ktime.push_back((launch + per_row * r) * (1.0 + rel(rng)) + abs_noise(rng));
      }
    const auto k = weave::plan::fit_kernel(rows, ktime);
    CHECK(k.fixed_us == doctest::Approx(launch).epsilon(0.25));
    CHECK(k.us_per_row == doctest::Approx(per_row).epsilon(0.05));
  }
}

TEST_CASE("fit_line reports the residual of the fit") {
  // y = 1 + 2x with residuals +1, -1, +1, -1 at symmetric x: the fit stays exact, rms is 1.
  const std::vector<double> x = {-3, -1, 1, 3}, y = {1 - 6 + 1, 1 - 2 - 1, 1 + 2 + 1, 1 + 6 - 1};
  const auto f = weave::plan::fit_line(x, y);
  // Least squares of those residuals: slope shifts by sum(x*r)/sum(x^2) = (-3+1+1-3)/20 = -0.2.
  CHECK(f.slope == doctest::Approx(2.0 - 0.2));
  CHECK(f.intercept == doctest::Approx(1.0));
  const double r[] = {1 - 0.6, -1 - 0.2, 1 + 0.2, -1 + 0.6};
  double sse = 0;
  for (double v : r)
    sse += v * v;
  CHECK(f.rms_residual == doctest::Approx(std::sqrt(sse / 4)));
}

TEST_CASE("fitting rejects inputs that determine no line") {
  using weave::errc;
  auto code_of = [](auto&& f) {
    try {
      f();
    } catch (const weave::error& e) {
      return e.code();
    }
    return errc::internal;
  };
  const std::vector<double> two = {1, 2}, three = {1, 2, 3}, same = {4, 4, 4};
  const std::vector<double> nan = {1, std::numeric_limits<double>::quiet_NaN(), 3};
  CHECK(code_of([&] { weave::plan::fit_a2a(two, three); }) == errc::size_mismatch);
  CHECK(code_of([&] { weave::plan::fit_line(std::vector<double>{1}, std::vector<double>{1}); }) ==
        errc::invalid_argument);
  CHECK(code_of([&] { weave::plan::fit_kernel(same, three); }) == errc::invalid_argument);
  CHECK(code_of([&] { weave::plan::fit_line(three, nan); }) == errc::invalid_argument);
  CHECK(code_of([&] { weave::plan::a2a_cost::from_bandwidth(1.0, 0.0); }) ==
        errc::invalid_argument);
  CHECK(code_of([&] { weave::plan::a2a_cost::from_bandwidth(-1.0, 10.0); }) ==
        errc::invalid_argument);
}
