#!/usr/bin/env python3
"""Figure of an autoscaling run (bench/autoscale/ramp.sh OUT): workers
(planner's desired and registered, per role) and offered load over time;
per-request TTFT and the proxy's windowed TTFT/ITL p90 over time.
Needs matplotlib (python3 -m venv v && v/bin/pip install matplotlib)."""
import glob
import json
import os
import sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

out, png = sys.argv[1], sys.argv[2]
phases = [l.split() for l in open(os.path.join(out, "phases.txt"))]
samples = [json.loads(l) for l in open(os.path.join(out, "samples.jsonl"))]
samples = [s for s in samples if "state" in s and "desired" in s]
t0 = float(phases[0][0])
t = [s["t"] - t0 for s in samples]


def window_p90(key, window=10.0):
    res = []
    for i, s in enumerate(samples):
        j = i
        while j > 0 and s["t"] - samples[j - 1]["t"] <= window:
            j -= 1
        a, b = samples[j][key], s[key]
        if not a or not b or j == i:
            res.append(None)
            continue
        da = {le: c for le, c in a}
        counts = [(le, c - da.get(le, 0)) for le, c in sorted(b)]
        total = counts[-1][1]
        if total <= 0:
            res.append(None)
            continue
        rank, lo, lo_c, v = 0.9 * total, 0.0, 0.0, None
        for le, c in counts:
            if c >= rank:
                v = lo if le == float("inf") else lo + (le - lo) * (rank - lo_c) / max(1e-12, c - lo_c)
                break
            lo, lo_c = le, c
        res.append(v * 1000 if v is not None else None)
    return res


fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 7.5), sharex=True)
for role, color in (("prefill", "tab:blue"), ("decode", "tab:orange")):
    ax1.step(t, [s["desired"].get(role, 0) for s in samples], where="post", color=color,
             linestyle="--", label=f"{role}: planner desired")
    ax1.step(t, [s["fleet"].get(role, 0) for s in samples], where="post", color=color,
             label=f"{role}: registered")
ax1.set_ylabel("workers")
ax1.set_ylim(0, 5)
rate_t, rate_v = [], []
for i in range(len(phases) - 1):
    rate_t += [float(phases[i][0]) - t0, float(phases[i + 1][0]) - t0]
    rate_v += [float(phases[i][1])] * 2
axr = ax1.twinx()
axr.plot(rate_t, rate_v, color="grey", alpha=0.6, label="offered req/s")
axr.set_ylabel("offered load (req/s)")
axr.set_ylim(0, 10)
h1, l1 = ax1.get_legend_handles_labels()
h2, l2 = axr.get_legend_handles_labels()
ax1.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=8)
ax1.set_title("Autoscaled sim fleet (configs/sim-autoscale.yaml): load ramp 1 → 8 → 1 req/s")

xs, ys = [], []
for i, p in enumerate(sorted(glob.glob(os.path.join(out, "phase-*.json")),
                            key=lambda p: int(p.rsplit("-", 1)[1].split(".")[0]))):
    j = json.load(open(p))
    start = float(phases[int(p.rsplit("-", 1)[1].split(".")[0])][0]) - t0
    for r in j["per_request"]:
        if r["ttft_ms"] is not None:
            xs.append(start + r["send_s"] + r["ttft_ms"] / 1000)
            ys.append(r["ttft_ms"])
ax2.scatter(xs, ys, s=3, alpha=0.35, color="tab:green", label="TTFT per request")
ax2.plot(t, window_p90("ttft"), color="darkgreen", label="TTFT p90, 10 s window (proxy)")
ax2.plot(t, window_p90("itl"), color="tab:red", label="ITL p90, 10 s window (proxy)")
ax2.set_yscale("log")
ax2.set_ylabel("ms")
ax2.set_xlabel("time since the ramp started (s)")
ax2.legend(loc="upper left", fontsize=8)
fig.tight_layout()
fig.savefig(png, dpi=110)
