//! \file
//! The maps the device row kernels read, as spans over memory of an execution space: what the
//! device plans expose (`device_dispatch_plan::maps`, `device_expert_plan::maps`) for the CUDA
//! layout moves (`layout_move` and `row_moves<cuda_space>`, `cuda_row_moves.cuh`).
#pragma once

#include "weave/core/config.hpp"

#include <cstdint>
#include <span>

WEAVE_NAMESPACE_BEGIN

//! A dispatch plan's maps (spans over device memory).
struct device_dispatch_maps {
  std::span<const std::int64_t> row_token;  //!< ORI token of each SFD row
  std::span<const std::int64_t> token_rows; //!< k SFD rows per token, -1 padded
  int k = 0;                                //!< entries per token in `token_rows`
};

//! An expert plan's maps (spans over device memory).
struct device_expert_maps {
  std::span<const std::int64_t> epd_row_source; //!< received row of each EPD row
  std::span<const float> epd_weight;            //!< gate weight of each EPD row
  std::span<const std::int64_t> row_epd;        //!< k EPD rows per received row, -1 padded
  std::span<const float> row_weight;            //!< k gate weights per received row
  int k = 0;                                    //!< entries per received row
};

WEAVE_NAMESPACE_END
