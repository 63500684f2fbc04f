//! \file
//! Carving typed scratch arrays out of one caller-provided buffer.
//!
//! Plans follow the CUTLASS pattern: the caller asks `workspace_size()`, allocates once, and
//! hands the bytes to `initialize()`. Both run the same carving code (`workspace_carver` with a
//! null base only measures), so a size query can never disagree with what is later used.
#pragma once

#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>

WEAVE_NAMESPACE_BEGIN

//! Hands out aligned sub-arrays of a byte buffer, front to back.
class workspace_carver {
 public:
  //! A carver that only measures: `take` returns empty spans and `used()` is the size needed.
  constexpr workspace_carver() noexcept = default;
  //! A carver over `bytes` bytes at `base` (aligned to `base_alignment`, as `cudaMalloc` and
  //! `operator new(std::align_val_t)` give); taking more than that throws `errc::size_mismatch`.
  workspace_carver(void* base, std::size_t bytes)
      : base_(static_cast<std::byte*>(base))
      , capacity_(bytes)
      , measuring_(base == nullptr) {
    WEAVE_EXPECT(reinterpret_cast<std::uintptr_t>(base) % base_alignment == 0,
                 errc::invalid_argument, "workspace at ", base, " is not aligned to ",
                 base_alignment, " bytes");
  }

  //! Alignment a workspace base must have; offsets are aligned relative to it.
  static constexpr std::size_t base_alignment = 256;

  //! The next `count` elements of `T`, aligned to `alignment` (at least `alignof(T)`).
  template <class T>
  std::span<T> take(std::size_t count, std::size_t alignment = base_alignment) {
    static_assert(std::is_trivially_copyable_v<T>, "workspace holds trivially copyable types");
    WEAVE_EXPECT(alignment != 0 && (alignment & (alignment - 1)) == 0 &&
                     alignment <= base_alignment,
                 errc::invalid_argument, "workspace alignment ", alignment,
                 " is not a power of two up to ", base_alignment);
    const std::size_t align = alignment < alignof(T) ? alignof(T) : alignment;
    const std::size_t offset = align_up(used_, align);
    const std::size_t end = checked_add(offset, checked_mul(count, sizeof(T), "workspace array"));
    used_ = end;
    if (measuring_)
      return {};
    WEAVE_EXPECT(end <= capacity_, errc::size_mismatch, "workspace of ", capacity_,
                 " bytes is too small: needs at least ", end, " bytes");
    return {reinterpret_cast<T*>(base_ + offset), count};
  }

  //! Bytes taken so far (including alignment padding).
  constexpr std::size_t used() const noexcept { return used_; }
  constexpr bool measuring() const noexcept { return measuring_; }

 private:
  std::byte* base_ = nullptr;
  std::size_t capacity_ = 0;
  std::size_t used_ = 0;
  bool measuring_ = true;
};

//! The recorder of a `carve(self, carver)` function shared by a size query (`Self` const, a
//! measuring carver) and the real carving: `record(ptr, count)` takes `count` elements of the
//! pointer's type and, unless `Self` is const, points `ptr` at them.
template <class Self>
auto carve_into(workspace_carver& carver) {
  return [&carver]<class T>(T* const& ptr, std::size_t count) {
    const std::span<T> taken = carver.take<T>(count);
    if constexpr (!std::is_const_v<Self>)
      const_cast<T*&>(ptr) = taken.data();
    else
      (void)taken;
  };
}

WEAVE_NAMESPACE_END
