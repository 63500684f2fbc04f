// The example of docs/comm.md, compiled and checked: a count exchange feeding a variable
// all-to-all on one stream, on 3 in-process ranks.
#include <doctest/doctest.h>

#include <weave/comm.hpp>
#include <weave/exec/host_stream.hpp>

#include <cstdint>
#include <numeric>
#include <vector>

TEST_CASE("docs/comm.md example: counts, then the rows they announce") {
  const int n = 3;
  std::vector<std::vector<std::int32_t>> received(n);
  weave::local_world world(n);
  //! [exchange]
  world.run([&](weave::local_communicator& comm) {
    const int me = comm.rank();
    // Rank r sends r + p + 1 values to peer p, each value 1000 * r + p.
    std::vector<std::int64_t> send_counts(n), send_displs(n), recv_counts(n), recv_displs(n);
    std::vector<std::int32_t> send;
    for (int p = 0; p < n; ++p) {
      send_counts[p] = me + p + 1;
      send_displs[p] = static_cast<std::int64_t>(send.size());
      send.insert(send.end(), static_cast<std::size_t>(send_counts[p]), 1000 * me + p);
    }
    std::vector<std::int32_t>& recv = received[static_cast<std::size_t>(me)];
    recv.resize(static_cast<std::size_t>(n * me + n * (n + 1) / 2)); // what the peers will send

    weave::host_stream s("comm");
    comm.exchange_counts(s, send_counts, recv_counts);
    s.submit([&] { // runs after the counts arrived: the receive layout
      std::exclusive_scan(recv_counts.begin(), recv_counts.end(), recv_displs.begin(),
                          std::int64_t{0});
    });
    comm.all_to_all_v(s, send.data(), send_counts, send_displs, recv.data(), recv_counts,
                      recv_displs, sizeof(std::int32_t));
    s.synchronize(); // everything above was only enqueued until here
  });
  //! [exchange]

  // Rank me receives, from each source src in rank order, src + me + 1 copies of 1000*src + me.
  for (int me = 0; me < n; ++me) {
    std::vector<std::int32_t> want;
    for (int src = 0; src < n; ++src)
      want.insert(want.end(), static_cast<std::size_t>(src + me + 1), 1000 * src + me);
    CHECK(received[static_cast<std::size_t>(me)] == want);
  }
}
