//! \file
//! How one rank's failure is described to its peers: `failure_record` (which rank, its error
//! code, its message), the `peer_error` a peer raises from it, its fixed-size wire form (a
//! status word and a short message travelling in 64-bit words beside a count exchange), and
//! the choice of the root cause among the failures one rank observed.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>

WEAVE_NAMESPACE_BEGIN

//! One rank's failure, as its peers learn it.
struct failure_record {
  int rank = -1;              //!< the rank where the failure started
  errc code = errc::internal; //!< its error code (meaningful when `weave_error`)
  bool weave_error = true;    //!< false: an exception that is not a `weave::error`
  std::string message;        //!< its message (without code and source location)

  //! "rank 1 failed with out_of_range: <message>", or "rank 1 failed: <message>".
  std::string describe() const {
    return weave_error
               ? detail::concat("rank ", rank, " failed with ", to_string(code), ": ", message)
               : detail::concat("rank ", rank, " failed: ", message);
  }
};

//! What a rank raises when a peer failed: `code()` is `errc::peer_failure` and `origin()` names
//! the rank where the failure started, its code and its message.
class peer_error : public error {
 public:
  //! `context` says where this rank noticed (e.g. "moe exchange count exchange").
  peer_error(failure_record origin, const std::string& context,
             source_location where = source_location::current())
      : error(errc::peer_failure, context + ": " + origin.describe(), where)
      , origin_(std::move(origin)) {}

  //! The failure as it started on its rank.
  const failure_record& origin() const noexcept { return origin_; }

 private:
  failure_record origin_;
};

namespace detail {

// "0x1f": a word as its wire bits, in messages about bytes that came from a peer.
inline std::string hex(std::uint64_t v) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string out;
  do {
    out.insert(out.begin(), digits[v & 0xF]);
    v >>= 4;
  } while (v != 0);
  return "0x" + out;
}

// A record as the wire form can carry it, as rank `rank`'s: a negative (unknown) origin rank
// (or one past what a status word holds) becomes `rank`, and a code that is no `errc` (a
// `weave::error` built from a cast integer) becomes `errc::internal`, its number kept in the
// message.
inline failure_record sendable(failure_record r, int rank) {
  if (r.rank < 0 || r.rank == std::numeric_limits<int>::max()) // see status_max_rank
    r.rank = rank;
  if (!is_errc(static_cast<std::int64_t>(r.code))) {
    r.message = concat("error code ", static_cast<int>(r.code), ": ", r.message);
    r.code = errc::internal;
  }
  return r;
}

} // namespace detail

//! Describes `failure` as rank `rank`'s: a `peer_error` keeps its origin (the failure started
//! elsewhere), a `weave::error` gives its code and message, anything else its `what()`. The
//! record can always travel (`encode_failure`): an origin without a rank is given `rank`, a
//! code that is no `errc` becomes `errc::internal` (its number in the message).
inline failure_record record_of(const std::exception_ptr& failure, int rank) {
  try {
    std::rethrow_exception(failure);
  } catch (const peer_error& e) {
    return detail::sendable(e.origin(), rank);
  } catch (const error& e) {
    return detail::sendable({rank, e.code(), true, e.message()}, rank);
  } catch (const std::exception& e) {
    return {rank, errc::internal, false, e.what()};
  } catch (...) {
    return {rank, errc::internal, false, "an exception of unknown type"};
  }
}

//! The record of what `f` throws, as rank `rank`'s (`f` names an error by throwing it, as the
//! error-flag throwers of the device plans do); an `errc::internal` record if it returns.
template <class F>
failure_record record_of_call(int rank, F&& f) {
  try {
    std::forward<F>(f)();
  } catch (...) {
    return record_of(std::current_exception(), rank);
  }
  return {rank, errc::internal, true, "error flags that name no error"};
}

//! `what()` of a failure (or a placeholder for exceptions of unknown type).
inline std::string what_of(const std::exception_ptr& failure) {
  try {
    std::rethrow_exception(failure);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception of unknown type";
  }
}

//! Words of a failure's wire form: a status word, then the message's first bytes.
inline constexpr std::size_t failure_words = 16;

