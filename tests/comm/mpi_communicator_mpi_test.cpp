// mpi_communicator against MPI_Alltoallv itself (bitwise) and against the naive reference, on
// random skewed layouts; the large-message path with a forced small chunk limit; the same
// exchanges through a local_world; reductions against MPI_Allreduce; 2DH over split
// communicators; a peer that arrives too late. Run under mpirun -np 2 and -np 4.
#include <doctest/doctest.h>

#include "a2a_cases.hpp"
#include "a2a_mpi_reference.hpp"
#include "mpi_session.hpp"

#include <weave/comm.hpp>
#include <weave/comm/mpi_communicator.hpp>
#include <weave/core/failure.hpp>
#include <weave/overlap/expert_state_moves.hpp>
#include <weave/placement/migration.hpp>

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <future>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

namespace {

// Buffers of collectives abandoned after an abort (MPI may write into them until MPI_Finalize).
weave_test::kept_until_finalize abandoned;
const weave_test::mpi_session mpi_for_the_whole_run;

using weave_test::world_rank;
using weave_test::world_size;

std::vector<std::byte> weave_mpi(const comm_test::a2a_case& c, weave::mpi_communicator& comm,
                                 int repeats = 2) {
  const auto& L = c.ranks[std::size_t(comm.rank())];
  std::vector<std::vector<std::byte>> outs(
      std::size_t(repeats), std::vector<std::byte>(L.recv_bytes, comm_test::sentinel));
  weave::host_stream s("mpi");
  for (auto& out : outs)
    comm.all_to_all_v(s, L.send.data(), L.send_counts, L.send_displs, out.data(), L.recv_counts,
                      L.recv_displs, c.unit);
  s.synchronize();
  for (auto& out : outs)
    REQUIRE(out == outs[0]);
  return outs[0];
}

std::vector<std::byte> local(const comm_test::a2a_case& c, int rank) {
  weave::local_world world(c.n);
  std::vector<std::byte> mine;
  world.run([&](weave::local_communicator& comm) {
    const auto& L = c.ranks[std::size_t(comm.rank())];
    std::vector<std::byte> out(L.recv_bytes, comm_test::sentinel);
    weave::host_stream s;
    comm.all_to_all_v(s, L.send.data(), L.send_counts, L.send_displs, out.data(), L.recv_counts,
                      L.recv_displs, c.unit);
    s.synchronize();
    if (comm.rank() == rank)
      mine = std::move(out);
  });
  return mine;
}

// Rank 0 sends rank 1 8 bytes where rank 1 receives (or has room for) 4: `issue(comm, s, sent)`
// enqueues the operation on `sent`'s buffers. Rank 1's receive is truncated: it fails with
// errc::mpi naming `what` and MPI's text, and every peer learns it by the next barrier.
template <class Issue>
void check_truncated_receive(const char* what, Issue&& issue) {
  // Open MPI reports errors inside its non-blocking collectives through MPI_COMM_WORLD's
  // handler (see mpi_communicator): return them here, as the header documents.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  {
    weave::mpi_communicator comm(MPI_COMM_WORLD);
    weave::host_stream s;
    const int n = comm.size(), r = comm.rank();
    auto layout = comm_test::uniform(n, 4, 8);
    const std::vector<std::int64_t> room = layout.counts;
    if (r == 0)
      layout.counts[1] = 8;
    auto send = std::make_shared<std::vector<std::byte>>(std::size_t(8 * n));
    auto recv = std::make_shared<std::vector<std::byte>>(send->size());
    abandoned.keep(send);
    abandoned.keep(recv);
    struct {
      const std::byte* send;
      std::byte* recv;
      const std::vector<std::int64_t>& counts;
      const std::vector<std::int64_t>& displs;
      const std::vector<std::int64_t>& room;
    } sent{send->data(), recv->data(), layout.counts, layout.displs, room};
    issue(comm, s, sent);
    if (r == 1) {
      try {
        s.synchronize();
        FAIL("a truncated receive went unnoticed");
      } catch (const weave::error& e) {
        CHECK(e.code() == weave::errc::mpi);
        CHECK(e.message().find(what) != std::string::npos);
        CHECK(e.message().find("MPI_ERR_TRUNCATE") != std::string::npos);
      }
      CHECK(comm.aborted()); // its peers may wait for it: it told them
    } else {
      try {
        s.synchronize(); // completes, or learns of rank 1's failure: both are fine here
      } catch (const weave::peer_error& e) {
        CHECK(e.origin().rank == 1);
        CHECK(e.origin().code == weave::errc::mpi);
      }
      comm.barrier(s); // rank 1's notice reaches every peer
      try {
        s.synchronize();
        FAIL("rank 1's MPI error did not reach rank ", r);
      } catch (const weave::peer_error& e) {
        CHECK(e.origin().rank == 1);
        CHECK(e.origin().code == weave::errc::mpi);
      }
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_ARE_FATAL);
}

} // namespace

