//! \file
//! `host_mirror<Space, T>`: host memory that an execution space's copies fill (or read) without
//! blocking the host, for the values a device algorithm's host code reads after a
//! stream-ordered copy (counts, status words, flags). On CUDA it is pinned memory: a
//! device-to-host copy into pageable memory blocks the calling thread until the stream has run
//! the copy, outside any watchdog, so a dead peer would hang the host there instead of ending
//! in the communicator's timeout; and a CUDA graph cannot capture such a copy.
#pragma once

#include "weave/core/config.hpp"

#include <cstddef>
#include <new>
#include <span>
#include <type_traits>
#include <utility>

WEAVE_NAMESPACE_BEGIN

//! `n` values of `T` (value-initialised) in host memory of `Space`'s choosing
//! (`Space::allocate_host` when it has one, else the heap). Allocate it once, with its owner:
//! pinned allocations are slow and, on CUDA, freeing one synchronizes the device.
template <class Space, class T>
class host_mirror {
  static_assert(std::is_trivially_copyable_v<T>, "a host mirror holds trivially copyable values");

 public:
  host_mirror() = default;
  explicit host_mirror(std::size_t n)
      : size_(n) {
    if (n == 0)
      return;
    if constexpr (requires { Space::allocate_host(std::size_t{}); })
      data_ = static_cast<T*>(Space::allocate_host(n * sizeof(T)));
    else
      data_ = static_cast<T*>(::operator new(n * sizeof(T)));
    for (std::size_t i = 0; i < n; ++i)
      ::new (static_cast<void*>(data_ + i)) T{};
  }
  host_mirror(host_mirror&& other) noexcept
      : data_(std::exchange(other.data_, nullptr))
      , size_(std::exchange(other.size_, 0)) {}
  host_mirror& operator=(host_mirror&& other) noexcept {
    if (this != &other) {
      release();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
    }
    return *this;
  }
  host_mirror(const host_mirror&) = delete;
  host_mirror& operator=(const host_mirror&) = delete;
  ~host_mirror() { release(); }

  T* data() noexcept { return data_; }
  const T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  T& operator[](std::size_t i) noexcept { return data_[i]; }
  const T& operator[](std::size_t i) const noexcept { return data_[i]; }
  T* begin() noexcept { return data_; }
  T* end() noexcept { return data_ + size_; }
  const T* begin() const noexcept { return data_; }
  const T* end() const noexcept { return data_ + size_; }
  operator std::span<T>() noexcept { return {data_, size_}; }             // NOLINT
  operator std::span<const T>() const noexcept { return {data_, size_}; } // NOLINT

 private:
  void release() noexcept {
    if (data_ == nullptr)
      return;
    if constexpr (requires { Space::free_host(static_cast<void*>(nullptr)); })
      Space::free_host(data_);
    else
      ::operator delete(data_);
    data_ = nullptr;
    size_ = 0;
  }

  T* data_ = nullptr;
  std::size_t size_ = 0;
};

WEAVE_NAMESPACE_END
