#!/usr/bin/env bash
# Builds weave's fuzz harnesses with clang (libFuzzer, ASan + UBSan) and runs a short campaign of
# each from its seed corpus (tests/fuzz/corpus/<harness>); fails on any finding: a crash, a
# sanitizer report, a leak, a slow input, a broken property, an exception that is not a typed
# refusal. New inputs go to a scratch directory (the corpora in the repository stay as they are);
# what a failing run found is kept under <build>/artifacts.
#
#   tests/fuzz/run.sh [seconds per harness (default 6)] [harness ...]
#
# Environment: WEAVE_FUZZ_BUILD (build directory, default build/fuzz), WEAVE_FUZZ_CXX (default
# clang++).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
seconds=${1:-6}
shift $(($# > 0 ? 1 : 0))
build=${WEAVE_FUZZ_BUILD:-build/fuzz}
harnesses=("$@")
if [[ ${#harnesses[@]} -eq 0 ]]; then
  harnesses=(trace cluster failure_words count_block fingerprint decode_headers call_messages
    options)
fi

cxx=${WEAVE_FUZZ_CXX:-clang++}
if ! echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' |
    "$cxx" -x c++ -fsanitize=fuzzer -o /dev/null - >/dev/null 2>&1; then
  echo "tests/fuzz/run.sh: '$cxx' cannot build a libFuzzer harness (Debian: apt-get install" \
       "clang libclang-rt-14-dev)" >&2
  exit 1
fi
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE= \
  -DCMAKE_CXX_COMPILER="$cxx" -DWEAVE_FUZZ=ON \
  -DWEAVE_ENABLE_TESTING=OFF -DWEAVE_ENABLE_BENCHMARKS=OFF -DWEAVE_ENABLE_EXAMPLES=OFF \
  -DWEAVE_ENABLE_HEADER_CHECKS=OFF -DWEAVE_INSTALL=OFF -DWEAVE_ENABLE_CUDA=OFF \
  -DWEAVE_ENABLE_NCCL=OFF -DWEAVE_ENABLE_MPI=OFF >/dev/null
cmake --build "$build" --target $(printf 'fuzz_%s ' "${harnesses[@]}")

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$build/artifacts"
status=0
for h in "${harnesses[@]}"; do
  mkdir -p "$scratch/$h"
  echo "--- fuzz_$h: ${seconds} s"
  if ! "$build/tests/fuzz/fuzz_$h" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
      -print_final_stats=1 -artifact_prefix="$build/artifacts/$h-" \
      "$scratch/$h" "tests/fuzz/corpus/$h" >"$scratch/$h.log" 2>&1; then
    tail -n 60 "$scratch/$h.log"
    echo "fuzz_$h: FINDING (inputs under $build/artifacts)" >&2
    status=1
  else
    grep -E "^stat::number_of_executed_runs|^Done" "$scratch/$h.log" || true
  fi
done
exit $status
