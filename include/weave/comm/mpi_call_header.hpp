//! \file
//! The header a tagged `mpi_communicator` collective sends each peer beside its data: a marker,
//! the call tag, the kind of collective and the size the sender sends that peer. The receiver
//! checks it before it posts the receive of that peer's data, so ranks at different calls (or
//! disagreeing on a size) fail with a typed error and MPI never truncates.
#pragma once

#include "weave/comm/call_tag.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"

#include <cstddef>
#include <cstdint>
#include <span>

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

} // namespace detail
WEAVE_NAMESPACE_END
