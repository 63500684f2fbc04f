#!/usr/bin/env bash
# weave's GPU run, split to fit a GPU machine reached one command at a time (one H200, 16 cores,
# 600 s per command; no doctest, Google Benchmark or MPI there, NCCL only as pip's
# nvidia-nccl-cu13, nothing to install). docs/gpu.md, "Running on a GPU", says how to use it.
#
#   bash bench/gpu/run.sh carry      here: build the CUDA tests and bench_gpu (sm_90) and gather
#                                    what must travel into build/gpu-carry (size printed)
#   bash bench/gpu/run.sh dry        here and in CI: carry, then check it without a GPU (every
#                                    binary starts and lists its tests, the benchmark names the
#                                    table reads exist, the table step runs on a made-up report)
#   bash bench/gpu/run.sh preflight  GPU machine, ~30 s: tools, NCCL, the carried binaries start,
#                                    compute-sanitizer runs, one short CUDA test
#   bash bench/gpu/run.sh core       GPU machine, < 5 min: every CUDA test (ctest -L cuda's list,
#                                    each with a timeout), then every benchmark instance in its
#                                    own process with fixed iterations; the table printed last
#   bash bench/gpu/run.sh sanitize   GPU machine, < 5 min: compute-sanitizer memcheck on every
#                                    CUDA test binary, racecheck and synccheck on the kernel
#                                    tests (routing, exec, core), each pass with a timeout
#
# Several modes may follow each other in one command. On the GPU machine the carried binaries
# run when they start there and match the sources; otherwise core and sanitize first rebuild
# there (build/gpu-rebuild, a few minutes) from the carried doctest and Google Benchmark. Logs
# and results go under $OUT (build/gpu-results where unset), at most 8 files. The exit status is
# non-zero when any step failed; every step runs regardless.
#
# Settings (environment): WEAVE_GPU_BUILD (build tree, default build/cuda: the `cuda` preset's),
# WEAVE_GPU_CARRY (default build/gpu-carry), WEAVE_GPU_TESTS (test binaries to run, by name,
# space-separated), WEAVE_GPU_BENCH_FILTER (an extended regex over benchmark instance names),
# WEAVE_GPU_TOOLS (sanitizer tools, default "memcheck racecheck synccheck"), WEAVE_GPU_DEADLINE
# (seconds per mode after which nothing new starts, default 540), WEAVE_GPU_TEST_TIMEOUT (120),
# WEAVE_GPU_BENCH_TIMEOUT (90), WEAVE_GPU_SANITIZE_TIMEOUT (150), WEAVE_GPU_REBUILD=1 (rebuild
# on the GPU machine even when the carry would do), WEAVE_NCCL_LIB (folder of libnccl.so.2).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
ROOT=$PWD
BUILD=${WEAVE_GPU_BUILD:-build/cuda}
CARRY=${WEAVE_GPU_CARRY:-build/gpu-carry}
REBUILD=build/gpu-rebuild   # build tree on the GPU machine, when the carry does not do
REBUILT=build/gpu-rebuilt   # its binaries, laid out as the carry
OUT=${OUT:-$ROOT/build/gpu-results}
DEADLINE=${WEAVE_GPU_DEADLINE:-540}
CARRY_LIMIT=$((64 * 1024 * 1024)) # what the GPU machine receives: working tree + carried folders
KERNEL_LABELS="routing exec core"  # tests of kernels: racecheck and synccheck too
# CUDA API calls that return an error are not sanitizer findings here: the tests provoke some on
# purpose (an allocation larger than the device, checked to become a weave::error), NCCL's
# initialisation probes kernels built for other architectures (cudaErrorNoKernelImageForDevice
# from cudaFuncGetAttributes, first seen on the H200), and weave checks every runtime call's
# result itself. Bad accesses, races and barrier errors still count.
SANITIZER_API=(--report-api-errors no)
TABLE=bench/gpu/table.py
mkdir -p "$OUT"
status=0
mode_start=$SECONDS
RT=""       # the folder of binaries a mode runs (the carry, or the rebuild)
NCCL_DIR="" # the folder of libnccl.so.2

fail() { echo "FAIL: $*"; status=1; }
step() { echo "== $* ($((SECONDS - mode_start)) s)"; }
left() { echo $((DEADLINE - (SECONDS - mode_start))); }
# min(a, b)
min() { if (($1 < $2)); then echo "$1"; else echo "$2"; fi; }

if ! command -v nvcc >/dev/null 2>&1 && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH="$PATH:/usr/local/cuda/bin"
fi

# --- sources and packaging (here, and on the GPU machine for a rebuild) -------------------------