namespace detail {

// The status word of a failure's wire form: bits 0-15 the code, bit 16 set for an exception that
// is not a `weave::error`, bits 32-62 the origin rank + 1 (never 0). Bit 17 marks the status of
// an exchange's device error flags (`device_counts_with_status`), which is not a failure record;
// no encoder sets bits 18-31 or 63.
inline constexpr std::uint64_t status_code_mask = 0xFFFF;
inline constexpr std::uint64_t status_foreign_bit = std::uint64_t{1} << 16;
inline constexpr std::int64_t device_flags_status = std::int64_t{1} << 17;
inline constexpr std::uint64_t status_unused_bits = 0xFFFC0000ull;
// The highest origin rank a status word holds (rank + 1 stays below bit 63).
inline constexpr int status_max_rank = std::numeric_limits<int>::max() - 1;
// Bytes of the message: every word after the status word, its last one a zero byte at least.
inline constexpr std::size_t failure_message_bytes = (failure_words - 1) * sizeof(std::int64_t);

} // namespace detail

//! Writes `record` (null: no failure) into `words` (`failure_words` of them). Status word: 0
//! when healthy, else (origin rank + 1) << 32 | not-a-weave-error << 16 | code. The message is
//! cut at its first zero byte and to the bytes that fit (119), and always ends with zero bytes.
//! Throws `errc::invalid_argument` for a record no peer could read back (a rank outside
//! [0, 2^31 - 1), a code that is no `errc`): `record_of` never makes one.
inline void encode_failure(const failure_record* record, std::span<std::int64_t> words) {
  WEAVE_EXPECT(words.size() == failure_words, errc::internal, "a failure wire form of ",
               words.size(), " words, not ", failure_words);
  std::fill(words.begin(), words.end(), 0);
  if (record == nullptr)
    return;
  WEAVE_EXPECT(record->rank >= 0 && record->rank <= detail::status_max_rank &&
                   detail::is_errc(static_cast<std::int64_t>(record->code)),
               errc::invalid_argument, "a failure record of rank ", record->rank, " and code ",
               static_cast<int>(record->code), " cannot travel (see record_of)");
  const std::uint64_t status = (static_cast<std::uint64_t>(record->rank) + 1) << 32 |
                               (record->weave_error ? 0 : detail::status_foreign_bit) |
                               static_cast<std::uint64_t>(record->code);
  words[0] = static_cast<std::int64_t>(status);
  const std::size_t room = detail::failure_message_bytes - 1;
  const std::size_t n = std::min(room, record->message.find('\0')); // npos: the whole message
  std::memcpy(words.data() + 1, record->message.data(), std::min(n, record->message.size()));
}

//! Reads the wire form (`failure_words` words) that rank `sender` of a world of `ranks` sent:
//! nothing when it says healthy, else the record `encode_failure` wrote. Throws
//! `errc::protocol` naming `sender` for words no encoder writes: a status word with unknown
//! bits (or the device-flags bit, which is not a failure record), an origin rank outside
//! [0, ranks), a code that is no `errc`, a message without its zero byte or with bytes after it,
//! or anything beside a healthy status word. A record read back re-encodes to the same words.
inline std::optional<failure_record> decode_failure(std::span<const std::int64_t> words, int sender,
                                                    int ranks) {
  WEAVE_EXPECT(words.size() == failure_words, errc::internal, "a failure wire form of ",
               words.size(), " words, not ", failure_words);
  const auto status = static_cast<std::uint64_t>(words[0]);
  const auto refuse = [&](const auto&... why) {
    WEAVE_THROW(errc::protocol, "rank ", sender,
                " sent a status no weave rank writes (status word ", detail::hex(status), ": ",
                why..., ")");
  };
  const auto* bytes = reinterpret_cast<const char*>(words.data() + 1);
  const char* const end = bytes + detail::failure_message_bytes;
  const char* const zero = std::find(bytes, end, '\0');
  const bool tail_clear = zero != end && std::all_of(zero, end, [](char c) { return c == 0; });
  if (status == 0) {
    if (zero != bytes || !tail_clear)
      refuse("healthy, yet followed by non-zero words");
    return std::nullopt;
  }
  if ((status & static_cast<std::uint64_t>(detail::device_flags_status)) != 0)
    refuse("a device's error flags where a failure record belongs");
  if ((status & detail::status_unused_bits) != 0)
    refuse("unknown bits ", detail::hex(status & detail::status_unused_bits));
  const std::uint64_t rank_field = status >> 32;
  if (rank_field < 1 || rank_field > static_cast<std::uint64_t>(std::max(ranks, 0)))
    refuse("origin rank field ", rank_field, " outside [1, ", ranks, "]");
  const auto code = static_cast<std::int64_t>(status & detail::status_code_mask);
  if (!detail::is_errc(code))
    refuse("code ", code, ", which is no errc");
  if (zero == end)
    refuse("a message without its terminating zero byte");
  if (!tail_clear)
    refuse("bytes after the message's terminating zero");
  failure_record r;
  r.rank = static_cast<int>(rank_field - 1);
  r.code = static_cast<errc>(code);
  r.weave_error = (status & detail::status_foreign_bit) == 0;
  r.message.assign(bytes, zero);
  return r;
}

