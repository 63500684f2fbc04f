#!/usr/bin/env python3
"""Runs two builds of a Google Benchmark binary alternately and prints a markdown table of their
per-benchmark medians and the speed-up old / new (above 1: the new build is faster).

    python3 bench/side_by_side.py OLD_BINARY NEW_BINARY [--runs N] [--filter REGEX]
                                  [--launcher "mpirun -np 2"] [--min-time S] [--json OUT]
                                  [--counters a_us,b_us]

Each round runs the old binary, then the new one (N rounds), so slow drifts of a shared machine
fall on both alike; the median over the rounds of each benchmark's time (real time, or manual time
where the benchmark sets it) is compared. The binaries must print the same benchmark names.
With --json the per-round times of both go to OUT (what docs/perf.md's tables are made from).
With --counters the named user counters of each benchmark are compared instead of its time (for
benchmarks that time several layers per iteration and report each as a counter, in microseconds).
"""
import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile


def run_once(binary, launcher, flt, min_time, counters):
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = shlex.split(launcher) + [binary, "--benchmark_out=" + out.name,
                                        "--benchmark_out_format=json"]
        if flt:
            cmd.append("--benchmark_filter=" + flt)
        if min_time:
            cmd.append("--benchmark_min_time=" + min_time)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(out.name) as f:
            data = json.load(f)
    times = {}
    for b in data["benchmarks"]:
        if b.get("run_type") == "aggregate":
            continue
        if counters:
            for c in counters:
                if c in b:
                    times[b["name"] + " " + c] = b[c] * 1e-6  # microseconds
            continue
        scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[b.get("time_unit", "ns")]
        times[b["name"]] = b["real_time"] * scale
    return times


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--filter", default="")
    p.add_argument("--launcher", default="")
    p.add_argument("--min-time", default="")
    p.add_argument("--json", default="")
    p.add_argument("--counters", default="")
    a = p.parse_args()
    counters = [c for c in a.counters.split(",") if c]
    rounds = {"old": [], "new": []}
    for i in range(a.runs):
        for which, binary in (("old", a.old), ("new", a.new)):
            rounds[which].append(run_once(binary, a.launcher, a.filter, a.min_time, counters))
            print(f"round {i + 1}/{a.runs}: {which} done", file=sys.stderr)
    names = [n for n in rounds["old"][0] if all(n in r for r in rounds["old"] + rounds["new"])]
    ratios = []
    print("| benchmark | old (ms) | new (ms) | old / new |")
    print("|---|---|---|---|")
    for n in names:
        old = statistics.median(r[n] for r in rounds["old"])
        new = statistics.median(r[n] for r in rounds["new"])
        ratios.append(old / new)
        print(f"| {n} | {old * 1e3:.3f} | {new * 1e3:.3f} | {old / new:.2f} |")
    if ratios:
        geo = statistics.geometric_mean(ratios)
        print(f"\ngeometric mean of old / new over {len(ratios)} benchmarks: {geo:.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rounds, f, indent=1)


if __name__ == "__main__":
    main()
