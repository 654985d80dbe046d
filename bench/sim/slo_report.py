#!/usr/bin/env python3
"""Summary of bench/sim/slo_admission.sh (and slo_seat_wait.sh): goodput of
`slo` vs `queue` (or of two builds) and the TTFT of admitted requests
against the SLO.
    slo_report.py CAPACITY.json QUEUE.json SLO.json TTFT_SLO_MS [NAME_A NAME_B]
NAME_A / NAME_B: the rows' names (default queue, slo)."""
import json, os, sys

cap, q, s = (json.load(open(p)) for p in sys.argv[1:4])
slo = float(sys.argv[4])
name_a, name_b = sys.argv[5:7] if len(sys.argv) >= 7 else ("queue", "slo")
load = os.getloadavg()


def row(name, r):
    ok = [x for x in r["per_request"] if x["ok"]]
    worst = max((x["ttft_ms"] for x in ok), default=float("nan"))
    return (f"| {name} | {r['requests']} | {r['completed']} | {r['failed_by_status']} | "
            f"{r['duration_s']:.1f} | {r['good_requests']} | {r['goodput']:.3f} | "
            f"{r['median_ttft_ms'] or float('nan'):.0f} | {r['p99_ttft_ms'] or float('nan'):.0f} | "
            f"{worst:.0f} ({worst / slo:.2f}x SLO) | {r['good_requests'] / max(1, r['completed']):.0%} |")


print(f"capacity (saturated, queue): {cap['request_throughput']:.3f} req/s "
      f"({cap['completed']} requests in {cap['duration_s']:.1f} s)")
print("| run | sent | completed | refused/failed | duration s | good | goodput req/s | "
      "TTFT p50 ms | TTFT p99 ms | worst admitted TTFT | good / completed |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
print(row(name_a, q))
print(row(name_b, s))
ratio = s["goodput"] / q["goodput"] if q["goodput"] > 0 else float("inf")
print(f"goodput {name_b} / {name_a} = {ratio:.2f}; load average now {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
