// Random all-to-all cases shared by the comm tests: skewed per-peer counts (zeros, one huge
// peer per sender), blocks in shuffled order with gaps, and the expected receive buffers
// computed by direct copying from every rank's send buffer (the naive reference).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

namespace comm_test {

inline constexpr std::byte sentinel{0xAB};

struct rank_layout {
  std::vector<std::int64_t> send_counts, send_displs, recv_counts, recv_displs;
  std::vector<std::byte> send;
  std::size_t recv_bytes = 0;
};

struct a2a_case {
  int n = 0;
  std::size_t unit = 1;
  std::vector<rank_layout> ranks;
};

// Displacements for blocks of `counts` laid out in a shuffled order with random gaps; returns
// the extent in units.
inline std::int64_t shuffled_displs(const std::vector<std::int64_t>& counts,
                                    std::vector<std::int64_t>& displs, std::mt19937_64& rng,
                                    bool gaps) {
  std::vector<std::size_t> order(counts.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::shuffle(order.begin(), order.end(), rng);
  displs.assign(counts.size(), 0);
  std::int64_t offset = 0;
  for (std::size_t j : order) {
    if (gaps)
      offset += static_cast<std::int64_t>(rng() % 4);
    displs[j] = offset;
    offset += counts[j];
  }
  return offset + (gaps ? 2 : 0);
}

// counts[s][d] in units: a quarter are zero, one peer per sender gets `huge`, the rest small.
// With `slack`, each receive has room for up to `slack` units more than its block (a bounded
// all-to-all's receives); `expected_recv` leaves the rest of the room as the sentinel.
inline a2a_case make_case(int n, std::size_t unit, std::uint64_t seed, std::int64_t huge = 3000,
                          bool gaps = true, std::int64_t slack = 0) {
  std::mt19937_64 rng(seed);
  a2a_case c;
  c.n = n;
  c.unit = unit;
  c.ranks.resize(static_cast<std::size_t>(n));
  std::vector<std::vector<std::int64_t>> counts(static_cast<std::size_t>(n),
                                                std::vector<std::int64_t>(std::size_t(n)));
  for (auto& row : counts) {
    for (auto& v : row)
      v = rng() % 4 == 0 ? 0 : static_cast<std::int64_t>(rng() % 40);
    if (n > 1)
      row[rng() % std::size_t(n)] = huge;
  }
  for (int r = 0; r < n; ++r) {
    rank_layout& L = c.ranks[std::size_t(r)];
    L.send_counts = counts[std::size_t(r)];
    L.recv_counts.resize(std::size_t(n));
    for (int s = 0; s < n; ++s)
      L.recv_counts[std::size_t(s)] =
          counts[std::size_t(s)][std::size_t(r)] +
          (slack > 0 ? static_cast<std::int64_t>(rng() % std::uint64_t(slack + 1)) : 0);
    const std::int64_t send_extent = shuffled_displs(L.send_counts, L.send_displs, rng, gaps);
    const std::int64_t recv_extent = shuffled_displs(L.recv_counts, L.recv_displs, rng, gaps);
    L.send.resize(static_cast<std::size_t>(send_extent) * unit);
    for (auto& b : L.send)
      b = static_cast<std::byte>(rng());
    L.recv_bytes = static_cast<std::size_t>(recv_extent) * unit;
  }
  return c;
}

// What rank r must hold after the exchange (sentinel in the gaps).
inline std::vector<std::byte> expected_recv(const a2a_case& c, int r) {
  const rank_layout& me = c.ranks[std::size_t(r)];
  std::vector<std::byte> out(me.recv_bytes, sentinel);
  for (int s = 0; s < c.n; ++s) {
    const rank_layout& from = c.ranks[std::size_t(s)];
    const auto bytes = static_cast<std::size_t>(from.send_counts[std::size_t(r)]) * c.unit;
    if (bytes > 0)
      std::memcpy(out.data() + static_cast<std::size_t>(me.recv_displs[std::size_t(s)]) * c.unit,
                  from.send.data() +
                      static_cast<std::size_t>(from.send_displs[std::size_t(r)]) * c.unit,
                  bytes);
  }
  return out;
}

// `count` units to and from each of `n` peers, peer j's block at j * `stride` units.
struct uniform_layout {
  std::vector<std::int64_t> counts, displs;
};
inline uniform_layout uniform(int n, std::int64_t count, std::int64_t stride) {
  uniform_layout u{std::vector<std::int64_t>(static_cast<std::size_t>(n), count),
                   std::vector<std::int64_t>(static_cast<std::size_t>(n))};
  for (int j = 0; j < n; ++j)
    u.displs[static_cast<std::size_t>(j)] = stride * j;
  return u;
}

} // namespace comm_test
