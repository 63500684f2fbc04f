//! \file
//! `placement`: which device holds which expert, with optional replicas.
//!
//! The world has `num_devices()` devices with `slots_per_device()` expert slots each; physical
//! slot `s` lives on device `s / slots_per_device()` at local index `s % slots_per_device()`.
//! A slot holds one logical expert or is empty (`placement::empty_slot`: a device with fewer
//! usable slots than `slots_per_device()`, e.g. from a per-device spare list); every logical
//! expert has at least one slot (its replicas), never two on one device. Routing works in
//! logical expert ids; `slot_for` resolves a token's expert to the replica it is sent to and
//! never returns an empty slot, so an empty slot receives no rows.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

WEAVE_NAMESPACE_BEGIN

class placement {
 public:
  placement() = default;

  //! A slot that holds no expert.
  static constexpr std::int32_t empty_slot = -1;

  //! A placement from the logical expert held by each physical slot (device-major), or
  //! `empty_slot`. Throws `errc::invalid_argument` unless the slots divide evenly over the
  //! devices, every expert in [0, num_experts) has a slot, and no device holds two replicas of
  //! one expert; `errc::out_of_range` for a slot naming an expert outside [0, num_experts) (other
  //! than `empty_slot`).
  placement(int num_experts, int num_devices, std::vector<std::int32_t> slot_experts)
      : num_experts_(num_experts)
      , num_devices_(num_devices)
      , slot_expert_(std::move(slot_experts)) {
    WEAVE_EXPECT(num_experts > 0, errc::invalid_argument, "num_experts = ", num_experts);
    WEAVE_EXPECT(num_devices > 0, errc::invalid_argument, "num_devices = ", num_devices);
    const std::size_t slots = slot_expert_.size();
    WEAVE_EXPECT(slots % static_cast<std::size_t>(num_devices) == 0 && slots > 0,
                 errc::invalid_argument, slots, " slots do not divide evenly over ", num_devices,
                 " devices");
    slots_per_device_ = static_cast<int>(slots / static_cast<std::size_t>(num_devices));
    WEAVE_EXPECT(slots >= static_cast<std::size_t>(num_experts), errc::invalid_argument, slots,
                 " slots cannot hold ", num_experts, " experts");
    replica_offsets_.assign(static_cast<std::size_t>(num_experts) + 1, 0);
    for (std::size_t s = 0; s < slots; ++s) {
      const std::int32_t e = slot_expert_[s];
      if (e == empty_slot)
        continue;
      WEAVE_EXPECT(e >= 0 && e < num_experts, errc::out_of_range, "slot ", s, " holds expert ", e,
                   ", outside [0, ", num_experts, ") and is not empty_slot (-1)");
      ++replica_offsets_[static_cast<std::size_t>(e) + 1];
      ++filled_;
    }
    for (int e = 0; e < num_experts; ++e) {
      WEAVE_EXPECT(replica_offsets_[static_cast<std::size_t>(e) + 1] > 0, errc::invalid_argument,
                   "expert ", e, " has no slot");
      replica_offsets_[static_cast<std::size_t>(e) + 1] +=
          replica_offsets_[static_cast<std::size_t>(e)];
    }
    replica_slots_.assign(static_cast<std::size_t>(filled_), 0);
    std::vector<std::int32_t> cursor(replica_offsets_.begin(), replica_offsets_.end() - 1);
    for (std::size_t s = 0; s < slots; ++s) {
      if (slot_expert_[s] == empty_slot)
        continue;
      const auto e = static_cast<std::size_t>(slot_expert_[s]);
      replica_slots_[static_cast<std::size_t>(cursor[e]++)] = static_cast<std::int32_t>(s);
    }
    for (int e = 0; e < num_experts; ++e) {
      const auto replicas = slots_of(e);
      for (std::size_t i = 1; i < replicas.size(); ++i)
        WEAVE_EXPECT(device_of_slot(replicas[i]) != device_of_slot(replicas[i - 1]),
                     errc::invalid_argument, "expert ", e, " has two replicas on device ",
                     device_of_slot(replicas[i]));
    }
  }

