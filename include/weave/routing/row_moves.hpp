//! \file
//! `row_moves<Space>`: the two row primitives of the device algorithms (gather and merge), with
//! the forms static shapes need: index -1 leaves a row untouched (padding), and the row count
//! may be read from memory of the space when the step runs. Specialised for `host_space` in
//! `weave/routing/host_row_moves.hpp` (over the host kernels' arithmetic, so results equal
//! `gather_rows` / `merge_rows` bitwise) and for `cuda_space` in
//! `weave/routing/cuda_row_moves.cuh`.
//!
//! - `gather(s, src, dst, index, scale, count)`: for i < n, dst[i] = src[index[i]] (times
//!   scale[i] when `scale` is not null) where index[i] >= 0;
//! - `merge(s, src, dst, index, k, weight, count, skip_empty)`: for i < n, dst[i] = the sum over
//!   j < k with index[i*k+j] >= 0 of weight[i*k+j] * src[index[i*k+j]] (plain sum when
//!   `weight` is null), in j order with fp32 accumulation; a row with no index becomes zeros,
//!   or is left untouched with `skip_empty`;
//! - `dot(s, a, b, out, count)`: for i < n, out[i] = the fp32 sum over columns of a[i] * b[i]
//!   (host: in column order; CUDA: a fixed warp reduction order, so both are deterministic);
//! where n = dst.rows(), or min(*count, dst.rows()) when `count` is not null. Indices come from
//! plans and are not range-checked.
#pragma once

#include "weave/core/config.hpp"

#include <cstddef>
#include <cstdint>

WEAVE_NAMESPACE_BEGIN

namespace detail {

//! The rows a counted host step visits: `capacity`, or min(*count, capacity) when `count` is
//! not null (a count of zero or less visits none).
inline std::size_t counted_rows(const std::int64_t* count, std::size_t capacity) noexcept {
  if (count == nullptr)
    return capacity;
  return *count <= 0                                   ? 0
         : static_cast<std::size_t>(*count) < capacity ? static_cast<std::size_t>(*count)
                                                       : capacity;
}

} // namespace detail

//! Row primitives of an execution space (specialised per space).
template <class Space>
struct row_moves;

WEAVE_NAMESPACE_END
