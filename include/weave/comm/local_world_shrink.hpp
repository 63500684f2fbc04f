//! \file
//! The agreement behind `local_communicator::shrink`: one round per world in which the ranks
//! still alive say whom they exclude, and which closes once every rank either joined or left
//! (its thread ended, its handle was destroyed) or the world's timeout passed since the first
//! join (a rank an operation's timeout found missing counts as left). Whoever closes it computes
//! one outcome that every joined rank then reads: there is only ever one group of survivors.
#pragma once

#include "weave/comm/shrink.hpp"
#include "weave/core/config.hpp"
#include "weave/core/error.hpp"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

WEAVE_NAMESPACE_BEGIN
namespace detail {

class local_world_state;

class local_shrink_round {
 public:
  struct outcome {
    std::vector<int> survivors;              // old ranks, ascending
    std::shared_ptr<local_world_state> next; // the survivors' world
  };
  using make_world = std::function<std::shared_ptr<local_world_state>(const std::vector<int>&)>;

  explicit local_shrink_round(int size)
      : joined_(static_cast<std::size_t>(size), 0)
      , departed_(static_cast<std::size_t>(size), 0)
      , views_(static_cast<std::size_t>(size)) {}

  //! Rank `rank` is not waited for: its thread ended, its handle was destroyed, or a timeout
  //! found it missing (it is still a survivor if it joins before the round closes).
  void depart(int rank) {
    {
      std::lock_guard lock(mutex_);
      departed_[static_cast<std::size_t>(rank)] = 1;
    }
    changed_.notify_all();
  }

  //! Joins the round as `rank` excluding `excluded` (sorted, unique); blocks until it closes.
  //! Returns the outcome for a survivor; throws for a rank left out or a disagreement.
  outcome join(int rank, std::vector<int> excluded, std::chrono::milliseconds timeout,
               const make_world& make) {
    std::unique_lock lock(mutex_);
    const auto r = static_cast<std::size_t>(rank);
    WEAVE_EXPECT(!closed_, errc::invalid_state, "local_world rank ", rank,
                 ": shrink reached after the survivors ", rank_list(survivors_),
                 " closed the group without it (a rank that does not reach the shrink within the "
                 "world's timeout counts as lost)");
    WEAVE_EXPECT(!joined_[r], errc::invalid_state, "local_world rank ", rank,
                 ": shrink called twice on one world (shrink the new communicator instead)");
    joined_[r] = 1;
    views_[r] = std::move(excluded);
    if (!deadline_)
      deadline_ = std::chrono::steady_clock::now() + timeout;
    changed_.notify_all();
    const auto everyone = [&] {
      for (std::size_t p = 0; p < joined_.size(); ++p)
        if (!joined_[p] && !departed_[p])
          return false;
      return true;
    };
    changed_.wait_until(lock, *deadline_, [&] { return closed_ || everyone(); });
    if (!closed_)
      close(make);
    if (refusal_)
      WEAVE_THROW(refusal_->first, "local_world rank ", rank, ": ", refusal_->second);
    WEAVE_EXPECT(std::binary_search(survivors_.begin(), survivors_.end(), rank),
                 errc::invalid_state, "local_world rank ", rank,
                 ": excluded from the survivors' group by its peers (survivors ",
                 rank_list(survivors_), ")");
    return {survivors_, next_};
  }

 private:
  // Under mutex_: the one outcome of the round.
  void close(const make_world& make) {
    closed_ = true;
    std::optional<std::size_t> first;
    for (std::size_t p = 0; p < joined_.size(); ++p) {
      if (!joined_[p])
        continue;
      if (!first) {
        first = p;
      } else if (views_[p] != views_[*first]) {
        refusal_.emplace(errc::config_mismatch,
                         concat("the survivors disagree about who is left: rank ", *first,
                                " excludes ", rank_list(views_[*first]), ", rank ", p, " excludes ",
                                rank_list(views_[p])));
        break;
      }
    }
    if (!refusal_) {
      for (std::size_t p = 0; p < joined_.size(); ++p)
        if (joined_[p] &&
            !std::binary_search(views_[*first].begin(), views_[*first].end(), static_cast<int>(p)))
          survivors_.push_back(static_cast<int>(p));
      if (survivors_.empty())
        refusal_.emplace(errc::invalid_state, "every rank that reached the shrink is excluded");
    }
    if (!refusal_) {
      try {
        next_ = make(survivors_);
      } catch (const error& e) {
        refusal_.emplace(e.code(), e.message());
      }
    }
    changed_.notify_all();
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<char> joined_, departed_;
  std::vector<std::vector<int>> views_; // what each joined rank excludes
  std::optional<std::chrono::steady_clock::time_point> deadline_;
  bool closed_ = false;
  std::vector<int> survivors_;
  std::shared_ptr<local_world_state> next_;
  std::optional<std::pair<errc, std::string>> refusal_;
};

} // namespace detail
WEAVE_NAMESPACE_END