  //! Experts `[d * E / D, (d + 1) * E / D)` on device `d`: the Megatron/DeepSpeed/Tutel layout.
  //! Throws `errc::invalid_argument` unless `num_devices` divides `num_experts`.
  static placement contiguous(int num_experts, int num_devices) {
    WEAVE_EXPECT(num_devices > 0 && num_experts > 0 && num_experts % num_devices == 0,
                 errc::invalid_argument, num_experts, " experts do not divide over ", num_devices,
                 " devices");
    std::vector<std::int32_t> slots(static_cast<std::size_t>(num_experts));
    for (int e = 0; e < num_experts; ++e)
      slots[static_cast<std::size_t>(e)] = e;
    return placement(num_experts, num_devices, std::move(slots));
  }

  int num_experts() const noexcept { return num_experts_; }
  int num_devices() const noexcept { return num_devices_; }
  int slots_per_device() const noexcept { return slots_per_device_; }
  //! Physical slots, empty ones included (`num_devices() * slots_per_device()`).
  int num_slots() const noexcept { return static_cast<int>(slot_expert_.size()); }
  //! Slots holding an expert.
  int num_filled_slots() const noexcept { return filled_; }
  //! True when some slot holds no expert.
  bool has_empty_slots() const noexcept { return filled_ < num_slots(); }
  //! Slots of `device` holding an expert.
  int filled_slots_on(int device) const noexcept {
    int n = 0;
    for (int l = 0; l < slots_per_device_; ++l)
      n += slot_expert_[static_cast<std::size_t>(device * slots_per_device_ + l)] != empty_slot;
    return n;
  }
  //! True when some expert has more than one replica.
  bool replicated() const noexcept { return filled_ > num_experts_; }

  int device_of_slot(int slot) const noexcept { return slot / slots_per_device_; }
  int local_of_slot(int slot) const noexcept { return slot % slots_per_device_; }
  //! The expert in `slot`, or `empty_slot`.
  int expert_of_slot(int slot) const noexcept {
    return slot_expert_[static_cast<std::size_t>(slot)];
  }
  //! Logical expert of each slot (or `empty_slot`), device-major.
  std::span<const std::int32_t> slot_experts() const noexcept { return slot_expert_; }

  //! The slots holding `expert`, in ascending order (at least one).
  std::span<const std::int32_t> slots_of(int expert) const noexcept {
    const auto first = static_cast<std::size_t>(replica_offsets_[static_cast<std::size_t>(expert)]);
    const auto last =
        static_cast<std::size_t>(replica_offsets_[static_cast<std::size_t>(expert) + 1]);
    return std::span<const std::int32_t>(replica_slots_).subspan(first, last - first);
  }

  //! The replica of `expert` that token number `token` from `source_device` is sent to: the one
  //! on the source device if there is one (no traffic at all), else replicas in turn by token
  //! index (deterministic, spreads load evenly). Unreplicated experts have one answer.
  int slot_for(int expert, std::size_t token, int source_device) const noexcept {
    const auto replicas = slots_of(expert);
    if (replicas.size() == 1)
      return replicas[0];
    for (const std::int32_t s : replicas)
      if (device_of_slot(s) == source_device)
        return s;
    return replicas[token % replicas.size()];
  }

  //! Device that holds expert `expert`, for unreplicated placements (its first replica's device).
  int device_of(int expert) const noexcept { return device_of_slot(slots_of(expert)[0]); }

  friend bool operator==(const placement& a, const placement& b) {
    return a.num_experts_ == b.num_experts_ && a.num_devices_ == b.num_devices_ &&
           a.slot_expert_ == b.slot_expert_;
  }

 private:
  int num_experts_ = 0;
  int num_devices_ = 0;
  int slots_per_device_ = 0;
  int filled_ = 0;
  std::vector<std::int32_t> slot_expert_;     // slot -> logical expert
  std::vector<std::int32_t> replica_offsets_; // expert -> [begin, end) in replica_slots_
  std::vector<std::int32_t> replica_slots_;   // slots grouped by expert, ascending
};

WEAVE_NAMESPACE_END
