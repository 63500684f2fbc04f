//! \file
//! The phases of `basic_decode_exchange`, out of the class: the dispatch's pack (routing, the
//! records, the send rows, the headers), its all-to-all and its unpack (the headers and records
//! checked, the expert pool filled), and the combine's. Each pack and unpack is one
//! `Space::launch`: on host streams one task (or, under the caller's claim, work on its thread)
//! whose steps run within it, so that its host code sees what they computed; on CUDA the steps
//! are enqueued at once. Included by `decode_exchange.hpp`.
#pragma once

#include "weave/overlap/decode_exchange.hpp"
#include "weave/routing/route_entry.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <utility>

WEAVE_NAMESPACE_BEGIN

template <execution_space Space, decode_communicator<Space> Comm, class T>
void basic_decode_exchange<Space, Comm, T>::pack_dispatch(stream_arg s, std::span<const T> x,
                                                          std::span<const std::int32_t> ids,
                                                          std::span<const float> weights) {
  decode_header rejected;
  if constexpr (exact) {
    // A failure of the pack sends every header failed instead, with its cause (the rows after
    // are not read); this rank raises it at the unpack, where its peers raise theirs.
    local_failure_ = nullptr;
    try {
      route(s, x, ids, weights, rejected);
    } catch (...) {
      rejected = reject(std::current_exception());
      words_[call_flags] = 0; // raised here, named: not flags for a later check
      if (bad_token_ != nullptr)
        *bad_token_ = -1;
      send_headers(s, at_.dispatch, rejected, a_.records);
    }
    if constexpr (bounded) // a message's occupied part; a failed one's header alone
      for (std::int64_t d = 0; d < world(); ++d)
        if (d != rank_)
          dispatch_send_[static_cast<std::size_t>(d)] = static_cast<std::int64_t>(
              local_failure_ ? sizeof(decode_header) : at_.dispatch.message_bytes(a_.records[d]));
  } else {
    try {
      (void)detail::decode_call_tokens(options_, x.size(), ids.size(), weights.size(),
                                       "decode_exchange");
    } catch (...) {
      rejected = reject(std::current_exception());
    }
    rejected_ = rejected.status != decode_status::ok;
    route(s, rejected_ ? std::span<const T>{} : x,
          rejected_ ? std::span<const std::int32_t>{} : ids,
          rejected_ ? std::span<const float>{} : weights, rejected);
  }
}

template <execution_space Space, decode_communicator<Space> Comm, class T>
void basic_decode_exchange<Space, Comm, T>::route(stream_arg s, std::span<const T> x,
                                                  std::span<const std::int32_t> ids,
                                                  std::span<const float> weights,
                                                  const decode_header& rejected) {
  const std::size_t tokens =
      detail::decode_call_tokens(options_, x.size(), ids.size(), weights.size(), "decode_exchange");
  const int k = options_.k, E = where_.num_experts();
  const auto n = static_cast<std::int64_t>(tokens);
  const bool fp8 = options_.fp8_dispatch.has_value();
  tokens_ = tokens;
  weights_ = weights.data();
  x_ = reinterpret_cast<const std::byte*>(x.data());
  static_assert(call_failed == call_flags + 1); // the two per-call words, cleared together
  Space::fill(s, words_ + call_flags, 0, 2 * sizeof(std::uint32_t));
  Space::fill(s, a_.token_rows, 0xFF, tokens * static_cast<std::size_t>(k) * sizeof(std::int64_t));
  if (fp8 || !serial_space<Space>) // the gather's map (a serial space scatters by token_rows)
    Space::fill(s, a_.send_index, 0xFF, at_.dispatch.rows() * sizeof(std::int64_t));
  if (fp8)
    Space::fill(s, bad_token_, 0xFF, sizeof(std::int64_t)); // -1: every token finite
  if (n > 0)
    Space::for_each(s, n,
                    detail::decode_route_step{ids.data(), weights.data(), k, E, table_, table_ + E,
                                              table_ + 2 * E + 1, a_.pair_slot,
                                              words_ + call_flags});
  if constexpr (exact) { // host code after the step: a flagged pair fails the call, named
    if (const std::uint32_t flagged = std::exchange(words_[call_flags], 0u); flagged != 0) {
      detail::check_routing(ids, weights, static_cast<std::size_t>(k), E);
      device_dispatch_plan<Space>::throw_plan_errors(flagged, E);
    }
  }
  const float* partial = options_.partial_sums ? weights.data() : nullptr; // beside the slots
  const detail::decode_position_step position{
      at_.dispatch, n,     k,           spd(),      rank_,       fp8,           a_.pair_slot,
      partial,      send_, a_.pair_pos, a_.records, a_.pairs_to, a_.send_index, a_.token_rows,
      a_.own_token};
  if constexpr (serial_space<Space>)
    Space::launch(s, [position, last = scratch_, next = scratch_ + world()](stream_arg) {
      detail::decode_position_serial(position, last, next);
    });
  else
    Space::for_each(s, world(), position);
  if (fp8) { // each record quantised (this rank's own too: the pool reads them from `send_`)
    const auto [codes, scales] = wire_views(send_, at_.dispatch.rows());
    quant::quantize(s, rows(x_, tokens), codes, scales, a_.send_index, nullptr,
                    options_.fp8_dispatch->blocks, bad_token_);
    if constexpr (exact)
      WEAVE_EXPECT(*bad_token_ < 0, errc::invalid_argument, "token ", *bad_token_,
                   " holds a NaN or an infinity: the FP8 dispatch (decode_options::fp8_dispatch) "
                   "cannot quantise it");
  } else if (n > 0) { // each record's row from its token (serial spaces: each token once)
    layout_move<Space>(s, rows(x_, tokens), buffer(send_, at_.dispatch), a_.send_index, nullptr,
                       nullptr, a_.token_rows, k, nullptr, nullptr);
  }
  send_headers(s, at_.dispatch, rejected, a_.records);
}

