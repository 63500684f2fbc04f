//! \file
//! The assignment problem (Hungarian method, O(n³) shortest augmenting paths): match n rows to
//! n columns maximising the total weight. Used to map new device groups onto devices so a
//! rebalance moves the fewest experts.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/float_bits.hpp"

#include <cmath>
#include <cstddef>
#include <limits>
#include <span>
#include <vector>

WEAVE_NAMESPACE_BEGIN

//! The column matched to each row of the n×n row-major `weights`, maximising the sum of the
//! chosen weights. Deterministic for a given matrix. Throws `errc::size_mismatch` unless
//! `weights.size() == n·n`, `errc::invalid_argument` for a non-finite weight.
inline std::vector<int> max_weight_assignment(std::span<const double> weights, int n) {
  WEAVE_EXPECT(n >= 0 &&
                   weights.size() == static_cast<std::size_t>(n) * static_cast<std::size_t>(n),
               errc::size_mismatch, weights.size(), " weights for a ", n, "x", n, " assignment");
  for (std::size_t i = 0; i < weights.size(); ++i)
    WEAVE_EXPECT(weave::detail::is_finite(weights[i]), errc::invalid_argument, "assignment weight ",
                 i, " is ", weights[i]);
  const auto N = static_cast<std::size_t>(n);
  const double inf = std::numeric_limits<double>::infinity();
  // Minimise cost = -weight. 1-based potentials u (rows), v (columns); way/match per column.
  std::vector<double> u(N + 1, 0.0), v(N + 1, 0.0), minv(N + 1);
  std::vector<std::size_t> row_of(N + 1, 0), way(N + 1, 0);
  std::vector<char> used(N + 1);
  for (std::size_t i = 1; i <= N; ++i) {
    row_of[0] = i;
    std::size_t j0 = 0;
    std::fill(minv.begin(), minv.end(), inf);
    std::fill(used.begin(), used.end(), 0);
    do {
      used[j0] = 1;
      const std::size_t i0 = row_of[j0];
      double delta = inf;
      std::size_t j1 = 0;
      for (std::size_t j = 1; j <= N; ++j) {
        if (used[j])
          continue;
        const double cur = -weights[(i0 - 1) * N + (j - 1)] - u[i0] - v[j];
        if (cur < minv[j]) {
          minv[j] = cur;
          way[j] = j0;
        }
        if (minv[j] < delta) {
          delta = minv[j];
          j1 = j;
        }
      }
      for (std::size_t j = 0; j <= N; ++j) {
        if (used[j]) {
          u[row_of[j]] += delta;
          v[j] -= delta;
        } else {
          minv[j] -= delta;
        }
      }
      j0 = j1;
    } while (row_of[j0] != 0);
    do {
      const std::size_t j1 = way[j0];
      row_of[j0] = row_of[j1];
      j0 = j1;
    } while (j0 != 0);
  }
  std::vector<int> col_of(N, -1);
  for (std::size_t j = 1; j <= N; ++j)
    col_of[row_of[j] - 1] = static_cast<int>(j - 1);
  return col_of;
}

WEAVE_NAMESPACE_END
