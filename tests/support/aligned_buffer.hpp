// A 256-byte aligned host buffer poisoned with 0xFF bytes (NaN floats, -1 indices), freed at
// scope exit: the workspace of device algorithms run in host_space.
#pragma once

#include <cstddef>
#include <cstring>
#include <new>

namespace weave_test {

struct aligned_buffer {
  explicit aligned_buffer(std::size_t bytes)
      : ptr(static_cast<std::byte*>(::operator new (bytes == 0 ? 1 : bytes, std::align_val_t{256})))
      , size(bytes) {
    std::memset(ptr, 0xFF, bytes);
  }
  ~aligned_buffer() { ::operator delete (ptr, std::align_val_t{256}); }
  aligned_buffer(const aligned_buffer&) = delete;
  aligned_buffer& operator=(const aligned_buffer&) = delete;
  std::byte* ptr;
  std::size_t size;
};

} // namespace weave_test
