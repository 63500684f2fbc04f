// Brute-force references for the placement tests: enumerate every balanced partition, every
// permutation. Only for small instances.
#pragma once

#include <weave/placement/placement.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <numeric>
#include <vector>

namespace brute {

// Calls f(groups) for every partition of {0..n-1} into `parts` unordered groups of n/parts.
inline void balanced_partitions(int n, int parts,
                                const std::function<void(const std::vector<int>&)>& f) {
  const int cap = n / parts;
  std::vector<int> group(static_cast<std::size_t>(n), -1);
  std::vector<int> size(static_cast<std::size_t>(parts), 0);
  // Items in order; an item may open group g only if groups < g are already opened, so each
  // unordered partition is produced once.
  std::function<void(int, int)> rec = [&](int i, int opened) {
    if (i == n) {
      f(group);
      return;
    }
    for (int g = 0; g < std::min(parts, opened + 1); ++g) {
      if (size[static_cast<std::size_t>(g)] == cap)
        continue;
      group[static_cast<std::size_t>(i)] = g;
      ++size[static_cast<std::size_t>(g)];
      rec(i + 1, std::max(opened, g + 1));
      --size[static_cast<std::size_t>(g)];
    }
    group[static_cast<std::size_t>(i)] = -1;
  };
  rec(0, 0);
}

inline weave::placement to_placement(const std::vector<int>& group, int parts) {
  std::vector<std::int32_t> slots;
  for (int g = 0; g < parts; ++g)
    for (std::size_t e = 0; e < group.size(); ++e)
      if (group[e] == g)
        slots.push_back(static_cast<std::int32_t>(e));
  return weave::placement(static_cast<int>(group.size()), parts, slots);
}

// Calls f(perm) for every permutation of 0..n-1.
inline void permutations(int n, const std::function<void(const std::vector<int>&)>& f) {
  std::vector<int> p(static_cast<std::size_t>(n));
  std::iota(p.begin(), p.end(), 0);
  do
    f(p);
  while (std::next_permutation(p.begin(), p.end()));
}

} // namespace brute
