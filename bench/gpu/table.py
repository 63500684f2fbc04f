#!/usr/bin/env python3
"""bench_gpu's results for bench/gpu/run.sh (standard library only: it runs under any python3).

  table.py merge OUT.json FAILURES.tsv RUN.json...  merge per-instance JSON reports into one;
                                                    FAILURES.tsv lines are "name<TAB>why" for
                                                    instances that left no usable report
  table.py table REPORT.json [--strict]             print the table of ratios (--strict: exit 1
                                                    when a cell has no number)
  table.py check NAMES.txt                          the listed instances (--benchmark_list_tests)
                                                    hold every name the table reads, exactly
                                                    once, and each has a fixed iteration count
  table.py synthetic NAMES.txt OUT.json             a made-up report of the listed instances, so
                                                    the table step can be run without a GPU
"""
import json
import re
import sys

# --- the names the table reads (prefixes of instance names, up to the next '/') -------------

COPY_T = (16384, 65536)
MOVES = (("gather", "BM_gather/{T}/0"), ("gather (scaled)", "BM_gather/{T}/1"),
         ("merge (k=2, weighted)", "BM_merge/{T}/2"), ("merge (k=8, weighted)", "BM_merge/{T}/8"))
GATE_E = (64, 256)
GATE_T = (16384, 65536)
EXCHANGE = ((0, 1, 0), (0, 4, 0), (1, 1, 0), (1, 4, 0), (1, 1, 1), (1, 4, 1))
WORLD = ((0, 1), (0, 4), (1, 1), (1, 4))
DECODE_TOKENS = (1, 8, 64, 256)
DECODE_MODES = ((0, "dynamic cuda_moe_exchange"), (1, "cuda_decode_exchange"),
                (2, "cuda_decode_exchange, graph"))
PIPELINE_CHUNKS = (1, 2, 4, 8, 16)


def wanted():
    names = []
    for T in COPY_T:
        names.append(f"BM_d2d_copy/{T}")
        names += [pattern.format(T=T) for _, pattern in MOVES]
    for E in GATE_E:
        for T in GATE_T:
            names += [f"BM_gate/{E}/{T}", f"BM_gate_plan_weave/{E}/{T}",
                      f"BM_gate_plan_mask/{E}/{T}"]
    names.append("BM_exchange_naive")
    names += [f"BM_exchange/static:{s}/chunks:{c}/graph:{g}" for s, c, g in EXCHANGE]
    names += [f"BM_exchange_world/static:{s}/chunks:{c}" for s, c in WORLD]
    names += [f"BM_decode/mode:{m}/tokens:{t}" for t in DECODE_TOKENS for m, _ in DECODE_MODES]
    names += [f"BM_pipeline/{c}" for c in PIPELINE_CHUNKS]
    return names


def matches(name, prefix):
    return name.startswith(prefix + "/")


# --- reading reports --------------------------------------------------------------------------

UNIT_US = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}


class Report:
    def __init__(self, benchmarks):
        self.runs = [b for b in benchmarks if b.get("run_type", "iteration") == "iteration"]
        self.missing = 0

    def find(self, prefix):
        for b in self.runs:
            if matches(b.get("name", ""), prefix):
                return b
        return None

    def value(self, prefix, key):
        """The number, or None (no such instance, an instance that failed, or no such key)."""
        b = self.find(prefix)
        if b is None or b.get("error_occurred"):
            return None
        if key == "us":
            t = b.get("real_time")
            return None if t is None else t * UNIT_US.get(b.get("time_unit", "ns"), 1e-3)
        return b.get(key)

    def mark(self, prefix):
        """What a cell without a number shows: ERR for a failed instance, - for a missing one."""
        b = self.find(prefix)
        return "ERR" if b is not None and b.get("error_occurred") else "-"


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def cell(report, x, spec, prefix=None):
    width = int(re.match(r"\d*", spec).group() or 0)
    if x is None:
        report.missing += 1
        return format(report.mark(prefix) if prefix else "-", f">{width}")
    return format(x, spec)


