//! \file
//! `call_tag`: which call of which layer a collective belongs to, so that ranks which issue
//! different calls at the same collective fail with `errc::call_mismatch` naming both, instead of
//! exchanging one call's data for another's (silently wrong when the sizes agree).
//!
//! A tag is one 64-bit word: the layer (its serial on the communicator, agreed by every rank
//! when the layer is built), the call (the layer's dispatch count, from 1), the stage of the
//! call and its chunk. Layers pass it to the communicator's tagged collectives
//! (`has_tagged_collectives`), which check it: `local_world` and `cuda_local_world` compare the
//! ranks' tags where they meet, `mpi_communicator` sends it (with each peer's size) in a small
//! header before the data, so a mismatched call fails before any byte of it is received, and
//! nothing is ever truncated. A tag of 0 is "untagged" (a user's own collective).
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"

#include <cstdint>
#include <exception>
#include <string>

WEAVE_NAMESPACE_BEGIN

//! The stage of a layer call a collective belongs to.
enum class call_stage : std::uint8_t {
  none = 0,
  dispatch = 1,          //!< a forward chunk's dispatch (its count exchange and all-to-alls)
  combine = 2,           //!< a forward chunk's combine
  backward_dispatch = 3, //!< the backward's dispatch of a chunk (the combine's backward)
  backward_combine = 4,  //!< the backward's return of a chunk (the dispatch's backward)
  decode_dispatch = 5,   //!< a decode layer's dispatch
  decode_combine = 6,    //!< a decode layer's combine
};

constexpr const char* to_string(call_stage s) noexcept {
  switch (s) {
  case call_stage::dispatch:
    return "dispatch";
  case call_stage::combine:
    return "combine";
  case call_stage::backward_dispatch:
    return "backward dispatch";
  case call_stage::backward_combine:
    return "backward combine";
  case call_stage::decode_dispatch:
    return "decode dispatch";
  case call_stage::decode_combine:
    return "decode combine";
  case call_stage::none:
    break;
  }
  return "untagged";
}

//! Which call a collective belongs to (see the file comment). Bits: layer 63-48, call 47-24,
//! stage 23-20, chunk 19-0; a field wraps past its width (a mismatch must also differ there).
struct call_tag {
  std::uint64_t bits = 0;

  static constexpr call_tag of(std::uint32_t layer, std::uint64_t call, call_stage stage,
                               int chunk) noexcept {
    return {(std::uint64_t{layer & 0xFFFFu} << 48) | ((call & 0xFFFFFFu) << 24) |
            (std::uint64_t{static_cast<std::uint8_t>(stage) & 0xFu} << 20) |
            (static_cast<std::uint64_t>(chunk) & 0xFFFFFu)};
  }
  constexpr std::uint32_t layer() const noexcept { return static_cast<std::uint32_t>(bits >> 48); }
  constexpr std::uint64_t call() const noexcept { return (bits >> 24) & 0xFFFFFFu; }
  constexpr call_stage stage() const noexcept {
    return static_cast<call_stage>((bits >> 20) & 0xFu);
  }
  constexpr int chunk() const noexcept { return static_cast<int>(bits & 0xFFFFFu); }
  constexpr bool tagged() const noexcept { return bits != 0; }
  friend constexpr bool operator==(call_tag, call_tag) = default;

  //! "layer 3 call 12 combine chunk 1", or "an untagged collective".
  std::string describe() const {
    if (!tagged())
      return "an untagged collective";
    return detail::concat("layer ", layer(), " call ", call(), " ", to_string(stage()), " chunk ",
                          chunk());
  }
};

namespace detail {

//! The error of ranks `rank` (at `mine`) and `peer` (at `theirs`) meeting at one collective.
[[noreturn]] inline void throw_call_mismatch(const char* where, int rank, call_tag mine, int peer,
                                             call_tag theirs) {
  WEAVE_THROW(errc::call_mismatch, where, ": rank ", rank, " is at ", mine.describe(), ", rank ",
              peer, " at ", theirs.describe(),
              " (every rank must issue a layer's calls, chunks and stages in the same order)");
}

//! The error `throw_call_mismatch` throws, as a pointer (for a verdict reported later).
inline std::exception_ptr call_mismatch_error(const char* where, int rank, call_tag mine, int peer,
                                              call_tag theirs) {
  try {
    throw_call_mismatch(where, rank, mine, peer, theirs);
  } catch (...) {
    return std::current_exception();
  }
}

} // namespace detail

WEAVE_NAMESPACE_END