template <execution_space Space, decode_communicator<Space> Comm, class T>
void basic_decode_exchange<Space, Comm, T>::send_headers(stream_arg s,
                                                         const detail::decode_wire& at,
                                                         const decode_header& rejected,
                                                         const std::int64_t* counts) {
  const bool dispatch = &at == &at_.dispatch;
  Space::for_each(s, at.D,
                  detail::decode_header_step{
                      at, send_, rejected, counts, words_ + call_flags,
                      dispatch && options_.fp8_dispatch ? bad_token_ : nullptr,
                      dispatch ? nullptr : words_ + call_failed, words_ + sticky_error, rank_});
}

template <execution_space Space, decode_communicator<Space> Comm, class T>
void basic_decode_exchange<Space, Comm, T>::unpack_dispatch(stream_arg s, std::uint64_t call) {
  Space::for_each(s, world(),
                  detail::decode_receive_step{at_.dispatch, recv_, send_, rank_, known_flags, spd(),
                                              nullptr, a_.arrived, words_ + call_failed,
                                              words_ + sticky_error, kept_});
  if constexpr (exact) {
    try {
      throw_received(true);
    } catch (...) {
      failed_call_.store(call, std::memory_order_release); // every rank knows: no combine
      throw;
    }
  }
  deliver(s);
  if constexpr (exact)
    arrived_.store(call, std::memory_order_release);
}

template <execution_space Space, decode_communicator<Space> Comm, class T>
void basic_decode_exchange<Space, Comm, T>::deliver(stream_arg s) {
  const std::int64_t L = spd();
  const bool fp8 = options_.fp8_dispatch.has_value(), gathered = options_.gathered_inputs;
  const detail::decode_received in{at_.dispatch, recv_, send_, rank_, words_ + call_failed};
  const bool in_place = !fp8 && !gathered; // a peer's one row read where it arrived
  const detail::decode_pool_maps m{at_.dispatch, at_.combine, rank_, options_.partial_sums,
                                   gathered,     in_place,    fp8,   options_.hidden * sizeof(T),
                                   x_,           recv_,       send_, a_};
  if constexpr (serial_space<Space>) {
    Space::launch(s, [in, m, L, fed = fed_, cursor = scratch_ + 2 * world()](stream_arg) {
      detail::decode_slots_serial(in, m, L, fed, cursor);
    });
  } else {
    const std::size_t choices = static_cast<std::size_t>(at_.dispatch.choices);
    if (options_.partial_sums)
      Space::fill(s, a_.merge_index, 0xFF, at_.combine.rows() * choices * sizeof(std::int64_t));
    else
      Space::fill(s, a_.return_index, 0xFF, at_.combine.rows() * sizeof(std::int64_t));
    Space::fill(s, a_.own_index, 0xFF,
                static_cast<std::size_t>(at_.dispatch.M) * choices * sizeof(std::int64_t));
    Space::for_each(
        s, L, detail::decode_slot_count_step{in, a_.slot_rows, a_.source_rows, a_.source_first});
    Space::exclusive_scan(s, a_.slot_rows, a_.first, L + 1, scan_temp_,
                          Space::scan_temp_bytes(L + 1));
    Space::for_each(s, 1, detail::decode_busy_step{a_.slot_rows, L, a_.busy});
    Space::for_each(s, L, detail::decode_place_step{in, m});
  }
  const std::int64_t* count = a_.first + L; // the pool's rows
  const auto pool = at_.pool_rows();
  if (gathered)
    return;
  if (!fp8) { // the peers' rows from their messages, this rank's own from its tokens
    moves::gather(s, buffer(recv_, at_.dispatch), rows(pool_in_, pool), a_.from_peer, nullptr,
                  count);
    moves::gather(s, rows(x_, tokens_), rows(pool_in_, pool), a_.from_own, nullptr, count);
    return;
  }
  const auto wire = [&](std::byte* p, std::size_t n) {
    return token_view(p, n, at_.wire.stride, dtype::u8, Space::memory, -1, at_.dispatch.row);
  };
  const token_view pool_wire(pool_wire_, pool, at_.wire.stride, dtype::u8, Space::memory);
  moves::gather(s, wire(recv_, at_.dispatch.rows()), pool_wire, a_.from_peer, nullptr, count);
  moves::gather(s, wire(send_, at_.dispatch.rows()), pool_wire, a_.from_own, nullptr, count);
  if (options_.fp8_dispatch->dequantized_inputs) {
    const auto [codes, scales] = wire_views(pool_wire_, pool);
    quant::dequantize(s, codes, scales, rows(pool_in_, pool), nullptr, count,
                      options_.fp8_dispatch->blocks);
  }
}

