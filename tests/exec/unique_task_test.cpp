#include <doctest/doctest.h>

#include <weave/exec/unique_task.hpp>

#include <array>
#include <memory>
#include <utility>
#include <vector>

namespace {
struct counted {
  static inline int alive = 0;
  counted() { ++alive; }
  counted(const counted&) { ++alive; }
  counted(counted&&) noexcept { ++alive; }
  ~counted() { --alive; }
};
} // namespace

TEST_CASE("unique_task runs move-only captures, inline and on the heap") {
  int result = 0;
  {
    auto owned = std::make_unique<int>(41);
    weave::unique_task small([&result, p = std::move(owned)] { result = *p + 1; });
    weave::unique_task moved(std::move(small));
    CHECK_FALSE(small);
    REQUIRE(moved);
    moved();
    CHECK(result == 42);
  }
  {
    std::array<int, 64> big{}; // 256 bytes: heap path
    big[63] = 7;
    weave::unique_task large([&result, big] { result = big[63]; });
    weave::unique_task target;
    target = std::move(large);
    target();
    CHECK(result == 7);
  }
}

TEST_CASE("unique_task destroys its callable exactly once") {
  CHECK(counted::alive == 0);
  {
    std::vector<weave::unique_task> tasks;
    for (int i = 0; i < 10; ++i) {
      counted c;
      tasks.emplace_back([c] { (void)c; });
      std::array<counted, 20> many; // heap path
      tasks.emplace_back([many] { (void)many; });
    }
    CHECK(counted::alive == 10 + 10 * 20);
    tasks.erase(tasks.begin(), tasks.begin() + 4); // relocations
    CHECK(counted::alive == 8 + 8 * 20);
  }
  CHECK(counted::alive == 0);
}
