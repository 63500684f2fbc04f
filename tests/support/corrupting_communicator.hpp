// A local_world rank whose outgoing messages a test corrupts, as a faulty sender or a bad link
// would: right before each count exchange or all-to-all leaves (on the stream), the test edits
// what the rank sends (a copy of the counts; the bytes in place). Tests of the receivers' checks
// inject with it the bytes no weave rank writes.
#pragma once

#include <weave/comm/communicator.hpp>
#include <weave/comm/local_world.hpp>
#include <weave/core/failure.hpp>
#include <weave/exec/host_stream.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

namespace weave_test {

class corrupting_communicator {
 public:
  using stream_type = weave::host_stream;

  //! Edits the words of count exchange number `call` (from 0, in enqueue order) sent to `dest`.
  using count_edit = std::function<void(int call, int dest, std::span<std::int64_t> words)>;
  //! Edits the bytes of all-to-all number `call` (from 0, in enqueue order) sent to `dest` (in
  //! the sender's buffer).
  using byte_edit = std::function<void(int call, int dest, std::span<std::byte> bytes)>;

  explicit corrupting_communicator(weave::local_communicator& comm, count_edit counts = {},
                                   byte_edit bytes = {})
      : comm_(&comm)
      , counts_(std::move(counts))
      , bytes_(std::move(bytes)) {}

  int rank() const noexcept { return comm_->rank(); }
  int size() const noexcept { return comm_->size(); }

  void exchange_counts(weave::host_stream& s, std::span<const std::int64_t> send,
                       std::span<std::int64_t> recv) {
    auto copy = keep(std::vector<std::int64_t>(send.size()));
    const int call = count_calls_++;
    const std::size_t k = send.size() / static_cast<std::size_t>(size());
    s.submit_always([this, copy, send, call, k](std::exception_ptr pending) {
      std::copy(send.begin(), send.end(), copy->begin());
      if (counts_)
        for (int d = 0; d < size(); ++d)
          counts_(call, d, std::span(*copy).subspan(static_cast<std::size_t>(d) * k, k));
      return pending;
    });
    comm_->exchange_counts(s, std::span<const std::int64_t>(*copy), recv);
  }

  void all_to_all_v(weave::host_stream& s, const void* send,
                    std::span<const std::int64_t> send_counts,
                    std::span<const std::int64_t> send_displs, void* recv,
                    std::span<const std::int64_t> recv_counts,
                    std::span<const std::int64_t> recv_displs, std::size_t unit = 1) {
    // The counts are read when the stream gets there, as the transfer reads them; the bytes are
    // edited in place, as memory overwritten on the sender would be (the senders rewrite them
    // for every message). A transfer its failed stream skips is left alone.
    const int call = byte_calls_++;
    s.submit_always([this, send, call, unit, send_counts, send_displs](std::exception_ptr pending) {
      if (!pending && bytes_)
        for (int d = 0; d < size(); ++d) {
          const auto i = static_cast<std::size_t>(d);
          auto* at = static_cast<std::byte*>(const_cast<void*>(send)) +
                     static_cast<std::size_t>(send_displs[i]) * unit;
          bytes_(call, d, std::span(at, static_cast<std::size_t>(send_counts[i]) * unit));
        }
      return pending;
    });
    comm_->all_to_all_v(s, send, send_counts, send_displs, recv, recv_counts, recv_displs, unit);
  }

  void abort(const weave::failure_record& why) { comm_->abort(why); }
  void abort(const std::string& reason) { comm_->abort(reason); }
  bool aborted() const { return comm_->aborted(); }

 private:
  // The copies outlive the queued transfers that read them (the test's communicator does).
  template <class V>
  std::shared_ptr<V> keep(V v) {
    auto p = std::make_shared<V>(std::move(v));
    std::lock_guard lock(mutex_);
    kept_.push_back(p);
    return p;
  }

  weave::local_communicator* comm_;
  count_edit counts_;
  byte_edit bytes_;
  int count_calls_ = 0, byte_calls_ = 0;
  std::mutex mutex_;
  std::vector<std::shared_ptr<void>> kept_;
};

static_assert(weave::has_all_to_all_v<corrupting_communicator> &&
              weave::has_exchange_counts<corrupting_communicator>);

} // namespace weave_test
