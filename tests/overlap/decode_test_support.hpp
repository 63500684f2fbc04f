// What the decode exchange tests share, in every execution space and on every communicator: the
// naive per-token references (the sum over the token's choices, in order, of w * f_e(x); per
// device with partial sums), per-slot row counts counted directly from the ids, one call run
// through a decode exchange with linear experts (the view's per-slot accessors checked against its
// raw arrays and the packed pool on the way), and a run that records the typed error a rank's
// call ended with.
#pragma once

#include "aligned_buffer.hpp"
#include "moe_test_support.hpp"

#include <weave/exec/emulated_gpu_space.hpp>
#include <weave/exec/host_space.hpp>
#include <weave/exec/host_stream.hpp>
#include <weave/overlap/decode_exchange.hpp>

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

namespace decode_test {

// The decode exchange in `Space` (host_space: `decode_exchange<Comm, T>`).
template <class Space, class Comm, class T>
using exchange_in = weave::basic_decode_exchange<Space, Comm, T>;

// The naive reference of one rank's layer output.
template <class T>
std::vector<T> reference(const moe_test::rank_input<T>& in, int k,
                         const moe_test::linear_experts& f) {
  const std::size_t H = f.hidden;
  std::vector<T> y(in.x.rows() * H), out(H);
  std::vector<float> acc(H);
  for (std::size_t t = 0; t < in.x.rows(); ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int j = 0; j < k; ++j) {
      const std::int32_t e = in.ids[t * static_cast<std::size_t>(k) + static_cast<std::size_t>(j)];
      if (e < 0)
        continue;
      f.apply(e, in.x.row(t).data(), out.data());
      const float w = in.weights[t * static_cast<std::size_t>(k) + static_cast<std::size_t>(j)];
      for (std::size_t i = 0; i < H; ++i)
        acc[i] += w * static_cast<float>(out[i]);
    }
    for (std::size_t i = 0; i < H; ++i)
      y[t * H + i] = T(acc[i]);
  }
  return y;
}

// The naive reference with `decode_options::partial_sums`, for rank `rank`'s tokens: per device
// (ascending), the sum over the token's choices there, in order, of w * f_e(x) rounded to T;
// then the sum of those rows. A choice's device is its slot's (`placement::slot_for`).
template <class T>
std::vector<T> partial_sums_reference(const moe_test::rank_input<T>& in, int k,
                                      const moe_test::linear_experts& f,
                                      const weave::placement& where, int rank) {
  const std::size_t H = f.hidden;
  const int spd = where.slots_per_device();
  std::vector<T> y(in.x.rows() * H), out(H);
  std::vector<float> acc(H), part(H);
  for (std::size_t t = 0; t < in.x.rows(); ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int d = 0; d < where.num_devices(); ++d) {
      std::fill(part.begin(), part.end(), 0.0f);
      bool any = false;
      for (int j = 0; j < k; ++j) {
        const std::size_t p = t * static_cast<std::size_t>(k) + static_cast<std::size_t>(j);
        const std::int32_t e = in.ids[p];
        if (e < 0 || where.slot_for(e, t, rank) / spd != d)
          continue;
        any = true;
        f.apply(e, in.x.row(t).data(), out.data());
        for (std::size_t i = 0; i < H; ++i)
          part[i] += in.weights[p] * static_cast<float>(out[i]);
      }
      if (any)
        for (std::size_t i = 0; i < H; ++i)
          acc[i] += static_cast<float>(T(part[i]));
    }
    for (std::size_t i = 0; i < H; ++i)
      y[t * H + i] = T(acc[i]);
  }
  return y;
}

// The reference of a decode call built with `o`: per device (`partial_sums`, the default) or
// per (token, expert) pair.
template <class T>
std::vector<T> expected(const moe_test::rank_input<T>& in, const weave::decode_options& o,
                        const moe_test::linear_experts& f, const weave::placement& where,
                        int rank) {
  return o.partial_sums ? partial_sums_reference(in, o.k, f, where, rank) : reference(in, o.k, f);
}

// Rows expert `e` gets from a rank with these ids (unreplicated placements).
inline std::int64_t pairs_for(const std::vector<std::int32_t>& ids, int e) {
  return std::count(ids.begin(), ids.end(), e);
}