# A hash of every file the binaries are built from: the carry records it, the GPU machine checks
# it, so a carry built from other sources is never run.
source_hash() {
  find include tests bench cmake CMakeLists.txt CMakePresets.json -type f \
    \( -name '*.hpp' -o -name '*.h' -o -name '*.cuh' -o -name '*.cu' -o -name '*.cpp' \
    -o -name '*.cmake' -o -name CMakeLists.txt -o -name CMakePresets.json \) -print0 |
    LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16
}

manifest_get() { # key [folder]
  sed -n "s/^$1=//p" "${2:-$CARRY}/manifest.txt" 2>/dev/null | sed -n 1p
}

# The CUDA tests and the GPU benchmark of a configured (Ninja) build tree.
gpu_targets() {
  ninja -C "$1" -t targets all | sed -n 's/^\(test_[a-z0-9_]*_cuda\|bench_gpu\): .*/\1/p' |
    sort -u | tr '\n' ' '
}

# A library the GPU machine has itself (C and C++ runtimes, the loader; NCCL from its wheel).
system_library() {
  case "$1" in
    libc.so.* | libm.so.* | libdl.so.* | librt.so.* | libpthread.so.* | ld-linux* | \
      libstdc++.so.* | libgcc_s.so.* | libnccl.so.*) return 0 ;;
    *) return 1 ;;
  esac
}

# The folder of a header the C++ compiler finds (e.g. doctest/doctest.h -> /usr/include/doctest).
header_dir() {
  local deps path
  deps=$(printf '#include <%s>\n' "$1" | "${CXX:-c++}" -std=c++20 -M -x c++ - 2>/dev/null) ||
    return 1
  path=$(grep -m 1 -o "[^ ]*/$1" <<<"$deps") || return 1
  dirname "$path"
}

# package BUILD DEST: the binaries (stripped), the libraries they need that the GPU machine lacks,
# the list of tests with their labels and timeouts, and (with "deps") the doctest and Google
# Benchmark headers and CMake files a rebuild there needs.
package() {
  local build=$1 dest=$2 deps=${3:-} tests_json bin name lib dir
  rm -rf "$dest"
  mkdir -p "$dest/bin" "$dest/lib"
  tests_json=$(ctest --test-dir "$build" -L cuda --show-only=json-v1) || return 1
  # name, binary, labels, timeout of each test `ctest -L cuda` selects
  python3 -c '
import json, os, sys
for t in json.load(sys.stdin)["tests"]:
    props = {p["name"]: p["value"] for p in t.get("properties", [])}
    cmd = t["command"]
    if len(cmd) != 1:
        sys.exit("%s: test arguments are not supported: %s" % (t["name"], cmd))
    print("\t".join([t["name"], os.path.basename(cmd[0]),
                     ",".join(props.get("LABELS", [])), str(int(props.get("TIMEOUT", 300)))]))
' <<<"$tests_json" >"$dest/tests.tsv" || return 1
  while IFS=$'\t' read -r name bin _; do
    cp "$(python3 -c '
import json, sys
print(next(t["command"][0] for t in json.load(sys.stdin)["tests"] if t["name"] == sys.argv[1]))
' "$name" <<<"$tests_json")" "$dest/bin/$bin" || return 1
  done <"$dest/tests.tsv"
  if [[ -x "$build/bench/bench_gpu" ]]; then
    cp "$build/bench/bench_gpu" "$dest/bin/"
  else
    echo "package: $build/bench/bench_gpu was not built (Google Benchmark missing?)"
    return 1
  fi
  if command -v strip >/dev/null 2>&1; then
    strip "$dest"/bin/*
  else
    echo "package: no strip here: binaries kept with their symbols"
  fi
  # Libraries the binaries load that the GPU machine does not have (Google Benchmark's).
  command -v objdump >/dev/null 2>&1 || { echo "package: no objdump here"; return 1; }
  for bin in "$dest"/bin/*; do
    for lib in $(objdump -p "$bin" | awk '/NEEDED/ {print $2}'); do
      system_library "$lib" && continue
      [[ -e "$dest/lib/$lib" ]] && continue
      path=$(ldd "$bin" | awk -v l="$lib" '$1 == l {print $3}')
      [[ -f "$path" ]] || path="$CARRY/lib/$lib" # a rebuild there links the carried one
      [[ -f "$path" ]] || { echo "package: $lib of $(basename "$bin") not found"; return 1; }
      cp -L "$path" "$dest/lib/$lib"
    done
  done
  if [[ "$deps" == deps ]]; then
    mkdir -p "$dest/deps/include" "$dest/deps/cmake"
    for header in doctest/doctest.h benchmark/benchmark.h; do
      dir=$(header_dir "$header") || { echo "package: $header not found"; return 1; }
      cp -r "$dir" "$dest/deps/include/"
    done
    dir=$(sed -n 's/^doctest_DIR:PATH=//p' "$build/CMakeCache.txt")
    cp "$dir/doctest.cmake" "$dir/doctestAddTests.cmake" "$dest/deps/cmake/" || return 1
    cp bench/gpu/cmake/doctestConfig.cmake bench/gpu/cmake/benchmarkConfig.cmake "$dest/deps/cmake/"
  fi
  {
    echo "source_hash=$(source_hash)"
    echo "commit=$(git describe --always --dirty --abbrev=7 2>/dev/null || echo unknown)"
    echo "built=$(date -u +%Y-%m-%dT%H:%MZ)"
    echo "nvcc=$(nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\).*/\1/p')"
    echo "cuda_architectures=$(sed -n 's/^CMAKE_CUDA_ARCHITECTURES:[A-Z]*=//p' "$build/CMakeCache.txt")"
    echo "glibc_needed=$(objdump -T "$dest"/bin/* "$dest"/lib/* 2>/dev/null |
      grep -o 'GLIBC_[0-9.]*' | sort -Vu | tail -n 1)"
    echo "glibcxx_needed=$(objdump -T "$dest"/bin/* "$dest"/lib/* 2>/dev/null |
      grep -o 'GLIBCXX_[0-9.]*' | sort -Vu | tail -n 1)"
  } >"$dest/manifest.txt"
}

