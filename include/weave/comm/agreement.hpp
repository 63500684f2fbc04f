//! \file
//! Configuration agreement: the ranks that build one collective object (an MoE layer, a 2DH
//! all-to-all) check once, with one small all-gather, that they built it alike.
//!
//! Each rank describes what must agree as named 64-bit fields (`config_fingerprint`); every
//! rank gathers every rank's fields and compares them, so all ranks reach the same verdict and,
//! on a disagreement, throw the same `errc::config_mismatch` naming the first field that
//! differs and the value each rank holds. A rank whose own configuration is invalid still takes
//! part, carrying its error: it throws that error and its peers a `peer_error` naming it. The
//! cost is one collective of `agreement_words` 64-bit words per rank, once per object.
#pragma once

#include "weave/comm/communicator.hpp"
#include "weave/comm/fail_stop.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/failure.hpp"

#include <algorithm>
#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

WEAVE_NAMESPACE_BEGIN

//! 64-bit FNV-1a of `bytes` (for fingerprints of tables such as a placement; not cryptographic).
inline std::uint64_t fnv1a(std::span<const std::byte> bytes,
                           std::uint64_t hash = 0xcbf29ce484222325ull) noexcept {
  for (const std::byte b : bytes)
    hash = (hash ^ static_cast<std::uint64_t>(b)) * 0x100000001b3ull;
  return hash;
}

//! How a fingerprint field's value reads in a disagreement message.
enum class field_format : std::uint8_t {
  integer, //!< a count or size
  boolean, //!< false / true
  hash,    //!< a digest, in hex
  real,    //!< a double stored by its bits
  label,   //!< an enumerator, named by the field's naming function (dtype, drop order, ...)
};

//! The first field on which ranks disagree (`field`: its index, or `config_fingerprint::max_fields`
//! when the ranks' fingerprints differ in kind), and the message naming each rank's value.
struct config_disagreement {
  std::size_t field = 0;
  std::string message;
};

//! What one rank says about an object that must be built alike on every rank: up to
//! `max_fields` named 64-bit values, compared in the order they were added.
class config_fingerprint {
 public:
  static constexpr std::size_t max_fields = 24;

  //! `what` names the object in messages ("moe_exchange").
  explicit config_fingerprint(std::string what)
      : what_(std::move(what)) {}

  //! Adds an integer field.
  config_fingerprint& add(std::string_view name, std::int64_t value) {
    return push(name, value, field_format::integer);
  }
  //! Adds a boolean field.
  config_fingerprint& add_flag(std::string_view name, bool value) {
    return push(name, value ? 1 : 0, field_format::boolean);
  }
  //! Adds a double field (compared bit for bit).
  config_fingerprint& add_real(std::string_view name, double value) {
    return push(name, std::bit_cast<std::int64_t>(value), field_format::real);
  }
  //! Adds a field whose value `v` reads as `label(v)` (the number itself where that is null).
  config_fingerprint& add_label(std::string_view name, std::int64_t value,
                                const char* (*label)(std::int64_t)) {
    push(name, value, field_format::label);
    fields_.back().label = label;
    return *this;
  }
  //! Adds the FNV-1a digest of `table`'s bytes.
  template <class T>
  config_fingerprint& add_hash(std::string_view name, std::span<const T> table) {
    return push(name, static_cast<std::int64_t>(fnv1a(std::as_bytes(table))), field_format::hash);
  }

  //! The object's name in messages.
  const std::string& what() const noexcept { return what_; }
  //! Number of fields.
  std::size_t size() const noexcept { return fields_.size(); }
  //! Name of field `i`.
  const std::string& name(std::size_t i) const { return fields_.at(i).name; }

  //! The wire form: a tag, the field count, the values, zeros up to `fingerprint_words`.
  std::vector<std::int64_t> words() const;

  //! The first disagreement among `all` (every rank's wire form, rank-major), or nothing:
  //! "moe_exchange: ranks disagree on hidden: 64 on ranks 0, 2-3; 32 on rank 1 (...)". A
  //! fingerprint of this version that no rank writes (more than `max_fields` fields, words set
  //! past its fields) throws `errc::protocol` naming its rank.
  std::optional<config_disagreement> find_disagreement(std::span<const std::int64_t> all) const;

 private:
  struct field {
    std::string name;
    std::int64_t value = 0;
    field_format format = field_format::integer;
    const char* (*label)(std::int64_t) = nullptr;
  };

  config_fingerprint& push(std::string_view name, std::int64_t value, field_format format) {
    WEAVE_EXPECT(fields_.size() < max_fields, errc::internal, "config_fingerprint of ", what_,
                 ": more than ", max_fields, " fields");
    fields_.push_back({std::string(name), value, format, {}});
    return *this;
  }

  std::string format(const field& f, std::int64_t value) const;

  std::string what_;
  std::vector<field> fields_;
};

//! 64-bit words of a fingerprint's wire form.
inline constexpr std::size_t fingerprint_words = 2 + config_fingerprint::max_fields;
//! 64-bit words per rank in an agreement: the fingerprint, the object's serial this rank
//! proposes, then the rank's status.
inline constexpr std::size_t agreement_words = fingerprint_words + 1 + failure_words;

