// mpi_communicator's tagged collectives under mpirun -np 2 and -np 4: a tagged all-to-all (each
// peer's header leaves with its data; a peer's data is taken only after its header checked) and
// a tagged count exchange equal MPI_Alltoallv and MPI_Alltoall, interleaved with untagged calls
// and with blocks in pieces; ranks at different calls, at different kinds of collective or
// disagreeing on a size fail every rank with the header's typed error within seconds (the
// timeout is 10 minutes), also where MPI truncated a larger block's receive posted beside the
// headers, and a failed call copies nothing out of its headers. (A size disagreement is found by
// the receiver of the block: a rank whose own receives agreed may complete its call, right, and
// then fails at its next operation.)
#include <doctest/doctest.h>

#include "a2a_cases.hpp"
#include "a2a_mpi_reference.hpp"
#include "mpi_session.hpp"

#include <weave/comm/mpi_communicator.hpp>
#include <weave/core/failure.hpp>

#include <mpi.h>

#include <chrono>
#include <climits>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace {

// Buffers of collectives abandoned after an abort (MPI may write into them until MPI_Finalize).
weave_test::kept_until_finalize abandoned;
const weave_test::mpi_session mpi_for_the_whole_run;

using weave_test::world_rank;
using weave_test::world_size;

weave::call_tag tag_of(std::uint64_t call, weave::call_stage stage = weave::call_stage::dispatch) {
  return weave::call_tag::of(3, call, stage, 0);
}

// What one rank saw of a call that must fail: its error code, and the origin's for a peer_error.
struct outcome {
  weave::errc code{}, origin_code{};
  int origin = -1;
  std::string message;
  double seconds = 0;
};

template <class F>
outcome failing(F&& call) {
  const auto start = std::chrono::steady_clock::now();
  outcome o;
  try {
    call();
    o.message = "returned";
  } catch (const weave::peer_error& e) {
    o.code = e.code();
    o.origin = e.origin().rank;
    o.origin_code = e.origin().code;
    o.message = e.what();
  } catch (const weave::error& e) {
    o.code = e.code();
    o.message = e.what();
  }
  o.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return o;
}

// A failing case's communicator and buffers, kept until MPI_Finalize (the case abandons its
// operation), and its stream.
struct failing_case {
  std::shared_ptr<weave::mpi_communicator> comm;
  weave::host_stream s{"tags"};
  explicit failing_case(weave::mpi_options options = {})
      : comm(std::make_shared<weave::mpi_communicator>(MPI_COMM_WORLD, options)) {
    abandoned.keep(comm);
  }
  template <class T>
  std::shared_ptr<std::vector<T>> buffer(std::size_t size, T value) {
    auto b = std::make_shared<std::vector<T>>(size, value);
    abandoned.keep(b);
    return b;
  }
};

// Every rank ends with `code`, found itself or learned from the rank that found it.
void check_everyone_fails_with(const outcome& o, weave::errc code) {
  CAPTURE(o.message);
  CHECK((o.code == code || (o.code == weave::errc::peer_failure && o.origin_code == code)));
  CHECK(o.seconds < 30.0);
}

} // namespace

TEST_CASE("tagged all-to-alls and count exchanges equal MPI, between untagged ones") {
  const int n = world_size(), r = world_rank();
  const auto ranks = static_cast<std::size_t>(n);
  // Blocks inside their header's message (a limit that holds every block here), none, and some
  // (at most 64 bytes, or the default: others go alone once the headers checked).
  for (const std::size_t inline_limit : {std::size_t{1} << 16, std::size_t{0}, std::size_t{64},
                                         weave::mpi_options{}.tagged_inline_bytes})
    for (std::int64_t chunk : {std::int64_t{INT_MAX}, std::int64_t{7}}) {
      CAPTURE(inline_limit);
      CAPTURE(chunk);
      weave::mpi_options options;
      options.max_chunk_units = chunk;
      options.tagged_inline_bytes = inline_limit;
      weave::mpi_communicator comm(MPI_COMM_WORLD, options);
      weave::host_stream s("tags");
      for (std::size_t unit : {std::size_t{1}, std::size_t{8}}) {
        CAPTURE(unit);
        const auto a = comm_test::make_case(n, unit, 11 + unit, 500);
        const auto b = comm_test::make_case(n, unit, 23 + unit, 0); // some empty blocks
        const auto& A = a.ranks[std::size_t(r)];
        const auto& B = b.ranks[std::size_t(r)];
        std::vector<std::byte> tagged_a(A.recv_bytes, comm_test::sentinel),
            untagged_b(B.recv_bytes, comm_test::sentinel),
            tagged_b(B.recv_bytes, comm_test::sentinel);
        std::vector<std::int64_t> announce(3 * ranks), heard(3 * ranks, -1);
        for (std::size_t j = 0; j < announce.size(); ++j)
          announce[j] = 1000 * r + static_cast<std::int64_t>(j);
        // One stream, no wait between: tagged and untagged messages of consecutive calls.
        comm.all_to_all_v(s, A.send.data(), A.send_counts, A.send_displs, tagged_a.data(),
                          A.recv_counts, A.recv_displs, unit, tag_of(1));
        comm.all_to_all_v(s, B.send.data(), B.send_counts, B.send_displs, untagged_b.data(),
                          B.recv_counts, B.recv_displs, unit);
        comm.exchange_counts(s, announce, heard, tag_of(2));
        comm.all_to_all_v(s, B.send.data(), B.send_counts, B.send_displs, tagged_b.data(),
                          B.recv_counts, B.recv_displs, unit,
                          tag_of(3, weave::call_stage::combine));
        s.synchronize();
        CHECK(tagged_a == comm_test::mpi_alltoallv_reference(a, MPI_COMM_WORLD));
        CHECK(tagged_a == comm_test::expected_recv(a, r));
        CHECK(untagged_b == comm_test::expected_recv(b, r));
        CHECK(tagged_b == untagged_b);
        std::vector<std::int64_t> reference(heard.size());
        MPI_Alltoall(announce.data(), 3, MPI_INT64_T, reference.data(), 3, MPI_INT64_T,
                     MPI_COMM_WORLD);
        CHECK(heard == reference);
      }
    }
}

