// The raw-MPI decode reference of bench_decode_mpi: one decode MoE layer written by hand with
// plain MPI and plain loops, no weave, doing the work a weave decode layer does with the
// benchmark's experts, so that the two compare as implementations of the same layer:
//  - dispatch: one record per (token, device) its top-k reach, the token's row with its choices
//    there (expert, weight), in fixed slots of `tokens` records per peer; one MPI_Alltoallv
//    (a rank's block to itself is its record count only: its own tokens are read in place);
//  - experts: each (record, choice) row copied to its own output row (the benchmark's experts),
//    read where it arrived or, with `expert_blocks`, first copied into one block of rows per
//    local expert in (source, record) order, each expert then copying its block (the contract
//    of weave's default decode layer, whose `input(l)` is such a block);
//  - device sums: per record, the weighted sum of its experts' outputs in float, rounded to
//    bf16 once (one row per (token, device), as weave's default combine);
//  - combine: one MPI_Alltoallv of those rows, exactly the received records' (each side knows
//    the counts from the dispatch);
//  - source sums: per token, its devices' rows summed in float, rounded once.
// Expert ids map to devices contiguously (E / size experts each). The layout of a record is
// this file's own; its bytes per peer are within a few percent of weave's.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

namespace raw_mpi_decode {

inline float widen(std::uint16_t b) {
  return std::bit_cast<float>(std::uint32_t{b} << 16);
}

inline std::uint16_t round_bf16(float f) { // round to nearest even (no NaN in these inputs)
  const auto u = std::bit_cast<std::uint32_t>(f);
  return static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

class layer {
 public:
  layer(MPI_Comm comm, std::size_t tokens, std::size_t hidden, int experts, int k,
        bool expert_blocks = false)
      : tokens_(tokens)
      , hidden_(hidden)
      , k_(k)
      , expert_blocks_(expert_blocks) {
    MPI_Comm_dup(comm, &comm_);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    per_device_ = experts / size_;
    const auto n = static_cast<std::size_t>(size_);
    record_ = header_bytes() + hidden_ * 2;
    per_peer_ = 16 + tokens_ * record_;
    send_.resize(n * per_peer_);
    recv_.resize(n * per_peer_);
    counts_.assign(n, static_cast<int>(per_peer_));
    counts_[static_cast<std::size_t>(rank_)] = 16;
    displs_.resize(n);
    for (std::size_t j = 0; j < n; ++j)
      displs_[j] = static_cast<int>(j * per_peer_);
    const std::size_t pairs = n * tokens_ * static_cast<std::size_t>(std::min(k, per_device_));
    expert_out_.resize(pairs * hidden_);
    if (expert_blocks_) {
      expert_in_.resize(pairs * hidden_);
      block_of_.resize(pairs);
      block_start_.resize(static_cast<std::size_t>(per_device_) + 1);
    }
    partial_.resize(n * tokens_ * hidden_); // per source, its records' rows
    returned_.resize(n * tokens_ * hidden_);
    acc_.resize(hidden_);
    choices_.resize(n * static_cast<std::size_t>(k));
    for (auto* v : {&back_send_, &back_recv_, &back_send_displs_, &back_recv_displs_})
      v->resize(n);
    sent_.resize(n);
  }
  ~layer() { MPI_Comm_free(&comm_); }
  layer(const layer&) = delete;
  layer& operator=(const layer&) = delete;

  //! Dispatch bytes per peer (fixed slots).
  std::size_t dispatch_bytes_per_peer() const { return per_peer_; }

  // One layer: `x` and `y` are tokens x hidden bf16 bits, `ids` and `weights` tokens x k.
  void run(std::span<const std::uint16_t> x, std::span<const std::int32_t> ids,
           std::span<const float> weights, std::span<std::uint16_t> y) {
    const auto n = static_cast<std::size_t>(size_);
    const auto me = static_cast<std::size_t>(rank_);
    const auto k = static_cast<std::size_t>(k_);
    // Dispatch: a record per (token, remote device) reached.
    std::fill(sent_.begin(), sent_.end(), 0);
    for (std::size_t t = 0; t < tokens_; ++t) {
      group(ids.subspan(t * k, k), weights.subspan(t * k, k));
      for (std::size_t d = 0; d < n; ++d) {
        const int m = reached_[d];
        if (m == 0 || d == me)
          continue;
        std::byte* r = record(send_.data(), d, sent_[d]++);
        const auto token = static_cast<std::int32_t>(t);
        std::memcpy(r, &token, 4);
        std::memcpy(r + 4, &m, 4);
        std::memcpy(r + 8, &choices_[d * k], static_cast<std::size_t>(m) * 8);
        std::memcpy(r + header_bytes(), &x[t * hidden_], hidden_ * 2);
      }
    }
    for (std::size_t d = 0; d < n; ++d)
      std::memcpy(send_.data() + d * per_peer_, &sent_[d], sizeof(std::int64_t));
    MPI_Alltoallv(send_.data(), counts_.data(), displs_.data(), MPI_BYTE, recv_.data(),
                  counts_.data(), displs_.data(), MPI_BYTE, comm_);
    if (expert_blocks_)
      run_expert_blocks(x, ids);
    else
      run_experts_in_place(x, ids);
    // The device sums, reading each pair's output row.
    std::size_t pair = 0;
    const auto output = [&](std::size_t p) {
      return &expert_out_[(expert_blocks_ ? block_of_[p] : p) * hidden_];
    };
    for (std::size_t s = 0; s < n; ++s) {
      std::uint16_t* out = &partial_[s * tokens_ * hidden_];
      if (s == me) {
        for (std::size_t t = 0; t < tokens_; ++t) {
          std::fill(acc_.begin(), acc_.end(), 0.0f);
          bool any = false;
          for (std::size_t j = 0; j < k; ++j)
            if (device_of(ids[t * k + j]) == me) {
              accumulate(output(pair++), weights[t * k + j]);
              any = true;
            }
          if (any)
            store(out + t * hidden_);
        }
        continue;
      }
      for_each_record(s, [&](std::int64_t i, const std::byte* r, std::int32_t m) {
        std::fill(acc_.begin(), acc_.end(), 0.0f);
        for (std::int32_t c = 0; c < m; ++c) {
          float w = 0;
          std::memcpy(&w, r + 8 + 8 * static_cast<std::size_t>(c) + 4, 4);
          accumulate(output(pair++), w);
        }
        store(out + static_cast<std::size_t>(i) * hidden_);
      });
    }
    // Combine: each source's records' rows back to it.
    for (std::size_t d = 0; d < n; ++d) {
      const int row = static_cast<int>(hidden_ * 2);
      back_send_[d] = d == me ? 0 : static_cast<int>(count_from(d)) * row;
      back_recv_[d] = d == me ? 0 : static_cast<int>(sent_[d]) * row;
      back_send_displs_[d] = static_cast<int>(d * tokens_) * row;
      back_recv_displs_[d] = static_cast<int>(d * tokens_) * row;
    }
    MPI_Alltoallv(partial_.data(), back_send_.data(), back_send_displs_.data(), MPI_BYTE,
                  returned_.data(), back_recv_.data(), back_recv_displs_.data(), MPI_BYTE, comm_);
    // Source sums, devices in rank order.
    std::fill(sent_.begin(), sent_.end(), 0); // each device's next returned row
    for (std::size_t t = 0; t < tokens_; ++t) {
      group(ids.subspan(t * k, k), weights.subspan(t * k, k));
      std::fill(acc_.begin(), acc_.end(), 0.0f);
      for (std::size_t d = 0; d < n; ++d) {
        if (reached_[d] == 0)
          continue;
        const std::uint16_t* row =
            d == me ? &partial_[(me * tokens_ + t) * hidden_]
                    : &returned_[(d * tokens_ + static_cast<std::size_t>(sent_[d]++)) * hidden_];
        accumulate(row, 1.0f);
      }
      store(&y[t * hidden_]);
    }
  }

 private:
  // Calls f(row, local expert) for every pair this rank's experts take, in (source, record,
  // choice) order: a source's own tokens from `x`, the others' from their records.
  template <class F>
  void for_each_pair(std::span<const std::uint16_t> x, std::span<const std::int32_t> ids, F&& f) {
    const auto me = static_cast<std::size_t>(rank_);
    const auto k = static_cast<std::size_t>(k_);
    const std::int32_t first = rank_ * per_device_;
    for (std::size_t s = 0; s < static_cast<std::size_t>(size_); ++s) {
      if (s == me) {
        for (std::size_t t = 0; t < tokens_; ++t)
          for (std::size_t j = 0; j < k; ++j)
            if (device_of(ids[t * k + j]) == me)
              f(&x[t * hidden_], ids[t * k + j] - first);
        continue;
      }
      for_each_record(s, [&](std::int64_t, const std::byte* r, std::int32_t m) {
        const auto* row = reinterpret_cast<const std::uint16_t*>(r + header_bytes());
        for (std::int32_t c = 0; c < m; ++c) {
          std::int32_t id = 0;
          std::memcpy(&id, r + 8 + 8 * static_cast<std::size_t>(c), 4);
          f(row, id - first);
        }
      });
    }
  }
  // Experts: every (record, choice) row copied to its own output row.
  void run_experts_in_place(std::span<const std::uint16_t> x, std::span<const std::int32_t> ids) {
    std::size_t pair = 0;
    for_each_pair(x, ids, [&](const std::uint16_t* row, std::int32_t) {
      std::memcpy(&expert_out_[pair++ * hidden_], row, hidden_ * 2);
    });
  }
  // Experts reading one block each: the rows copied into their expert's block (counted first),
  // then each block copied to the outputs' block at the same rows.
  void run_expert_blocks(std::span<const std::uint16_t> x, std::span<const std::int32_t> ids) {
    std::fill(block_start_.begin(), block_start_.end(), 0);
    for_each_pair(x, ids, [&](const std::uint16_t*, std::int32_t l) {
      ++block_start_[static_cast<std::size_t>(l) + 1];
    });
    for (std::size_t l = 1; l < block_start_.size(); ++l)
      block_start_[l] += block_start_[l - 1];
    std::size_t pair = 0;
    for_each_pair(x, ids, [&](const std::uint16_t* row, std::int32_t l) {
      const std::size_t at = block_start_[static_cast<std::size_t>(l)]++;
      block_of_[pair++] = at;
      std::memcpy(&expert_in_[at * hidden_], row, hidden_ * 2);
    });
    std::size_t begin = 0; // block_start_[l] is now expert l's end
    for (std::size_t l = 0; l + 1 < block_start_.size(); ++l) {
      const std::size_t end = block_start_[l];
      std::memcpy(&expert_out_[begin * hidden_], &expert_in_[begin * hidden_],
                  (end - begin) * hidden_ * 2);
      begin = end;
    }
  }
  std::size_t header_bytes() const { return (8 + 8 * static_cast<std::size_t>(k_) + 15) / 16 * 16; }
  std::size_t device_of(std::int32_t id) const {
    return static_cast<std::size_t>(id / per_device_);
  }
  std::byte* record(std::byte* base, std::size_t peer, std::int64_t i) const {
    return base + peer * per_peer_ + 16 + static_cast<std::size_t>(i) * record_;
  }
  // Calls f(i, record, choices) for each record peer s sent, in order.
  template <class F>
  void for_each_record(std::size_t s, F&& f) {
    const std::int64_t records = count_from(s);
    for (std::int64_t i = 0; i < records; ++i) {
      const std::byte* r = record(recv_.data(), s, i);
      std::int32_t m = 0;
      std::memcpy(&m, r + 4, 4);
      f(i, r, m);
    }
  }
  std::int64_t count_from(std::size_t peer) const {
    std::int64_t c = 0;
    std::memcpy(&c, recv_.data() + peer * per_peer_, sizeof c);
    return c;
  }
  // The token's choices per device: reached_[d] of them at choices_[d * k] as (id, weight).
  void group(std::span<const std::int32_t> ids, std::span<const float> weights) {
    reached_.assign(static_cast<std::size_t>(size_), 0);
    for (std::size_t j = 0; j < ids.size(); ++j) {
      const std::size_t d = device_of(ids[j]);
      auto& c =
          choices_[d * static_cast<std::size_t>(k_) + static_cast<std::size_t>(reached_[d]++)];
      c.id = ids[j];
      c.weight = weights[j];
    }
  }
  void accumulate(const std::uint16_t* row, float w) {
    for (std::size_t h = 0; h < hidden_; ++h)
      acc_[h] += w * widen(row[h]);
  }
  void store(std::uint16_t* out) const {
    for (std::size_t h = 0; h < hidden_; ++h)
      out[h] = round_bf16(acc_[h]);
  }

  struct choice {
    std::int32_t id;
    float weight;
  };
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1, per_device_ = 1;
  std::size_t tokens_, hidden_, record_ = 0, per_peer_ = 0;
  int k_;
  bool expert_blocks_;
  std::vector<std::byte> send_, recv_;
  std::vector<int> counts_, displs_, back_send_, back_recv_, back_send_displs_, back_recv_displs_;
  std::vector<std::uint16_t> expert_in_, expert_out_, partial_, returned_;
  std::vector<std::size_t> block_of_, block_start_; // each pair's row in the blocks; per expert
  std::vector<float> acc_;
  std::vector<choice> choices_;
  std::vector<int> reached_;
  std::vector<std::int64_t> sent_;
};

} // namespace raw_mpi_decode