namespace detail {

inline constexpr std::int64_t fingerprint_tag = 0x77656176650001; // "weave", version 1

// The serials of the collective objects built on each communicator object, so that the ranks of
// one object name it alike in their call tags: each rank proposes one more than the last it
// agreed on for its communicator, and the agreement takes the largest proposal (ranks whose
// histories differ, e.g. a communicator at an address an earlier one had, still agree).
class object_serials {
 public:
  static std::uint32_t propose(const void* comm) {
    std::lock_guard lock(mutex());
    return last()[comm] + 1;
  }
  static void settle(const void* comm, std::uint32_t serial) {
    std::lock_guard lock(mutex());
    std::uint32_t& last_serial = last()[comm];
    last_serial = std::max(last_serial, serial);
  }

 private:
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static std::map<const void*, std::uint32_t>& last() {
    static std::map<const void*, std::uint32_t> serials;
    return serials;
  }
};

// "0, 2-3": ascending ranks as ranges.
inline std::string rank_ranges(const std::vector<int>& ranks) {
  std::string out;
  for (std::size_t i = 0; i < ranks.size();) {
    std::size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1)
      ++j;
    out += (out.empty() ? "" : ", ") + std::to_string(ranks[i]);
    if (j > i)
      out += "-" + std::to_string(ranks[j]);
    i = j + 1;
  }
  return out;
}

} // namespace detail

inline std::vector<std::int64_t> config_fingerprint::words() const {
  std::vector<std::int64_t> w(fingerprint_words, 0);
  w[0] = detail::fingerprint_tag;
  w[1] = static_cast<std::int64_t>(fields_.size());
  for (std::size_t i = 0; i < fields_.size(); ++i)
    w[2 + i] = fields_[i].value;
  return w;
}

inline std::string config_fingerprint::format(const field& f, std::int64_t value) const {
  switch (f.format) {
  case field_format::boolean:
    return value == 0 ? "false" : value == 1 ? "true" : std::to_string(value);
  case field_format::hash: {
    static constexpr char hex[] = "0123456789abcdef";
    std::string out = "0x";
    for (int shift = 60; shift >= 0; shift -= 4)
      out += hex[(static_cast<std::uint64_t>(value) >> shift) & 0xF];
    return out;
  }
  case field_format::real:
    return detail::concat(std::bit_cast<double>(value));
  case field_format::label:
    if (const char* name = f.label(value))
      return name;
    break;
  case field_format::integer:
    break;
  }
  return std::to_string(value);
}

inline std::optional<config_disagreement>
config_fingerprint::find_disagreement(std::span<const std::int64_t> all) const {
  WEAVE_EXPECT(all.size() % agreement_words == 0, errc::internal, what_, ": ", all.size(),
               " agreement words are not whole ranks of ", agreement_words);
  const std::size_t ranks = all.size() / agreement_words;
  auto rank_words = [&](std::size_t r) { return all.subspan(r * agreement_words); };
  // One line per distinct value, in order of first appearance: "64 on ranks 0, 2-3".
  auto describe = [&](auto value_of, auto format_value) {
    std::vector<std::int64_t> values;
    std::vector<std::vector<int>> holders;
    for (std::size_t r = 0; r < ranks; ++r) {
      const std::int64_t v = value_of(r);
      std::size_t i = 0;
      while (i < values.size() && values[i] != v)
        ++i;
      if (i == values.size()) {
        values.push_back(v);
        holders.emplace_back();
      }
      holders[i].push_back(static_cast<int>(r));
    }
    if (values.size() < 2)
      return std::string();
    std::string out;
    for (std::size_t i = 0; i < values.size(); ++i)
      out += detail::concat(i == 0 ? "" : "; ", format_value(values[i]), " on rank",
                            holders[i].size() > 1 ? "s " : " ", detail::rank_ranges(holders[i]));
    return out;
  };
  const auto plain = [](std::int64_t v) { return std::to_string(v); };
  std::string differs = describe([&](std::size_t r) { return rank_words(r)[0]; }, plain);
  if (!differs.empty())
    return config_disagreement{max_fields, detail::concat(what_,
                                                          ": ranks run different weave versions "
                                                          "(fingerprint tags ",
                                                          differs, ")")};
  // One version: every fingerprint must read as this one writes them, at most `max_fields`
  // fields and zeros after them.
  for (std::size_t r = 0; r < ranks; ++r) {
    const auto w = rank_words(r);
    const auto fields = static_cast<std::uint64_t>(w[1]);
    const bool fits = fields <= max_fields;
    WEAVE_EXPECT(fits && std::all_of(w.begin() + 2 + static_cast<std::ptrdiff_t>(fields),
                                     w.begin() + static_cast<std::ptrdiff_t>(fingerprint_words),
                                     [](std::int64_t v) { return v == 0; }),
                 errc::protocol, what_, ": rank ", r,
                 " sent a configuration fingerprint no weave rank writes (", w[1],
                 " fields, of at most ", max_fields, ", and words set past them)");
  }
  differs = describe([&](std::size_t r) { return rank_words(r)[1]; }, plain);
  if (!differs.empty())
    return config_disagreement{max_fields, detail::concat(what_,
                                                          ": ranks built different kinds of object "
                                                          "(field counts ",
                                                          differs, ")")};
  for (std::size_t i = 0; i < fields_.size(); ++i) {
    differs = describe([&](std::size_t r) { return rank_words(r)[2 + i]; },
                       [&](std::int64_t v) { return format(fields_[i], v); });
    if (!differs.empty())
      return config_disagreement{
          i, detail::concat(what_, ": ranks disagree on ", fields_[i].name, ": ", differs,
                            " (every rank must build it with the same configuration)")};
  }
  return std::nullopt;
}

