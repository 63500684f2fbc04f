// A local_world rank that fails as NCCL does, for tests of where device algorithms block the
// host: its operations wait for their peers as long as the world allows (make that long), and
// only `synchronize` (the watched wait every host block of a weave layer must go through, as
// `nccl_communicator::synchronize`) gives up after `watch`, aborting the world and throwing
// `errc::timeout`. A layer that blocks the host anywhere else waits out the world's timeout.
#pragma once

#include <weave/comm/communicator.hpp>
#include <weave/comm/local_world.hpp>
#include <weave/core/error.hpp>
#include <weave/core/failure.hpp>
#include <weave/exec/host_stream.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <thread>

namespace weave_test {

class watched_communicator {
 public:
  using stream_type = weave::host_stream;

  watched_communicator(weave::local_communicator& comm, std::chrono::milliseconds watch)
      : comm_(&comm)
      , watch_(watch) {}

  int rank() const noexcept { return comm_->rank(); }
  int size() const noexcept { return comm_->size(); }

  void all_to_all_v(weave::host_stream& s, const void* send,
                    std::span<const std::int64_t> send_counts,
                    std::span<const std::int64_t> send_displs, void* recv,
                    std::span<const std::int64_t> recv_counts,
                    std::span<const std::int64_t> recv_displs, std::size_t unit = 1) {
    comm_->all_to_all_v(s, send, send_counts, send_displs, recv, recv_counts, recv_displs, unit);
  }
  void exchange_counts(weave::host_stream& s, std::span<const std::int64_t> send,
                       std::span<std::int64_t> recv) {
    comm_->exchange_counts(s, send, recv);
  }
  void abort(const weave::failure_record& why) { comm_->abort(why); }
  void abort(const std::string& reason) { comm_->abort(reason); }
  bool aborted() const { return comm_->aborted(); }

  //! Waits for `w` (a stream or an event); after `watch`, aborts the world and throws
  //! `errc::timeout`. Rethrows a failure `w` carries.
  template <class Waitable>
  void synchronize(Waitable& w) {
    const auto deadline = std::chrono::steady_clock::now() + watch_;
    while (!w.query()) {
      if (std::chrono::steady_clock::now() > deadline) {
        const std::string why = weave::detail::concat("watched_communicator rank ", rank(),
                                                      ": not done after ", watch_.count(), " ms");
        comm_->abort(weave::failure_record{rank(), weave::errc::timeout, true, why});
        WEAVE_THROW(weave::errc::timeout, why);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    w.synchronize();
  }

 private:
  weave::local_communicator* comm_;
  std::chrono::milliseconds watch_;
};

static_assert(weave::has_all_to_all_v<watched_communicator> &&
              weave::has_exchange_counts<watched_communicator>);

} // namespace weave_test
