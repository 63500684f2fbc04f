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
  //! `context` says where this rank noticed (e.g. "moe_exchange count exchange").
  peer_error(failure_record origin, const std::string& context,
             source_location where = source_location::current())
      : error(errc::peer_failure, context + ": " + origin.describe(), where)
      , origin_(std::move(origin)) {}

  //! The failure as it started on its rank.
  const failure_record& origin() const noexcept { return origin_; }

 private:
  failure_record origin_;
};

//! Describes `failure` as rank `rank`'s: a `peer_error` keeps its origin (the failure started
//! elsewhere), a `weave::error` gives its code and message, anything else its `what()`.
inline failure_record record_of(const std::exception_ptr& failure, int rank) {
  try {
    std::rethrow_exception(failure);
  } catch (const peer_error& e) {
    return e.origin();
  } catch (const error& e) {
    return {rank, e.code(), true, e.message()};
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

//! Writes `record` (null: no failure) into `words` (`failure_words` of them). Status word: 0
//! when healthy, else (origin rank + 1) << 32 | not-a-weave-error << 16 | code. The message is
//! cut to the bytes that fit and always ends with a zero byte.
inline void encode_failure(const failure_record* record, std::span<std::int64_t> words) {
  std::fill(words.begin(), words.end(), 0);
  if (record == nullptr)
    return;
  words[0] = (static_cast<std::int64_t>(record->rank) + 1) << 32 |
             static_cast<std::int64_t>(record->weave_error ? 0 : 1) << 16 |
             static_cast<std::int64_t>(record->code);
  const std::size_t room = (words.size() - 1) * sizeof(std::int64_t) - 1;
  std::memcpy(words.data() + 1, record->message.data(), std::min(room, record->message.size()));
}

//! Reads a wire form written by `encode_failure`; nothing when it says healthy.
inline std::optional<failure_record> decode_failure(std::span<const std::int64_t> words) {
  if (words.empty() || words[0] == 0)
    return std::nullopt;
  failure_record r;
  r.rank = static_cast<int>((words[0] >> 32) - 1);
  r.weave_error = ((words[0] >> 16) & 1) == 0;
  r.code = static_cast<errc>(words[0] & 0xFFFF);
  const auto* bytes = reinterpret_cast<const char*>(words.data() + 1);
  const std::size_t room = (words.size() - 1) * sizeof(std::int64_t);
  r.message.assign(bytes, std::find(bytes, bytes + room, '\0'));
  return r;
}

namespace detail {

// The peers' failures in a received block (per rank: k counts, then `failure_words` of status):
// null if every peer is healthy, else a peer_error naming the lowest failing rank (and how
// many others failed). `describe(rank, words)` turns a rank's status into its record;
// `counts(words)` says whether a set status is a failure here (default: always).
template <class Describe, class Counts = bool (*)(std::span<const std::int64_t>)>
std::exception_ptr peer_failure_in(
    std::span<const std::int64_t> received, std::size_t k, int ranks, int self,
    const std::string& context, Describe&& describe,
    Counts counts = [](std::span<const std::int64_t>) { return true; }) {
  const std::size_t stride = k + failure_words;
  const auto status = [&](int r) {
    return received.subspan(static_cast<std::size_t>(r) * stride + k, failure_words);
  };
  int first = -1, others = 0;
  for (int r = 0; r < ranks; ++r)
    if (r != self && status(r)[0] != 0 && counts(status(r))) {
      if (first < 0)
        first = r;
      else
        ++others;
    }
  if (first < 0)
    return nullptr;
  failure_record origin = describe(first, status(first));
  std::string where = context;
  if (others > 0)
    where += detail::concat(" (", others, " other rank", others > 1 ? "s" : "", " failed too)");
  return std::make_exception_ptr(peer_error(std::move(origin), where));
}

// A status block's record: its wire form, naming `rank` if the words do not.
inline failure_record decode_status(int rank, std::span<const std::int64_t> words) {
  failure_record r = decode_failure(words).value_or(failure_record{});
  if (r.rank < 0)
    r.rank = rank;
  return r;
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