TEST_CASE("mpi_communicator equals MPI_Alltoallv, the reference and local_world") {
  const int n = world_size(), r = world_rank();
  weave::mpi_communicator comm(MPI_COMM_WORLD);
  CHECK(comm.rank() == r);
  CHECK(comm.size() == n);
  for (std::size_t unit : {std::size_t{1}, std::size_t{12}}) {
    for (std::uint64_t seed = 1; seed <= 4; ++seed) {
      CAPTURE(unit);
      CAPTURE(seed);
      const auto c = comm_test::make_case(n, unit, seed * 31 + unit, seed == 4 ? 200000 : 3000);
      const auto got = weave_mpi(c, comm);
      CHECK(got == comm_test::mpi_alltoallv_reference(c, MPI_COMM_WORLD));
      CHECK(got == comm_test::expected_recv(c, r));
      CHECK(got == local(c, r));
    }
  }
}

TEST_CASE("inline and handed-off operations agree with MPI, and counts are read when they run") {
  const int n = world_size(), r = world_rank();
  for (const std::size_t limit : {std::size_t{0}, std::size_t{512}, std::size_t{1} << 22}) {
    CAPTURE(limit);
    weave::mpi_options options;
    options.inline_max_bytes = limit;
    weave::mpi_communicator comm(MPI_COMM_WORLD, options);
    for (std::uint64_t seed = 1; seed <= 3; ++seed) { // small and large against the limit
      const auto c = comm_test::make_case(n, 1, seed * 7, seed == 1 ? 40 : 3000);
      CHECK(weave_mpi(c, comm) == comm_test::mpi_alltoallv_reference(c, MPI_COMM_WORLD));
    }
    // The counts-then-all-to-all pattern behind a busy stream: the count exchange is queued,
    // so the all-to-all enqueued after it must size itself (inline or not) only once the
    // counts arrived.
    const auto c = comm_test::make_case(n, 1, 99, 200);
    const auto& L = c.ranks[std::size_t(r)];
    weave::host_stream s;
    std::promise<void> gate;
    auto opened = gate.get_future().share();
    s.submit([opened] { opened.wait(); });
    std::vector<std::int64_t> recv_counts(std::size_t(n), -1);
    comm.exchange_counts(s, L.send_counts, recv_counts);
    std::vector<std::byte> out(L.recv_bytes, comm_test::sentinel);
    comm.all_to_all_v(s, L.send.data(), L.send_counts, L.send_displs, out.data(), recv_counts,
                      L.recv_displs);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    gate.set_value();
    s.synchronize();
    CHECK(recv_counts == L.recv_counts);
    CHECK(out == comm_test::mpi_alltoallv_reference(c, MPI_COMM_WORLD));
    // An idle stream and a small operation: complete when the call returns.
    std::vector<std::int64_t> v{r + 1}, sum(1);
    comm.all_reduce(s, std::span<const std::int64_t>(v), std::span<std::int64_t>(sum),
                    weave::reduce_op::sum);
    if (limit >= 16)
      CHECK(sum[0] == std::int64_t(n) * (n + 1) / 2);
    s.synchronize();
    CHECK(sum[0] == std::int64_t(n) * (n + 1) / 2);
  }
}

