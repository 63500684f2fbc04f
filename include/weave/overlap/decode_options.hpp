//! \file
//! Options and message headers of `decode_exchange`, the low-latency exchange for decoding (its
//! messages: `detail/decode_wire.hpp`).
#pragma once

#include "weave/comm/agreement.hpp"
#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/core/dtype.hpp"
#include "weave/core/error.hpp"
#include "weave/core/failure.hpp"
#include "weave/overlap/detail/layer_agreement.hpp"
#include "weave/overlap/moe_options.hpp"
#include "weave/placement/placement.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <string_view>

WEAVE_NAMESPACE_BEGIN

//! How a `decode_exchange` is shaped. Every buffer is sized from these once, at construction.
struct decode_options {
  int k = 1;                           //!< experts chosen per token
  std::size_t hidden = 0;              //!< elements per token row
  std::size_t max_tokens_per_rank = 0; //!< the most tokens any rank passes to one call
  //! Send the dispatch quantised to FP8 with block scales (DeepEP's low-latency FP8 dispatch;
  //! see `fp8_dispatch_options`): the experts get the codes and scales, and the rows
  //! dequantised when `dequantized_inputs` is set. The combine keeps the row type.
  std::optional<fp8_dispatch_options> fp8_dispatch{};
  //! The combine returns one row per (token, device) (the default): the device sums the
  //! token's local expert outputs (gate-weighted, f32 in choice order, rounded to the row type)
  //! and the source sums the returned rows in ascending device order (f32, one rounding), the
  //! sums of the dynamic `moe_exchange`: for the same tokens, routing and experts the output is
  //! the dynamic exchange's bitwise. Set to false for DeepEP's low-latency combine: one row per
  //! (token, expert) pair, summed on the source per token in choice order (one rounding, the
  //! naive reference's bits), at up to min(k, local experts) times the combine bytes. On the
  //! device the combine messages have room for `max_tokens_per_rank` rows (false:
  //! `max_tokens_per_rank` x min(k, local experts)).
  bool partial_sums = true;
  //! The experts read their input rows where they arrived, not from copies:
  //! `decode_experts::input_rows(l)` gives one pointer per row, into the received messages or,
  //! for this rank's own tokens, into the dispatch's `x` (borrowed then until the combine has
  //! run), and `input(l)` is refused. Saves one row copy per (token, expert) pair received. Not
  //! with `fp8_dispatch`.
  bool gathered_inputs = false;
};

//! Status word of a `decode_header`.
enum class decode_status : std::int32_t {
  ok = 0,     //!< the rows are valid
  failed = 1, //!< the sender failed locally; `code` and `cause` say why, `rows` is 0
};

//! The front of every decode message (128 bytes, trivially copyable, sent as raw bytes).
struct decode_header {
  std::int64_t rows = 0;                    //!< rows that follow (at most max_tokens_per_rank)
  decode_status status = decode_status::ok; //!< whether the sender failed
  std::int32_t code = 0;                    //!< the sender's `errc` when it failed
  std::int32_t source = -1;                 //!< the sending rank
  std::int32_t flags = 0;                   //!< a device sender's error flags, else zero
  char cause[104] = {};                     //!< the sender's error message, truncated
};
static_assert(sizeof(decode_header) == 128, "decode_header is sent as 128 raw bytes");

//! Why a received `decode_header` is not one a sender writes (`detail::decode_header_fault_of`).
enum class decode_header_fault : std::int32_t {
  none = 0, //!< a header some sender writes
  status,   //!< a status other than `ok` and `failed`
  source,   //!< another source than the rank it came from
  rows,     //!< `ok`: rows outside [0, max_tokens_per_rank]; `failed`: rows other than 0
  code,     //!< `ok`: a code; `failed`: a code that is no `errc`
  flags,    //!< flags the exchange's senders never set
  cause,    //!< `ok`: a cause; `failed`: a cause without its zero byte, or bytes after it
};