TEST_CASE("a rank at another call fails every rank with call_mismatch, whatever the block size") {
  const int n = world_size(), r = world_rank(), culprit = n - 1;
  const auto ranks = static_cast<std::size_t>(n);
  // Blocks inside their headers (16 bytes), and alone (64 KiB, whose receives were posted beside
  // the headers'; the culprit's call sends a longer one, which MPI truncates there).
  for (const std::int64_t bytes : {std::int64_t{16}, std::int64_t{1} << 16}) {
    CAPTURE(bytes);
    failing_case c;
    const auto layout = comm_test::uniform(n, bytes, bytes);
    const auto longer = comm_test::uniform(n, 2 * bytes, 2 * bytes);
    const auto& sent = r == culprit ? longer : layout;
    auto send = c.buffer(2 * static_cast<std::size_t>(bytes) * ranks, std::byte{7});
    auto recv = c.buffer(2 * static_cast<std::size_t>(bytes) * ranks, comm_test::sentinel);
    const outcome o = failing([&] {
      c.comm->all_to_all_v(c.s, send->data(), sent.counts, sent.displs, recv->data(), sent.counts,
                           sent.displs, 1, tag_of(r == culprit ? 8 : 7));
      c.s.synchronize();
    });
    check_everyone_fails_with(o, weave::errc::call_mismatch);
    if (o.code == weave::errc::call_mismatch) // the error names both calls
      CHECK((o.message.find("call 7") != std::string::npos &&
             o.message.find("call 8") != std::string::npos));
    if (bytes <= 16) // a block inside its header is copied out only once every header checked
      CHECK(*recv == std::vector<std::byte>(recv->size(), comm_test::sentinel));
    MPI_Barrier(MPI_COMM_WORLD);
  }
}