def print_table(report):
    r = report
    out = []
    p = out.append
    p("== bench_gpu (bf16 rows of hidden 4096; us per call unless noted)")
    p("")
    p("row moves vs a device-to-device copy of the same bytes (goal >= 70% of copy)")
    p(f"{'kernel':<24}{'T':>7}{'GB/s':>9}{'% of copy':>11}")
    for T in COPY_T:
        copy_name = f"BM_d2d_copy/{T}"
        copy = r.value(copy_name, "GB/s")
        p(f"{'d2d copy':<24}{T:>7}{cell(r, copy, '9.0f', copy_name)}"
          f"{cell(r, None if copy is None else 100.0, '11.0f', copy_name)}")
        for label, pattern in MOVES:
            name = pattern.format(T=T)
            bw = r.value(name, "GB/s")
            pct = None if ratio(bw, copy) is None else 100 * ratio(bw, copy)
            p(f"{label:<24}{T:>7}{cell(r, bw, '9.0f', name)}{cell(r, pct, '11.0f', name)}")
    p("")
    p("gate + plan vs gate + mask-based plan, k=8 (goal >= 3x at E=256)")
    p(f"{'E':>5}{'T':>7}{'gate':>9}{'+ plan':>9}{'+ mask':>9}{'speedup':>9}")
    for E in GATE_E:
        for T in GATE_T:
            g, w, m = (f"BM_gate/{E}/{T}", f"BM_gate_plan_weave/{E}/{T}",
                       f"BM_gate_plan_mask/{E}/{T}")
            ours, mask = r.value(w, "us"), r.value(m, "us")
            p(f"{E:>5}{T:>7}{cell(r, r.value(g, 'us'), '9.1f', g)}{cell(r, ours, '9.1f', w)}"
              f"{cell(r, mask, '9.1f', m)}{cell(r, ratio(mask, ours), '9.2f', w)}")
    p("")
    p("MoE exchange forward, one-rank NCCL, T=8192, E=64, k=8 (identity experts)")
    p(f"{'path':<28}{'us':>9}{'vs naive':>10}{'graph vs eager':>16}")
    naive = r.value("BM_exchange_naive", "us")
    p(f"{'naive per-(token, expert)':<28}{cell(r, naive, '9.1f', 'BM_exchange_naive')}"
      f"{'1.00':>10}")
    for s, c, g in EXCHANGE:
        name = f"BM_exchange/static:{s}/chunks:{c}/graph:{g}"
        t = r.value(name, "us")
        label = ("static" if s else "dynamic") + f", C={c}" + (", graph" if g else ", eager")
        eager = r.value(f"BM_exchange/static:{s}/chunks:{c}/graph:0", "us") if g else None
        extra = cell(r, ratio(eager, t), "16.2f", name) if g else ""
        p(f"{label:<28}{cell(r, t, '9.1f', name)}{cell(r, ratio(naive, t), '10.2f', name)}{extra}")
    p("")
    p("MoE exchange forward, 4 ranks of cuda_local_world on one GPU, T=4096 per rank")
    p("(per layer, host wait included; a multi-rank cuda_local_world is not capturable: graphs")
    p(" are measured above on one-rank NCCL)")
    p(f"{'shapes':<28}{'us':>9}{'vs dynamic C=1':>16}")
    base = r.value("BM_exchange_world/static:0/chunks:1", "us")
    for s, c in WORLD:
        name = f"BM_exchange_world/static:{s}/chunks:{c}"
        t = r.value(name, "us")
        label = ("static" if s else "dynamic") + f", C={c}"
        p(f"{label:<28}{cell(r, t, '9.1f', name)}{cell(r, ratio(base, t), '16.2f', name)}")
    p("")
    p("decode layer vs the dynamic exchange, one-rank NCCL, E=64, k=8")
    p(f"{'layer':<32}{'tokens':>7}{'us':>9}{'vs dynamic':>12}")
    for tokens in DECODE_TOKENS:
        base = r.value(f"BM_decode/mode:0/tokens:{tokens}", "us")
        for mode, label in DECODE_MODES:
            name = f"BM_decode/mode:{mode}/tokens:{tokens}"
            t = r.value(name, "us")
            p(f"{label:<32}{tokens:>7}{cell(r, t, '9.1f', name)}"
              f"{cell(r, ratio(base, t), '12.2f', name)}")
    p("")
    p("pipeline emulation, 1 GiB each way (copy / compute / copy)")
    p(f"{'chunks':>7}{'ms':>9}{'hidden %':>10}")
    for c in PIPELINE_CHUNKS:
        name = f"BM_pipeline/{c}"
        t = r.value(name, "us")
        p(f"{c:>7}{cell(r, None if t is None else t / 1e3, '9.2f', name)}"
          f"{cell(r, r.value(name, 'hidden_pct'), '10.1f', name)}")
    failed = [b["name"] for b in report.runs if b.get("error_occurred")]
    if failed:
        p("")
        p(f"{len(failed)} instance(s) failed (ERR): " + ", ".join(failed[:8]) +
          (" ..." if len(failed) > 8 else ""))
        for b in report.runs:
            if b.get("error_occurred"):
                p(f"  first failure: {b['name']}: {b.get('error_message', '')[:200]}")
                break
    print("\n".join(out))


