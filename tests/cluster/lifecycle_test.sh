#!/usr/bin/env bash
# weave-cluster's life cycle: it runs programs on distinct nodes, shapes each node's uplink as
# asked, counts the bytes, passes the program's exit status on, and leaves nothing behind (no
# namespace, no file) on a normal exit, a failing program, a crashing rank, SIGTERM, SIGINT and
# SIGHUP; what a SIGKILLed run leaves, --cleanup removes. It refuses with 77 when not root or
# without tc tbf.
# Usage: lifecycle_test.sh PATH/TO/weave-cluster. Exits 77 (skipped) where clusters cannot run.
set -uo pipefail
cluster="${1:?usage: lifecycle_test.sh weave-cluster}"
"$cluster" --check || exit 77

failures=0
check() { # description, then a command that must succeed
  local what="$1"
  shift
  if "$@"; then
    echo "ok: $what"
  else
    echo "FAILED: $what" >&2
    failures=$((failures + 1))
  fi
}
namespaces_of() { ip netns list | awk '{ print $1 }' | grep "^wcl$1-" || true; }
left_by() { # nothing of run $1: namespaces, its directory, Open MPI's files
  [[ -z $(namespaces_of "$1") ]] && ! compgen -G "/tmp/wcl$1.*" >/dev/null &&
    ! compgen -G "/tmp/ompi.wcl$1-*" >/dev/null && ! compgen -G "/dev/shm/*wcl$1-*" >/dev/null
}
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# A run that succeeds: one hostname per node, each rank on its node, bytes counted.
"$cluster" -n 3 -g 2 --bytes "$work/bytes" -- hostname >"$work/names" 2>"$work/log" &
pid=$!
wait $pid
check "a run exits 0" [ $? = 0 ]
check "6 ranks report" [ "$(wc -l <"$work/names")" = 6 ]
check "3 distinct hostnames, 2 ranks each" \
  [ "$(sort "$work/names" | uniq -c | awk '{ print $1 }' | sort -u)" = 2 -a \
  "$(sort -u "$work/names" | wc -l)" = 3 ]
check "the byte table has a row per node" [ "$(tail -n +2 "$work/bytes" | wc -l)" = 3 ]
check "every node's uplink carried bytes (mpirun's wire-up)" \
  awk -F'\t' 'NR > 1 && ($4 <= 0 || $5 <= 0) { exit 1 }' "$work/bytes"
check "nothing left after a run" left_by $pid

# Rates: node 1 slower than the rest, as tc reports it inside the node.
"$cluster" -q -n 2 -g 1 --rate 200mbit --node-rate 1=20mbit --exec -- \
  sh -c 'tc qdisc show dev eth0; mpirun -np 2 sh -c "tc qdisc show dev eth0"' >"$work/tc" 2>&1 &
pid=$!
wait $pid
check "node 0's uplink is shaped at 200 Mbit" grep -q "tbf.*rate 200Mbit" "$work/tc"
check "node 1's uplink is shaped at 20 Mbit" grep -q "tbf.*rate 20Mbit" "$work/tc"
check "nothing left after --exec" left_by $pid

# The program's exit status is the script's; a crashing rank ends the job.
"$cluster" -q -n 2 -g 1 --exec -- sh -c 'exit 7' 2>/dev/null &
pid=$!
wait $pid
check "a failing program's status (7) is passed on" [ $? = 7 ]
check "nothing left after a failing program" left_by $pid
"$cluster" -q -n 2 -g 1 -- sh -c 'if [ "$OMPI_COMM_WORLD_RANK" = 1 ]; then kill -9 $$; fi; sleep 30' \
  >/dev/null 2>&1 &
pid=$!
wait $pid
check "a rank killed by SIGKILL fails the run" [ $? != 0 ]
check "nothing left after a crashed rank" left_by $pid

# Signals: the cluster is torn down and the script dies of the signal. Job control gives the
# background job default signal dispositions (a plain background job ignores SIGINT).
set -m
for sig in TERM INT HUP; do
  "$cluster" -q -n 2 -g 2 -- sleep 60 >/dev/null 2>&1 &
  pid=$!
  for _ in $(seq 100); do # until the ranks run on node 1
    [[ -n $(ip netns pids "wcl$pid-n1" 2>/dev/null | head -1) ]] && break
    sleep 0.1
  done
  sleep 0.5
  kill -s $sig $pid
  wait $pid
  status=$?
  check "SIG$sig ends the run by that signal" [ $status = $((128 + $(kill -l $sig))) ]
  check "nothing left after SIG$sig" left_by $pid
done

# SIGKILL cannot be trapped: the namespaces stay until --cleanup removes them.
"$cluster" -q -n 2 -g 1 -- sleep 60 >/dev/null 2>&1 &
pid=$!
for _ in $(seq 100); do
  [[ -n $(ip netns pids "wcl$pid-n1" 2>/dev/null | head -1) ]] && break
  sleep 0.1
done
kill -9 $pid
wait $pid 2>/dev/null
check "a SIGKILLed run leaves its namespaces" [ -n "$(namespaces_of $pid)" ]
"$cluster" --cleanup 2>/dev/null
check "--cleanup removes them, their processes and files" left_by $pid
set +m

# Refusals: not root; bad options.
if command -v setpriv >/dev/null; then
  # A copy the unprivileged user can read wherever the checkout lives.
  copy="$(mktemp /tmp/weave-cluster.XXXXXX)"
  cp "$cluster" "$copy" && chmod 755 "$copy"
  setpriv --reuid=65534 --regid=65534 --clear-groups "$copy" -n 2 -- true 2>"$work/refusal"
  check "as an unprivileged user it refuses with 77" [ $? = 77 ]
  check "and says why" grep -q "need root" "$work/refusal"
  rm -f "$copy"
fi
# Without tc tbf (a tc that always fails, first on PATH): refused, nothing left behind.
mkdir -p "$work/no-tbf" && printf '#!/bin/sh\nexit 1\n' >"$work/no-tbf/tc" && chmod +x "$work/no-tbf/tc"
PATH="$work/no-tbf:$PATH" "$cluster" -n 2 -- true 2>"$work/refusal" &
pid=$!
wait $pid
check "without tc tbf it refuses with 77" [ $? = 77 ]
check "and says why" grep -q "tbf is unavailable" "$work/refusal"
check "leaving nothing behind" left_by $pid
"$cluster" -n 0 -- true 2>/dev/null
check "--nodes 0 is a usage error (2)" [ $? = 2 ]
"$cluster" -n 2 --node-rate 5=1mbit -- true 2>/dev/null
check "--node-rate of a node that does not exist is a usage error (2)" [ $? = 2 ]

((failures == 0)) || { echo "$failures check(s) failed" >&2; exit 1; }
echo "all life-cycle checks passed"
