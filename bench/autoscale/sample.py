#!/usr/bin/env python3
"""Samples an autoscaled fleet every second (bench/autoscale/ramp.sh):
the proxy's tandem_planner_desired_workers / tandem_fleet_workers by role,
the cumulative TTFT and ITL histogram buckets, request outcomes, and the
workers the launcher's state file lists. One JSON object per line."""
import json
import re
import sys
import time
import urllib.request

state_path, out_path = sys.argv[1], sys.argv[2]
LINE = re.compile(r'^([a-z_]+)\{([^}]*)\} (\S+)$')


def scrape(addr):
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=2) as r:
        text = r.read().decode()
    out = {"desired": {}, "fleet": {}, "ttft": [], "itl": [], "outcome": {}}
    for line in text.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), dict(re.findall(r'(\w+)="([^"]*)"', m.group(2))), float(m.group(3))
        if name == "tandem_planner_desired_workers":
            out["desired"][labels["role"]] = value
        elif name == "tandem_fleet_workers":
            out["fleet"][labels["role"]] = value
        elif name == "tandem_time_to_first_token_seconds_bucket":
            out["ttft"].append([float(labels["le"]), value])
        elif name == "tandem_inter_token_latency_seconds_bucket":
            out["itl"].append([float(labels["le"]), value])
        elif name == "tandem_requests_total":
            out["outcome"][labels["outcome"]] = value
    return out


with open(out_path, "a") as f:
    while True:
        t = time.time()
        rec = {"t": t}
        try:
            state = json.load(open(state_path))
            rec["state"] = {}
            for w in state["workers"]:
                rec["state"][w["role"]] = rec["state"].get(w["role"], 0) + 1
            rec.update(scrape(state["proxy"]["metrics"]))
        except Exception as e:  # a rewrite in progress, a slow scrape: next second
            rec["error"] = str(e)
        f.write(json.dumps(rec) + "\n")
        f.flush()
        time.sleep(max(0.0, 1.0 - (time.time() - t)))