# --- commands -----------------------------------------------------------------------------

def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def cmd_merge(out_path, failures_path, paths):
    context, benchmarks = None, []
    for path in paths:
        try:
            data = read_json(path)
        except (OSError, ValueError):
            continue  # the runner lists the instance in FAILURES.tsv
        context = context or data.get("context")
        benchmarks += data.get("benchmarks", [])
    try:
        with open(failures_path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                name, _, why = line.rstrip("\n").partition("\t")
                if not any(b.get("name") == name for b in benchmarks):
                    benchmarks.append({"name": name, "run_name": name, "run_type": "iteration",
                                       "error_occurred": True, "error_message": why})
    except OSError:
        pass
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump({"context": context or {}, "benchmarks": benchmarks}, f, indent=1)
    return 0


def cmd_table(path, strict):
    try:
        data = read_json(path)
    except (OSError, ValueError) as e:
        print(f"table: cannot read {path}: {e}")
        return 1
    report = Report(data.get("benchmarks", []))
    print_table(report)
    if strict and report.missing:
        print(f"table: {report.missing} cell(s) without a number")
        return 1
    return 0


def read_names(path):
    with open(path, encoding="utf-8") as f:
        return [line.strip() for line in f if line.strip()]


def cmd_check(path):
    names = read_names(path)
    problems = []
    for prefix in wanted():
        hits = [n for n in names if matches(n, prefix)]
        if len(hits) != 1:
            problems.append(f"{prefix}: {len(hits)} instances (the table needs exactly 1)")
    for n in names:
        if "/iterations:" not in n:
            problems.append(f"{n}: no fixed iteration count (Google Benchmark would probe it)")
        if not re.fullmatch(r"[A-Za-z0-9_/:.]+", n):
            problems.append(f"{n}: characters the runner's --benchmark_filter does not expect")
    unused = [n for n in names if not any(matches(n, p) for p in wanted())]
    for p in problems:
        print("check: " + p)
    print(f"check: {len(names)} instances, {len(wanted())} names in the table, "
          f"{len(unused)} listed but not in the table{': ' + ', '.join(unused) if unused else ''}")
    return 1 if problems else 0


def cmd_synthetic(names_path, out_path):
    benchmarks = []
    for i, name in enumerate(read_names(names_path)):
        unit = "ms" if name.startswith("BM_pipeline/") else "us"
        benchmarks.append({"name": name, "run_name": name, "run_type": "iteration",
                           "iterations": 10, "real_time": 100.0 + i, "cpu_time": 10.0,
                           "time_unit": unit, "GB/s": 1000.0 + i, "hidden_pct": 50.0})
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump({"context": {"synthetic": True}, "benchmarks": benchmarks}, f)
    return 0


def main(argv):
    if len(argv) >= 4 and argv[0] == "merge":
        return cmd_merge(argv[1], argv[2], argv[3:])
    if len(argv) in (2, 3) and argv[0] == "table":
        return cmd_table(argv[1], strict=argv[2:] == ["--strict"])
    if len(argv) == 2 and argv[0] == "check":
        return cmd_check(argv[1])
    if len(argv) == 3 and argv[0] == "synthetic":
        return cmd_synthetic(argv[1], argv[2])
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
