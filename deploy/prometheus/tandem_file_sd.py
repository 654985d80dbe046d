#!/usr/bin/env python3
"""Writes Prometheus file_sd targets for a fleet from its launch state file.

`tandem launch CONFIG --state-file STATE` writes STATE (JSON) once every
process serves:
  {"proxy": {"grpc": ..., "http": ..., "metrics": "host:port", ...},
   "workers": [{"role": ..., "name": ..., "grpc": ..., "metrics": "host:port", "pid": N}, ...]}
This script turns it into a file_sd file with one target per process
(labels fleet, process), written atomically (rename), so Prometheus never
reads half a file. With --watch it keeps rewriting it whenever STATE
changes. Standard library only.

  python3 deploy/prometheus/tandem_file_sd.py STATE --out targets/tandem.json [--fleet NAME] [--watch]
"""
import argparse
import json
import os
import sys
import time


def targets(state, fleet):
    out = []
    proxy = state.get("proxy", {})
    if proxy.get("metrics"):
        out.append({"targets": [proxy["metrics"]],
                    "labels": {"fleet": fleet, "process": "proxy"}})
    for i, w in enumerate(state.get("workers", [])):
        if not w.get("metrics"):
            continue
        name = w.get("name") or f"{w.get('role', 'worker')}-{i}"
        out.append({"targets": [w["metrics"]], "labels": {"fleet": fleet, "process": name}})
    return out


def write(state_path, out_path, fleet):
    with open(state_path) as f:
        state = json.load(f)
    data = targets(state, fleet)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.replace(tmp, out_path)
    return len(data)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("state", help="state file written by tandem launch --state-file")
    p.add_argument("--out", required=True, help="file_sd JSON to write")
    p.add_argument("--fleet", default="tandem", help="value of the 'fleet' label (default tandem)")
    p.add_argument("--watch", action="store_true", help="rewrite whenever the state file changes")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between checks with --watch")
    a = p.parse_args()
    if not a.watch:
        try:
            n = write(a.state, a.out, a.fleet)
        except (OSError, ValueError) as e:
            print(f"tandem_file_sd: {a.state}: {e}", file=sys.stderr)
            return 1
        print(f"tandem_file_sd: {n} targets written to {a.out}")
        return 0
    last = None
    while True:
        try:
            mtime = os.stat(a.state).st_mtime_ns
            if mtime != last:
                n = write(a.state, a.out, a.fleet)
                print(f"tandem_file_sd: {n} targets written to {a.out}", flush=True)
                last = mtime
        except (OSError, ValueError) as e:
            print(f"tandem_file_sd: waiting for {a.state}: {e}", file=sys.stderr, flush=True)
        time.sleep(a.interval)


if __name__ == "__main__":
    sys.exit(main())
