#!/usr/bin/env bash
# Regenerates the learned routing trace bench/placement/traces/fortunes-moe-e64-k8.trace: trains
# the small byte-level MoE language model of moe_lm_trace.cpp on the fortune cookies of Debian's
# `fortunes` package and records the routing of its 4 MoE layers on held-out text. Not run by
# the tests or CI: training takes about 10 minutes of one core (1500 steps).
#
#   examples/torch/record_trace.sh [build dir, default build/default] [extra moe_lm_trace options]
#
# Installs, where missing: `fortunes` (the corpus) and `libopenblas0-serial` (libtorch's BLAS;
# the reference BLAS makes training about 20x slower; Debian then makes OpenBLAS the system's
# BLAS). Needs root or sudo for that.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
build="${1:-$root/build/default}"
shift || true
out="$root/bench/placement/traces/fortunes-moe-e64-k8.trace"

missing=()
[ -d /usr/share/games/fortunes ] || missing+=(fortunes)
[ -e /usr/lib/x86_64-linux-gnu/openblas-serial/libblas.so.3 ] || missing+=(libopenblas0-serial)
if [ ${#missing[@]} -gt 0 ]; then
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get install -y "${missing[@]}"
fi

cmake --build "$build" --target moe_lm_trace
# One BLAS thread and one torch thread: the run is deterministic for a given machine and
# library build (a fixed step count, not a time budget).
OMP_NUM_THREADS=1 LD_LIBRARY_PATH="/usr/lib/x86_64-linux-gnu/openblas-serial${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  "$build/examples/moe_lm_trace" --out "$out" --steps 1500 --batch 32 --tokens 8192 "$@"
ls -l "$out"
