//! \file
//! The header a tagged `mpi_communicator` collective sends each peer beside its data: a marker,
//! the call tag, the kind of collective and the size the sender sends that peer. The receiver
//! checks every header before it takes any peer's data, so ranks at different calls (or
//! disagreeing on a size) fail with a typed error naming the cause. A small block travels inside
//! its header's message (`mpi_call_messages`).
#pragma once

#include "weave/comm/call_tag.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/retain.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <utility>
#include <vector>

WEAVE_NAMESPACE_BEGIN
namespace detail {

//! One peer's header, as 64-bit words on the wire.
struct mpi_call_header {
  static constexpr std::int64_t marker = 0x7765617665544147; // "weaveTAG"
  static constexpr std::int64_t all_to_all = 1, counts = 2;  // kinds of collective
  static constexpr std::size_t words = 4;

  //! The size a header of `kind` states for `count` units of `unit` bytes: bytes for an
  //! all-to-all, the counts per peer for a count exchange.
  static std::int64_t size_of(std::int64_t kind, std::int64_t count, std::size_t unit) {
    return kind == counts ? count : count * static_cast<std::int64_t>(unit);
  }

  static void write(std::int64_t* h, call_tag tag, std::int64_t kind, std::int64_t size) {
    h[0] = marker;
    h[1] = static_cast<std::int64_t>(tag.bits);
    h[2] = kind;
    h[3] = size;
  }

  //! Throws `errc::call_mismatch` unless `h` (from rank `peer`) is a header of this rank's
  //! `tag` and `kind`, and `errc::size_mismatch` unless it states `expected` (what rank `rank`
  //! receives from `peer`).
  static void check(std::span<const std::int64_t, words> h, int rank, int peer, call_tag tag,
                    std::int64_t kind, std::int64_t expected, const char* what) {
    WEAVE_EXPECT(h[0] == marker, errc::call_mismatch, "mpi_communicator rank ", rank, ": ", what,
                 ": rank ", peer, " is at a collective that carries no weave call header");
    const call_tag theirs{static_cast<std::uint64_t>(h[1])};
    if (theirs != tag)
      throw_call_mismatch("mpi_communicator", rank, tag, peer, theirs);
    WEAVE_EXPECT(h[2] == kind, errc::call_mismatch, "mpi_communicator rank ", rank, ": ", what,
                 " of ", tag.describe(), ": rank ", peer, " is at ", name(h[2]),
                 " of that call, this rank at ", name(kind));
    WEAVE_EXPECT(h[3] == expected, errc::size_mismatch, "mpi_communicator rank ", rank, ": ", what,
                 " of ", tag.describe(), ": rank ", peer, " sends ", h[3],
                 kind == counts ? " counts per peer" : " bytes", " where this rank receives ",
                 expected);
  }

 private:
  static const char* name(std::int64_t kind) {
    return kind == counts       ? "a count exchange"
           : kind == all_to_all ? "an all-to-all"
                                : "another collective";
  }
};

//! A tagged call's message to and from each peer: a header, then the peer's block when it has at
//! most `inline_bytes()` (the receiver tells the two apart by the message's length).
class mpi_call_messages {
 public:
  using header = mpi_call_header;

  //! Blocks of at most `bytes` (rounded down to whole words) travel inside their header.
  explicit mpi_call_messages(std::size_t bytes = 0)
      : inline_words_(bytes / sizeof(std::int64_t)) {}

  std::size_t inline_bytes() const noexcept { return inline_words_ * sizeof(std::int64_t); }
  //! Whether a block of `bytes` travels inside its header's message (else alone, after it).
  bool travels_inside(std::size_t bytes) const noexcept { return bytes <= inline_bytes(); }
  //! The bytes a receive must take: the longest message a peer may send.
  int capacity() const noexcept { return static_cast<int>(slot() * sizeof(std::int64_t)); }

  //! Sizes the buffers for `peers` peers (grow-only).
  void prepare(std::size_t peers) {
    send_.resize(peers * slot());
    recv_.resize(peers * slot());
    inside_.assign(peers, 0);
  }

  //! Where peer j's message lands.
  std::int64_t* receive_buffer(std::size_t j) { return recv_.data() + j * slot(); }

  //! Writes the message to peer j: its header and, when it fits, its `bytes` at `block`.
  //! Returns the message and its length in bytes.
  std::pair<const std::int64_t*, int> write(std::size_t j, call_tag tag, std::int64_t kind,
                                            std::int64_t size, const std::byte* block,
                                            std::size_t bytes) {
    std::int64_t* h = send_.data() + j * slot();
    header::write(h, tag, kind, size);
    std::size_t length = header::words * sizeof(std::int64_t);
    if (travels_inside(bytes)) {
      if (bytes > 0)
        std::memcpy(h + header::words, block, bytes);
      length += bytes;
    }
    return {h, static_cast<int>(length)};
  }

  //! Checks peer j's message of `length` bytes (from rank `peer`, which sends this rank `bytes`
  //! bytes, a header stating `expected`) and records whether the block came inside. Throws as
  //! `mpi_call_header::check`, and `errc::call_mismatch` for a message of another length.
  void check(std::size_t j, int length, int rank, int peer, call_tag tag, std::int64_t kind,
             std::int64_t expected, std::size_t bytes, const char* what) {
    const std::size_t head = header::words * sizeof(std::int64_t);
    WEAVE_EXPECT(length >= static_cast<int>(head), errc::call_mismatch, "mpi_communicator rank ",
                 rank, ": ", what, ": rank ", peer, " sent a call header of ", length, " bytes");
    header::check(std::span<const std::int64_t, header::words>(receive_buffer(j), header::words),
                  rank, peer, tag, kind, expected, what);
    const std::size_t body = static_cast<std::size_t>(length) - head;
    WEAVE_EXPECT(body == 0 || body == bytes, errc::call_mismatch, "mpi_communicator rank ", rank,
                 ": ", what, ": rank ", peer, " sent ", body,
                 " bytes inside its call header where this rank receives ", bytes);
    inside_[j] = body > 0 || bytes == 0;
  }

  //! Whether peer j's checked block came inside its header (an empty one always does).
  bool inside(std::size_t j) const { return inside_[j] != 0; }
  //! Copies peer j's checked block out of its message.
  void copy_block(std::size_t j, std::byte* to, std::size_t bytes) {
    if (bytes > 0)
      std::memcpy(to, receive_buffer(j) + header::words, bytes);
  }

  //! Keeps the buffers until the process exits: MPI may still use them after an abandoned call.
  void retain_until_exit() {
    retain_value_until_exit(std::move(send_));
    retain_value_until_exit(std::move(recv_));
  }

 private:
  std::size_t slot() const noexcept { return header::words + inline_words_; }

  std::size_t inline_words_ = 0;
  std::vector<std::int64_t> send_, recv_;
  std::vector<char> inside_; // which peers' blocks came inside their header message
};

} // namespace detail
WEAVE_NAMESPACE_END
