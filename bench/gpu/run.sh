#!/usr/bin/env bash
# One-call GPU check of weave on a single Hopper GPU (sm_90, e.g. one H200), within 6 minutes:
# configures the `cuda` preset in a fresh build folder, builds the CUDA tests and the GPU
# benchmarks, runs every CUDA test (ctest -L cuda: routing kernels and device plans against the
# host path, stream/event tests, the 1-rank NCCL communicator, cuda_moe_exchange over
# cuda_local_world and NCCL against the host moe_exchange, cuda_decode_exchange against the host
# decode_exchange, CUDA-graph capture of both), every CUDA test
# binary again under compute-sanitizer (memcheck for all; racecheck and synccheck for the kernel
# tests, whose gate and reductions use warp and block synchronisation), then the GPU benchmarks
# with JSON output, and prints a short table last. Results go under $OUT (./gpu-results when
# unset), at most 8 files: configure.log, build.log, ctest.log, sanitizer.log, bench_gpu.json,
# bench_gpu.log, table.txt. WEAVE_GPU_SANITIZE=0 skips the sanitizer pass.
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

echo "== compute-sanitizer"
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if [[ "${WEAVE_GPU_SANITIZE:-1}" == 0 ]]; then
  echo "skipped (WEAVE_GPU_SANITIZE=0)"
elif [[ ! -x "$sanitizer" ]]; then
  echo "compute-sanitizer not found: sanitizer pass not run" | tee "$OUT/sanitizer.log"
else
  : >"$OUT/sanitizer.log"
  for test in $(find "$BUILD/tests" -type f -name 'test_*_cuda' | sort); do
    name=$(basename "$test")
    tools="memcheck"
    [[ "$name" == test_routing_cuda ]] && tools="memcheck racecheck synccheck"
    for tool in $tools; do
      t0=$(date +%s)
      set +e
      # The multi-rank tests' rendezvous timeout is 60 s; sanitized kernels stay far below it at
      # these sizes. Each pass is bounded so one slow tool cannot eat the run.
      timeout 240 "$sanitizer" --tool "$tool" --error-exitcode 99 --print-limit 20 \
        "$test" >>"$OUT/sanitizer.log" 2>&1
      rc=$?
      set -e
      case $rc in
        0) verdict="clean" ;;
        77) verdict="skipped" ;;
        99) verdict="ERRORS"; status=1 ;;
        124) verdict="timed out"; status=1 ;;
        *) verdict="failed (exit $rc)"; status=1 ;;
      esac
      printf '%-20s %-10s %-12s %4d s\n' "$name" "$tool" "$verdict" $(( $(date +%s) - t0 )) |
        tee -a "$OUT/sanitizer.log"
    done
  done
fi

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
    width = spec.split(".")[0].rstrip("df")
    return format("-", ">" + width) if x is None else format(x, spec)
print("\n== table (bf16 rows, hidden 4096; GB/s counts bytes read + written)")
print(f"{'kernel':<22}{'T':>7}{'GB/s':>9}{'% of copy':>11}")
for T in (16384, 65536):
    copy = get(f"BM_d2d_copy/{T}", "GB/s")
    print(f"{'d2d copy':<22}{T:>7}{fmt(copy, '9.0f')}{'100':>11}")
    for label, name in (("gather", f"BM_gather/{T}/0"), ("gather (scaled)", f"BM_gather/{T}/1"),
                        ("merge (k=2, weighted)", f"BM_merge/{T}/2"),
                        ("merge (k=8, weighted)", f"BM_merge/{T}/8")):
        bw = get(name, "GB/s")
        pct = None if bw is None or not copy else 100 * bw / copy
        print(f"{label:<22}{T:>7}{fmt(bw, '9.0f')}{fmt(pct, '11.0f')}")
print(f"\n{'gating + plan, k=8 (goal >= 3x at E=256)':<42}{'E':>5}{'T':>7}{'us':>10}{'mask us':>10}"
      f"{'speedup':>9}")
for E in (64, 256):
    for T in (16384, 65536):
        gate = get(f"BM_gate/{E}/{T}", "real_time")
        ours = get(f"BM_gate_plan_weave/{E}/{T}", "real_time")
        mask = get(f"BM_gate_plan_mask/{E}/{T}", "real_time")
        sp = None if not ours or mask is None else mask / ours
        print(f"{'gate + counting-sort plan':<42}{E:>5}{T:>7}{fmt(ours, '10.1f')}{fmt(mask, '10.1f')}"
              f"{fmt(sp, '9.2f')}   (gate alone {fmt(gate, '.1f')} us)")
naive = get("BM_exchange_naive", "real_time")
print(f"\n{'MoE exchange fwd, 1 GPU':<30}{'T':>6}{'us':>10}{'vs naive':>10}   (E=64, k=8, bf16 4096)")
print(f"{'naive per-(token, expert)':<30}{8192:>6}{fmt(naive, '10.1f')}{'1.00':>10}")
for fixed, chunks, graph in ((0, 1, 0), (0, 4, 0), (1, 1, 0), (1, 4, 0), (1, 1, 1), (1, 4, 1)):
    t = get(f"BM_exchange/static:{fixed}/chunks:{chunks}/graph:{graph}", "real_time")
    label = ("static" if fixed else "dynamic") + f", C={chunks}" + (", graph" if graph else "")
    sp = None if not t or naive is None else naive / t
    print(f"{'weave ' + label:<30}{8192:>6}{fmt(t, '10.1f')}{fmt(sp, '10.2f')}")
print(f"\n{'exchange fwd, 4 ranks cuda_local_world':<40}{'us/layer':>10}{'vs dynamic C=1':>16}"
      "   (T=4096/rank, E=64, k=8, bf16 4096; forward + host wait)")
base = get("BM_exchange_world/static:0/chunks:1", "real_time")
for fixed, chunks in ((0, 1), (0, 4), (1, 1), (1, 4)):
    t = get(f"BM_exchange_world/static:{fixed}/chunks:{chunks}", "real_time")
    label = ("static" if fixed else "dynamic") + f", C={chunks}"
    sp = None if not t or base is None else base / t
    print(f"{label:<40}{fmt(t, '10.1f')}{fmt(sp, '16.2f')}")
print(f"\n{'decode layer, 1 GPU (one-rank NCCL)':<36}{'tokens':>7}{'us':>10}{'vs dynamic':>12}"
      "   (E=64, k=8, bf16 4096)")
for tokens in (1, 8, 64, 256):
    base = get(f"BM_decode/mode:0/tokens:{tokens}", "real_time")
    for mode, label in ((0, "dynamic cuda_moe_exchange"), (1, "cuda_decode_exchange"),
                        (2, "cuda_decode_exchange, graph")):
        t = get(f"BM_decode/mode:{mode}/tokens:{tokens}", "real_time")
        sp = None if not t or base is None else base / t
        print(f"{label:<36}{tokens:>7}{fmt(t, '10.1f')}{fmt(sp, '12.2f')}")
print(f"\n{'pipeline emulation (1 GiB)':<30}{'chunks':>7}{'ms':>9}{'hidden %':>10}")
for c in (1, 2, 4, 8, 16):
    name = f"BM_pipeline/{c}"
    print(f"{'copy/compute/copy':<30}{c:>7}{fmt(get(name, 'real_time'), '9.2f')}"
          f"{fmt(get(name, 'hidden_pct'), '10.1f')}")
EOF
fi
date -u
exit "$status"