namespace detail {

// The peers' failures in a received block (per rank: k counts, then `failure_words` of status):
// null if every peer is healthy, else a peer_error naming the lowest failing rank (and how
// many others failed), or the `errc::protocol` error of the lowest rank whose status no encoder
// writes. `describe(rank, words)` reads a rank's status: its record when it is a failure that
// counts here, nothing when healthy (or a failure that does not count here); it throws an
// `errc::protocol` error for words no encoder writes (`decode_failure`).
template <class Describe>
std::exception_ptr peer_failure_in(std::span<const std::int64_t> received, std::size_t k, int ranks,
                                   int self, const std::string& context, Describe&& describe) {
  const std::size_t stride = k + failure_words;
  WEAVE_EXPECT(received.size() == stride * static_cast<std::size_t>(std::max(ranks, 0)),
               errc::internal, context, ": a status block of ", received.size(), " words for ",
               ranks, " ranks of ", stride);
  int others = 0;
  std::optional<failure_record> origin;
  for (int r = 0; r < ranks; ++r) {
    if (r == self)
      continue;
    std::optional<failure_record> record;
    try {
      record =
          describe(r, received.subspan(static_cast<std::size_t>(r) * stride + k, failure_words));
    } catch (const error& e) {
      if (e.code() != errc::protocol)
        throw;
      if (!origin) // the lowest rank that did not send a healthy status is the cause
        return std::make_exception_ptr(error(errc::protocol, context + ": " + e.message()));
      ++others;
      continue;
    }
    if (!record)
      continue;
    if (origin)
      ++others;
    else
      origin = std::move(record);
  }
  if (!origin)
    return nullptr;
  std::string where = context;
  if (others > 0)
    where += detail::concat(" (", others, " other rank", others > 1 ? "s" : "", " failed too)");
  return std::make_exception_ptr(peer_error(std::move(*origin), where));
}

// `describe` for `peer_failure_in` in a world of `ranks`: a rank's status as `decode_failure`
// reads it.
inline auto status_decoder(int ranks) {
  return [ranks](int rank, std::span<const std::int64_t> words) {
    return decode_failure(words, rank, ranks);
  };
}

// How much a failure says about its root cause: a rank's own error names it; a peer's failure
// points to it; a timeout or an abort only says that something went wrong somewhere.
inline int cause_rank(const std::exception_ptr& failure) {
  try {
    std::rethrow_exception(failure);
  } catch (const peer_error&) {
    return 1;
  } catch (const error& e) {
    return e.code() == errc::timeout || e.code() == errc::peer_failure ? 2 : 0;
  } catch (...) {
    return 0;
  }
}

} // namespace detail

//! The root cause among failures one rank observed (earlier arguments win ties): its own error
//! first, else a peer's failure naming its origin, else a timeout. Null if all are null.
inline std::exception_ptr root_cause(std::initializer_list<std::exception_ptr> failures) {
  std::exception_ptr best;
  int best_rank = 3;
  for (const std::exception_ptr& f : failures)
    if (f && detail::cause_rank(f) < best_rank) {
      best = f;
      best_rank = detail::cause_rank(f);
    }
  return best;
}

WEAVE_NAMESPACE_END