template <execution_space Space, decode_communicator<Space> Comm, class T>
void basic_decode_exchange<Space, Comm, T>::pack_combine(stream_arg s, std::span<T> y,
                                                         std::uint64_t call) {
  const std::int64_t D = world(), own = rank_;
  const std::size_t H = options_.hidden;
  decode_header rejected;
  const auto expected = options_.partial_sums ? a_.records : a_.pairs_to;
  if constexpr (exact) { // the sizes both sides know from the dispatch
    for (std::int64_t d = 0; d < D; ++d)
      if (d != own) {
        combine_send_[static_cast<std::size_t>(d)] =
            static_cast<std::int64_t>(at_.combine.message_bytes(a_.arrived[d]));
        combine_recv_[static_cast<std::size_t>(d)] =
            static_cast<std::int64_t>(at_.combine.message_bytes(expected[d]));
      }
    local_failure_ = nullptr;
  }
  try {
    if constexpr (exact)
      WEAVE_EXPECT(arrived_.load(std::memory_order_acquire) == call, errc::invalid_state,
                   "decode_exchange::combine after a dispatch that failed");
    WEAVE_EXPECT(rejected_ || y.size() == tokens_ * H, errc::size_mismatch,
                 "decode_exchange::combine: an output of ", y.size(), " elements for ", tokens_,
                 " tokens of hidden = ", H);
  } catch (...) {
    rejected = reject(std::current_exception());
  }
  if constexpr (!exact)
    Space::fill(s, words_ + call_flags, 0, sizeof(std::uint32_t));
  if (rejected.status == decode_status::ok) {
    const token_view out = rows(pool_out_, at_.pool_rows()), sent = buffer(send_, at_.combine),
                     mine = buffer(recv_, at_.combine)
                                .subrows(static_cast<std::size_t>(at_.combine.payload_row(own, 0)),
                                         static_cast<std::size_t>(at_.combine.M));
    const int choices = static_cast<int>(at_.dispatch.choices);
    const bool partial = options_.partial_sums;
    // Combine rows `to` from the pool's outputs by their entries (`index`, `weight`), at most
    // `*count` rows where `count` is given.
    const auto put = [=](stream_arg ls, token_view to, const std::int64_t* index,
                         const float* weight, const std::int64_t* count) {
      if (partial)
        moves::merge(ls, out, to, index, choices, weight, count, true);
      else
        moves::gather(ls, out, to, index, nullptr, count);
    };
    const std::int64_t* index = partial ? a_.merge_index : a_.return_index;
    if constexpr (serial_space<Space>) { // each source's rows, exactly (no pass over the rooms)
      Space::launch(s, [=, this](stream_arg ls) {
        for (std::int64_t d = 0; d < D; ++d)
          if (d != own && a_.arrived[d] != 0) {
            const auto first = static_cast<std::size_t>(at_.combine.payload_row(d, 0));
            const std::size_t entry = first * (partial ? static_cast<std::size_t>(choices) : 1);
            put(ls, sent.subrows(first, static_cast<std::size_t>(a_.arrived[d])), index + entry,
                partial ? a_.merge_weight + entry : nullptr, nullptr);
          }
      });
    } else { // every room's rows: the ones without records have no entry
      put(s, sent, index, a_.merge_weight, nullptr);
    }
    put(s, mine, a_.own_index, a_.own_weight, a_.arrived + own); // own records, where they are
  }
  send_headers(s, at_.combine, rejected, a_.arrived);
}

