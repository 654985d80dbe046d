#!/usr/bin/env python3
"""The table of bench/results/kv_tiers_mooncake.md from the runs of
`bench/sim/experiments.sh kv-tiers` (bench/results/sim_raw/kv_tiers_*)."""
import glob, json, os, re, sys

RAW = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "results", "sim_raw")
ideal = float(sys.argv[1]) if len(sys.argv) > 1 else None
rows = []
for path in sorted(glob.glob(os.path.join(RAW, "kv_tiers_*.cpu.json"))):
    name = os.path.basename(path)[len("kv_tiers_"):-len(".cpu.json")]
    m = re.match(r"host(\d+)_(kv_aware|round_robin|least_loaded|random)(?:_(.*))?$", name)
    if not m:
        continue
    c = json.load(open(path))
    b = json.load(open(path.replace(".cpu.json", ".json")))
    hits = c.get("prefill_tier_hits_tokens", {})
    rows.append((int(m.group(1)), m.group(2), m.group(3) or "", b, c, hits))
rows.sort(key=lambda r: (r[0], r[1] != "kv_aware", r[2]))
print("| host tier (blocks per worker) | policy | variant | completed / failed | cached-prompt ratio (client) | of the ideal | "
      "prefill hits device / host / disk (M tokens) | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | load avg at end |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for t, pol, var, b, c, hits in rows:
    ratio = b["cached_token_ratio"]
    of = f"{ratio / ideal:.2f}" if ideal else "—"
    h = " / ".join(f"{hits.get(k, 0) / 1e6:.2f}" for k in ("device", "host", "disk"))
    la = " / ".join(f"{x:.1f}" for x in c["loadavg_1_5_15"])
    print(f"| {t} | {pol} | {var or '—'} | {b['completed']} / {b['failed']} | {ratio:.3f} | {of} | {h} | "
          f"{b['median_ttft_ms']:.0f} | {b['p90_ttft_ms']:.0f} | {b['p99_ttft_ms']:.0f} | {la} |")
