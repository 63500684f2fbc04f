#!/usr/bin/env bash
# One-call GPU check of weave on a single Hopper GPU (sm_90, e.g. one H200), within 6 minutes:
# configures the `cuda` preset in a fresh build folder, builds the CUDA tests and the GPU
# benchmarks, runs every CUDA test (ctest -L cuda: routing kernels and device plans against the
# host path, stream/event tests, the 1-rank NCCL communicator, cuda_moe_exchange over
# cuda_local_world and NCCL against the host moe_exchange, CUDA-graph capture), then the GPU
# benchmarks with JSON output, and prints a short table last. Results go under $OUT (./gpu-results when unset).
# Needs CMake >= 3.25, Ninja, nvcc (CUDA 12.x/13), doctest, Google Benchmark and NCCL headers.
set -euo pipefail

cd "$(dirname "$0")/../.."
OUT="${OUT:-$PWD/gpu-results}"
mkdir -p "$OUT"
BUILD="${WEAVE_GPU_BUILD:-build/gpu-run}"
JOBS="$(nproc 2>/dev/null || echo 4)"
status=0

echo "== weave GPU check"
date -u
nvidia-smi --query-gpu=name --format=csv,noheader || echo "nvidia-smi: no GPU name"
nvcc --version | tail -n 2 || true

echo "== configure + build (sm_90, $BUILD)"
rm -rf "$BUILD"
start=$(date +%s)
cmake --preset cuda -B "$BUILD" -DCMAKE_CUDA_ARCHITECTURES=90 >"$OUT/configure.log" 2>&1 ||
  { tail -n 40 "$OUT/configure.log"; echo "configure failed"; exit 1; }
# Only the CUDA tests and the GPU benchmark: the preset's header checks are covered in CI.
targets=$(ninja -C "$BUILD" -t targets all | sed -n 's/^\(test_[a-z_]*_cuda\|bench_gpu\): .*/\1/p' |
  sort -u | tr '\n' ' ')
echo "targets: $targets"
# shellcheck disable=SC2086
cmake --build "$BUILD" -j "$JOBS" --target $targets >"$OUT/build.log" 2>&1 ||
  { tail -n 60 "$OUT/build.log"; echo "build failed"; exit 1; }
echo "built in $(( $(date +%s) - start )) s"

echo "== CUDA tests"
ctest --test-dir "$BUILD" -L cuda --output-on-failure --timeout 120 2>&1 | tee "$OUT/ctest.log" ||
  status=1

echo "== GPU benchmarks"
if [[ -x "$BUILD/bench/bench_gpu" ]]; then
  "$BUILD/bench/bench_gpu" --benchmark_out="$OUT/bench_gpu.json" --benchmark_out_format=json \
    2>&1 | tee "$OUT/bench_gpu.log" || status=1
else
  echo "bench_gpu was not built (Google Benchmark missing?)"
  status=1
fi

if [[ -f "$OUT/bench_gpu.json" ]]; then
  python3 - "$OUT/bench_gpu.json" <<'EOF' | tee "$OUT/table.txt"
import json, sys
runs = {b["name"]: b for b in json.load(open(sys.argv[1]))["benchmarks"]
        if b.get("run_type", "iteration") == "iteration"}
def get(prefix, key):
    for name, b in runs.items():
        if name.startswith(prefix + "/"):
            return b.get(key)
    return None
def fmt(x, spec):
    return "-" if x is None else format(x, spec)
print("\n== table (bf16 rows, hidden 4096; GB/s counts bytes read + written)")
print(f"{'kernel':<22}{'T':>7}{'GB/s':>9}{'% of copy':>11}")
for T in (16384, 65536):
    copy = get(f"BM_d2d_copy/{T}", "GB/s")
    print(f"{'d2d copy':<22}{T:>7}{fmt(copy, '9.0f')}{'100':>11}")
    for label, name in (("gather", f"BM_gather/{T}/0"), ("gather (scaled)", f"BM_gather/{T}/1"),
                        ("merge (k=2, weighted)", f"BM_merge/{T}")):
        bw = get(name, "GB/s")
        pct = None if bw is None or not copy else 100 * bw / copy
        print(f"{label:<22}{T:>7}{fmt(bw, '9.0f')}{fmt(pct, '11.0f')}")
print(f"\n{'gating + plan, T=16384, k=8':<30}{'E':>5}{'us':>10}{'mask us':>10}{'speedup':>9}")
for E in (64, 256):
    gate = get(f"BM_gate/{E}", "real_time")
    ours = get(f"BM_gate_plan_weave/{E}", "real_time")
    mask = get(f"BM_gate_plan_mask/{E}", "real_time")
    sp = None if not ours or mask is None else mask / ours
    print(f"{'gate + counting-sort plan':<30}{E:>5}{fmt(ours, '10.1f')}{fmt(mask, '10.1f')}"
          f"{fmt(sp, '9.2f')}   (gate alone {fmt(gate, '.1f')} us)")
naive = get("BM_exchange_naive", "real_time")
print(f"\n{'MoE exchange fwd, 1 GPU':<30}{'T':>6}{'us':>10}{'vs naive':>10}   (E=64, k=8, bf16 4096)")
print(f"{'naive per-(token, expert)':<30}{8192:>6}{fmt(naive, '10.1f')}{'1.00':>10}")
for fixed, chunks, graph in ((0, 1, 0), (0, 4, 0), (1, 1, 0), (1, 4, 0), (1, 1, 1), (1, 4, 1)):
    t = get(f"BM_exchange/static:{fixed}/chunks:{chunks}/graph:{graph}", "real_time")
    label = ("static" if fixed else "dynamic") + f", C={chunks}" + (", graph" if graph else "")
    sp = None if not t or naive is None else naive / t
    print(f"{'weave ' + label:<30}{8192:>6}{fmt(t, '10.1f')}{fmt(sp, '10.2f')}")
print(f"\n{'pipeline emulation (1 GiB)':<30}{'chunks':>7}{'ms':>9}{'hidden %':>10}")
for c in (1, 2, 4, 8, 16):
    name = f"BM_pipeline/{c}"
    print(f"{'copy/compute/copy':<30}{c:>7}{fmt(get(name, 'real_time'), '9.2f')}"
          f"{fmt(get(name, 'hidden_pct'), '10.1f')}")
EOF
fi
date -u
exit "$status"