TEST_CASE("blocks cut into pieces equal MPI_Alltoallv") {
  const int n = world_size(), r = world_rank();
  for (std::int64_t chunk : {64, 1000, 7, 1}) {
    CAPTURE(chunk);
    weave::mpi_options options;
    options.max_chunk_units = chunk;
    weave::mpi_communicator comm(MPI_COMM_WORLD, options);
    for (std::size_t unit : {std::size_t{1}, std::size_t{8}}) {
      const auto c = comm_test::make_case(n, unit, 77 + unit, chunk == 1 ? 300 : 3000);
      const auto got = weave_mpi(c, comm, 1);
      CHECK(got == comm_test::mpi_alltoallv_reference(c, MPI_COMM_WORLD));
      CHECK(got == comm_test::expected_recv(c, r));
    }
  }
}

TEST_CASE("a bounded all-to-all fills each room with its block alone and reports its length") {
  const int n = world_size(), r = world_rank();
  weave::mpi_options small_chunks;
  small_chunks.max_chunk_units = 7; // does not cut a bounded block
  for (const weave::mpi_options& o : {weave::mpi_options{}, small_chunks}) {
    weave::mpi_communicator comm(MPI_COMM_WORLD, o);
    for (std::size_t unit : {std::size_t{1}, std::size_t{12}}) {
      for (std::uint64_t seed = 1; seed <= 3; ++seed) {
        CAPTURE(unit);
        CAPTURE(seed);
        const auto c = comm_test::make_case(n, unit, seed * 131 + unit, seed == 2 ? 20000 : 300,
                                            true, seed == 3 ? 0 : 9);
        const comm_test::rank_layout& L = c.ranks[std::size_t(r)];
        std::vector<std::byte> out(L.recv_bytes, comm_test::sentinel);
        std::vector<std::int64_t> received(std::size_t(n), -1);
        weave::host_stream s("mpi");
        comm.all_to_all_v_bounded(s, L.send.data(), L.send_counts, L.send_displs, out.data(),
                                  L.recv_counts, L.recv_displs, received, c.unit);
        s.synchronize();
        CHECK(out == comm_test::expected_recv(c, r));
        for (std::size_t j = 0; j < std::size_t(n); ++j)
          CHECK(received[j] == c.ranks[j].send_counts[std::size_t(r)]);
      }
    }
  }
}

TEST_CASE("a bounded all-to-all's block longer than its room fails its receiver, whose peers "
          "learn it") {
  check_truncated_receive("all_to_all_v_bounded", [](weave::mpi_communicator& comm,
                                                     weave::host_stream& s, const auto& sent) {
    auto received = std::make_shared<std::vector<std::int64_t>>(std::size_t(comm.size()));
    abandoned.keep(received);
    comm.all_to_all_v_bounded(s, sent.send, sent.counts, sent.displs, sent.recv, sent.room,
                              sent.displs, *received);
  });
}

TEST_CASE("a rank whose own block's counts disagree fails with size_mismatch, its peers learn it") {
  weave::mpi_communicator comm(MPI_COMM_WORLD);
  weave::host_stream s;
  const int n = comm.size(), r = comm.rank();
  auto layout = comm_test::uniform(n, 4, 8);
  std::vector<std::int64_t>& send_counts = layout.counts;
  const std::vector<std::int64_t>& displs = layout.displs;
  const std::vector<std::int64_t> recv_counts = send_counts;
  if (r == n - 1)
    send_counts[std::size_t(r)] = 8; // to itself: 8 sent, 4 received
  auto send = std::make_shared<std::vector<std::byte>>(std::size_t(8 * n), std::byte{1});
  auto recv = std::make_shared<std::vector<std::byte>>(send->size());
  abandoned.keep(send); // the peers' receives from the failing rank stay posted
  abandoned.keep(recv);
  comm.all_to_all_v(s, send->data(), send_counts, displs, recv->data(), recv_counts, displs);
  try {
    s.synchronize();
    FAIL("rank ", r, " returned from an all-to-all whose rank ", n - 1, " counts disagree");
  } catch (const weave::peer_error& e) {
    CHECK(r != n - 1);
    CHECK(e.origin().rank == n - 1);
    CHECK(e.origin().code == weave::errc::size_mismatch);
  } catch (const weave::error& e) {
    CHECK(r == n - 1);
    CHECK(e.code() == weave::errc::size_mismatch);
    CHECK(e.message().find("sends 8 units to itself but receives 4") != std::string::npos);
  }
  CHECK(comm.aborted());
}

