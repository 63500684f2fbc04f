//! \file
//! The checks `moe_exchange_base` makes before it issues anything: a call's rows, ids, weights,
//! hooks and streams, and a handle's phase, stream and outputs. Each fails with a typed error
//! naming what differs. Included by `moe_exchange_base.hpp`.
#pragma once

#include "weave/overlap/detail/moe_exchange_base.hpp"

#include <type_traits>

WEAVE_NAMESPACE_BEGIN

template <class Derived, class Traits>
void moe_exchange_base<Derived, Traits>::check_rows(const const_token_view& v, const char* what,
                                                    std::size_t tokens) const {
  self().check_rows(v, what);
  WEAVE_EXPECT(v.rows() == tokens, errc::size_mismatch, what, " of ", v.rows(),
               " rows for a call of ", tokens, " tokens");
}

template <class Derived, class Traits>
void moe_exchange_base<Derived, Traits>::check_dispatch(
    const const_token_view& x, std::span<const std::int32_t> ids, std::span<const float> weights,
    const hooks_type* hooks, const stream_type& compute, const stream_type& comm) const {
  self().check_rows(x, "input");
  WEAVE_EXPECT(x.rows() <= options_.max_tokens, errc::invalid_argument, "a call of ", x.rows(),
               " tokens exceeds max_tokens = ", options_.max_tokens);
  const std::size_t pairs = x.rows() * static_cast<std::size_t>(options_.k);
  WEAVE_EXPECT(ids.size() == pairs && weights.size() == pairs, errc::size_mismatch,
               "dispatch: ", ids.size(), " ids and ", weights.size(), " weights for ", x.rows(),
               " tokens with k = ", options_.k);
  detail::check_hooks(hooks, options_);
  if constexpr (std::is_reference_v<stream_arg>)
    WEAVE_EXPECT(&compute != &comm, errc::invalid_argument,
                 "the compute and comm streams must differ");
}

template <class Derived, class Traits>
void moe_exchange_base<Derived, Traits>::check_comm(const slot_type& s, const stream_type& comm,
                                                    const char* call) const {
  if constexpr (std::is_pointer_v<typename slot_type::stream_store>)
    WEAVE_EXPECT(&comm == s.comm, errc::invalid_argument, call,
                 ": another comm stream than the one the handle's phase started on");
  else
    (void)s, (void)comm, (void)call;
}

template <class Derived, class Traits>
void moe_exchange_base<Derived, Traits>::check_backward_outputs(const slot_type& s,
                                                                const token_view& dx,
                                                                std::span<float> dw) const {
  check_rows(dx, "input gradient", s.tokens);
  WEAVE_EXPECT(dw.size() == s.tokens * static_cast<std::size_t>(options_.k), errc::size_mismatch,
               "dispatch_backward: ", dw.size(), " gate gradients for a call of ", s.tokens,
               " tokens with k = ", options_.k);
}

template <class Derived, class Traits>
void moe_exchange_base<Derived, Traits>::check_same_output(const slot_type& s,
                                                           const token_view& early,
                                                           const token_view& now,
                                                           const char* call) const {
  WEAVE_EXPECT(!s.output_known || (early.data() == now.data() && early.rows() == now.rows()),
               errc::invalid_argument, call, ": another output than `chunks` was given");
}

template <class Derived, class Traits>
void moe_exchange_base<Derived, Traits>::expect_phase(const slot_type& s, moe_phase want,
                                                      const char* call) const {
  WEAVE_EXPECT(s.phase == want, errc::invalid_state, call, " on a handle in phase ",
               to_string(s.phase), " (it needs ", to_string(want), ")");
}

WEAVE_NAMESPACE_END
