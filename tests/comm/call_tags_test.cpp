// device_call_tags on local_world ranks behind a communicator without tagged collectives, against
// a naive reference: every rank gets every rank's tag, and a rank whose tags differ fails with
// call_mismatch naming the lowest rank whose tag differs from its own and both calls. Host
// streams fail on the stream; the CUDA control flow (emulated GPU) keeps the first mismatch for
// `take` / `mismatch` (cleared by `take`), or with `wait_on_host` throws at the exchange.
#include <doctest/doctest.h>

#include "corrupting_communicator.hpp"

#include <weave/comm/device_call_tags.hpp>
#include <weave/comm/local_world.hpp>
#include <weave/comm/mpi_call_header.hpp>
#include <weave/exec/emulated_gpu_space.hpp>
#include <weave/exec/host_space.hpp>
#include <weave/exec/host_stream.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

namespace {

using untagged = weave_test::corrupting_communicator;
static_assert(!weave::has_tagged_collectives<untagged>);

weave::call_tag tag_of(std::uint64_t call) {
  return weave::call_tag::of(3, call, weave::call_stage::combine, 1);
}

// The reference: the lowest rank whose call differs from rank `rank`'s, or -1.
int first_other(const std::vector<std::uint64_t>& calls, int rank) {
  for (std::size_t r = 0; r < calls.size(); ++r)
    if (calls[r] != calls[static_cast<std::size_t>(rank)])
      return static_cast<int>(r);
  return -1;
}

// What one rank saw: its error's code and message (none: errc{}).
struct seen {
  weave::errc code{};
  std::string message;
};

seen seen_of(const std::exception_ptr& e) {
  if (!e)
    return {};
  try {
    std::rethrow_exception(e);
  } catch (const weave::error& w) {
    return {w.code(), w.what()};
  }
}

// Runs one tag exchange of call `calls[rank]` on every rank (twice, the second of `second`
// where given, to check that the first mismatch is kept) in `Space`, and returns what each rank
// saw.
template <class Space>
std::vector<seen> run(const std::vector<std::uint64_t>& calls, bool wait_on_host,
                      const std::vector<std::uint64_t>& second = {}) {
  const int ranks = static_cast<int>(calls.size());
  std::vector<seen> out(calls.size());
  weave::local_world world(ranks);
  world.run([&](weave::local_communicator& local) {
    untagged comm(local);
    const int rank = comm.rank();
    const auto R = static_cast<std::size_t>(ranks);
    weave::device_call_tags<Space> tags(ranks, rank, true, "test", wait_on_host);
    weave::device_tag_block<Space> b;
    tags.size_block(b);
    std::vector<std::int64_t> send(R), recv(R), mismatch(3);
    b.send = send.data();
    b.recv = recv.data();
    b.mismatch = mismatch.data();
    weave::host_stream s("comm");
    std::exception_ptr failure;
    try {
      tags.initialize(s, b);
      tags.exchange(comm, s, b, tag_of(calls[static_cast<std::size_t>(rank)]));
      if (!second.empty())
        tags.exchange(comm, s, b, tag_of(second[static_cast<std::size_t>(rank)]));
      tags.take(s, b);
      s.synchronize();
      failure = tags.mismatch(b);
      if (!failure) { // take cleared what it copied: a second take finds nothing
        tags.take(s, b);
        s.synchronize();
        CHECK(tags.mismatch(b) == nullptr);
      }
    } catch (...) {
      failure = std::current_exception();
    }
    out[static_cast<std::size_t>(rank)] = seen_of(failure);
  });
  return out;
}

// Every rank whose calls differ from a peer's saw call_mismatch naming the reference's rank and
// both calls; the others saw nothing.
void check(const std::vector<seen>& got, const std::vector<std::uint64_t>& calls) {
  for (std::size_t r = 0; r < got.size(); ++r) {
    CAPTURE(r);
    const int other = first_other(calls, static_cast<int>(r));
    if (other < 0) {
      CHECK(got[r].code == weave::errc{});
      continue;
    }
    CHECK(got[r].code == weave::errc::call_mismatch);
    const std::string want = "rank " + std::to_string(r) + " is at " + tag_of(calls[r]).describe() +
                             ", rank " + std::to_string(other) + " at " +
                             tag_of(calls[static_cast<std::size_t>(other)]).describe();
    CAPTURE(got[r].message);
    CHECK(got[r].message.find(want) != std::string::npos);
  }
}

} // namespace

TEST_CASE("device_call_tags: ranks at one call pass, ranks at other calls fail naming both") {
  const std::vector<std::vector<std::uint64_t>> cases = {{5, 5},    {5, 5, 5},    {5, 7},
                                                         {5, 7, 5}, {5, 5, 9, 5}, {2, 3, 4}};
  for (const auto& calls : cases) {
    CAPTURE(calls.size());
    CAPTURE(calls[1]);
    check(run<weave::host_space>(calls, false), calls);
    check(run<weave::emulated_gpu_space>(calls, false), calls);
    check(run<weave::emulated_gpu_space>(calls, true), calls);
  }
}

TEST_CASE("device_call_tags: the CUDA control flow keeps the first mismatch until take") {
  // The first exchange differs on rank 1; the second differs elsewhere: the first is reported.
  const std::vector<std::uint64_t> first = {5, 7, 5}, second = {8, 8, 6};
  check(run<weave::emulated_gpu_space>(first, false, second), first);
}

