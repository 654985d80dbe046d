#!/usr/bin/env python3
"""Per-phase table of an autoscaling run (bench/autoscale/ramp.sh OUT):
offered rate, requests, failures, TTFT/TPOT percentiles and goodput from
each phase's `tandem bench serve --json`, and the workers the launcher ran
during the phase (state file, sampled every second)."""
import json
import os
import sys

out = sys.argv[1]
phases = [l.split() for l in open(os.path.join(out, "phases.txt"))]
samples = [json.loads(l) for l in open(os.path.join(out, "samples.jsonl"))]
samples = [s for s in samples if "state" in s and "desired" in s]
t0 = float(phases[0][0])


def workers_between(a, b, role, key="state"):
    v = [s[key].get(role, 0) for s in samples if a <= s["t"] < b]
    return (int(min(v)), int(max(v))) if v else (None, None)


def span(lo_hi):
    lo, hi = lo_hi
    return "-" if lo is None else (str(lo) if lo == hi else f"{lo}→{hi}")


print("| phase | t (s) | offered req/s | requests | failed | TTFT p50 / p90 (ms) | TPOT p50 / p90 (ms) | good req/s | good share | prefillers | decoders |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
tot_req = tot_failed = tot_good = 0
for i in range(len(phases) - 2):
    start, rate = float(phases[i][0]), phases[i][1]
    end = float(phases[i + 1][0])
    j = json.load(open(os.path.join(out, f"phase-{i}.json")))
    tot_req += j["requests"]
    tot_failed += j["failed"]
    tot_good += j["good_requests"]
    print(f"| {i} | {start - t0:.0f}–{end - t0:.0f} | {rate} | {j['requests']} | {j['failed']} | "
          f"{j['median_ttft_ms']:.0f} / {j['p90_ttft_ms']:.0f} | {j['median_tpot_ms']:.1f} / {j['p90_tpot_ms']:.1f} | "
          f"{j['goodput']:.2f} | {j['good_requests'] / max(1, j['requests']):.0%} | "
          f"{span(workers_between(start, end, 'prefill'))} | {span(workers_between(start, end, 'decode'))} |")
idle_start, end = float(phases[-2][0]), float(phases[-1][0])
print(f"| idle | {idle_start - t0:.0f}–{end - t0:.0f} | 0 | – | – | – | – | – | – | "
      f"{span(workers_between(idle_start, end, 'prefill'))} | {span(workers_between(idle_start, end, 'decode'))} |")
print()
last = samples[-1]
print(f"Total: {tot_req} requests, {tot_failed} failed, {tot_good} met both SLOs "
      f"({tot_good / max(1, tot_req):.1%}); proxy outcomes at the end: "
      + ", ".join(f"{k}={int(v)}" for k, v in sorted(last.get("outcome", {}).items())))
for role in ("prefill", "decode"):
    d = [int(s["desired"].get(role, 0)) for s in samples]
    print(f"{role}: planner desired min {min(d)} max {max(d)}; state file min "
          f"{min(int(s['state'].get(role, 0)) for s in samples)} max {max(int(s['state'].get(role, 0)) for s in samples)}")
changes = []
prev = None
for s in samples:
    cur = (int(s["state"].get("prefill", 0)), int(s["state"].get("decode", 0)))
    if cur != prev:
        changes.append(f"{s['t'] - t0:.0f} s: {cur[0]}P{cur[1]}D")
        prev = cur
print("Fleet (state file) over time: " + "; ".join(changes))
for l in open(os.path.join(out, "load.txt")):
    print(l.strip())
