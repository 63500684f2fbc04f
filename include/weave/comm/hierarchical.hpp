//! \file
//! `hierarchical_all_to_all`: Tutel's 2D-hierarchical (2DH) all-to-all over `nodes x local`
//! ranks, built from an intra-node and an inter-node sub-communicator.
//!
//! Global rank g = node * local_size + local_rank. Instead of every rank sending a small message
//! to every other rank across the network, each rank first exchanges inside its node, grouping
//! by destination local rank (what it and its node peers send to local rank l' of every node
//! ends up on local rank l'), and then only same-local-rank peers of different nodes exchange,
//! each message now aggregating a whole node's traffic. Results are identical to the flat
//! all-to-all byte for byte. Cost: one count exchange inside the node and three local copies
//! (pack, regroup, unpack) through staging buffers allocated once at construction.
#pragma once

#include "weave/comm/communicator.hpp"
#include "weave/core/checked.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

WEAVE_NAMESPACE_BEGIN

//! A 2DH all-to-all plan. Borrows both communicators; owns three staging buffers of
//! `staging_bytes` each, which must hold this rank's total send bytes, its total receive bytes,
//! and everything its node peers route through it (at most local_size times the largest
//! per-rank send total). Operations on one plan run in stream order, so several may be queued
//! on one stream; the plan and both communicators must outlive them.
template <communicator Intra, communicator Inter>
requires std::same_as<typename Intra::stream_type, typename Inter::stream_type> &&
    host_executor<typename Intra::stream_type> && has_exchange_counts<Intra>
class hierarchical_all_to_all {
 public:
  using stream_type = typename Intra::stream_type;

  //! `intra`: the ranks of this node (rank = local rank); `inter`: the ranks with this local
  //! rank on every node (rank = node). All nodes must have the same number of local ranks.
  hierarchical_all_to_all(Intra& intra, Inter& inter, std::size_t staging_bytes)
      : intra_(intra)
      , inter_(inter)
      , local_(intra.size())
      , nodes_(inter.size())
      , capacity_(staging_bytes)
      , pack_(staging_bytes)
      , routed_(staging_bytes)
      , regrouped_(staging_bytes)
      , block_counts_send_(std::size_t(local_) * std::size_t(nodes_))
      , block_counts_recv_(block_counts_send_.size())
      , intra_layout_(4 * std::size_t(local_))
      , inter_layout_(4 * std::size_t(nodes_)) {}

  //! Global rank: node * local_size + local rank.
  int rank() const { return inter_.rank() * local_ + intra_.rank(); }
  //! Global size: nodes * local_size.
  int size() const { return nodes_ * local_; }
  int local_size() const noexcept { return local_; }
  int nodes() const noexcept { return nodes_; }

  //! Enqueues the same exchange as the flat `all_to_all_v` over the global ranks.
  void all_to_all_v(stream_type& s, const void* send, std::span<const std::int64_t> send_counts,
                    std::span<const std::int64_t> send_displs, void* recv,
                    std::span<const std::int64_t> recv_counts,
                    std::span<const std::int64_t> recv_displs, std::size_t unit = 1) {
    s.submit([=, this] { pack(send, send_counts, send_displs, recv_counts, recv_displs, unit); });
    intra_.exchange_counts(s, std::span<const std::int64_t>(block_counts_send_),
                           std::span<std::int64_t>(block_counts_recv_));
    s.submit([this] { plan_intra(); });
    weave::all_to_all_v(intra_, s, pack_.data(), part(intra_layout_, 0, local_),
                        part(intra_layout_, 1, local_), routed_.data(),
                        part(intra_layout_, 2, local_), part(intra_layout_, 3, local_));
    s.submit([=, this] { regroup(recv_counts, unit); });
    weave::all_to_all_v(inter_, s, regrouped_.data(), part(inter_layout_, 0, nodes_),
                        part(inter_layout_, 1, nodes_), pack_.data(),
                        part(inter_layout_, 2, nodes_), part(inter_layout_, 3, nodes_));
    s.submit([=, this] { unpack(recv, recv_counts, recv_displs, unit); });
  }

 private:
  static std::span<const std::int64_t> part(const std::vector<std::int64_t>& v, int which, int n) {
    return std::span<const std::int64_t>(v).subspan(std::size_t(which) * std::size_t(n),
                                                    std::size_t(n));
  }
  std::int64_t* layout(std::vector<std::int64_t>& v, int which, int n) {
    return v.data() + std::size_t(which) * std::size_t(n);
  }

  void fits(std::int64_t bytes, const char* what) const {
    WEAVE_EXPECT(static_cast<std::uint64_t>(bytes) <= capacity_, errc::size_overflow,
                 "hierarchical_all_to_all: ", what, " needs ", bytes,
                 " staging bytes but the plan has ", capacity_);
  }

