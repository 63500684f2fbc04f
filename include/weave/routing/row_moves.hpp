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
//! plans and are not range-checked. Serial spaces (`serial_space`) also have
//! - `scatter(s, src, dst, index, k, scale, count)`: for i < n (source rows, counted as above
//!   over src.rows()) and j < k with index[i*k+j] >= 0, dst[index[i*k+j]] = src[i] (times
//!   scale[i*k+j]), each destination written once;
//! and `layout_move` picks between the two forms of a move whose inverse map is known.
#pragma once

#include "weave/core/config.hpp"
#include "weave/exec/space.hpp"

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

//! The move `gather(s, src, dst, by_dst, scale_by_dst, dst_count)` given with its inverse map
//! `by_src` (k destination rows per source row, -1 none, each destination once; with
//! `scale_by_src` aligned to it, over `src_count` source rows when not null): a serial space
//! scatters through the inverse, reading each source row once, in order, where a gather would
//! read a source row once per destination; a GPU gathers (coalesced writes).
template <class Space, class Src, class Dst>
void layout_move(typename Space::stream_arg s, const Src& src, const Dst& dst,
                 const std::int64_t* by_dst, const float* scale_by_dst,
                 const std::int64_t* dst_count, const std::int64_t* by_src, int k,
                 const float* scale_by_src, const std::int64_t* src_count) {
  if constexpr (serial_space<Space>)
    row_moves<Space>::scatter(s, src, dst, by_src, k, scale_by_src, src_count);
  else
    row_moves<Space>::gather(s, src, dst, by_dst, scale_by_dst, dst_count);
}

WEAVE_NAMESPACE_END
