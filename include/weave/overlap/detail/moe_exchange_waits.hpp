//! \file
//! `basic_moe_exchange`'s waits and errors: the one wait of `synchronize`, the flags its steps
//! set (`check_errors`), a call rejected on the host, and the statistics counters read back.
//! Included by `moe_exchange.hpp`.
#pragma once

#include "weave/overlap/moe_exchange.hpp"

#include <cstddef>
#include <cstdint>
#include <exception>
#include <utility>

WEAVE_NAMESPACE_BEGIN

template <execution_space Space, exchange_communicator<Space> Comm>
void basic_moe_exchange<Space, Comm>::check_errors(stream_arg stream) {
  if (!initialized_)
    return; // no call yet
  const bool fp8 = this->options_.fp8_dispatch.has_value();
  host_mirror<Space, std::uint32_t>& words = error_words_; // the copies land here, pinned
  host_mirror<Space, std::int64_t>& bad_tokens = bad_tokens_;
  std::size_t at = 0, c = 0;
  for (const auto& s : this->slots())
    for (chunk_state& ch : s->state.chunks) {
      take_error_word<Space>(stream, &words[at++], ch.error);
      take_error_word<Space>(stream, &words[at++], ch.plan.error_word());
      take_error_word<Space>(stream, &words[at++], ch.experts.error_word());
      status_.take(stream, ch.status);
      tags_.take(stream, ch.tags);
      if (fp8) {
        Space::copy_to_host(stream, &bad_tokens[c++], ch.quant_status, sizeof(std::int64_t));
        Space::fill(stream, ch.quant_status, 0xff, sizeof(std::int64_t)); // -1: none
      }
    }
  wait_watched(*this->comm_, stream);
  // A call of another handle at one of this rank's count or tag exchanges explains everything
  // else (its rows were another call's): every rank finds it; the ranks are out of step, so
  // abort.
  for (const auto& s : this->slots())
    for (const chunk_state& ch : s->state.chunks)
      for (std::exception_ptr mismatch :
           {status_.call_mismatch(ch.status), tags_.mismatch(ch.tags)})
        if (mismatch) {
          abort_peers(*this->comm_, mismatch);
          std::rethrow_exception(mismatch);
        }
  std::uint32_t own = 0, plan = 0, experts = 0;
  for (std::size_t i = 0; i < words.size(); i += 3) {
    own |= words[i];
    plan |= words[i + 1];
    experts |= words[i + 2];
  }
  throw_sender_errors(plan, own);
  c = 0;
  for (const auto& s : this->slots())
    for (const chunk_state& ch : s->state.chunks) {
      const std::int64_t bad = fp8 ? bad_tokens[c++] : -1;
      WEAVE_EXPECT(bad < 0, errc::invalid_argument, "token ",
                   static_cast<std::int64_t>(ch.first) + bad,
                   " of a forward holds a NaN or an infinity: the FP8 dispatch "
                   "(moe_options::fp8_dispatch) sent its rows as NaN");
    }
  for (const auto& s : this->slots()) // a peer's failure explains what this rank received
    for (const chunk_state& ch : s->state.chunks)
      if (std::exception_ptr peer = status_.peer_failure(ch.status))
        std::rethrow_exception(peer);
  device_expert_plan<Space>::throw_expert_errors(experts, this->placement_.slots_per_device());
}

template <execution_space Space, exchange_communicator<Space> Comm>
void basic_moe_exchange<Space, Comm>::throw_sender_errors(std::uint32_t plan,
                                                          std::uint32_t exchange) const {
  device_dispatch_plan<Space>::throw_plan_errors(plan, this->placement_.num_experts());
  WEAVE_EXPECT((exchange & device_exchange_slot_overflow) == 0, errc::size_overflow,
               "a chunk sent more rows to a peer than its static slot of ", layout_.slot_rows(),
               " rows (moe_options.static_rows_per_peer)");
  WEAVE_EXPECT((exchange & device_exchange_bad_count) == 0, errc::size_mismatch,
               "a peer announced a row count outside the static slot of ", layout_.slot_rows(),
               " rows (moe_options.static_rows_per_peer): its rows were not read");
}

template <execution_space Space, exchange_communicator<Space> Comm>
void basic_moe_exchange<Space, Comm>::synchronize_layer(stream_arg compute, stream_arg comm) {
  std::exception_ptr waited, flagged;
  try {
    synchronize_streams(*this->comm_, compute, comm);
  } catch (...) {
    waited = std::current_exception();
  }
  // After an abort the flags are read only when the streams ran every task (a peer may have
  // aborted after this rank's collectives completed with the wrong call's data: the blocks
  // still say so).
  if (!communicator_aborted(*this->comm_) || !waited) {
    try {
      check_errors(compute);
    } catch (...) {
      flagged = std::current_exception();
    }
  }
  if (is_call_mismatch(flagged)) // the ranks were at other calls: that explains the rest
    std::rethrow_exception(flagged);
  if (std::exception_ptr root = root_cause({waited, flagged}))
    std::rethrow_exception(root);
}

template <execution_space Space, exchange_communicator<Space> Comm>
template <class Issue>
void basic_moe_exchange<Space, Comm>::enqueue_rejected(slot_type& s,
                                                       const std::exception_ptr& failure,
                                                       stream_arg compute, stream_arg comm,
                                                       Issue&& issue) {
  s.args.x = rows_view(nullptr, 0);
  s.args.y = rows_view(nullptr, 0);
  if constexpr (Space::runs_later) {
    enqueue_failed_call(*this->comm_, compute, comm, failure, std::forward<Issue>(issue));
  } else {
    status_.report(comm, failure, s.state.reported_h, s.state.reported);
    s.state.rejected = true;
    try {
      std::forward<Issue>(issue)();
    } catch (...) {
      s.state.rejected = false;
      throw;
    }
    s.state.rejected = false;
  }
}

template <execution_space Space, exchange_communicator<Space> Comm>
moe_stats basic_moe_exchange<Space, Comm>::read_counters(const slot_type& s,
                                                         stream_arg stream) const {
  WEAVE_EXPECT(initialized_ && s.call != 0, errc::invalid_state,
               "moe_exchange statistics: no forward yet");
  std::int64_t* c = counters_h_.data();
  Space::copy_to_host(stream, c, s.state.counters, counter_count * sizeof(std::int64_t));
  wait_watched(*this->comm_, stream);
  WEAVE_EXPECT(c[counter_call] == static_cast<std::int64_t>(s.call), errc::invalid_state,
               "moe_exchange statistics of call ", s.call,
               ": its forward has not run its combine (synchronize its streams first), or it "
               "failed");
  return {s.tokens,
          c[counter_routed],
          c[counter_dropped],
          c[counter_sent],
          c[counter_received],
          c[counter_local],
          c[counter_expert_rows],
          this->options_.hidden * size_of(this->options_.element),
          detail::dispatch_row_bytes(this->options_)};
}

WEAVE_NAMESPACE_END
