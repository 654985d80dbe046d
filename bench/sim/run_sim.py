#!/usr/bin/env python3
"""Runs one `tandem bench serve` against a freshly launched sim fleet and
measures tandem's own CPU cost.

    bench/sim/run_sim.py --config configs/sim-1p1d.yaml --out DIR/NAME [--set KEY=VALUE ...] \
        -- BENCH_SERVE_ARGS...

Launches `tandem launch CONFIG` (optionally a copy of CONFIG with YAML keys
overridden by --set, e.g. --set sim.link_gbps=25 --set router.policy=round_robin),
waits for the state file, samples utime+stime of the launcher, the proxy and
every worker from /proc/PID/stat, runs `tandem bench serve --state-file ...
--json NAME.json BENCH_SERVE_ARGS`, samples again, scrapes every worker's
/metrics, stops the fleet (SIGTERM) and writes NAME.cpu.json:
CPU seconds per role, per generated token and per routed request, the load
average, and worker-side KV-transfer figures (sums over prefillers).
"""
import argparse, json, os, re, signal, subprocess, sys, tempfile, time, urllib.request

import yaml  # python3-yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime
    except OSError:
        return None


def scrape(addr):
    try:
        return urllib.request.urlopen(f"http://{addr}/metrics", timeout=5).read().decode()
    except OSError:
        return ""


