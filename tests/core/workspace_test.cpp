#include <doctest/doctest.h>

#include <weave/core/workspace.hpp>

#include <cstdint>
#include <new>

namespace {
// The same carving sequence measures and assigns, as a plan's workspace_size()/initialize().
struct carved {
  std::span<std::int32_t> counts;
  std::span<double> weights;
  std::span<std::uint8_t> flags;
};
carved carve(weave::workspace_carver& c, std::size_t n) {
  return {c.take<std::int32_t>(n), c.take<double>(n * 2, 8), c.take<std::uint8_t>(3)};
}
} // namespace

TEST_CASE("a measuring carver and an assigning carver agree") {
  weave::workspace_carver measure;
  (void)carve(measure, 100);
  CHECK(measure.measuring());
  const std::size_t bytes = measure.used();
  CHECK(bytes >= 100 * 4 + 200 * 8 + 3);

  void* base = ::operator new (bytes, std::align_val_t{weave::workspace_carver::base_alignment});
  weave::workspace_carver assign(base, bytes);
  const carved c = carve(assign, 100);
  CHECK(assign.used() == bytes);
  CHECK(c.counts.size() == 100);
  CHECK(c.weights.size() == 200);
  CHECK(reinterpret_cast<std::uintptr_t>(c.weights.data()) % 8 == 0);
  CHECK(reinterpret_cast<std::byte*>(c.flags.data() + 3) <= static_cast<std::byte*>(base) + bytes);
  // Arrays do not overlap.
  CHECK(reinterpret_cast<std::byte*>(c.counts.data() + 100) <=
        reinterpret_cast<std::byte*>(c.weights.data()));

  weave::workspace_carver small(base, bytes - 1);
  CHECK_THROWS_AS((void)carve(small, 100), weave::error);
  CHECK_THROWS_AS(weave::workspace_carver(static_cast<std::byte*>(base) + 8, bytes), weave::error);
  CHECK_THROWS_AS((void)assign.take<int>(1, 3), weave::error);
  ::operator delete (base, std::align_val_t{weave::workspace_carver::base_alignment});
}
