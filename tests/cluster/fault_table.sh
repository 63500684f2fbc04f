#!/usr/bin/env bash
# Node and link faults on an emulated cluster: runs fault_probe (MoE layers over MPI, each checked)
# on NODES x RANKS ranks, injects one fault into the last node a second after every rank has
# completed 3 layers, and prints what every rank saw (outcome, correct layers, seconds from the
# injection) as a Markdown table.
#
# Usage: fault_table.sh [options] PATH/TO/fault_probe
#   --cases "kill stop link-down slow"   which faults (default: all four)
#     kill       the node's ranks get SIGKILL
#     stop       the node's ranks get SIGSTOP (frozen; SIGKILLed once the survivors recorded)
#     link-down  the node's link goes down, and up again 5 s later
#     slow       the node's link is shaped down to 1% of its rate (both directions)
#   -n/--nodes N (2), -g/--ranks-per-node G (2), --rate RATE (1gbit), --seconds S (probe run, 12)
#   --timeout-ms T   mpi_options::timeout of the probe (default: the library's, 10 minutes)
#   --bound S        a rank with no outcome S seconds after the injection is a hang (default:
#                    the timeout + 60 s)
#   --check          exit 1 unless every surviving rank completed correctly or ended with a typed
#                    error (or by mpirun) within the bound, and none saw a wrong result
# Exits 77 where weave-cluster cannot run. Needs root.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cluster="$here/weave-cluster"

# --- inside the cluster (node 0): one case.
if [[ ${1:-} == --inside ]]; then
  shift
  case_name="$1" probe="$2" seconds="$3" timeout_ms="$4" bound="$5" rate="$6"
  nodes="$WEAVE_CLUSTER_NODES" per_node="$WEAVE_CLUSTER_RANKS_PER_NODE"
  victim="$(awk -v n="$nodes" 'NR == n { print $2 }' "$WEAVE_CLUSTER_DIR/nodes")"
  switch="${victim%-n*}-sw"
  port="v$((nodes - 1))"
  out="$(mktemp -d)"
  extra=()
  [[ $timeout_ms == default ]] || extra=(--timeout-ms "$timeout_ms")
  mpirun -np $((nodes * per_node)) --map-by slot "$probe" --out "$out" --seconds "$seconds" \
    "${extra[@]}" >"$out/mpirun.log" 2>&1 &
  job=$!
  # Warm-up: every rank past its third layer (at most 60 s), then a second more.
  for _ in $(seq 600); do
    n=$(ls "$out" | grep -c '^running')
    ((n == nodes * per_node)) && break
    kill -0 $job 2>/dev/null || break
    sleep 0.1
  done
  sleep 1
  ranks_of_victim() {
    local p
    for p in $(ip netns pids "$victim"); do
      [[ $(cat "/proc/$p/comm" 2>/dev/null) == fault_probe ]] && echo "$p"
    done
  }
  t0="$(date +%s.%N)"
  case "$case_name" in
    kill) kill -9 $(ranks_of_victim) ;;
    stop) kill -STOP $(ranks_of_victim) ;;
    link-down)
      ip -n "$victim" link set eth0 down
      (sleep 5 && ip -n "$victim" link set eth0 up) &
      ;;
    slow)
      n="${rate%%[a-z]*}" unit="${rate#"${rate%%[a-z]*}"}"
      case "$unit" in gbit) kbit=$((n * 1000000)) ;; mbit) kbit=$((n * 1000)) ;; *) kbit=$n ;; esac
      slow_rate="$((kbit / 100))kbit"
      for dev in "$victim eth0" "$switch $port"; do
        set -- $dev
        ip netns exec "$1" tc qdisc change dev "$2" root tbf rate "$slow_rate" burst 64kb \
          latency 100ms
      done
      ;;
    *) echo "fault_table: unknown case $case_name" >&2; exit 2 ;;
  esac
  survivors=$(((nodes - 1) * per_node))
  recorded() { local c=0 r; for ((r = 0; r < survivors; ++r)); do [[ -s $out/rank$r ]] && ((++c)); done; echo $c; }
  end_of_job=""
  while :; do
    now="$(date +%s.%N)"
    if ! kill -0 $job 2>/dev/null; then
      end_of_job="$now"
      break
    fi
    if [[ $case_name == stop && $(recorded) == "$survivors" ]]; then
      sleep 6 # the survivors' own exit after their error
      kill -9 $(ranks_of_victim) 2>/dev/null
    fi
    if awk -v a="$now" -v b="$t0" -v s="$bound" 'BEGIN { exit !(a - b > s) }'; then
      echo "HANG past ${bound}s" >"$out/hang"
      kill -9 $job 2>/dev/null # mpirun too: it may wait for what it cannot reach
      for ns in $(awk '{ print $2 }' "$WEAVE_CLUSTER_DIR/nodes"); do # this cluster's only
        for p in $(ip netns pids "$ns"); do
          [[ $(cat "/proc/$p/comm" 2>/dev/null) == fault_probe ]] && kill -9 "$p"
        done
      done
      break
    fi
    sleep 0.2
  done
  wait $job
  job_status=$?
  for ((r = 0; r < nodes * per_node; ++r)); do
    node=$((r / per_node))
    role=survivor
    ((node == nodes - 1)) && role=faulty
    if [[ -s $out/rank$r ]]; then
      read -r outcome layers longest when detail <"$out/rank$r"
      after="$(awk -v a="$when" -v b="$t0" 'BEGIN { printf "%.2f", a - b }')"
    elif [[ -e $out/hang ]]; then
      outcome=hang layers=- longest=- after=">$bound" detail="no outcome within the bound"
    else
      outcome="ended by mpirun" layers=- longest=-
      detail="$(grep -m1 -o "mpirun noticed that.*" "$out/mpirun.log" || echo "mpirun's exit status $job_status")"
      after="$(awk -v a="$end_of_job" -v b="$t0" 'BEGIN { printf "%.2f", a - b }')"
    fi
    detail="${detail//|//}"
    [[ $longest == - ]] || longest="$(printf "%.2f" "$longest")"
    echo "| $case_name | $r | $node ($role) | $outcome | $layers | $longest | $after | ${detail:0:150} |"
  done
  rm -rf "$out"
  exit 0