// The view's per-slot accessors against its raw arrays (host memory in the spaces tested here):
// the counts are the arrays' entries, the busy slots those with rows, and the pool is packed,
// slot l's rows at pool rows [slot_first[l], + slot_rows[l]), slots in order, each source's rows
// in order within its slot. A slot's input is its pool rows, or the one row a peer sent where it
// arrived (`input_blocks`), or with gathered inputs one pointer per pool row.
template <class View>
void check_view_arrays(const View& xs, int ranks, bool gathered) {
  using T = typename View::element_type;
  const int L = xs.local_experts();
  const auto H = static_cast<std::int64_t>(xs.hidden());
  std::vector<std::int64_t> busy;
  std::int64_t first = 0;
  for (int l = 0; l < L; ++l) {
    CAPTURE(l);
    const std::int64_t n = xs.rows(l);
    CHECK(xs.slot_rows()[l] == n);
    CHECK(xs.slot_first()[l] == first);
    std::int64_t in_slot = 0;
    for (int src = 0; src < ranks; ++src) {
      CHECK(xs.source_rows()[l * ranks + src] == xs.rows(l, src));
      if (n > 0) // (an idle slot's sources start anywhere: none of its rows exists)
        CHECK(xs.source_first()[l * ranks + src] == in_slot);
      in_slot += xs.rows(l, src);
    }
    CHECK(in_slot == n);
    if (n > 0)
      busy.push_back(l);
    else
      continue;
    CHECK(xs.output(l).data() == xs.output_pool() + first * H);
    CHECK(xs.output(l).size() == static_cast<std::size_t>(n * H));
    if (gathered) {
      CHECK(xs.input_pool() == nullptr);
      const auto rows = xs.input_rows(l);
      CHECK(rows.size() == static_cast<std::size_t>(n));
      for (std::int64_t r = 0; r < n && r < static_cast<std::int64_t>(rows.size()); ++r)
        CHECK(reinterpret_cast<const T*>(xs.input_row_pointers()[first + r]) ==
              rows[static_cast<std::size_t>(r)]);
    } else if (xs.input_pool() != nullptr) {
      const std::byte* block = xs.input_blocks()[l];
      if (block != nullptr) // one row, read where it arrived
        CHECK(n == 1);
      CHECK(xs.input(l).data() ==
            (block != nullptr ? reinterpret_cast<const T*>(block) : xs.input_pool() + first * H));
      CHECK(xs.input(l).size() == static_cast<std::size_t>(n * H));
    }
    first += n;
  }
  CHECK(xs.slot_first()[L] == first);
  CHECK(std::vector<std::int64_t>(xs.busy().begin(), xs.busy().end()) == busy);
  CHECK(xs.busy_slots()[L] == static_cast<std::int64_t>(busy.size()));
  CHECK(std::equal(busy.begin(), busy.end(), xs.busy_slots()));
}

// The linear experts on every local slot's rows (copies, the one row in place, or with
// gathered inputs the rows where they arrived); `rows[l * D + s]` receives the per-(slot,
// source) counts when given.
template <class View>
void run_linear_experts(const View& xs, const moe_test::linear_experts& f, bool gathered, int ranks,
                        std::vector<std::int64_t>* rows = nullptr) {
  const auto H = static_cast<std::int64_t>(xs.hidden());
  for (int l = 0; l < xs.local_experts(); ++l) {
    const auto output = xs.output(l);
    for (std::int64_t r = 0; r < xs.rows(l); ++r)
      f.apply(xs.expert(l),
              gathered ? xs.input_rows(l)[static_cast<std::size_t>(r)] : xs.input(l).data() + r * H,
              output.data() + r * H);
    if (rows != nullptr)
      for (int src = 0; src < ranks; ++src)
        rows->push_back(xs.rows(l, src));
  }
}

// How a test's experts wait for the dispatch: the host waits for the stream and runs them, or
// they run as a task queued after the dispatch (no host wait between the phases).
enum class experts_wait { host, queued };

// One decode call: dispatch, the linear experts on every local slot's rows (the view checked by
// `check_view_arrays`), combine, then the exchange's one wait. Returns y (`extra_outputs` more
// elements than the tokens' rows: a wrong output); `rows[l * D + s]` receives the per-(slot,
// source) counts the view reported.
template <class T, class Exchange>
std::vector<T> decode_call(Exchange& ex, const moe_test::rank_input<T>& in,
                           const moe_test::linear_experts& f, weave::host_stream& s,
                           std::vector<std::int64_t>* rows = nullptr,
                           experts_wait wait = experts_wait::host, std::size_t extra_outputs = 0) {
  const std::size_t H = f.hidden;
  std::vector<T> y(in.x.rows() * H + extra_outputs, T(-7.0f));
  const int D = ex.where().num_devices();
  const bool gathered = ex.options().gathered_inputs;
  auto h = ex.dispatch(in.x.elements(), in.ids, in.weights, s);
  const auto experts = [&f, gathered, D, rows](const auto& xs) {
    check_view_arrays(xs, D, gathered);
    run_linear_experts(xs, f, gathered, D, rows);
  };
  if (wait == experts_wait::queued) {
    s.submit([experts, xs = h.experts()] { experts(xs); });
  } else {
    s.synchronize(); // (on host streams a failed dispatch throws here)
    experts(h.experts());
  }
  ex.combine(h, std::span<T>(y), s);
  ex.synchronize(s);
  return y;
}

// A decode exchange given its workspace by `initialize`, the workspace's bytes garbage first:
// memory of the space is not cleared, and no step may read what it did not write.
template <class Exchange>
struct initialized_layer {
  template <class Comm>
  initialized_layer(Comm& comm, const weave::placement& where, weave::host_stream& s,
                    const weave::decode_options& o)
      : ex(comm, where, o) {
    ws = std::make_unique<weave_test::aligned_buffer>(ex.workspace_size());
    std::memset(ws->ptr, 0x5A, ws->size);
    ex.initialize(ws->ptr, ws->size, s);
  }
  std::unique_ptr<weave_test::aligned_buffer> ws; // declared first: destroyed after the layer
  Exchange ex;
};

// How a rank's call ended.
struct outcome {
  weave::errc code{};
  std::string message;
};

template <class F>
outcome outcome_of(F&& f) {
  try {
    f();
  } catch (const weave::error& e) {
    return {e.code(), e.what()};
  }
  return {};
}

template <class T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// The space's name, for messages.
template <class Space>
const char* space_name() {
  return std::is_same_v<Space, weave::host_space> ? "host_space" : "emulated_gpu_space";
}

} // namespace decode_test
