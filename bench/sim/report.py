#!/usr/bin/env python3
"""Turns bench/results/sim_raw/* into the tables of bench/results/sim_*.md.

    bench/sim/report.py cpu|interference|bandwidth|routing [skip3600]|pd
prints a markdown table (the reports quote it)."""
import glob, json, os, re, sys

RAW = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "results", "sim_raw")


def load(name):
    with open(os.path.join(RAW, name)) as f:
        return json.load(f)


def f(x, n=1):
    return "—" if x is None else f"{x:.{n}f}"


def table(head, rows):
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def cpu():
    rows = []
    for c in ["aggregated", "1p1d", "2p2d", "4p4d", "8p8d"]:
        try:
            b, s = load(f"cpu_{c}.json"), load(f"cpu_{c}.cpu.json")
        except OSError:
            continue
        r = s["cpu_seconds_by_role"]
        roles = ", ".join(f"{k} {v:.2f}" for k, v in r.items() if k != "launcher")
        rows.append([c, b["completed"], b["total_output_tokens"], f(b["duration_s"]), roles,
                     f(s["cpu_seconds_total"], 2), f(s["cpu_ms_per_output_token"], 3),
                     f(s["cpu_ms_per_request"], 1), f(s["proxy_cpu_ms_per_request"], 1),
                     f(b["median_itl_ms"]), f(b["p99_itl_ms"]), f(b["p99_ttft_ms"]),
                     " / ".join(f"{x:.1f}" for x in s["loadavg_1_5_15"])])
    print(table(["fleet", "requests", "output tokens", "run s", "CPU s by role", "CPU s total",
                 "CPU ms / output token", "CPU ms / request", "proxy CPU ms / request",
                 "ITL p50 ms", "ITL p99 ms", "TTFT p99 ms", "load avg 1/5/15"], rows))


def interference():
    rows = []
    for long in [4096, 512]:
        for c in ["aggregated", "1p1d"]:
            try:
                a, b = load(f"interference_{c}_long{long}.json"), load(f"interference_{c}_long{long}.b.json")
                s = load(f"interference_{c}_long{long}.cpu.json")
            except OSError:
                continue
            rows.append([long, "aggregated x2" if c == "aggregated" else "1P1D",
                         a["completed"], f(a["median_itl_ms"]), f(a["p90_itl_ms"]), f(a["p99_itl_ms"]),
                         f(a["max_itl_ms"]), f(a["p99_tpot_ms"]), f(a["p99_ttft_ms"]),
                         b["completed"], f(b["median_ttft_ms"]), f(b["p99_ttft_ms"]),
                         " / ".join(f"{x:.1f}" for x in s["loadavg_1_5_15"])])
    print(table(["long prompt tokens", "layout", "stream requests", "stream ITL p50 ms",
                 "ITL p90 ms", "ITL p99 ms", "ITL max ms", "TPOT p99 ms", "stream TTFT p99 ms",
                 "long requests", "long TTFT p50 ms", "long TTFT p99 ms", "load avg"], rows))


def bandwidth():
    rows = []
    for g in [10, 25, 50, 100, 200, 400]:
        try:
            b, s = load(f"bandwidth_{g}gbps.json"), load(f"bandwidth_{g}gbps.cpu.json")
            plan = open(os.path.join(RAW, f"bandwidth_{g}gbps.plan.txt")).read()
        except OSError:
            continue
        ratio = re.search(r"transfer / prefill\s+([0-9.]+)", plan).group(1)
        ptrans = re.search(r"KV transfer, mean prompt\s+([0-9.]+) ms", plan).group(1)
        ppre = re.search(r"prefill, mean prompt\s+([0-9.]+) ms", plan).group(1)
        rec = re.search(r"recommendation\s+(\S+)", plan).group(1)
        n = s["overhead_ratio_count"] or 1
        rows.append([g, ppre, ptrans, ratio, rec,
                     f(1000 * s["prefill_seconds_sum"] / n), f(1000 * s["kv_transfer_seconds_sum"] / n),
                     f(s["overhead_ratio_sum"] / n, 3), b["completed"], f(b["median_ttft_ms"]),
                     f(b["p99_ttft_ms"]), " / ".join(f"{x:.1f}" for x in s["loadavg_1_5_15"])])
    print(table(["link Gb/s", "plan: prefill ms", "plan: transfer ms", "plan: ratio",
                 "plan says", "measured prefill ms (mean)", "measured transfer ms (mean)",
                 "measured ratio (mean)", "requests", "TTFT p50 ms", "TTFT p99 ms", "load avg"], rows))


def routing():
    window = sys.argv[2] + "_" if len(sys.argv) > 2 else ""  # e.g. skip3600
    rows = []
    for p in ["kv_aware", "least_loaded", "round_robin"]:
        try:
            b, s = load(f"routing_{window}{p}.json"), load(f"routing_{window}{p}.cpu.json")
        except OSError:
            continue
        hit = s["prefix_hits_tokens"] / s["prefix_query_tokens"] if s["prefix_query_tokens"] else None
        rows.append([p, b["completed"], b["failed"], f(hit, 3), f(b["cached_token_ratio"], 3),
                     f(b["median_ttft_ms"]), f(b["p99_ttft_ms"]), f(b["p99_itl_ms"]),
                     f(b["request_throughput"], 2), f(b["output_throughput"]),
                     " / ".join(f"{x:.1f}" for x in s["loadavg_1_5_15"])])
    print(table(["policy", "completed", "failed", "prefix hit rate (workers)",
                 "cached prompt ratio (client)", "TTFT p50 ms", "TTFT p99 ms", "ITL p99 ms",
                 "req/s", "output tok/s", "load avg"], rows))


def pd():
    rows = []
    for p, d in [(1, 3), (2, 2), (3, 1)]:
        try:
            b, s = load(f"pd_{p}p{d}d.json"), load(f"pd_{p}p{d}d.cpu.json")
        except OSError:
            continue
        rows.append([f"{p}:{d}", b["completed"], b["good_requests"], f(b["goodput"], 2),
                     f(b["request_throughput"], 2), f(b["median_ttft_ms"]), f(b["p99_ttft_ms"]),
                     f(b["median_itl_ms"]), f(b["p99_itl_ms"]),
                     " / ".join(f"{x:.1f}" for x in s["loadavg_1_5_15"])])
    print(table(["P:D", "completed", "good (SLO)", "goodput req/s", "req/s", "TTFT p50 ms",
                 "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "load avg"], rows))


{"cpu": cpu, "interference": interference, "bandwidth": bandwidth, "routing": routing,
 "pd": pd}[sys.argv[1]]()
