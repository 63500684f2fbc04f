//! \file
//! `detail::decode_mailbox`: the host decode exchange's message buffers, one message per peer
//! and phase (`decode_phase`), each behind its `decode_header`, and how a phase's headers carry
//! a failure: a pack that throws marks every header failed instead, and the receiver checks
//! every header before it reads a record.
#pragma once

#include "weave/comm/fail_stop.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/core/failure.hpp"
#include "weave/core/retain.hpp"
#include "weave/overlap/decode_options.hpp"
#include "weave/overlap/detail/decode_records.hpp"

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <span>
#include <string>
#include <utility>
#include <vector>

WEAVE_NAMESPACE_BEGIN
namespace detail {

class decode_mailbox {
 public:
  decode_mailbox() = default;
  decode_mailbox(int rank, std::size_t send_bytes, std::size_t recv_bytes)
      : rank_(rank)
      , send_(send_bytes, std::byte{0})
      , recv_(recv_bytes, std::byte{0}) {}

  std::vector<std::byte>& send_buffer() noexcept { return send_; }
  std::vector<std::byte>& recv_buffer() noexcept { return recv_; }
  const std::vector<std::byte>& send_buffer() const noexcept { return send_; }
  const std::vector<std::byte>& recv_buffer() const noexcept { return recv_; }
  // Keeps both buffers until the process exits (a communicator abandoned its operations: MPI
  // may still write into them until MPI_Finalize).
  void retain_until_exit() {
    retain_value_until_exit(std::move(send_));
    retain_value_until_exit(std::move(recv_));
  }

  // The message to peer d in the send buffer, and the one from peer d in the receive buffer.
  std::byte* sent(std::size_t d, const decode_phase& p) noexcept {
    return send_.data() + p.send_displs[d];
  }
  std::byte* received(std::size_t d, const decode_phase& p) noexcept {
    return recv_.data() + p.recv_displs[d];
  }
  decode_header header(std::size_t d, const decode_phase& p) noexcept {
    decode_header h;
    std::memcpy(&h, received(d, p), sizeof h);
    return h;
  }
  void put_header(std::size_t d, const decode_header& h, const decode_phase& p) noexcept {
    std::memcpy(sent(d, p), &h, sizeof h);
  }

  // Runs `fill`, which writes the send messages of phase `p`; on failure every header says so
  // instead, and the failure is kept for this rank's own `check_headers`.
  template <class F>
  void pack(F&& fill, const decode_phase& p) noexcept {
    local_failure_ = nullptr;
    try {
      fill();
      return;
    } catch (const error& e) {
      local_failure_ = std::current_exception();
      mark_failed(e.code(), e.message(), p);
    } catch (const std::exception& e) {
      local_failure_ = std::current_exception();
      mark_failed(errc::internal, e.what(), p);
    }
  }

  // Checks every received header of phase `p`: this rank's own failure first (the root
  // cause), then the lowest failed peer's (a failed header in any slot), or a header no sender
  // writes. A failure its peers may not know (a header no sender writes, a sender that failed in
  // some of its headers only) aborts `comm`, so that no peer waits for this rank in a later
  // collective.
  template <class Comm>
  void check_headers(Comm& comm, const decode_phase& p, std::size_t max_rows, const char* who) {
    if (local_failure_)
      std::rethrow_exception(local_failure_);
    const decode_headers_verdict verdict = check_decode_headers(
        p.send_counts.size(), 1, static_cast<std::int64_t>(max_rows), 0, who,
        [&](std::size_t d, std::size_t) { return header(d, p); },
        [](const decode_header& h) {
          return failure_record{h.source, static_cast<errc>(h.code), true,
                                std::string(h.cause, ::strnlen(h.cause, sizeof h.cause))};
        });
    if (!verdict.failure)
      return;
    if (!verdict.told)
      abort_peers(comm, verdict.failure);
    std::rethrow_exception(verdict.failure);
  }

  // A bounded dispatch's messages (phase `p`): each as long as `bytes_of(rows)` for its header's
  // rows (`received[d]`: the bytes peer d sent); a shorter one would leave the last call's bytes
  // to be read as this one's. Otherwise errc::protocol, and the peers are told (`comm` aborted).
  template <class Comm, class BytesOf>
  void check_lengths(Comm& comm, const decode_phase& p, std::span<const std::int64_t> received,
                     BytesOf&& bytes_of, const char* who) {
    for (std::size_t d = 0; d < received.size(); ++d) {
      if (d == static_cast<std::size_t>(rank_))
        continue;
      const auto rows = static_cast<std::size_t>(header(d, p).rows);
      const auto expected = static_cast<std::int64_t>(bytes_of(rows));
      if (received[d] == expected)
        continue;
      const auto failure = std::make_exception_ptr(error(
          errc::protocol, concat(who, ": rank ", d, " sent a dispatch message of ", received[d],
                                 " bytes for ", rows, " records (", expected, " bytes)")));
      abort_peers(comm, failure);
      std::rethrow_exception(failure);
    }
  }

 private:
  void mark_failed(errc code, const std::string& what, const decode_phase& p) noexcept {
    const decode_header h = failed_header(rank_, code, what);
    for (std::size_t d = 0; d < p.send_counts.size(); ++d)
      put_header(d, h, p);
  }

  int rank_ = 0;
  std::vector<std::byte> send_, recv_; // [rank][message] of the larger phase (recv_: then the pool)
  std::exception_ptr local_failure_;   // this rank's own failure in the last pack
};

} // namespace detail
WEAVE_NAMESPACE_END
