// Traffic patterns of the all-to-all benchmarks (as nccl-tests: uniform and skewed), and the
// nccl-tests bandwidth conventions: algbw = bytes / time, busbw = algbw * (n - 1) / n, where
// bytes is the per-rank volume (for the variable variant, max(send, recv) over the ranks).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace comm_bench {

enum class traffic : int { uniform = 0, skewed = 1 };

// counts[s][d] in bytes: `per_rank` bytes leave every rank. Uniform: per_rank / n to each peer.
// Skewed: half of it to the next rank, the rest evenly over all ranks (so receivers differ).
inline std::vector<std::vector<std::int64_t>> pattern(int n, std::int64_t per_rank, traffic t) {
  std::vector<std::vector<std::int64_t>> c(static_cast<std::size_t>(n),
                                           std::vector<std::int64_t>(static_cast<std::size_t>(n)));
  for (int s = 0; s < n; ++s) {
    const std::int64_t spread = t == traffic::uniform || n == 1 ? per_rank : per_rank / 2;
    for (int d = 0; d < n; ++d)
      c[std::size_t(s)][std::size_t(d)] = spread / n;
    if (t == traffic::skewed && n > 1)
      c[std::size_t(s)][std::size_t((s + 1) % n)] += per_rank - spread;
  }
  return c;
}

// max over ranks of max(bytes sent, bytes received).
inline std::int64_t volume(const std::vector<std::vector<std::int64_t>>& c) {
  std::int64_t v = 0;
  const std::size_t n = c.size();
  for (std::size_t r = 0; r < n; ++r) {
    std::int64_t sent = 0, received = 0;
    for (std::size_t j = 0; j < n; ++j) {
      sent += c[r][j];
      received += c[j][r];
    }
    v = std::max({v, sent, received});
  }
  return v;
}

struct layout {
  std::vector<std::int64_t> send_counts, send_displs, recv_counts, recv_displs;
  std::int64_t send_bytes = 0, recv_bytes = 0;
};

inline layout layout_of(const std::vector<std::vector<std::int64_t>>& c, int r) {
  layout L;
  const std::size_t n = c.size();
  for (std::size_t j = 0; j < n; ++j) {
    L.send_counts.push_back(c[std::size_t(r)][j]);
    L.send_displs.push_back(L.send_bytes);
    L.send_bytes += c[std::size_t(r)][j];
    L.recv_counts.push_back(c[j][std::size_t(r)]);
    L.recv_displs.push_back(L.recv_bytes);
    L.recv_bytes += c[j][std::size_t(r)];
  }
  return L;
}

} // namespace comm_bench