  // Groups this rank's blocks by destination local rank l', then node m, and announces the
  // block sizes to the node peers.
  void pack(const void* send, std::span<const std::int64_t> send_counts,
            std::span<const std::int64_t> send_displs, std::span<const std::int64_t> recv_counts,
            std::span<const std::int64_t> recv_displs, std::size_t unit) {
    const int n = size();
    detail::check_layout(n, send_counts, send_displs, unit, "send");
    detail::check_layout(n, recv_counts, recv_displs, unit, "receive");
    const auto u = static_cast<std::int64_t>(unit);
    std::int64_t* counts = layout(intra_layout_, 0, local_);
    std::int64_t* displs = layout(intra_layout_, 1, local_);
    std::int64_t offset = 0;
    for (int l = 0; l < local_; ++l) {
      displs[l] = offset;
      for (int m = 0; m < nodes_; ++m) {
        const auto g = std::size_t(m * local_ + l);
        const std::int64_t bytes = send_counts[g] * u;
        block_counts_send_[std::size_t(l * nodes_ + m)] = bytes;
        fits(offset + bytes, "the packed send");
        if (bytes > 0)
          std::memcpy(pack_.data() + offset,
                      static_cast<const std::byte*>(send) + send_displs[g] * u,
                      static_cast<std::size_t>(bytes));
        offset += bytes;
      }
      counts[l] = offset - displs[l];
    }
  }

  void plan_intra() {
    std::int64_t* counts = layout(intra_layout_, 2, local_);
    std::int64_t* displs = layout(intra_layout_, 3, local_);
    std::int64_t offset = 0;
    for (int l = 0; l < local_; ++l) {
      displs[l] = offset;
      for (int m = 0; m < nodes_; ++m)
        offset += block_counts_recv_[std::size_t(l * nodes_ + m)];
      counts[l] = offset - displs[l];
    }
    fits(offset, "routing through this rank");
  }

  // routed_ holds, per source local rank l, its blocks for (node m, this local rank) in node
  // order; regroup them by node so each node receives one contiguous message.
  void regroup(std::span<const std::int64_t> recv_counts, std::size_t unit) {
    const std::int64_t* routed_displs = layout(intra_layout_, 3, local_);
    std::int64_t* counts = layout(inter_layout_, 0, nodes_);
    std::int64_t* displs = layout(inter_layout_, 1, nodes_);
    std::int64_t offset = 0;
    for (int m = 0; m < nodes_; ++m) {
      displs[m] = offset;
      for (int l = 0; l < local_; ++l) {
        std::int64_t at = routed_displs[l];
        for (int before = 0; before < m; ++before)
          at += block_counts_recv_[std::size_t(l * nodes_ + before)];
        const std::int64_t bytes = block_counts_recv_[std::size_t(l * nodes_ + m)];
        if (bytes > 0)
          std::memcpy(regrouped_.data() + offset, routed_.data() + at,
                      static_cast<std::size_t>(bytes));
        offset += bytes;
      }
      counts[m] = offset - displs[m];
    }
    std::int64_t* rcounts = layout(inter_layout_, 2, nodes_);
    std::int64_t* rdispls = layout(inter_layout_, 3, nodes_);
    offset = 0;
    for (int m = 0; m < nodes_; ++m) {
      rdispls[m] = offset;
      for (int l = 0; l < local_; ++l)
        offset += recv_counts[std::size_t(m * local_ + l)] * static_cast<std::int64_t>(unit);
      rcounts[m] = offset - rdispls[m];
    }
    fits(offset, "the receive");
  }

  // pack_ now holds, per source node n, the blocks of its local ranks 0..L-1 for this rank.
  void unpack(void* recv, std::span<const std::int64_t> recv_counts,
              std::span<const std::int64_t> recv_displs, std::size_t unit) {
    const auto u = static_cast<std::int64_t>(unit);
    std::int64_t offset = 0;
    for (int g = 0; g < size(); ++g) {
      const std::int64_t bytes = recv_counts[std::size_t(g)] * u;
      if (bytes > 0)
        std::memcpy(static_cast<std::byte*>(recv) + recv_displs[std::size_t(g)] * u,
                    pack_.data() + offset, static_cast<std::size_t>(bytes));
      offset += bytes;
    }
  }

  Intra& intra_;
  Inter& inter_;
  int local_;
  int nodes_;
  std::size_t capacity_;
  std::vector<std::byte> pack_;                 // packed send, then the final receive
  std::vector<std::byte> routed_;               // what node peers route through this rank
  std::vector<std::byte> regrouped_;            // the same, grouped by destination node
  std::vector<std::int64_t> block_counts_send_; // [l' * nodes + m]: bytes for (m, l')
  std::vector<std::int64_t> block_counts_recv_; // [l * nodes + m]: bytes from (node, l) for (m, me)
  std::vector<std::int64_t> intra_layout_;      // send counts, displs, recv counts, displs
  std::vector<std::int64_t> inter_layout_;
};

WEAVE_NAMESPACE_END