TEST_CASE("device_call_tags: disabled, it carves and sends nothing") {
  weave::device_call_tags<weave::host_space> tags(2, 0, false, "test");
  weave::device_tag_block<weave::host_space> b;
  tags.size_block(b);
  std::size_t carved = 0;
  tags.carve(b, [&](auto* const&, std::size_t n) { carved += n; });
  CHECK(carved == 0);
  CHECK(tags.mismatch(b) == nullptr);
}

TEST_CASE("mpi_call_header: a header written for a call passes only that call, kind and size") {
  using header = weave::detail::mpi_call_header;
  const auto failure = [](const std::array<std::int64_t, header::words>& h, weave::call_tag tag,
                          std::int64_t kind, std::int64_t expected) -> std::string {
    try {
      header::check(h, 0, 1, tag, kind, expected, "all_to_all_v");
      return "passed";
    } catch (const weave::error& e) {
      return std::string(weave::to_string(e.code())) + ": " + e.message();
    }
  };
  std::array<std::int64_t, header::words> h{};
  header::write(h.data(), tag_of(5), header::all_to_all, header::size_of(header::all_to_all, 3, 8));
  CHECK(h[3] == 24); // an all-to-all states bytes, a count exchange its counts per peer
  CHECK(header::size_of(header::counts, 3, 8) == 3);
  CHECK(failure(h, tag_of(5), header::all_to_all, 24) == "passed");
  const std::string other_call = failure(h, tag_of(6), header::all_to_all, 24);
  CHECK(other_call.starts_with("call_mismatch"));
  CHECK(other_call.find("call 5") != std::string::npos);
  CHECK(other_call.find("call 6") != std::string::npos);
  CHECK(failure(h, tag_of(5), header::counts, 24)
            .find("is at an all-to-all of that call, this "
                  "rank at a count exchange") != std::string::npos);
  CHECK(failure(h, tag_of(5), header::all_to_all, 16)
            .find("size_mismatch: mpi_communicator rank 0: all_to_all_v of layer 3 call 5 combine "
                  "chunk "
                  "1: rank 1 sends 24 bytes where this rank receives 16") == 0);
  h[0] = 0; // a collective without weave's header
  CHECK(failure(h, tag_of(5), header::all_to_all, 24).find("carries no weave call header") !=
        std::string::npos);
}

TEST_CASE("mpi_call_messages: a block up to the limit travels inside its header, a larger alone") {
  using header = weave::detail::mpi_call_header;
  weave::detail::mpi_call_messages m(27); // rounded down to 3 words
  CHECK(m.inline_bytes() == 24);
  CHECK(m.capacity() == static_cast<int>((header::words + 3) * sizeof(std::int64_t)));
  m.prepare(3);
  std::vector<std::byte> block(40);
  for (std::size_t i = 0; i < block.size(); ++i)
    block[i] = static_cast<std::byte>(i + 1);
  const int head = static_cast<int>(header::words * sizeof(std::int64_t));
  // What the receiver of each message finds: the sender's message copied into its receive slot.
  const auto deliver = [&](std::size_t j, std::size_t bytes) {
    const auto [message, length] = m.write(j, tag_of(4), header::all_to_all,
                                           static_cast<std::int64_t>(bytes), block.data(), bytes);
    std::memcpy(m.receive_buffer(j), message, static_cast<std::size_t>(length));
    return length;
  };
  const auto failure = [&](std::size_t j, int length, std::size_t bytes) -> std::string {
    try {
      m.check(j, length, 0, 1, tag_of(4), header::all_to_all, static_cast<std::int64_t>(bytes),
              bytes, "all_to_all_v");
      return "passed";
    } catch (const weave::error& e) {
      return std::string(weave::to_string(e.code())) + ": " + e.message();
    }
  };
  for (const std::size_t bytes :
       {std::size_t{0}, std::size_t{5}, std::size_t{24}, std::size_t{25}, std::size_t{40}}) {
    CAPTURE(bytes);
    const int length = deliver(1, bytes);
    const bool inside = bytes <= 24;
    CHECK(length == head + static_cast<int>(inside ? bytes : 0));
    CHECK(failure(1, length, bytes) == "passed");
    CHECK(m.inside(1) == inside);
    if (inside && bytes > 0) {
      std::vector<std::byte> out(bytes, std::byte{0});
      m.copy_block(1, out.data(), bytes);
      CHECK(out == std::vector<std::byte>(block.begin(), block.begin() + std::ptrdiff_t(bytes)));
    }
  }
  // A message whose body is neither empty nor the block this rank receives, or too short.
  const int length = deliver(2, 16);
  CHECK(failure(2, length - 8, 16).starts_with("call_mismatch"));
  CHECK(failure(2, length - 8, 16)
            .find("sent 8 bytes inside its call header where this rank "
                  "receives 16") != std::string::npos);
  CHECK(failure(2, head - 1, 16).find("sent a call header of 31 bytes") != std::string::npos);
  // The header is checked first: another size is size_mismatch, whatever came inside.
  CHECK(failure(2, length, 8).starts_with("size_mismatch"));
}
