#!/usr/bin/env python3
"""Turn bench_kernels_gemm JSON into the markdown ratio table of
bench/results/kernels.md.

usage: gemm_ratio.py [--stat median|min] RUN.json [RUN_OPENBLAS_OTHER.json LABEL]

For every (shape, m, threads): tandem GFLOP/s, OpenBLAS GFLOP/s, and
tandem time / OpenBLAS time (> 1: tandem slower, the price of invariance).
Uses the chosen aggregate of repetitions (default median) when present; rates from real time (the
number a user sees) and, in brackets, from CPU time (less sensitive to other
load on a shared machine).
"""
import json
import re
import sys


STAT = "median"


def load(path):
    with open(path) as f:
        data = json.load(f)
    runs = {}
    for b in data["benchmarks"]:
        if b.get("run_type") == "aggregate" and b.get("aggregate_name") != STAT:
            continue
        m = re.match(r"BM_(\w+)/shape:(\d+)/m:(\d+)/threads:(\d+)", b["name"])
        if not m:
            continue
        key = (m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4)))
        # Prefer the median aggregate over single repetitions.
        if key in runs and b.get("run_type") != "aggregate":
            continue
        runs[key] = dict(real=b["real_time"], cpu=b["cpu_time"], label=b.get("label", ""),
                         flops=b.get("FLOPS", 0.0) * b["real_time"])  # FLOP per iteration * unit
    return data["context"], runs


def main():
    global STAT
    args = sys.argv[1:]
    if args[:1] == ["--stat"]:
        STAT = args[1]
        args = args[2:]
    ctx, runs = load(args[0])
    other = None
    if len(args) >= 3:
        _, other = load(args[1])
        other_label = args[2]
    print(f"<!-- {ctx.get('date')} host={ctx.get('host_name')} cpus={ctx.get('num_cpus')} "
          f"mhz={ctx.get('mhz_per_cpu')} load={ctx.get('load_avg')} -->")
    head = "| shape (n x k) | m | threads | tandem GFLOP/s | OpenBLAS GFLOP/s | tandem / OpenBLAS time |"
    sep = "|---|---:|---:|---:|---:|---:|"
    if other:
        head += f" OpenBLAS {other_label} GFLOP/s | tandem / {other_label} time |"
        sep += "---:|---:|"
    print(head)
    print(sep)
    keys = sorted(k for k in runs if k[0] == "TandemGemm")
    keys.sort(key=lambda k: (k[3], k[1], k[2]))
    for _, shape, m, threads in keys:
        t = runs[("TandemGemm", shape, m, threads)]
        name = t["label"]
        dims = re.search(r"(\d+)x(\d+)", name)
        n, k = int(dims.group(1)), int(dims.group(2))
        flop = 2.0 * m * n * k
        def gf(r, which):  # times are in ns by default
            return flop / r[which]

        def both(r):  # CPU time covers the main thread only: shown for 1 thread
            return f"{gf(r, 'real'):.1f} ({gf(r, 'cpu'):.1f})" if threads == 1 else f"{gf(r, 'real'):.1f}"

        def ratio(a, b):
            real = a["real"] / b["real"]
            return f"{real:.2f} ({a['cpu'] / b['cpu']:.2f})" if threads == 1 else f"{real:.2f}"

        row = f"| {name} | {m} | {threads} | {both(t)} "
        o = runs.get(("OpenBlasSgemm", shape, m, threads))
        if o:
            row += f"| {both(o)} | {ratio(t, o)} |"
        else:
            row += "| – | – |"
        if other:
            o2 = other.get(("OpenBlasSgemm", shape, m, threads))
            if o2:
                row += f" {both(o2)} | {ratio(t, o2)} |"
            else:
                row += " – | – |"
        print(row)
    peak = [b for b in json.load(open(args[0]))["benchmarks"]
            if b["name"].startswith("BM_PeakFma") and b.get("run_type") != "aggregate"]
    if peak:
        best_real = max(b["FLOPS"] for b in peak)
        best_cpu = max(b["FLOPS"] * b["real_time"] / b["cpu_time"] for b in peak)
        print(f"\nSingle-core AVX-512 FMA peak (BM_PeakFmaAvx512, best repetition): "
              f"{best_real / 1e9:.1f} GFLOP/s real time, {best_cpu / 1e9:.1f} GFLOP/s CPU time.")

if __name__ == "__main__":
    main()