//! A blocking all-gather of a few 64-bit words per rank, for setup-time agreement (not for the
//! hot path): `mine` from every rank, rank-major. Uses the communicator's own `all_gather_now`
//! if it has one (device communicators), else a count exchange on a temporary stream (host
//! streams). All ranks must call it at the same point with the same `mine.size()`.
template <communicator C>
std::vector<std::int64_t> all_gather_now(C& comm, std::span<const std::int64_t> mine) {
  if constexpr (requires { comm.all_gather_now(mine); }) {
    return comm.all_gather_now(mine);
  } else {
    using stream_type = typename C::stream_type;
    static_assert(has_exchange_counts<C> && host_executor<stream_type> &&
                      std::default_initializable<stream_type>,
                  "all_gather_now needs a communicator with all_gather_now, or a count exchange "
                  "on a default-constructible host stream");
    const auto n = static_cast<std::size_t>(comm.size());
    std::vector<std::int64_t> send(n * mine.size()), recv(send.size());
    for (std::size_t j = 0; j < n; ++j)
      std::copy(mine.begin(), mine.end(),
                send.begin() + static_cast<std::ptrdiff_t>(j * mine.size()));
    stream_type s;
    comm.exchange_counts(s, std::span<const std::int64_t>(send), std::span<std::int64_t>(recv));
    try { // a peer that never arrives ends in the communicator's watchdog
      wait_watched(comm, s);
    } catch (...) {
      try { // observe the stream's failure too (the watchdog aborted the communicator)
        s.synchronize();
      } catch (...) {
      }
      throw;
    }
    return recv;
  }
}

//! The first field on which the ranks of `comm` disagree, or nothing: every rank gathers every
//! rank's fingerprint (one collective) and reaches the same answer. For objects that combine
//! the verdicts of several communicators before failing (see `hierarchical_all_to_all`).
template <communicator C>
std::optional<config_disagreement> find_config_disagreement(C& comm,
                                                            const config_fingerprint& mine) {
  std::vector<std::int64_t> words = mine.words();
  words.resize(agreement_words, 0);
  return mine.find_disagreement(all_gather_now(comm, std::span<const std::int64_t>(words)));
}

//! Checks that every rank of `comm` built the object alike. Runs `validate()` (this rank's own
//! checks of its configuration) first; then, with one all-gather: a rank whose `validate` threw
//! rethrows its error and every other rank throws a `peer_error` naming it; else, if the
//! fingerprints differ, every rank throws `errc::config_mismatch` naming the first field that
//! differs and each rank's value. Collective: every rank calls it once, at the same point.
//! Returns the object's serial on `comm`, the same on every rank (`call_tag`'s layer).
template <communicator C, class Validate>
std::uint32_t agree_on_config(C& comm, const config_fingerprint& mine, Validate&& validate) {
  std::exception_ptr invalid;
  try {
    std::forward<Validate>(validate)();
  } catch (...) {
    invalid = std::current_exception();
  }
  std::vector<std::int64_t> words = mine.words();
  words.resize(agreement_words, 0);
  words[fingerprint_words] = detail::object_serials::propose(&comm);
  const failure_record record = invalid ? record_of(invalid, comm.rank()) : failure_record{};
  encode_failure(invalid ? &record : nullptr,
                 std::span<std::int64_t>(words).subspan(fingerprint_words + 1));
  const std::vector<std::int64_t> all = all_gather_now(comm, std::span<const std::int64_t>(words));
  if (invalid)
    std::rethrow_exception(invalid);
  if (std::exception_ptr peer = detail::peer_failure_in(all, fingerprint_words + 1, comm.size(),
                                                        comm.rank(), mine.what() + " construction",
                                                        detail::status_decoder(comm.size())))
    std::rethrow_exception(peer);
  if (auto disagreement = mine.find_disagreement(all))
    WEAVE_THROW(errc::config_mismatch, disagreement->message);
  std::int64_t serial = 0;
  for (std::size_t r = 0; r < static_cast<std::size_t>(comm.size()); ++r)
    serial = std::max(serial, all[r * agreement_words + fingerprint_words]);
  const auto agreed = static_cast<std::uint32_t>(serial);
  detail::object_serials::settle(&comm, agreed);
  return agreed;
}

//! As above, with nothing to validate.
template <communicator C>
std::uint32_t agree_on_config(C& comm, const config_fingerprint& mine) {
  return agree_on_config(comm, mine, [] {});
}

WEAVE_NAMESPACE_END