# The folder of libnccl.so.2: WEAVE_NCCL_LIB, pip's nvidia-nccl-cu* wheel, ldconfig, the toolkit.
find_nccl() {
  local dir
  if [[ -n "${WEAVE_NCCL_LIB:-}" ]]; then
    echo "$WEAVE_NCCL_LIB"
    return
  fi
  if dir=$(python3 -c '
import os, sys
try:
    import nvidia
except ImportError:
    sys.exit(1)
for base in list(nvidia.__path__):
    for root, _, files in os.walk(base):
        if "libnccl.so.2" in files:
            print(root)
            sys.exit(0)
sys.exit(1)
' 2>/dev/null); then
    echo "$dir"
    return
  fi
  dir=$(ldconfig -p 2>/dev/null | awk '$1 == "libnccl.so.2" {print $NF; exit}')
  if [[ -n "$dir" ]]; then
    dirname "$dir"
    return
  fi
  for dir in /usr/local/cuda/lib64 /usr/local/cuda/lib /usr/lib/x86_64-linux-gnu; do
    [[ -e "$dir/libnccl.so.2" ]] && { echo "$dir"; return; }
  done
  return 1
}

use_nccl() {
  [[ -n "$NCCL_DIR" ]] && return 0
  if NCCL_DIR=$(find_nccl); then
    return 0
  fi
  NCCL_DIR=""
  echo "NCCL: libnccl.so.2 not found (set WEAVE_NCCL_LIB)"
  return 1
}

# Runs a binary of folder $1 with its libraries and NCCL's on the library path.
with_libs() {
  local lib=$1/lib
  shift
  [[ "$lib" == /* ]] || lib=$ROOT/$lib
  LD_LIBRARY_PATH="$lib${NCCL_DIR:+:$NCCL_DIR}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$@"
}

# Every binary of folder $1 starts and lists its tests (no GPU needed). Prints one line each
# unless $2 is "quiet".
binaries_start() {
  local folder=$1 quiet=${2:-} ok=0 bin out rc count
  for bin in "$folder"/bin/*; do
    rc=0
    if [[ "$(basename "$bin")" == bench_gpu ]]; then
      out=$(with_libs "$folder" timeout 30 "$bin" --benchmark_list_tests 2>&1) || rc=$?
      count=$(grep -c '^BM_' <<<"$out" || true)
    else
      out=$(with_libs "$folder" timeout 30 "$bin" --list-test-cases --no-colors 2>&1) || rc=$?
      count=$(sed -n 's/.*test cases passing the current filters: \([0-9]*\).*/\1/p' <<<"$out")
    fi
    if ((rc != 0)) || [[ -z "$count" || "$count" == 0 ]]; then
      ok=1
      echo "  $(basename "$bin"): does not start (exit $rc)"
      grep -m 5 -i 'error\|not found\|version' <<<"$out" | sed 's/^/    /' || true
      with_libs "$folder" ldd "$bin" 2>&1 | grep 'not found' | sed 's/^/    /' || true
    elif [[ "$quiet" != quiet ]]; then
      printf '  %-20s starts: %s %s\n' "$(basename "$bin")" "$count" \
        "$([[ "$(basename "$bin")" == bench_gpu ]] && echo instances || echo test cases)"
    fi
  done
  return "$ok"
}

# Configure the `cuda` preset in tree $1 (extra cache settings after it) and build the GPU
# targets; output to log $2.
build_tree() {
  local tree=$1 log=$2 targets
  shift 2
  cmake --preset cuda -B "$tree" "$@" >"$log" 2>&1 ||
    { tail -n 30 "$log"; echo "configure failed (log: $log)"; return 1; }
  targets=$(gpu_targets "$tree")
  # shellcheck disable=SC2086 # one word per target
  cmake --build "$tree" -j "$(nproc 2>/dev/null || echo 2)" --target $targets >>"$log" 2>&1 ||
    { tail -n 40 "$log"; echo "build failed (log: $log)"; return 1; }
}

# Sets RT: the carry when it matches the sources and starts here, else a rebuild here.
use_runtime() {
  local why=""
  [[ -n "$RT" ]] && return 0
  use_nccl || true
  if [[ "${WEAVE_GPU_REBUILD:-0}" == 1 ]]; then
    why="WEAVE_GPU_REBUILD=1"
  elif [[ ! -f "$CARRY/manifest.txt" ]]; then
    why="no carry folder ($CARRY)"
  elif [[ "$(manifest_get source_hash)" != "$(source_hash)" ]]; then
    why="the carry was built from other sources (commit $(manifest_get commit))"
  elif ! binaries_start "$CARRY" quiet; then
    why="a carried binary does not start here"
  fi
  if [[ -z "$why" ]]; then
    RT=$CARRY
    return 0
  fi
  step "rebuild here: $why"
  # A newer compiler there may warn where this one does not: no -Werror.
  local args=(-DWEAVE_WERROR=OFF) deps
  [[ -n "$NCCL_DIR" ]] && args+=("-DNCCL_ROOT=$(dirname "$NCCL_DIR")")
  deps=$CARRY/deps/cmake
  [[ "$deps" == /* ]] || deps=$ROOT/$deps
  [[ -d "$deps" ]] && args+=("-Ddoctest_DIR=$deps" "-Dbenchmark_DIR=$deps")
  build_tree "$REBUILD" "$OUT/rebuild.log" "${args[@]}" || return 1
  package "$REBUILD" "$REBUILT" || return 1
  echo "rebuilt in $((SECONDS - mode_start)) s"
  RT=$REBUILT
}

# --- running tests and benchmarks ---------------------------------------------------------------

# run_tests [dry]: every test of $RT/tests.tsv (WEAVE_GPU_TESTS selects), each under a timeout.
# Dry: run without a visible GPU, where each must report skipped (exit 77).
run_tests() {
  local dry=${1:-} name bin labels timeout t rc verdict start log="$OUT/tests.log" out
  local cap=${WEAVE_GPU_TEST_TIMEOUT:-120} ran=0 bad=0
  out=$(mktemp)
  : >"$log"
  while IFS=$'\t' read -r name bin labels timeout; do
    if [[ -n "${WEAVE_GPU_TESTS:-}" && " $WEAVE_GPU_TESTS " != *" $name "* ]]; then
      continue
    fi
    t=$(min "$(min "$timeout" "$cap")" "$(left)")
    if ((t < 10)); then
      printf '%-22s %-16s\n' "$name" "not run (deadline)"
      bad=$((bad + 1))
      continue
    fi
    start=$SECONDS
    rc=0
    if [[ "$dry" == dry ]]; then
      CUDA_VISIBLE_DEVICES="" with_libs "$RT" timeout -k 5 "$t" "$RT/bin/$bin" >"$out" 2>&1 ||
        rc=$?
    else
      with_libs "$RT" timeout -k 10 "$t" "$RT/bin/$bin" --no-colors >"$out" 2>&1 || rc=$?
    fi
    { echo "=== $name (labels $labels, exit $rc)"; cat "$out"; } >>"$log"
    case "$rc" in
      0) verdict="passed" ;;
      77) verdict="skipped: no GPU" ;;
      124 | 137) verdict="TIMED OUT (${t} s)" ;;
      *) verdict="FAILED (exit $rc)" ;;
    esac
    ran=$((ran + 1))
    if [[ "$dry" == dry && "$rc" == 77 ]] || [[ "$dry" != dry && "$rc" == 0 ]]; then
      :
    else
      bad=$((bad + 1))
    fi
    printf '%-22s %-20s %4d s\n' "$name" "$verdict" $((SECONDS - start))
    if [[ "$dry" != dry && "$rc" != 0 ]]; then
      grep -E 'ERROR|FAILED|error|CHECK' "$out" | head -n 12 | sed 's/^/    /' || true
      tail -n 4 "$out" | sed 's/^/    /'
    fi
  done <"$RT/tests.tsv"
  rm -f "$out"
  ((ran > 0)) || { echo "no test ran"; bad=$((bad + 1)); }
  ((bad == 0))
}

# The benchmark instances of $RT/bin/bench_gpu (WEAVE_GPU_BENCH_FILTER selects).
bench_names() {
  with_libs "$RT" "$RT/bin/bench_gpu" --benchmark_list_tests | grep '^BM_' |
    grep -E "${WEAVE_GPU_BENCH_FILTER:-.}"
}

# run_benchmarks [list]: each instance in its own process (a failure costs that instance only),
# JSON merged into $OUT/bench_gpu.json. List: only check that each instance's filter selects
# exactly that instance (nothing runs).
run_benchmarks() {
  local list=${1:-} names name i=0 rc t why tmp failed=0 start=$SECONDS
  local cap=${WEAVE_GPU_BENCH_TIMEOUT:-90} log="$OUT/bench.log"
  names=$(bench_names) || { echo "bench_gpu does not list its benchmarks"; return 1; }
  tmp=$(mktemp -d)
  : >"$tmp/failures.tsv"
  [[ "$list" == list ]] || : >"$log"
  for name in $names; do
    i=$((i + 1))
    # Instance names hold [A-Za-z0-9_/:.] only (table.py check): escape the dots.
    local filter="^${name//./\\.}\$"
    if [[ "$list" == list ]]; then
      local got
      got=$(with_libs "$RT" "$RT/bin/bench_gpu" --benchmark_filter="$filter" \
        --benchmark_list_tests) || got="(exit $?)"
      if [[ "$got" != "$name" ]]; then
        echo "filter $filter selects: $(tr '\n' ' ' <<<"$got")"
        failed=$((failed + 1))
      fi
      continue
    fi
    t=$(min "$cap" "$(left)")
    if ((t < 10)); then
      printf '%s\tnot run: deadline\n' "$name" >>"$tmp/failures.tsv"
      failed=$((failed + 1))
      continue
    fi
    rc=0
    local json
    json=$(printf '%s/%03d.json' "$tmp" "$i")
    echo "=== $name" >>"$log"
    with_libs "$RT" timeout -k 5 "$t" "$RT/bin/bench_gpu" --benchmark_filter="$filter" \
      --benchmark_out="$json" --benchmark_out_format=json >>"$log" 2>&1 || rc=$?
    why=""
    case "$rc" in
      0) [[ -s "$json" ]] || why="no report" ;;
      124 | 137) why="timed out after ${t} s" ;;
      *) why="exit $rc" ;;
    esac
    if [[ -z "$why" ]] && grep -q '"error_occurred": true' "$json"; then
      why=$(sed -n 's/.*"error_message": "\(.*\)",*$/\1/p' "$json" | sed -n 1p)
      why="error: ${why:0:160}"
    fi
    if [[ -n "$why" ]]; then
      printf '%s\t%s\n' "$name" "$why" >>"$tmp/failures.tsv"
      failed=$((failed + 1))
      # The first few failures on the console, all of them in the table and bench.log.
      ((failed > 8)) || printf '  %s: %s\n' "$name" "$why"
    fi
  done
  if [[ "$list" == list ]]; then
    echo "$i instances, each selected alone by its filter: $([[ $failed == 0 ]] && echo yes || echo "no ($failed)")"
  else
    python3 "$TABLE" merge "$OUT/bench_gpu.json" "$tmp/failures.tsv" "$tmp"/*.json ||
      echo "merging the reports failed"
    echo "$i instances in $((SECONDS - start)) s, $failed failed"
  fi
  rm -rf "$tmp"
  ((failed == 0))
}

gpu_line() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null |
    head -n 1 || true
}

# --- modes -----------------------------------------------------------------------------------

mode_carry() {
  local size tree_size arch
  step "carry: build $BUILD (cuda preset, sm_90), gather $CARRY"
  build_tree "$BUILD" "$OUT/carry-build.log" || return 1
  arch=$(sed -n 's/^CMAKE_CUDA_ARCHITECTURES:[A-Z]*=//p' "$BUILD/CMakeCache.txt")
  [[ ";$arch;" == *";90;"* || ";$arch;" == *";90-real;"* ]] ||
    { echo "carry: $BUILD builds for '$arch', not sm_90"; return 1; }
  grep -q '^WEAVE_CUDA_STATIC_RUNTIME:BOOL=ON' "$BUILD/CMakeCache.txt" ||
    { echo "carry: $BUILD links the shared CUDA runtime (WEAVE_CUDA_STATIC_RUNTIME)"; return 1; }
  package "$BUILD" "$CARRY" deps || { echo "carry: packaging failed"; return 1; }
  size=$(du -sb "$CARRY" | cut -f1)
  # What else travels: the tracked and untracked-not-ignored files of the working tree.
  tree_size=$(git ls-files -co --exclude-standard -z 2>/dev/null |
    xargs -0 -r du -cb 2>/dev/null | tail -n 1 | cut -f1 || echo 0)
  echo "carry: $CARRY is $((size / 1024)) KiB ($(find "$CARRY/bin" -type f | wc -l) binaries);" \
    "with the working tree ($((tree_size / 1024)) KiB) $(((size + tree_size) / 1024)) KiB" \
    "of the $((CARRY_LIMIT / 1024)) KiB limit"
  du -b "$CARRY"/bin/* "$CARRY"/lib/* | awk '{printf "  %8d KiB  %s\n", $1 / 1024, $2}'
  ((size + tree_size < CARRY_LIMIT)) || { echo "carry: over the limit"; return 1; }
}

mode_dry() {
  local names bin lib synthetic
  mode_carry || { fail "carry"; return; }
  echo "carry took $((SECONDS - mode_start)) s"
  mode_start=$SECONDS
  step "dry: the carry as the GPU machine will see it (no GPU used)"
  if use_nccl; then
    echo "NCCL: $NCCL_DIR"
  else
    fail "NCCL not found here"
  fi
  RT=$CARRY
  while IFS=$'\t' read -r _ bin _; do
    [[ -x "$CARRY/bin/$bin" ]] || fail "$bin missing from the carry"
  done <"$CARRY/tests.tsv"
  [[ -x "$CARRY/bin/bench_gpu" ]] || fail "bench_gpu missing from the carry"
  echo "tests (ctest -L cuda): $(cut -f1 "$CARRY/tests.tsv" | tr '\n' ' ')"
  for bin in "$CARRY"/bin/*; do
    lib=$(objdump -p "$bin" | awk '/NEEDED/ {print $2}' | tr '\n' ' ')
    [[ "$lib" != *libcudart* ]] || fail "$(basename "$bin") loads the shared CUDA runtime"
    if command -v cuobjdump >/dev/null 2>&1; then
      [[ "$(cuobjdump --list-elf "$bin" 2>/dev/null)" == *sm_90* ]] ||
        fail "$(basename "$bin") has no sm_90 code"
    fi
  done
  echo "manifest: $(tr '\n' ' ' <"$CARRY/manifest.txt")"
  binaries_start "$CARRY" || fail "a carried binary does not start"
  step "dry: the test runner (each test must report skipped without a GPU)"
  run_tests dry || fail "test runner"
  step "dry: benchmark names, filters and the table"
  names=$(mktemp)
  bench_names >"$names" || fail "bench_gpu --benchmark_list_tests"
  python3 "$TABLE" check "$names" || fail "the table's benchmark names"
  run_benchmarks list || fail "per-instance filters"
  local rc=0
  CUDA_VISIBLE_DEVICES="" with_libs "$RT" "$RT/bin/bench_gpu" >/dev/null 2>&1 || rc=$?
  ((rc == 77)) || fail "bench_gpu without a GPU exits $rc, not 77 (skipped)"
  synthetic=$(mktemp -d)
  python3 "$TABLE" synthetic "$names" "$synthetic/report.json" || fail "synthetic report"
  python3 "$TABLE" table "$synthetic/report.json" --strict >"$synthetic/table.txt" ||
    { cat "$synthetic/table.txt"; fail "table on the synthetic report"; }
  # The merge step as core runs it: a report plus an instance that left none.
  printf 'BM_exchange_naive/iterations:50/manual_time\texit 134\n' >"$synthetic/failures.tsv"
  python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
d["benchmarks"] = [b for b in d["benchmarks"] if not b["name"].startswith("BM_exchange_naive/")]
json.dump(d, open(sys.argv[1], "w"))' "$synthetic/report.json"
  python3 "$TABLE" merge "$synthetic/merged.json" "$synthetic/failures.tsv" \
    "$synthetic/report.json" || fail "merge"
  python3 "$TABLE" table "$synthetic/merged.json" >"$synthetic/merged.txt" || true
  grep -q 'naive per-(token, expert) *ERR' "$synthetic/merged.txt" ||
    { cat "$synthetic/merged.txt"; fail "a failed instance is not shown as ERR"; }
  echo "table: $(wc -l <"$synthetic/table.txt") lines on the synthetic report, every cell filled"
  rm -rf "$synthetic" "$names"
  if command -v shellcheck >/dev/null 2>&1; then
    shellcheck bench/gpu/run.sh || fail "shellcheck bench/gpu/run.sh"
  fi
}

mode_preflight() {
  local missing=() rt=$CARRY san first case_name rc
  step "preflight: machine"
  date -u
  echo "GPU: $(gpu_line)"
  [[ -n "$(gpu_line)" ]] || missing+=("a GPU (nvidia-smi)")
  echo "kernel $(uname -r); $(ldd --version 2>/dev/null | sed -n 1p)"
  echo "nvcc: $(nvcc --version 2>/dev/null | tail -n 1 || echo missing)"
  command -v nvcc >/dev/null 2>&1 || missing+=("nvcc (rebuild)")
  echo "cmake: $(cmake --version 2>/dev/null | sed -n 1p || echo missing);" \
    "ninja: $(ninja --version 2>/dev/null || echo missing);" \
    "c++: $(c++ --version 2>/dev/null | sed -n 1p || echo missing)"
  echo "python3: $(python3 --version 2>&1)"
  step "preflight: NCCL"
  if use_nccl; then
    echo "libnccl.so.2 in $NCCL_DIR ($(python3 -c '
import importlib.metadata as m
for p in ("nvidia-nccl-cu13", "nvidia-nccl-cu12"):
    try:
        print(p, m.version(p)); break
    except m.PackageNotFoundError:
        pass
else:
    print("not from a wheel")' 2>/dev/null))"
    [[ -e "$(dirname "$NCCL_DIR")/include/nccl.h" ]] && echo "nccl.h beside it (rebuild: NCCL_ROOT)"
  else
    missing+=("libnccl.so.2")
  fi
  step "preflight: carried binaries"
  if [[ -f "$CARRY/manifest.txt" ]]; then
    echo "manifest: $(tr '\n' ' ' <"$CARRY/manifest.txt")"
    if [[ "$(manifest_get source_hash)" != "$(source_hash)" ]]; then
      echo "the carry was built from other sources: core and sanitize will rebuild here"
      missing+=("a carry matching these sources")
    fi
    binaries_start "$CARRY" ||
      missing+=("carried binaries that start here (core and sanitize will rebuild here)")
  else
    echo "no carry folder: send $CARRY along with the working tree; core will rebuild here"
    missing+=("the carry folder $CARRY")
    rt=""
  fi
  step "preflight: compute-sanitizer and one short CUDA test"
  san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  if [[ -x "$san" ]]; then
    "$san" --version 2>&1 | tail -n 1
  else
    missing+=("compute-sanitizer")
  fi
  if [[ -n "$rt" && -x "$rt/bin/test_exec_cuda" ]]; then
    rc=0
    with_libs "$rt" timeout 60 "$rt/bin/test_exec_cuda" --no-colors >"$OUT/preflight-test.log" 2>&1 ||
      rc=$?
    echo "test_exec_cuda: exit $rc ($(tail -n 2 "$OUT/preflight-test.log" | tr '\n' ' '))"
    ((rc == 0)) || missing+=("a passing test_exec_cuda")
    if [[ -x "$san" ]]; then
      first=$(with_libs "$rt" "$rt/bin/test_exec_cuda" --list-test-cases --no-colors 2>/dev/null |
        grep -v '^\[doctest\]\|^=====' | grep -m 1 '^[A-Za-z0-9 _:-]*$' || true)
      case_name=${first:-*}
      rc=0
      with_libs "$rt" timeout 60 "$san" --tool memcheck --error-exitcode 99 "${SANITIZER_API[@]}" \
        "$rt/bin/test_exec_cuda" --no-colors "--test-case=$case_name" \
        >>"$OUT/preflight-test.log" 2>&1 || rc=$?
      echo "memcheck of test_exec_cuda \"$case_name\": exit $rc" \
        "($(grep -m 1 'ERROR SUMMARY\|not supported\|Error' "$OUT/preflight-test.log" || true))"
      ((rc == 0)) || missing+=("compute-sanitizer memcheck on this machine")
    fi
  fi
  if ((${#missing[@]})); then
    echo "preflight: MISSING: $(printf '%s; ' "${missing[@]}")"
    status=1
  else
    echo "preflight: ready"
  fi
}

mode_core() {
  step "core: $(gpu_line)"
  use_runtime || { fail "no binaries to run"; return; }
  echo "binaries: $RT ($(manifest_get commit "$RT"), built $(manifest_get built "$RT"))"
  step "core: CUDA tests (ctest -L cuda's list; log tests.log)"
  run_tests || fail "CUDA tests"
  step "core: benchmarks, one process per instance (log bench.log, report bench_gpu.json)"
  run_benchmarks || fail "benchmarks"
  step "core: table"
  {
    echo "GPU: $(gpu_line); $(date -u +%Y-%m-%d); binaries $(manifest_get commit "$RT")"
    python3 "$TABLE" table "$OUT/bench_gpu.json"
  } >"$OUT/table.txt" 2>&1 || fail "table"
  cat "$OUT/table.txt"
}

mode_sanitize() {
  local san name bin labels tool tools t rc verdict start log="$OUT/sanitizer.log" out passes=()
  step "sanitize: $(gpu_line)"
  use_runtime || { fail "no binaries to run"; return; }
  san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  [[ -x "$san" ]] || { fail "compute-sanitizer not found"; return; }
  # Kernel tests first (memcheck, then racecheck and synccheck), then memcheck of the others
  # (NCCL and multi-rank exchanges: the slowest under a sanitizer).
  tools=${WEAVE_GPU_TOOLS:-memcheck racecheck synccheck}
  for tool in $tools; do
    while IFS=$'\t' read -r name bin labels _; do
      local kernel=0 label
      for label in ${labels//,/ }; do
        [[ " $KERNEL_LABELS " == *" $label "* ]] && kernel=1
      done
      ((kernel)) && passes+=("$name $bin $tool")
    done <"$RT/tests.tsv"
  done
  if [[ " $tools " == *" memcheck "* ]]; then
    while IFS=$'\t' read -r name bin labels _; do
      local kernel=0 label
      for label in ${labels//,/ }; do
        [[ " $KERNEL_LABELS " == *" $label "* ]] && kernel=1
      done
      ((kernel)) || passes+=("$name $bin memcheck")
    done <"$RT/tests.tsv"
  fi
  out=$(mktemp)
  : >"$log"
  step "sanitize: ${#passes[@]} passes (log sanitizer.log)"
  local pass
  for pass in "${passes[@]}"; do
    read -r name bin tool <<<"$pass"
    if [[ -n "${WEAVE_GPU_TESTS:-}" && " $WEAVE_GPU_TESTS " != *" $name "* ]]; then
      continue
    fi
    t=$(min "${WEAVE_GPU_SANITIZE_TIMEOUT:-150}" "$(left)")
    if ((t < 10)); then
      printf '%-20s %-10s %s\n' "$name" "$tool" "not run (deadline)"
      status=1
      continue
    fi
    start=$SECONDS
    rc=0
    with_libs "$RT" timeout -k 10 "$t" "$san" --tool "$tool" --error-exitcode 99 "${SANITIZER_API[@]}" \
      --print-limit 20 "$RT/bin/$bin" --no-colors >"$out" 2>&1 || rc=$?
    { echo "=== $name $tool (exit $rc)"; cat "$out"; } >>"$log"
    case "$rc" in
      0) verdict="clean" ;;
      77) verdict="SKIPPED (no GPU)"; status=1 ;;
      99) verdict="ERRORS"; status=1 ;;
      124 | 137) verdict="TIMED OUT (${t} s)"; status=1 ;;
      *) verdict="FAILED (exit $rc)"; status=1 ;;
    esac
    printf '%-20s %-10s %-18s %4d s\n' "$name" "$tool" "$verdict" $((SECONDS - start))
    if ((rc != 0 && rc != 77)); then
      grep -E '^========= (Invalid|Race|Barrier|Error|Program hit|ERROR SUMMARY)|not supported' \
        "$out" | head -n 6 | sed 's/^/    /' || true
    fi
  done
  rm -f "$out"
}

(($# > 0)) || { sed -n '2,32p' "$0"; exit 2; }
for mode in "$@"; do
  case "$mode" in
    carry | dry | preflight | core | sanitize) ;;
    *) echo "unknown mode '$mode' (carry, dry, preflight, core, sanitize)"; exit 2 ;;
  esac
done
for mode in "$@"; do
  mode_start=$SECONDS
  case "$mode" in
    carry) mode_carry || fail "$mode" ;;
    dry) mode_dry || fail "$mode" ;;
    preflight) mode_preflight || fail "$mode" ;;
    core) mode_core || fail "$mode" ;;
    sanitize) mode_sanitize || fail "$mode" ;;
  esac
  echo "== $mode done in $((SECONDS - mode_start)) s, status $status"
done
exit "$status"