TEST_CASE("counts exchange, all_reduce and barrier agree with MPI") {
  const int n = world_size(), r = world_rank();
  weave::mpi_communicator comm(MPI_COMM_WORLD);
  weave::host_stream s;
  std::vector<std::int64_t> announce(std::size_t(3 * n)), heard(announce.size());
  for (int j = 0; j < n; ++j)
    for (int i = 0; i < 3; ++i)
      announce[std::size_t(3 * j + i)] = 100 * r + 10 * j + i;
  comm.exchange_counts(s, announce, heard);
  std::vector<double> d{1.5 * r, -2.0 * r, 0.25 + r}, d_out(3);
  std::vector<float> f{float(r), float(-r)}, f_ref(2);
  std::vector<std::int64_t> i{std::int64_t(r) << 40, 7 - r}, i_out(2), i_ref(2);
  std::vector<double> d_ref(3);
  comm.all_reduce(s, std::span<const double>(d), std::span<double>(d_out), weave::reduce_op::sum);
  std::vector<float> f_inplace = f;
  comm.all_reduce(s, std::span<const float>(f_inplace), std::span<float>(f_inplace),
                  weave::reduce_op::max);
  comm.all_reduce(s, std::span<const std::int64_t>(i), std::span<std::int64_t>(i_out),
                  weave::reduce_op::sum);
  comm.barrier(s);
  s.synchronize();
  for (int j = 0; j < n; ++j)
    for (int k = 0; k < 3; ++k)
      CHECK(heard[std::size_t(3 * j + k)] == 100 * j + 10 * r + k);
  MPI_Allreduce(d.data(), d_ref.data(), 3, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  MPI_Allreduce(f.data(), f_ref.data(), 2, MPI_FLOAT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Allreduce(i.data(), i_ref.data(), 2, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  CHECK(d_out == d_ref);
  CHECK(f_inplace == f_ref);
  CHECK(i_out == i_ref);
  std::vector<std::int64_t> bad(std::size_t(n) + 1);
  CHECK_THROWS_AS(comm.exchange_counts(s, bad, bad), weave::error);
}

TEST_CASE("2DH over split MPI communicators equals MPI_Alltoallv") {
  const int n = world_size(), r = world_rank();
  for (int local : {1, 2}) {
    if (n % local != 0)
      continue;
    CAPTURE(local);
    MPI_Comm intra_comm, inter_comm;
    MPI_Comm_split(MPI_COMM_WORLD, r / local, r % local, &intra_comm);
    MPI_Comm_split(MPI_COMM_WORLD, r % local, r / local, &inter_comm);
    {
      weave::mpi_communicator intra(intra_comm), inter(inter_comm);
      weave::hierarchical_all_to_all<weave::mpi_communicator, weave::mpi_communicator> plan(
          intra, inter, 1 << 22);
      REQUIRE(plan.rank() == r);
      for (std::size_t unit : {std::size_t{1}, std::size_t{4}}) {
        const auto c = comm_test::make_case(n, unit, 5 + unit, 3000);
        const auto& L = c.ranks[std::size_t(r)];
        std::vector<std::byte> out(L.recv_bytes, comm_test::sentinel);
        weave::host_stream s;
        plan.all_to_all_v(s, L.send.data(), L.send_counts, L.send_displs, out.data(), L.recv_counts,
                          L.recv_displs, unit);
        s.synchronize();
        CHECK(out == comm_test::mpi_alltoallv_reference(c, MPI_COMM_WORLD));
      }
    }
    MPI_Comm_free(&intra_comm);
    MPI_Comm_free(&inter_comm);
  }
}

TEST_CASE("a peer that arrives after the timeout makes the waiting rank fail with timeout") {
  using namespace std::chrono_literals;
  weave::mpi_options options;
  options.timeout = 100ms;
  weave::mpi_communicator comm(MPI_COMM_WORLD, options);
  weave::host_stream s;
  if (world_rank() == 0) {
    comm.barrier(s);
    try {
      s.synchronize();
      FAIL("rank 0 did not time out");
    } catch (const weave::error& e) {
      CHECK(e.code() == weave::errc::timeout);
    }
  } else {
    std::this_thread::sleep_for(600ms); // "never" arrives within rank 0's timeout
    comm.barrier(s);
    try { // rank 0's timeout aborted the communicator: the late rank learns it at once
      s.synchronize();
      FAIL("a late rank did not learn of rank 0's timeout");
    } catch (const weave::peer_error& e) {
      CHECK(e.origin().rank == 0);
      CHECK(e.origin().code == weave::errc::timeout);
    }
  }
  CHECK(comm.aborted());
  MPI_Barrier(MPI_COMM_WORLD); // the caller's communicator is unaffected
}

// Rank 0 times out in an operation its peers reach late: its messages stay posted (MPI cannot
// cancel them), so a late rank's operation may complete against them. It then holds what rank
// 0 sent (`check_data()`), never anything else, and the rank learns of rank 0's timeout by its
// next operation at the latest; usually at this one (the notice is tested with its requests).
// `issue(comm, s)` enqueues the operation, the same on every rank.
template <class Issue, class Check>
void check_late_rank(const std::string& op, Issue&& issue, Check&& check_data) {
  using namespace std::chrono_literals;
  CAPTURE(op);
  weave::mpi_options options;
  options.timeout = 100ms;
  auto comm = std::make_shared<weave::mpi_communicator>(MPI_COMM_WORLD, options);
  abandoned.keep(comm); // rank 0's abandoned operation names the communicator's buffers
  weave::host_stream s;
  const auto timed_out = [](const weave::peer_error& e) {
    CHECK(world_rank() != 0);
    CHECK(e.origin().rank == 0);
    CHECK(e.origin().code == weave::errc::timeout);
  };
  if (world_rank() != 0)
    std::this_thread::sleep_for(600ms); // "never" arrive within rank 0's timeout
  issue(*comm, s);
  try {
    s.synchronize();
    REQUIRE(world_rank() != 0);
    check_data(); // completed against rank 0's part: its data
    comm->barrier(s);
    try {
      s.synchronize();
      FAIL("rank ", world_rank(), " did not learn of rank 0's timeout in its ", op);
    } catch (const weave::peer_error& e) {
      timed_out(e);
    }
  } catch (const weave::peer_error& e) {
    timed_out(e);
  } catch (const weave::error& e) {
    CHECK(world_rank() == 0);
    CHECK(e.code() == weave::errc::timeout);
  }
  CHECK(comm->aborted());
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("a late rank's operation that completes against a timed-out peer's holds its data, and "
          "the rank learns of the timeout by its next operation") {
  const auto n = static_cast<std::size_t>(world_size());
  const auto r = static_cast<std::int64_t>(world_rank());
  constexpr std::size_t k = 4; // words per peer: rank 0's sends leave before the peers arrive
  auto send = std::make_shared<std::vector<std::int64_t>>(n * k);
  auto recv = std::make_shared<std::vector<std::int64_t>>(n * k, -1);
  auto received = std::make_shared<std::vector<std::int64_t>>(n, -1);
  for (std::size_t j = 0; j < n * k; ++j) // to rank j / k: (this rank, j)
    (*send)[j] = r * 1000 + static_cast<std::int64_t>(j);
  abandoned.keep(send);
  abandoned.keep(recv);
  abandoned.keep(received);
  const std::vector<std::int64_t> counts(n, k * 8);
  std::vector<std::int64_t> displs(n);
  for (std::size_t j = 0; j < n; ++j)
    displs[j] = static_cast<std::int64_t>(j * k * 8);
  const auto* from = reinterpret_cast<const std::byte*>(send->data());
  auto* to = reinterpret_cast<std::byte*>(recv->data());
  const auto blocks = [&] { // block j from rank j: (j, this rank's words)
    for (std::size_t j = 0; j < n; ++j)
      for (std::size_t w = 0; w < k; ++w)
        CHECK((*recv)[j * k + w] == static_cast<std::int64_t>(j) * 1000 +
                                        r * static_cast<std::int64_t>(k) +
                                        static_cast<std::int64_t>(w));
  };
  check_late_rank(
      "all_to_all_v",
      [&](weave::mpi_communicator& c, weave::host_stream& s) {
        c.all_to_all_v(s, from, counts, displs, to, counts, displs, 1);
      },
      blocks);
  check_late_rank(
      "tagged all_to_all_v",
      [&](weave::mpi_communicator& c, weave::host_stream& s) {
        c.all_to_all_v(s, from, counts, displs, to, counts, displs, 1,
                       weave::call_tag::of(1, 1, weave::call_stage::dispatch, 0));
      },
      blocks);
  check_late_rank(
      "all_to_all_v_bounded",
      [&](weave::mpi_communicator& c, weave::host_stream& s) {
        c.all_to_all_v_bounded(s, from, counts, displs, to, counts, displs, *received, 1);
      },
      [&] {
        blocks();
        for (const std::int64_t length : *received)
          CHECK(length == static_cast<std::int64_t>(k * 8));
      });
  check_late_rank(
      "exchange_counts",
      [&](weave::mpi_communicator& c, weave::host_stream& s) {
        c.exchange_counts(s, std::span<const std::int64_t>(*send), std::span<std::int64_t>(*recv));
      },
      blocks);
  check_late_rank(
      "barrier", [](weave::mpi_communicator& c, weave::host_stream& s) { c.barrier(s); }, [] {});
}

TEST_CASE("an abort reaches every peer at once, naming the rank, its code and its message") {
  using namespace std::chrono_literals;
  weave::mpi_options options;
  options.timeout = 60s; // the peers must not need it
  weave::mpi_communicator comm(MPI_COMM_WORLD, options);
  weave::host_stream s;
  const auto start = std::chrono::steady_clock::now();
  if (comm.rank() == world_size() - 1) {
    std::this_thread::sleep_for(50ms); // the others are waiting in the barrier
    comm.abort(
        weave::failure_record{comm.rank(), weave::errc::invalid_argument, true, "NaN gate weight"});
    comm.barrier(s);
    try {
      s.synchronize();
      FAIL("an aborted communicator ran a barrier");
    } catch (const weave::error& e) {
      CHECK(e.code() == weave::errc::invalid_argument);
      CHECK(e.message().find("NaN gate weight") != std::string::npos);
    }
  } else {
    comm.barrier(s);
    try {
      s.synchronize();
      FAIL("a peer of an aborted rank finished its barrier");
    } catch (const weave::peer_error& e) {
      CHECK(e.origin().rank == world_size() - 1);
      CHECK(e.origin().code == weave::errc::invalid_argument);
      CHECK(e.origin().message == "NaN gate weight");
    }
    comm.barrier(s); // later operations fail at once
    CHECK_THROWS_AS(s.synchronize(), weave::peer_error);
  }
  CHECK(comm.aborted());
  CHECK(std::chrono::steady_clock::now() - start < 30s);
  MPI_Barrier(MPI_COMM_WORLD); // the caller's communicator is unaffected
}

TEST_CASE("MPI errors become errc::mpi naming the operation and MPI's text") {
  check_truncated_receive("all_to_all_v", [](weave::mpi_communicator& comm, weave::host_stream& s,
                                             const auto& sent) {
    comm.all_to_all_v(s, sent.send, sent.counts, sent.displs, sent.recv, sent.room, sent.displs);
  });
}

TEST_CASE("a real exchange of more than 2^31 bytes per peer (opt-in: WEAVE_COMM_LARGE_TEST=1)") {
  const char* enabled = std::getenv("WEAVE_COMM_LARGE_TEST");
  const int n = world_size(), r = world_rank();
  if (!enabled || std::string(enabled) != "1" || n != 2)
    return; // needs about 4.3 GB per rank
  const std::int64_t big = (std::int64_t(1) << 31) + 4099;
  std::vector<std::byte> send(std::size_t(big) + 16), recv(std::size_t(big) + 16);
  for (std::size_t k = 0; k < send.size(); ++k)
    send[k] = static_cast<std::byte>((k * 131 + std::size_t(r) * 7) >> 3);
  const std::int64_t other = 1 - r;
  // Rank r sends 16 bytes to itself at offset 0 and `big` bytes to the other rank at 16.
  const std::vector<std::int64_t> counts =
      r == 0 ? std::vector<std::int64_t>{16, big} : std::vector<std::int64_t>{big, 16};
  const std::vector<std::int64_t> displs =
      r == 0 ? std::vector<std::int64_t>{0, 16} : std::vector<std::int64_t>{16, 0};
  weave::mpi_communicator comm(MPI_COMM_WORLD);
  weave::host_stream s;
  comm.all_to_all_v(s, send.data(), counts, displs, recv.data(), counts, displs);
  s.synchronize();
  for (std::size_t k = 0; k < std::size_t(big); k += 4093) {
    const std::size_t at = 16 + k;
    REQUIRE(recv[at] == static_cast<std::byte>((at * 131 + std::size_t(other) * 7) >> 3));
  }
  REQUIRE(
      recv[16 + std::size_t(big) - 1] ==
      static_cast<std::byte>(((16 + std::size_t(big) - 1) * 131 + std::size_t(other) * 7) >> 3));
  CHECK(std::memcmp(recv.data(), send.data(), 16) == 0);
}

TEST_CASE("shrink on MPI refuses with not_supported, saying what can, and leaves the communicator "
          "working") {
  const int n = world_size(), r = world_rank();
  weave::mpi_communicator comm(MPI_COMM_WORLD);
  const std::vector<int> lost{n - 1};
  try {
    (void)weave::shrink(comm, lost);
    FAIL("shrink did not refuse");
  } catch (const weave::error& e) {
    CHECK(e.code() == weave::errc::not_supported);
    CHECK(e.message().find("ULFM") != std::string::npos);
    CHECK(e.message().find("restart") != std::string::npos);
  }
  const std::vector<int> outside{n};
  CHECK_THROWS_AS((void)comm.shrink(outside), weave::error);
  weave::host_stream s;
  std::vector<std::int64_t> announce(static_cast<std::size_t>(n)),
      heard(static_cast<std::size_t>(n));
  for (int j = 0; j < n; ++j)
    announce[static_cast<std::size_t>(j)] = 10 * r + j;
  comm.exchange_counts(s, announce, heard);
  s.synchronize();
  for (int j = 0; j < n; ++j)
    CHECK(heard[std::size_t(j)] == 10 * j + r);
}

TEST_CASE("move_expert_state over MPI carries a plan's copies, and a rank refusing its arguments "
          "ends every rank at once") {
  const int n = world_size(), r = world_rank();
  const int experts = 2 * n;
  const auto state_of = [](int e) {
    std::vector<std::byte> b(24);
    for (std::size_t i = 0; i < b.size(); ++i)
      b[i] = static_cast<std::byte>(e * 31 + static_cast<int>(i));
    return b;
  };
  // Device d holds {2d, 2d + 1}; the next placement swaps expert 1 and the last one.
  const auto current = weave::placement::contiguous(experts, n);
  std::vector<std::int32_t> slots(current.slot_experts().begin(), current.slot_experts().end());
  std::swap(slots[1], slots.back());
  const auto plan =
      weave::plan_migration(current, weave::placement(experts, n, slots), weave::topology::flat(n));
  REQUIRE(plan.moves.size() == 2);
  for (const bool bad : {false, true}) {
    CAPTURE(bad);
    weave::mpi_communicator comm(MPI_COMM_WORLD);
    weave::host_stream s;
    std::vector<std::vector<std::byte>> held, got(2);
    for (int e = 0; e < experts; ++e)
      held.push_back(state_of(e));
    const auto start = std::chrono::steady_clock::now();
    try {
      weave::move_expert_state(
          comm, s, plan, 24,
          [&](int e) {
            auto span = std::span<const std::byte>(held[static_cast<std::size_t>(e)]);
            return bad && r == n - 1 ? span.first(8) : span; // the last rank's is too short
          },
          [&](int slot, int) {
            got[static_cast<std::size_t>(slot)].assign(24, std::byte{0});
            return std::span<std::byte>(got[static_cast<std::size_t>(slot)]);
          });
      CHECK_FALSE(bad);
      for (const weave::expert_move& m : plan.moves)
        if (m.to_device == r)
          CHECK(got[static_cast<std::size_t>(m.to_slot % 2)] == state_of(m.expert));
    } catch (const weave::peer_error& e) {
      CHECK(bad);
      CHECK(r != n - 1);
      CHECK(e.origin().rank == n - 1);
      CHECK(e.origin().code == weave::errc::size_mismatch);
    } catch (const weave::error& e) {
      CHECK(bad);
      CHECK(r == n - 1);
      CHECK(e.code() == weave::errc::size_mismatch);
    }
    CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(20));
  }
}
