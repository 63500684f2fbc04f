//! \file
//! Replicated placement of many MoE layers in one call: every layer is placed exactly as
//! `place_replicated` places it alone (same options, its own current placement), optionally on
//! several threads, one layer at a time per thread.
#pragma once

#include "weave/core/config.hpp"
#include "weave/core/error.hpp"
#include "weave/placement/placement.hpp"
#include "weave/placement/replication.hpp"
#include "weave/placement/statistics.hpp"
#include "weave/placement/topology.hpp"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <exception>
#include <span>
#include <system_error>
#include <thread>
#include <vector>

WEAVE_NAMESPACE_BEGIN

//! Options of `place_replicated_layers`.
struct layer_replication_options {
  //! Options of every layer; `layer.current` must be null (use `current` below).
  replication_options layer = {};
  //! Each layer's current placement (one per layer), or empty for none.
  std::span<const placement> current = {};
  //! Layers placed at once; 0 means `std::thread::hardware_concurrency()`.
  int threads = 1;
};

namespace detail {

//! Runs `place(l)` for every layer l on up to `threads` threads; rethrows the error of the
//! lowest failing layer (a `weave::error` with "layer l: " before its message).
template <class Place>
std::vector<placement> for_each_layer(std::size_t layers, const layer_replication_options& o,
                                      Place place) {
  WEAVE_EXPECT(o.layer.current == nullptr, errc::invalid_argument,
               "layer.current is set; give each layer's current placement in `current`");
  WEAVE_EXPECT(o.current.empty() || o.current.size() == layers, errc::size_mismatch,
               o.current.size(), " current placements for ", layers, " layers");
  WEAVE_EXPECT(o.threads >= 0, errc::invalid_argument, "threads = ", o.threads);
  std::vector<placement> out(layers);
  std::vector<std::exception_ptr> failed(layers);
  std::atomic<std::size_t> next{0};
  auto work = [&] {
    for (std::size_t l = next++; l < layers; l = next++) {
      try {
        replication_options lo = o.layer;
        lo.current = o.current.empty() ? nullptr : &o.current[l];
        out[l] = place(l, lo);
      } catch (...) {
        failed[l] = std::current_exception();
      }
    }
  };
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  const std::size_t threads =
      std::min<std::size_t>(layers, o.threads == 0 ? hw : static_cast<unsigned>(o.threads));
  // The calling thread works too; if a helper cannot start, the others take its layers.
  std::vector<std::thread> helpers;
  try {
    for (std::size_t t = 1; t < threads; ++t)
      helpers.emplace_back(work);
  } catch (const std::system_error&) {
  }
  work();
  for (auto& t : helpers)
    t.join();
  for (std::size_t l = 0; l < layers; ++l)
    if (failed[l]) {
      try {
        std::rethrow_exception(failed[l]);
      } catch (const error& e) {
        throw error(e.code(), concat("layer ", l, ": ", e.message()), e.where());
      }
    }
  return out;
}

} // namespace detail

//! `place_replicated` of every layer of `loads` (layers × `num_experts`, row-major). Throws
//! `errc::size_mismatch` when `loads` is not whole layers or `current` has another number of
//! layers, `errc::invalid_argument` for `layer.current` set or negative threads, and whatever
//! `place_replicated` throws for a layer (its message starts with "layer l: ").
inline std::vector<placement> place_replicated_layers(std::span<const double> loads,
                                                      int num_experts, const topology& topo,
                                                      const layer_replication_options& options) {
  WEAVE_EXPECT(num_experts > 0 && loads.size() % static_cast<std::size_t>(num_experts) == 0,
               errc::size_mismatch, loads.size(), " loads are not whole layers of ", num_experts,
               " experts");
  const auto E = static_cast<std::size_t>(num_experts);
  return detail::for_each_layer(loads.size() / E, options,
                                [&](std::size_t l, const replication_options& lo) {
                                  return place_replicated(loads.subspan(l * E, E), topo, lo);
                                });
}

//! `place_replicated` on the statistics of every layer (co-activation included).
inline std::vector<placement> place_replicated_layers(std::span<const expert_statistics> stats,
                                                      const topology& topo,
                                                      const layer_replication_options& options) {
  return detail::for_each_layer(stats.size(), options,
                                [&](std::size_t l, const replication_options& lo) {
                                  return place_replicated(stats[l], topo, lo);
                                });
}

WEAVE_NAMESPACE_END
