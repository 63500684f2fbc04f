//! \file
//! `unique_task`: a move-only `void()` callable with small-buffer storage, the unit of work of
//! a `host_stream`. Unlike `std::function` it accepts move-only lambdas (owning captures) and
//! stores captures up to `inline_bytes` without allocating.
#pragma once

#include "weave/core/config.hpp"

#include <cstddef>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>

WEAVE_NAMESPACE_BEGIN

class unique_task {
 public:
  static constexpr std::size_t inline_bytes = 64;

  unique_task() noexcept = default;

  template <class F>
  requires(!std::is_same_v<std::remove_cvref_t<F>, unique_task> &&
           std::is_invocable_r_v<void, std::decay_t<F>&>)
      unique_task(F&& f) { // NOLINT(google-explicit-constructor): callables convert implicitly
    using callable = std::decay_t<F>;
    if constexpr (fits_inline<callable>) {
      ::new (static_cast<void*>(storage_)) callable(std::forward<F>(f));
      ops_ = &inline_ops<callable>;
    } else {
      *reinterpret_cast<callable**>(storage_) = new callable(std::forward<F>(f));
      ops_ = &heap_ops<callable>;
    }
  }

  unique_task(unique_task&& other) noexcept
      : ops_(other.ops_) {
    if (ops_)
      ops_->relocate(storage_, other.storage_);
    other.ops_ = nullptr;
  }

  unique_task& operator=(unique_task&& other) noexcept {
    if (this != &other) {
      reset();
      ops_ = other.ops_;
      if (ops_)
        ops_->relocate(storage_, other.storage_);
      other.ops_ = nullptr;
    }
    return *this;
  }

  unique_task(const unique_task&) = delete;
  unique_task& operator=(const unique_task&) = delete;
  ~unique_task() { reset(); }

  explicit operator bool() const noexcept { return ops_ != nullptr; }
  void operator()() { ops_->invoke(storage_); }

  void reset() noexcept {
    if (ops_)
      ops_->destroy(storage_);
    ops_ = nullptr;
  }

 private:
  struct operations {
    void (*invoke)(void*);
    void (*relocate)(void* to, void* from) noexcept; // move-construct into `to`, destroy `from`
    void (*destroy)(void*) noexcept;
  };

  template <class C>
  static constexpr bool fits_inline =
      sizeof(C) <= inline_bytes &&
      alignof(C) <= alignof(std::max_align_t) && std::is_nothrow_move_constructible_v<C>;

  template <class C>
  static constexpr operations inline_ops{
      [](void* p) { (*std::launder(static_cast<C*>(p)))(); },
      [](void* to, void* from) noexcept {
        C* source = std::launder(static_cast<C*>(from));
        ::new (to) C(std::move(*source));
        source->~C();
      },
      [](void* p) noexcept { std::launder(static_cast<C*>(p))->~C(); }};

  template <class C>
  static constexpr operations heap_ops{
      [](void* p) { (**static_cast<C**>(p))(); },
      [](void* to, void* from) noexcept { *static_cast<C**>(to) = *static_cast<C**>(from); },
      [](void* p) noexcept { delete *static_cast<C**>(p); }};

  alignas(std::max_align_t) std::byte storage_[inline_bytes];
  const operations* ops_ = nullptr;
};

WEAVE_NAMESPACE_END
