//! \file
//! What the ranks of one MoE layer must agree on, and the check the exchanges run once at
//! construction (`agree_on_layer`): the placement (experts, slots per device, the slot -> expert
//! table, which fixes the replica table), k, the row shape and type, the token bound, the
//! pipeline degree, the calls in flight, capacity (factor, drop order, rounding), the shape
//! mode and the FP8 dispatch (format, block, scale rounding, amax floor). Different values on
//! different ranks would otherwise give wrong numbers silently (a placement or expert count) or a
//! transfer failure mid-flight (a row size).
#pragma once

#include "weave/comm/agreement.hpp"
#include "weave/comm/communicator.hpp"
#include "weave/core/config.hpp"
#include "weave/core/dtype.hpp"
#include "weave/overlap/moe_options.hpp"
#include "weave/placement/placement.hpp"

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>

WEAVE_NAMESPACE_BEGIN

namespace detail {

// Names of enumerators in disagreement messages (null: the number is printed).
inline const char* dtype_label(std::int64_t v) {
  return to_string(static_cast<dtype>(static_cast<std::uint8_t>(v)));
}
template <std::size_t N>
const char* label_in(const char* const (&names)[N], std::int64_t v) {
  return v >= 0 && static_cast<std::size_t>(v) < N ? names[v] : nullptr;
}
inline const char* layer_kind_label(std::int64_t v) {
  static constexpr const char* names[] = {"moe_exchange", "device_exchange"};
  return label_in(names, v);
}
inline const char* drop_order_label(std::int64_t v) {
  static constexpr const char* names[] = {"position", "rank_major", "batch_prioritized",
                                          "priority_token_major"};
  return label_in(names, v);
}
inline const char* rounding_label(std::int64_t v) {
  static constexpr const char* names[] = {"ceil", "tutel"};
  return label_in(names, v);
}

// The FP8 dispatch fields of a layer's fingerprint: what the senders quantise with must be what
// the receivers read. Whether a rank also dequantises on arrival is its own business.
inline void add_fp8_dispatch(config_fingerprint& f,
                             const std::optional<fp8_dispatch_options>& fp8) {
  const fp8_dispatch_options q = fp8.value_or(fp8_dispatch_options{});
  f.add_flag("fp8_dispatch", fp8.has_value())
      .add_label("fp8_dispatch format", fp8 ? static_cast<std::int64_t>(q.format) : 0, dtype_label)
      .add("fp8_dispatch block", fp8 ? static_cast<std::int64_t>(q.blocks.block) : 0)
      .add("fp8_dispatch scale rounding", fp8 ? static_cast<std::int64_t>(q.blocks.rounding) : 0)
      .add_real("fp8_dispatch min_amax", fp8 ? q.blocks.min_amax : 0.0);
}

} // namespace detail

//! The fingerprint of an MoE layer built as `kind` over `where` with `o` (`basic_moe_exchange`
//! passes "moe_exchange" in every space).
inline config_fingerprint layer_fingerprint(const std::string& kind, const placement& where,
                                            const moe_options& o) {
  config_fingerprint f(kind);
  f.add_label("layer kind", kind == "moe_exchange" ? 0 : 1, detail::layer_kind_label)
      .add("devices", where.num_devices())
      .add("experts", where.num_experts())
      .add("slots per device", where.slots_per_device())
      .add_hash("placement (slot -> expert table)", where.slot_experts())
      .add("k", o.k)
      .add("hidden", static_cast<std::int64_t>(o.hidden))
      .add_label("element type", static_cast<std::int64_t>(o.element), detail::dtype_label)
      .add("max_tokens", static_cast<std::int64_t>(o.max_tokens))
      .add("chunks", o.chunks)
      .add("max_in_flight", o.max_in_flight)
      .add_real("capacity factor", o.capacity.factor)
      .add_label("capacity drop order", static_cast<std::int64_t>(o.capacity.order),
                 detail::drop_order_label)
      .add_label("capacity rounding", static_cast<std::int64_t>(o.capacity.rounding),
                 detail::rounding_label)
      .add_flag("save_for_backward", o.save_for_backward)
      .add_flag("static_shape", o.static_shape)
      .add("static_rows_per_peer", static_cast<std::int64_t>(o.static_rows_per_peer))
      .add_flag("strict_call_order", o.strict_call_order);
  detail::add_fp8_dispatch(f, o.fp8_dispatch);
  return f;
}

//! Checks, with one small collective, that every rank of `comm` builds the layer alike, and
//! returns `comm`. Validates this rank's options and placement first (`validate()` adds the
//! layer's own checks): a rank whose configuration is invalid throws its error and its peers a
//! `peer_error` naming it; if all are valid but differ, every rank throws
//! `errc::config_mismatch` naming the first field that differs and each rank's value. Every
//! rank calls it once, when it constructs the layer, before anything else that may throw.
//! Returns the layer's serial on `comm`, agreed by every rank (its `call_tag`s' layer).
template <communicator C, class Validate>
std::uint32_t agree_on_layer(C& comm, const std::string& kind, const placement& where,
                             const moe_options& o, Validate&& validate) {
  return agree_on_config(comm, layer_fingerprint(kind, where, o), [&] {
    detail::check_moe_options(o);
    WEAVE_EXPECT(where.num_devices() == comm.size(), errc::invalid_argument, "placement of ",
                 where.num_devices(), " devices for a world of ", comm.size());
    WEAVE_EXPECT(o.k <= where.num_experts(), errc::invalid_argument, "k = ", o.k, " exceeds the ",
                 where.num_experts(), " experts");
    std::forward<Validate>(validate)();
  });
}

WEAVE_NAMESPACE_END
