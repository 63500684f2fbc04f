// An independent brute-force model of the OCP 8-bit floating point formats: codes decoded by
// the specification's formula, and rounding by searching the nearest of the 256 decoded values
// (ties to the even code), with the specification's overflow behaviour.
#pragma once

#include <weave/core/fp8.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

namespace fp8_ref {

// One OFP8 format as the specification describes it.
struct format {
  int exponent_bits, mantissa_bits;
  bool infinities; // E5M2: IEEE-like; E4M3: only S.1111.111 is special (NaN)
  int bias() const { return (1 << (exponent_bits - 1)) - 1; }
};
inline constexpr format e4m3{4, 3, false};
inline constexpr format e5m2{5, 2, true};

inline double decode(const format& f, std::uint8_t code) {
  const int sign = (code & 0x80) ? -1 : 1;
  const int exponent = (code & 0x7f) >> f.mantissa_bits;
  const int mantissa = code & ((1 << f.mantissa_bits) - 1);
  const int top = (1 << f.exponent_bits) - 1;
  if (f.infinities && exponent == top)
    return mantissa ? NAN : sign * INFINITY;
  if (!f.infinities && exponent == top && mantissa == (1 << f.mantissa_bits) - 1)
    return NAN;
  if (exponent == 0)
    return sign * std::ldexp(mantissa, 1 - f.bias() - f.mantissa_bits);
  return sign *
         std::ldexp((1 << f.mantissa_bits) + mantissa, exponent - f.bias() - f.mantissa_bits);
}

// Non-negative finite values in code order, then the value one ulp past the largest finite
// one: a rounding that lands there overflowed (its code's parity decides ties, as if the
// exponent range went on).
struct table {
  format f;
  std::vector<std::pair<double, std::uint8_t>> entries;
  std::uint8_t max_code = 0;

  explicit table(format fmt)
      : f(fmt) {
    for (int code = 0; code < 0x80; ++code) {
      const double v = decode(f, static_cast<std::uint8_t>(code));
      if (std::isfinite(v)) {
        entries.emplace_back(v, static_cast<std::uint8_t>(code));
        max_code = static_cast<std::uint8_t>(code);
      }
    }
    const double max = entries.back().first;
    entries.emplace_back(max + ulp(max), static_cast<std::uint8_t>(max_code + 1));
  }

  double max_finite() const { return entries[entries.size() - 2].first; }

  // Spacing of the format's values at magnitude m (the subnormal spacing below the normals).
  double ulp(double m) const {
    const int emin = 1 - f.bias();
    const int e = m == 0 ? emin : std::max(std::ilogb(m), emin);
    return std::ldexp(1.0, e - f.mantissa_bits);
  }

  std::uint8_t round(double x, weave::fp8_overflow mode) const {
    if (std::isnan(x))
      return 0x7f; // the canonical NaN
    const std::uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
    const double m = std::fabs(x);
    std::uint8_t code = 0;
    bool overflow = m > entries.back().first;
    if (!overflow) {
      auto upper = std::lower_bound(entries.begin(), entries.end(), m,
                                    [](const auto& e, double v) { return e.first < v; });
      if (upper->first == m) {
        code = upper->second;
      } else {
        auto lower = upper - 1;
        const double below = m - lower->first, above = upper->first - m;
        code = below < above         ? lower->second
               : above < below       ? upper->second
               : (lower->second & 1) ? upper->second
                                     : lower->second;
      }
      overflow = code > max_code;
    }
    if (overflow) {
      if (mode == weave::fp8_overflow::saturate)
        return sign | max_code;
      return sign | (f.infinities ? 0x7c : 0x7f);
    }
    return sign | code;
  }
};

} // namespace fp8_ref
