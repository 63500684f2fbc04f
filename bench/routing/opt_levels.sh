#!/usr/bin/env bash
# The host kernels compiled at -O3 and at -O2 (as a consumer building with RelWithDebInfo
# compiles weave's headers), timed side by side: bench_routing's encode/decode moves and
# bench_quantize, each binary run in turn for several rounds so that both levels see the same
# machine load; prints one table (median time per benchmark and level, and the ratio).
#
#   bash bench/routing/opt_levels.sh [build dir, default build/default] [rounds, default 3]
#
# JSON reports land in $OUT (default <build dir>/opt-levels).
set -euo pipefail
build=${1:-build/default}
rounds=${2:-3}
out=${OUT:-$build/opt-levels}
mkdir -p "$out"
cmake --build "$build" --target bench_routing bench_routing_O2 bench_quantize bench_quantize_O2 -j2
for round in $(seq "$rounds"); do
  for level in O3 O2; do
    suffix=$([ "$level" = O2 ] && echo _O2 || true)
    "$build/bench/bench_routing$suffix" --benchmark_filter='^(encode|decode)/' \
      --benchmark_out="$out/routing_${level}_$round.json" --benchmark_out_format=json >/dev/null
    "$build/bench/bench_quantize$suffix" --benchmark_filter='^(quantize|dequantize)/' \
      --benchmark_out="$out/quantize_${level}_$round.json" --benchmark_out_format=json >/dev/null
  done
done
python3 - "$out" "$rounds" <<'EOF'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
times = {}
for kind in ("routing", "quantize"):
    for level in ("O3", "O2"):
        for r in range(1, rounds + 1):
            for b in json.load(open(f"{out}/{kind}_{level}_{r}.json"))["benchmarks"]:
                name = b["run_name"].split("/min_time")[0]
                times.setdefault(name, {}).setdefault(level, []).append(b["real_time"])
print(f"{'benchmark':60} {'-O3 ms':>9} {'-O2 ms':>9} {'O2/O3':>6}")
for name, t in times.items():
    o3, o2 = statistics.median(t["O3"]), statistics.median(t["O2"])
    print(f"{name:60} {o3:9.3f} {o2:9.3f} {o2 / o3:6.2f}")
EOF