TEST_CASE("a rank at a count exchange while its peers are at an all-to-all: call_mismatch") {
  const int n = world_size(), r = world_rank(), culprit = n - 1;
  const auto ranks = static_cast<std::size_t>(n);
  failing_case c;
  const auto layout = comm_test::uniform(n, 4, 4);
  const std::vector<std::int64_t>& counts = layout.counts;
  const std::vector<std::int64_t>& displs = layout.displs;
  auto announce = c.buffer(4 * ranks, std::int64_t{1});
  auto heard = c.buffer(4 * ranks, std::int64_t{-1});
  const outcome o = failing([&] {
    if (r == culprit) // the same call, another collective: its header names another kind
      c.comm->exchange_counts(c.s, *announce, *heard, tag_of(5));
    else
      c.comm->all_to_all_v(c.s, announce->data(), counts, displs, heard->data(), counts, displs,
                           sizeof(std::int64_t), tag_of(5));
    c.s.synchronize();
  });
  check_everyone_fails_with(o, weave::errc::call_mismatch);
  if (o.code == weave::errc::call_mismatch)
    CHECK(o.message.find(r == culprit ? "is at an all-to-all of that call, this rank at a count "
                                        "exchange"
                                      : "is at a count exchange of that call, this rank at an "
                                        "all-to-all") != std::string::npos);
  CHECK(*heard == std::vector<std::int64_t>(heard->size(), -1));
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("a size disagreement fails with size_mismatch naming both sizes, before any truncation") {
  const int n = world_size(), r = world_rank(), culprit = n - 1;
  const auto ranks = static_cast<std::size_t>(n);
  // The disagreeing block inside its header, alone, or alone where rank 0 expects it inside.
  for (const std::size_t inline_limit : {std::size_t{1} << 16, std::size_t{0}, std::size_t{96}})
    for (const bool counts_exchange : {false, true}) {
      CAPTURE(inline_limit);
      CAPTURE(counts_exchange);
      weave::mpi_options options;
      options.tagged_inline_bytes = inline_limit;
      failing_case c(options);
      auto& comm = c.comm;
      auto& s = c.s;
      // The culprit sends rank 0 a block 8 units longer than rank 0 receives (or, exchanging
      // counts, 2 counts per peer where the others exchange 1).
      auto layout = comm_test::uniform(n, 8, 16);
      std::vector<std::int64_t>& send_counts = layout.counts;
      const std::vector<std::int64_t>& displs = layout.displs;
      const std::vector<std::int64_t> recv_counts = send_counts;
      if (r == culprit)
        send_counts[0] = 16;
      const std::size_t per_peer = r == culprit ? 2 : 1;
      auto send = c.buffer(16 * ranks, std::int64_t{3});
      auto recv = c.buffer(16 * ranks, std::int64_t{-1});
      const outcome o = failing([&] {
        if (counts_exchange)
          comm->exchange_counts(s, std::span<const std::int64_t>(send->data(), per_peer * ranks),
                                std::span<std::int64_t>(recv->data(), per_peer * ranks), tag_of(4));
        else
          comm->all_to_all_v(s, send->data(), send_counts, displs, recv->data(), recv_counts,
                             displs, sizeof(std::int64_t), tag_of(4));
        s.synchronize();
      });
      if (o.message == "returned") {
        // Only a rank whose own receives agreed (not rank 0, which finds the disagreement; in an
        // all-to-all, where the others send rank 0 what it expects): its result is right, and its
        // next operation fails with rank 0's error.
        CHECK(r != 0);
        CHECK(!counts_exchange);
        for (std::size_t j = 0; j < ranks; ++j)
          CHECK((*recv)[16 * j] == 3);
        const outcome next = failing([&] {
          comm->barrier(s);
          s.synchronize();
        });
        check_everyone_fails_with(next, weave::errc::size_mismatch);
      } else {
        check_everyone_fails_with(o, weave::errc::size_mismatch);
      }
      if (r == 0 && o.code == weave::errc::size_mismatch)
        CHECK(o.message.find(counts_exchange ? "sends 2 counts per peer where this rank receives 1"
                                             : "sends 128 bytes where this rank receives 64") !=
              std::string::npos);
      // Where rank 0 expected the block inside its header, it posted no receive for it: nothing
      // of the culprit's landed (headers alone, the receive posted beside them was truncated).
      if (!counts_exchange && r == 0 && inline_limit > 0)
        CHECK(*recv == std::vector<std::int64_t>(recv->size(), -1));
      MPI_Barrier(MPI_COMM_WORLD);
    }
}

TEST_CASE("ranks with different inline limits: right where the blocks fit, else a typed error") {
  const int n = world_size(), r = world_rank(), culprit = n - 1;
  const auto ranks = static_cast<std::size_t>(n);
  // The culprit sends every block alone and takes none inside a header, the others send theirs
  // inside: MPI truncates what they send the culprit (errc::mpi there, a peer's failure or that
  // error at the next operation elsewhere), and nothing of it is received.
  weave::mpi_options options;
  options.tagged_inline_bytes = r == culprit ? 0 : std::size_t{1} << 16;
  failing_case c(options);
  const auto layout = comm_test::uniform(n, 32, 32);
  auto send = c.buffer(32 * ranks, std::byte{5});
  auto recv = c.buffer(32 * ranks, comm_test::sentinel);
  const outcome o = failing([&] {
    c.comm->all_to_all_v(c.s, send->data(), layout.counts, layout.displs, recv->data(),
                         layout.counts, layout.displs, 1, tag_of(9));
    c.s.synchronize();
  });
  if (o.message == "returned") { // a rank whose receives all fit: right, then the next one fails
    CHECK(r != culprit);
    CHECK(*recv == std::vector<std::byte>(recv->size(), std::byte{5}));
    const outcome next = failing([&] {
      c.comm->barrier(c.s);
      c.s.synchronize();
    });
    check_everyone_fails_with(next, weave::errc::mpi);
  } else {
    check_everyone_fails_with(o, weave::errc::mpi);
  }
  if (r == culprit) {
    CHECK(o.code == weave::errc::mpi);
    CHECK(*recv == std::vector<std::byte>(recv->size(), comm_test::sentinel));
  }
  MPI_Barrier(MPI_COMM_WORLD);
}