namespace detail {

inline void check_decode_options(const decode_options& o) {
  WEAVE_EXPECT(o.k >= 1, errc::invalid_argument, "decode_options.k = ", o.k);
  WEAVE_EXPECT(o.hidden >= 1, errc::invalid_argument, "decode_options.hidden = ", o.hidden);
  WEAVE_EXPECT(o.max_tokens_per_rank >= 1, errc::invalid_argument,
               "decode_options.max_tokens_per_rank = ", o.max_tokens_per_rank);
  if (o.fp8_dispatch)
    check_quantization(o.hidden, o.fp8_dispatch->format, o.fp8_dispatch->blocks,
                       "decode_options.fp8_dispatch");
}

//! The tokens of a call of `who` with `elements` input elements and `ids` / `weights` entries:
//! whole rows, at most `max_tokens_per_rank`, k entries per token (typed errors otherwise).
inline std::size_t decode_call_tokens(const decode_options& o, std::size_t elements,
                                      std::size_t ids, std::size_t weights, const char* who) {
  const std::size_t H = o.hidden, k = static_cast<std::size_t>(o.k);
  WEAVE_EXPECT(elements % H == 0, errc::size_mismatch, who, ": ", elements,
               " input elements are not whole rows of hidden = ", H);
  const std::size_t tokens = elements / H;
  WEAVE_EXPECT(tokens <= o.max_tokens_per_rank, errc::invalid_argument, who, ": a call of ", tokens,
               " tokens exceeds max_tokens_per_rank = ", o.max_tokens_per_rank);
  WEAVE_EXPECT(ids == tokens * k && weights == tokens * k, errc::size_mismatch, who, ": ", ids,
               " ids and ", weights, " weights for ", tokens, " tokens with k = ", k);
  return tokens;
}

//! A header saying that `source` failed with `code` (`errc::internal` if it is no `errc`: a
//! receiver refuses such a header) and `what` (cut at a zero byte and to 103 bytes).
inline decode_header failed_header(int source, errc code, std::string_view what) noexcept {
  decode_header h;
  h.status = decode_status::failed;
  h.code =
      static_cast<std::int32_t>(is_errc(static_cast<std::int64_t>(code)) ? code : errc::internal);
  h.source = source;
  const std::size_t n = std::min(what.substr(0, what.find('\0')).size(), sizeof(h.cause) - 1);
  std::memcpy(h.cause, what.data(), n);
  h.cause[n] = '\0';
  return h;
}

//! Why `h`, received from rank `sender` in a phase whose slots hold `max_rows` rows, is not a
//! header that a decode exchange whose senders set only `known_flags` writes; `none` if it is.
//! Run where the headers are (a step of the device exchange, or the host).
WEAVE_HOST_DEVICE inline decode_header_fault decode_header_fault_of(const decode_header& h,
                                                                    std::int64_t sender,
                                                                    std::int64_t max_rows,
                                                                    std::uint32_t known_flags) {
  const bool failed = h.status == decode_status::failed;
  if (!failed && h.status != decode_status::ok)
    return decode_header_fault::status;
  if (h.source != sender)
    return decode_header_fault::source;
  if (failed ? h.rows != 0 : h.rows < 0 || h.rows > max_rows)
    return decode_header_fault::rows;
  if (failed ? !is_errc(h.code) : h.code != 0)
    return decode_header_fault::code;
  if (failed ? (static_cast<std::uint32_t>(h.flags) & ~known_flags) != 0 : h.flags != 0)
    return decode_header_fault::flags;
  // The cause: `failed_header` writes at most 103 bytes and zeros after them; `ok`: none, checked
  // a word at a time (every received header of every call passes here).
  if (!failed) {
    static_assert(sizeof h.cause % sizeof(std::uint64_t) == 0);
    std::uint64_t any = 0;
    for (std::size_t i = 0; i < sizeof h.cause; i += sizeof(std::uint64_t)) {
      std::uint64_t word = 0;
      std::memcpy(&word, h.cause + i, sizeof word);
      any |= word;
    }
    return any == 0 ? decode_header_fault::none : decode_header_fault::cause;
  }
  std::size_t end = 0;
  while (end < sizeof h.cause && h.cause[end] != 0)
    ++end;
  if (end == sizeof h.cause)
    return decode_header_fault::cause;
  for (std::size_t i = end; i < sizeof h.cause; ++i)
    if (h.cause[i] != 0)
      return decode_header_fault::cause;
  return decode_header_fault::none;
}

//! What is wrong with `h` (its `fault`), for messages.
inline std::string describe_header_fault(decode_header_fault fault, const decode_header& h,
                                         std::int64_t max_rows) {
  const bool failed = h.status == decode_status::failed;
  switch (fault) {
  case decode_header_fault::none:
    break;
  case decode_header_fault::status:
    return concat("status ", static_cast<std::int32_t>(h.status), " (0: ok, 1: failed)");
  case decode_header_fault::source:
    return concat("source rank ", h.source);
  case decode_header_fault::rows:
    return failed ? concat("a failed header of ", h.rows, " rows")
                  : concat(h.rows, " rows, outside [0, ", max_rows, "]");
  case decode_header_fault::code:
    return failed ? concat("code ", h.code, ", which is no errc")
                  : concat("code ", h.code, " in a header of status ok");
  case decode_header_fault::flags:
    return concat("flags ", hex(static_cast<std::uint32_t>(h.flags)));
  case decode_header_fault::cause:
    return failed ? std::string("a cause without its zero byte, or bytes after it")
                  : std::string("a cause in a header of status ok");
  }
  return "nothing";
}

//! The failure a received phase of a decode exchange reports, if any
//! (`check_decode_headers`), and whether every rank knows it (`told`: false when its sender did
//! not fail in every header this rank received, or a header is not one a sender writes; the
//! peers may then wait for this rank in a later collective).
struct decode_headers_verdict {
  std::exception_ptr failure;
  bool told = true;
};

//! Checks the headers of one received phase of `who` (a decode exchange), `header(d, l)` for
//! `ranks` senders and `slots` local slots, in rank-major order. The first sender with a header
//! no sender writes gives an `errc::protocol` error naming it, its slot and the fault; else the
//! first sender with a failed header, in any slot, gives a `peer_error` naming it
//! (`record(h)`: the sender's failure as its header `h` tells it); else no failure.
template <class Header, class Record>
decode_headers_verdict check_decode_headers(std::size_t ranks, std::size_t slots,
                                            std::int64_t max_rows, std::uint32_t known_flags,
                                            const char* who, Header&& header, Record&& record) {
  for (std::size_t d = 0; d < ranks; ++d) {
    std::size_t failed = 0, first_failed = 0;
    for (std::size_t l = 0; l < slots; ++l) {
      const decode_header h = header(d, l);
      const decode_header_fault fault =
          decode_header_fault_of(h, static_cast<std::int64_t>(d), max_rows, known_flags);
      if (fault != decode_header_fault::none)
        return {
            std::make_exception_ptr(error(
                errc::protocol, concat(who, ": rank ", d,
                                       " sent a header no weave rank writes "
                                       "(local slot ",
                                       l, ": ", describe_header_fault(fault, h, max_rows), ")"))),
            false};
      if (h.status == decode_status::failed && failed++ == 0)
        first_failed = l;
    }
    if (failed > 0)
      return {std::make_exception_ptr(peer_error(record(header(d, first_failed)), who)),
              failed == slots};
  }
  return {};
}

//! The construction's agreement of a decode layer named `name`: the options valid on this rank,
//! then the same on every rank (`agree_on_config`). Returns the layer's serial on `comm`.
template <class Comm>
std::uint32_t agree_on_decode(Comm& comm, const placement& where, const decode_options& o,
                              dtype element, const char* name) {
  config_fingerprint f(name);
  f.add("devices", where.num_devices())
      .add("experts", where.num_experts())
      .add("slots per device", where.slots_per_device())
      .add_hash("placement (slot -> expert table)", where.slot_experts())
      .add("k", o.k)
      .add("hidden", static_cast<std::int64_t>(o.hidden))
      .add_label("element type", static_cast<std::int64_t>(element),
                 [](std::int64_t v) { return to_string(static_cast<dtype>(v)); })
      .add("max_tokens_per_rank", static_cast<std::int64_t>(o.max_tokens_per_rank))
      .add("partial_sums", o.partial_sums ? 1 : 0);
  add_fp8_dispatch(f, o.fp8_dispatch);
  return agree_on_config(comm, f, [&] {
    check_decode_options(o);
    WEAVE_EXPECT(o.k <= where.num_experts(), errc::invalid_argument, "decode_options.k = ", o.k,
                 " exceeds the ", where.num_experts(), " experts");
    WEAVE_EXPECT(where.num_devices() == comm.size(), errc::invalid_argument, "placement of ",
                 where.num_devices(), " devices for a world of ", comm.size());
    WEAVE_EXPECT(!o.gathered_inputs || !o.fp8_dispatch, errc::invalid_argument, name,
                 ": decode_options.gathered_inputs with an FP8 dispatch (the experts read codes "
                 "and scales from the pool)");
  });
}

} // namespace detail

WEAVE_NAMESPACE_END