fi

# --- outside: one cluster per case.
cases="kill stop link-down slow" nodes=2 per_node=2 rate=1gbit seconds=12 timeout_ms=default
bound="" check=0
while (($#)); do
  case "$1" in
    --cases) cases="$2"; shift 2 ;;
    -n | --nodes) nodes="$2"; shift 2 ;;
    -g | --ranks-per-node) per_node="$2"; shift 2 ;;
    --rate) rate="$2"; shift 2 ;;
    --seconds) seconds="$2"; shift 2 ;;
    --timeout-ms) timeout_ms="$2"; shift 2 ;;
    --bound) bound="$2"; shift 2 ;;
    --check) check=1; shift ;;
    -*) echo "fault_table: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
probe="$(readlink -f "${1:?usage: fault_table.sh [options] PATH/TO/fault_probe}")"
if [[ -z $bound ]]; then
  ms=600000
  [[ $timeout_ms == default ]] || ms=$timeout_ms
  bound=$((ms / 1000 + 60))
fi
"$cluster" --check 2>/dev/null || { "$cluster" --check; exit 77; }
echo "Faults on $nodes nodes x $per_node ranks, uplinks $rate, probe timeout $timeout_ms ms," \
  "bound ${bound} s; the fault hits node $((nodes - 1)) a second after every rank's third layer."
echo
echo "| fault | rank | node | outcome | correct layers | longest layer (s) | seconds after the fault | detail |"
echo "|---|---|---|---|---|---|---|---|"
bad=0
for c in $cases; do
  rows="$("$cluster" -q -n "$nodes" -g "$per_node" --rate "$rate" --exec -- \
    bash "${BASH_SOURCE[0]}" --inside "$c" "$probe" "$seconds" "$timeout_ms" "$bound" "$rate")"
  echo "$rows"
  # Surviving ranks: completed, a typed error, or ended by mpirun; never wrong, never a hang.
  if echo "$rows" | awk -F'|' '$4 ~ /survivor/ && $5 !~ /completed|error|ended by mpirun/' |
    grep -q .; then
    bad=1
  fi
done
((check == 0 || bad == 0))
