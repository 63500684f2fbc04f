//! \file
//! Where a buffer lives. weave never dereferences memory a space says it cannot reach.
#pragma once

#include "weave/core/config.hpp"

#include <cstdint>
#include <ostream>

WEAVE_NAMESPACE_BEGIN

//! The memory space of a buffer.
enum class memory_space : std::uint8_t {
  host,    //!< pageable host memory
  pinned,  //!< page-locked host memory (reachable by the host and by copy engines)
  device,  //!< memory of one GPU
  managed, //!< CUDA unified memory
};

constexpr const char* to_string(memory_space space) noexcept {
  switch (space) {
  case memory_space::host:
    return "host";
  case memory_space::pinned:
    return "pinned";
  case memory_space::device:
    return "device";
  case memory_space::managed:
    return "managed";
  }
  return "?";
}

inline std::ostream& operator<<(std::ostream& out, memory_space space) {
  return out << to_string(space);
}

//! True where host code may read and write the memory directly.
constexpr bool host_accessible(memory_space space) noexcept {
  return space != memory_space::device;
}

//! True where device kernels may read and write the memory directly.
constexpr bool device_accessible(memory_space space) noexcept {
  return space != memory_space::host;
}

WEAVE_NAMESPACE_END
