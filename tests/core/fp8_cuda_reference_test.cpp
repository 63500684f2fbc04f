// weave's FP8 conversions against CUDA's own: cuda_fp8.h's __nv_cvt_float_to_fp8 and
// __nv_cvt_bfloat16raw_to_fp8 compile for the host (their host path is NVIDIA's reference
// implementation, through double), so this runs without a GPU wherever the toolkit's headers
// are installed. Every bf16 input and a strided sweep of f32 bit patterns, both formats, both
// overflow modes, bit for bit. WEAVE_FP8_EXHAUSTIVE=1 sweeps all 2^32 f32 patterns (minutes).
#include <doctest/doctest.h>

#include <weave/core/fp8.hpp>

#include <cuda_fp8.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ios>

namespace {

__nv_saturation_t cuda_mode(weave::fp8_overflow mode) {
  return mode == weave::fp8_overflow::saturate ? __NV_SATFINITE : __NV_NOSAT;
}

// Returns the first f32 pattern in [first, last] (stepping by `step`) where weave and CUDA
// differ, or -1.
std::int64_t first_difference(std::uint64_t first, std::uint64_t last, std::uint64_t step) {
  for (std::uint64_t bits = first; bits <= last; bits += step) {
    const float x = std::bit_cast<float>(static_cast<std::uint32_t>(bits));
    for (auto mode : {weave::fp8_overflow::saturate, weave::fp8_overflow::non_saturating}) {
      if (weave::fp8_e4m3(x, mode).bits != __nv_cvt_float_to_fp8(x, cuda_mode(mode), __NV_E4M3) ||
          weave::fp8_e5m2(x, mode).bits != __nv_cvt_float_to_fp8(x, cuda_mode(mode), __NV_E5M2))
        return static_cast<std::int64_t>(bits);
    }
  }
  return -1;
}

} // namespace

TEST_CASE("FP8 conversions equal CUDA's __nv_cvt_float_to_fp8 bit for bit") {
  const char* exhaustive = std::getenv("WEAVE_FP8_EXHAUSTIVE");
  const bool all = exhaustive != nullptr && std::strcmp(exhaustive, "1") == 0;
  const std::int64_t diff = first_difference(0, 0xffffffffu, all ? 1 : 257);
  INFO("first differing f32 pattern: 0x", std::hex, diff);
  CHECK(diff == -1);
}

TEST_CASE("bf16 -> FP8 equals CUDA's __nv_cvt_bfloat16raw_to_fp8 for every bf16 value") {
  for (std::uint32_t b = 0; b <= 0xffff; ++b) {
    __nv_bfloat16_raw raw;
    raw.x = static_cast<unsigned short>(b);
    const float x = std::bit_cast<float>(b << 16); // bf16 widens to f32 exactly
    for (auto mode : {weave::fp8_overflow::saturate, weave::fp8_overflow::non_saturating}) {
      REQUIRE(weave::fp8_e4m3(x, mode).bits ==
              __nv_cvt_bfloat16raw_to_fp8(raw, cuda_mode(mode), __NV_E4M3));
      REQUIRE(weave::fp8_e5m2(x, mode).bits ==
              __nv_cvt_bfloat16raw_to_fp8(raw, cuda_mode(mode), __NV_E5M2));
    }
  }
}

TEST_CASE("FP8 -> f32 equals CUDA's decoding for every code") {
  for (int code = 0; code < 256; ++code) {
    const auto c = static_cast<__nv_fp8_storage_t>(code);
    for (auto kind : {__NV_E4M3, __NV_E5M2}) {
      const __half_raw h = __nv_cvt_fp8_to_halfraw(c, kind);
      // Every FP8 value is a half value; widen CUDA's half exactly.
      const std::uint32_t exponent = (h.x >> 10) & 0x1fu, mantissa = h.x & 0x3ffu;
      const double magnitude = exponent == 0    ? std::ldexp(mantissa, -24)
                               : exponent == 31 ? (mantissa ? NAN : INFINITY)
                                                : std::ldexp(1024 + mantissa, int(exponent) - 25);
      const double want = (h.x & 0x8000u) ? -magnitude : magnitude;
      const float got = kind == __NV_E4M3
                            ? static_cast<float>(weave::fp8_e4m3::from_bits(std::uint8_t(code)))
                            : static_cast<float>(weave::fp8_e5m2::from_bits(std::uint8_t(code)));
      if (std::isnan(want))
        CHECK(std::isnan(got));
      else
        CHECK(static_cast<double>(got) == want);
    }
  }
}
