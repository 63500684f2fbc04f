//! \file
//! Shrinking a communicator after a failure: the survivors agree on who is left and continue on
//! a smaller communicator of their own (elastic expert parallelism, docs/faults.md).
//!
//! `c.shrink(excluded)` is collective over the ranks that are still alive. It first revokes `c`
//! (every rank still inside one of its operations fails out of it, as after an abort), then the
//! survivors agree on the new group: the ranks that reached the shrink and that no rank names in
//! `excluded`. Every survivor must name the same `excluded` ranks (the failed ranks a
//! `peer_error` names, say); ranks that disagree fail with `errc::config_mismatch` naming both
//! views, and a rank that arrives after the group closed without it fails with
//! `errc::invalid_state`: there is never a second group. Ranks keep their order: new rank i is the
//! i-th survivor in old-rank order.
//!
//! Backends: `local_communicator` (a rank that threw, stopped or was dropped is left out; one that
//! never arrives is left out after the world's timeout), `nccl_communicator` (`ncclCommRevoke` +
//! `ncclCommShrink`, with the agreement checked on the new communicator), and
//! `mpi_communicator`, which refuses with `errc::not_supported` (Open MPI without the ULFM
//! extension ends the whole job when a process dies; see docs/faults.md).
#pragma once

#include "weave/comm/communicator.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <vector>

WEAVE_NAMESPACE_BEGIN

//! The survivors' communicator after a shrink.
template <class C>
struct shrunk_communicator {
  std::unique_ptr<C> comm;    //!< this rank's handle to the new group
  std::vector<int> survivors; //!< old rank of each new rank (ascending)
  std::vector<int> lost;      //!< old ranks left out (ascending)

  //! This rank's old rank.
  int old_rank() const { return survivors[static_cast<std::size_t>(comm->rank())]; }
};

//! A communicator whose survivors can continue without some ranks (see the file comment).
template <class C>
concept has_shrink = communicator<C> && requires(C& c, std::span<const int> excluded) {
  { c.shrink(excluded) } -> std::same_as<shrunk_communicator<C>>;
};

namespace detail {

//! `excluded` sorted without repeats; throws `errc::out_of_range` for a rank outside [0, size).
inline std::vector<int> excluded_ranks(std::span<const int> excluded, int size, const char* who) {
  std::vector<int> out(excluded.begin(), excluded.end());
  for (const int r : out)
    WEAVE_EXPECT(r >= 0 && r < size, errc::out_of_range, who, ": excluded rank ", r,
                 " outside a group of ", size);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

//! "{1, 3}".
inline std::string rank_list(std::span<const int> ranks) {
  std::string s = "{";
  for (std::size_t i = 0; i < ranks.size(); ++i)
    s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s + "}";
}

//! The ranks of [0, size) not in `survivors` (both ascending).
inline std::vector<int> lost_ranks(std::span<const int> survivors, int size) {
  std::vector<int> lost;
  for (int r = 0, i = 0; r < size; ++r)
    if (static_cast<std::size_t>(i) < survivors.size() &&
        survivors[static_cast<std::size_t>(i)] == r)
      ++i;
    else
      lost.push_back(r);
  return lost;
}

} // namespace detail

//! `c.shrink(excluded)`: the survivors' communicator (see the file comment).
template <has_shrink C>
shrunk_communicator<C> shrink(C& c, std::span<const int> excluded = {}) {
  return c.shrink(excluded);
}

WEAVE_NAMESPACE_END