template <execution_space Space, decode_communicator<Space> Comm, class T>
void basic_decode_exchange<Space, Comm, T>::unpack_combine(stream_arg s, std::span<T> y) {
  const auto expected = options_.partial_sums ? a_.records : a_.pairs_to;
  Space::for_each(s, world(),
                  detail::decode_receive_step{at_.combine, recv_, send_, rank_, known_flags, spd(),
                                              expected, nullptr, words_ + call_failed,
                                              words_ + sticky_error, kept_});
  if constexpr (exact)
    throw_received(false);
  const auto tokens = static_cast<std::int64_t>(tokens_);
  const bool sums = !rejected_ && tokens > 0 && y.size() == tokens_ * options_.hidden;
  const token_view out = rows(reinterpret_cast<std::byte*>(y.data()), sums ? tokens_ : 0);
  if (sums) { // each token's returned rows (per device, or per pair), summed
    const bool partial = options_.partial_sums;
    const int per_token = partial ? std::min(static_cast<int>(world()), options_.k) : options_.k;
    if (partial)
      Space::for_each(s, tokens,
                      detail::decode_token_rows_step{at_.combine, spd(), options_.k, per_token,
                                                     a_.pair_slot, a_.pair_pos,
                                                     words_ + call_failed, a_.final_rows});
    else
      Space::for_each(s, tokens * options_.k,
                      detail::decode_pair_row_step{at_.combine, spd(), a_.pair_slot, a_.pair_pos,
                                                   words_ + call_failed, a_.final_rows});
    moves::merge(s, buffer(recv_, at_.combine), out, a_.final_rows, per_token,
                 partial ? nullptr : weights_, nullptr, false);
  }
  if constexpr (!exact) // no stream fails here: a failed call's output is NaN
    Space::for_each(s, 1,
                    detail::decode_poison_step{words_ + call_failed,
                                               reinterpret_cast<std::byte*>(y.data()),
                                               static_cast<std::int64_t>(y.size_bytes())});
}

template <execution_space Space, decode_communicator<Space> Comm, class T>
void basic_decode_exchange<Space, Comm, T>::throw_received(bool dispatch) {
  // Host memory, after the receive step ran here: this rank's own failure first (the root
  // cause), then a header no sender writes (the peers may not know: told by abort), a failed
  // peer (every rank saw its failed headers), a record no sender writes (abort), and in the
  // combine a message of other rows than were sent.
  const detail::decode_kept kept = *kept_;
  *kept_ = detail::decode_kept{};
  words_[call_failed] = 0;
  words_[sticky_error] &= ~decode_bad_message_flag;
  if (local_failure_)
    std::rethrow_exception(std::exchange(local_failure_, nullptr));
  const auto abort_with = [&](const error& e) {
    const std::exception_ptr failure = std::make_exception_ptr(e);
    abort_peers(*comm_, failure);
    std::rethrow_exception(failure);
  };
  if (kept.bad_claimed != 0)
    abort_with(kept.bad_header());
  if (kept.peer_claimed != 0)
    throw peer_error(peer_record(kept.peer), "decode_exchange");
  if (kept.record_claimed != 0)
    abort_with(kept.bad_record(spd()));
  if (dispatch) {
    if constexpr (bounded) // each message as long as its header's records make it
      for (std::int64_t d = 0; d < world(); ++d) {
        if (d == rank_)
          continue;
        const std::int64_t n = at_.dispatch.header(recv_, d)->rows;
        const auto want = static_cast<std::int64_t>(at_.dispatch.message_bytes(n));
        if (received_[static_cast<std::size_t>(d)] != want)
          abort_with(
              error(errc::protocol,
                    detail::concat("decode_exchange: rank ", d, " sent a dispatch message of ",
                                   received_[static_cast<std::size_t>(d)], " bytes for ", n,
                                   " records (", want, " bytes)")));
      }
    return;
  }
  const auto expected = options_.partial_sums ? a_.records : a_.pairs_to;
  for (std::int64_t d = 0; d < world(); ++d) {
    const std::int64_t returned = at_.combine.header(recv_, d)->rows;
    WEAVE_EXPECT(returned == expected[d], errc::size_mismatch, "decode_exchange::combine: rank ", d,
                 " returned ", returned, " rows for the ", expected[d],
                 options_.partial_sums ? " token records" : " pairs", " sent to it");
  }
}

WEAVE_NAMESPACE_END
