// Random top-k choices for the plan tests: distinct experts per token, about one in nine
// choices -1 ("no expert"), weights in [0, 1.003]; and random keep masks.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

namespace weave_test {

inline void random_choices(std::mt19937& rng, std::size_t T, int E, int k,
                           std::vector<std::int32_t>& ids, std::vector<float>& w) {
  ids.assign(T * k, -1);
  w.assign(T * k, 0.0f);
  std::vector<std::int32_t> perm(static_cast<std::size_t>(E));
  for (std::size_t t = 0; t < T; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int i = 0; i < k; ++i) {
      ids[t * k + i] = rng() % 9 == 0 ? -1 : perm[static_cast<std::size_t>(i)];
      w[t * k + i] = static_cast<float>(rng() % 1000) / 997.0f;
    }
  }
}

// Half the time no keep mask (dropless); else one flag per choice, about a quarter dropped.
inline std::vector<std::uint8_t> random_keep(std::mt19937& rng, std::size_t choices) {
  std::vector<std::uint8_t> keep;
  if (rng() % 2 == 0)
    for (std::size_t i = 0; i < choices; ++i)
      keep.push_back(rng() % 4 == 0 ? 0 : 1);
  return keep;
}

} // namespace weave_test
