#!/usr/bin/env bash
# One MoE layer on an emulated cluster at each uplink rate, measured beside weave-sim's
# prediction (layer_speed), as one Markdown table. Usage:
#   speed_table.sh [-n NODES] [-g RANKS_PER_NODE] [--rates "1 4"] PATH/TO/layer_speed [ARGS...]
# ARGS go to layer_speed (--tokens, --hidden, --experts, --k, --iters, --compute-us).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
nodes=2 per_node=2 rates="1 4"
while (($#)); do
  case "$1" in
    -n) nodes="$2"; shift 2 ;;
    -g) per_node="$2"; shift 2 ;;
    --rates) rates="$2"; shift 2 ;;
    *) break ;;
  esac
done
probe="$(readlink -f "${1:?usage: speed_table.sh [options] PATH/TO/layer_speed [ARGS...]}")"
shift
"$here/weave-cluster" --check 2>/dev/null || { "$here/weave-cluster" --check; exit 77; }
echo "| uplink | case | measured (ms) | weave-sim (ms) | measured / predicted |"
echo "|---|---|---|---|---|"
for r in $rates; do
  out="$("$here/weave-cluster" -q -n "$nodes" -g "$per_node" --rate "${r}gbit" -- \
    "$probe" --uplink-gbit "$r" "$@")"
  echo "$out" | grep '^#' >&2
  echo "$out" | awk -F'\t' -v r="$r" '!/^#/ && $1 != "case" {
    printf "| %s Gbit/s | %s | %s | %s | %s |\n", r, $1, $2, $3, $4 }'
done
