//! \file
//! `stream_allocator<Space>`: where a device algorithm gets the memory it sizes at call time
//! (the receive-side buffers of a dynamic-shape exchange, sized from the counts it has just
//! received). Stream-ordered, as `cudaMallocAsync` / `cudaFreeAsync`: memory allocated on a
//! stream may be used by work enqueued on it after the call (and by other streams ordered after
//! that point); memory freed on a stream is released once the stream reaches the free, so work
//! queued before it may still use it.
//!
//! The default is the space's own (`Space::allocate_async` / `Space::free_async`: CUDA's
//! stream-ordered pool of the current device; host spaces: the heap, freed in stream order). A
//! framework with its own caching allocator (PyTorch's, say) passes one built on it.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"

#include <cstddef>
#include <functional>
#include <utility>

WEAVE_NAMESPACE_BEGIN

//! A stream-ordered allocator of memory of `Space` (see the file comment). Both functions must be
//! set. `allocate(bytes, s)` returns memory aligned to 256 bytes, usable in stream order from
//! `s` (or throws); `deallocate(p, bytes, s)` never throws and frees `p` once `s` reaches this
//! point, or at once when `s` is null (the work that used `p` has completed).
template <class Space>
struct stream_allocator {
  using stream_type = typename Space::stream_type;
  std::function<void*(std::size_t bytes, stream_type& s)> allocate;
  std::function<void(void* p, std::size_t bytes, stream_type* s)> deallocate;

  //! The space's own stream-ordered allocation.
  static stream_allocator space_default() {
    return {[](std::size_t bytes, stream_type& s) { return Space::allocate_async(bytes, s); },
            [](void* p, std::size_t bytes, stream_type* s) { Space::free_async(p, bytes, s); }};
  }
};

//! One allocation of a `stream_allocator`, released (in stream order) on the stream it is given
//! when replaced or reset. Move-only.
template <class Space>
class stream_block {
 public:
  using stream_type = typename Space::stream_type;

  stream_block() = default;
  stream_block(const stream_block&) = delete;
  stream_block& operator=(const stream_block&) = delete;
  stream_block(stream_block&& o) noexcept
      : alloc_(std::exchange(o.alloc_, nullptr))
      , data_(std::exchange(o.data_, nullptr))
      , bytes_(std::exchange(o.bytes_, 0)) {}
  //! Frees at once: the work that used the block must have completed.
  ~stream_block() { release(nullptr); }

  //! Replaces the block by `bytes` bytes from `alloc`, allocated on `s`; the old block is freed
  //! on `s` (after the work queued on it). Keeps nothing.
  void replace(const stream_allocator<Space>& alloc, std::size_t bytes, stream_type& s) {
    WEAVE_EXPECT(alloc.allocate && alloc.deallocate, errc::invalid_argument,
                 "a stream_allocator needs both allocate and deallocate");
    void* fresh = alloc.allocate(bytes, s);
    WEAVE_EXPECT(fresh != nullptr || bytes == 0, errc::internal,
                 "stream_allocator returned null for ", bytes, " bytes");
    release(&s);
    alloc_ = &alloc;
    data_ = static_cast<std::byte*>(fresh);
    bytes_ = bytes;
  }

  //! Frees the block on `s` (after the work queued on it), or at once for a null `s`.
  void release(stream_type* s) noexcept {
    if (data_ != nullptr && alloc_ != nullptr)
      alloc_->deallocate(data_, bytes_, s);
    data_ = nullptr;
    bytes_ = 0;
  }

  std::byte* data() const noexcept { return data_; }
  std::size_t bytes() const noexcept { return bytes_; }

 private:
  const stream_allocator<Space>* alloc_ = nullptr;
  std::byte* data_ = nullptr;
  std::size_t bytes_ = 0;
};

WEAVE_NAMESPACE_END