def metric_sum(text, name):
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def metric_sum_labeled(text, name, label):
    """Sum of `name{...label...}` samples, e.g. label 'tier="host"'."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and label in line.split("}", 1)[0]:
            total += float(line.rsplit(" ", 1)[1])
    return total


def override(cfg, key, value):
    node = cfg
    parts = key.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
    node[parts[-1]] = yaml.safe_load(value)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True, help="path prefix of the outputs")
    ap.add_argument("--tandem", default=os.path.join(ROOT, "build-sim", "tandem"))
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--ready-timeout", type=float, default=120)
    ap.add_argument("--also", default="",
                    help="a second bench serve's arguments, run at the same time (NAME.b.json)")
    ap.add_argument("--also-delay", type=float, default=2.0,
                    help="seconds before the second bench starts: both number their requests "
                         "bench-0, bench-1, ..., and ids in flight at once must differ")
    ap.add_argument("bench", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    bench_args = [x for x in a.bench if x != "--"]

    config = os.path.abspath(a.config)
    if a.set:
        with open(config) as f:
            cfg = yaml.safe_load(f)
        for kv in a.set:
            k, v = kv.split("=", 1)
            override(cfg, k, v)
        # Keep relative paths working: write next to the original.
        fd, config = tempfile.mkstemp(suffix=".yaml", prefix=".run-", dir=os.path.dirname(config))
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(cfg, f, sort_keys=False)
    state = tempfile.mktemp(suffix=".json", prefix="sim-state-")
    log = open(a.out + ".launch.log", "w")
    launcher = subprocess.Popen([a.tandem, "launch", config, "--state-file", state],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + a.ready_timeout
        while not os.path.exists(state):
            if launcher.poll() is not None or time.time() > deadline:
                sys.exit(f"fleet did not start; see {a.out}.launch.log")
            time.sleep(0.5)
        time.sleep(0.3)
        with open(state) as f:
            st = json.load(f)
        procs = {"launcher": [launcher.pid], "proxy": [st["proxy"]["pid"]]}
        for w in st["workers"]:
            procs.setdefault(w["role"], []).append(w["pid"])
        before = {r: [cpu_seconds(p) for p in ps] for r, ps in procs.items()}
        t0 = time.time()
        cmd = [a.tandem, "bench", "serve", "--state-file", state, "--json", a.out + ".json",
               "--no-progress"] + bench_args
        cmd_b = None
        main = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if a.also:
            time.sleep(a.also_delay)
            cmd_b = [a.tandem, "bench", "serve", "--state-file", state, "--json", a.out + ".b.json",
                     "--no-progress"] + a.also.split()
            bench_b = subprocess.Popen(cmd_b, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True)
        out, err = main.communicate()
        bench = subprocess.CompletedProcess(cmd, main.returncode, out, err)
        if cmd_b:
            out_b = bench_b.communicate()[0]
            with open(a.out + ".b.txt", "w") as f:
                f.write("$ " + " ".join(cmd_b) + "\n" + out_b)
        wall = time.time() - t0
        after = {r: [cpu_seconds(p) for p in ps] for r, ps in procs.items()}
        load = os.getloadavg()
        metrics = {w["name"]: scrape(w["metrics"]) for w in st["workers"]}
        with open(a.out + ".txt", "w") as f:
            f.write("$ " + " ".join(cmd) + "\n" + bench.stdout + bench.stderr)
        if bench.returncode != 0:
            print(bench.stdout + bench.stderr, file=sys.stderr)
            sys.exit(f"bench serve failed ({bench.returncode})")
        with open(a.out + ".json") as f:
            res = json.load(f)
        res_b = {}
        if cmd_b:
            with open(a.out + ".b.json") as f:
                res_b = json.load(f)
    finally:
        launcher.send_signal(signal.SIGTERM)
        try:
            launcher.wait(timeout=60)
        except subprocess.TimeoutExpired:
            launcher.kill()
        if a.set:
            os.unlink(config)
        if os.path.exists(state):
            os.unlink(state)
    cpu = {}
    for r in procs:
        cpu[r] = sum((y - x) for x, y in zip(before[r], after[r]) if x is not None and y is not None)
    total = sum(cpu.values())
    out_tokens = res.get("total_output_tokens", 0) + res_b.get("total_output_tokens", 0)
    requests = res.get("completed", 0) + res_b.get("completed", 0)
    pre = [t for n, t in metrics.items() if n.startswith("prefill") or n.startswith("both")]
    summary = {
        "config": a.config, "overrides": a.set, "bench_command": " ".join(cmd),
        "bench_command_b": " ".join(cmd_b) if cmd_b else None,
        "wall_s": wall, "loadavg_1_5_15": load,
        "cpu_seconds_by_role": cpu, "cpu_seconds_total": total,
        "completed_requests": requests, "output_tokens": out_tokens,
        "cpu_ms_per_output_token": 1000 * total / out_tokens if out_tokens else None,
        "cpu_ms_per_request": 1000 * total / requests if requests else None,
        "proxy_cpu_ms_per_request": 1000 * cpu["proxy"] / requests if requests else None,
        "kv_transfer_seconds_sum": sum(metric_sum(t, "tandem_kv_transfer_seconds_sum") for t in pre),
        "kv_transfer_count": sum(metric_sum(t, "tandem_kv_transfer_seconds_count") for t in pre),
        "kv_transfer_bytes": sum(metric_sum(t, "tandem_kv_transfer_bytes_total") for t in pre),
        "prefill_seconds_sum": sum(metric_sum(t, "tandem_prefill_seconds_sum") for t in pre),
        "overhead_ratio_sum": sum(metric_sum(t, "tandem_kv_transfer_overhead_ratio_sum") for t in pre),
        "overhead_ratio_count": sum(metric_sum(t, "tandem_kv_transfer_overhead_ratio_count") for t in pre),
        "prefix_hits_tokens": sum(metric_sum(t, "tandem_prefix_cache_hits_tokens_total") for t in metrics.values()),
        "prefix_query_tokens": sum(metric_sum(t, "tandem_prefix_cache_queries_tokens_total") for t in metrics.values()),
        # KV tiers (issue 17), prefillers only: hit tokens and evictions by tier.
        "prefill_tier_hits_tokens": {tier: sum(metric_sum_labeled(t, "tandem_kv_tier_hits_tokens_total", f'tier="{tier}"')
                                               for t in pre) for tier in ("device", "host", "disk")},
        "prefill_tier_evictions": {tier: sum(metric_sum_labeled(t, "tandem_kv_tier_evictions_total", f'tier="{tier}"')
                                             for t in pre) for tier in ("device", "host", "disk")},
        "prefill_onboard_seconds_sum": sum(metric_sum(t, "tandem_kv_tier_onboard_seconds_sum") for t in pre),
        "prefill_onboard_count": sum(metric_sum(t, "tandem_kv_tier_onboard_seconds_count") for t in pre),
    }
    with open(a.out + ".cpu.json", "w") as f:
        json.dump(summary, f, indent=2)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
