#!/usr/bin/env python3
"""Greedy output of a real fleet equals `tandem generate --config` (one
process, no network) for N prompts sent together: the device check's 1P1D
stage (tests/gpu/device_check.sh), usable with any fleet file.

1. The reference: `tandem generate --config CONFIG --prompt P --temperature 0
   --ignore-eos --max-tokens M --json` for every prompt (a few at a time).
2. The fleet: a copy of CONFIG with the model path made absolute and the
   proxy on port 0, started with `tandem launch --state-file`; every prompt
   is sent at once to POST /v1/completions (temperature 0, ignore_eos); the
   fleet is stopped with SIGTERM (SIGKILL after a grace period).
3. Texts and completion token counts are compared; the result goes to
   OUT/fleet_check.json. Exit 0 when every prompt matches, 1 otherwise.

Standard library only. Every wait is bounded.

    fleet_check.py --tandem build/tandem --config configs/cuda-1p1d.yaml --out DIR
                   [--prompts 16] [--max-tokens 32] [--timeout 240]
"""
import argparse
import concurrent.futures as cf
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

VERSES = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void; and darkness was upon the face of the deep.",
    "And God said, Let there be light: and there was light.",
    "The LORD is my shepherd; I shall not want.",
    "Blessed are the meek: for they shall inherit the earth.",
    "And it came to pass in those days,",
    "For God so loved the world,",
    "Vanity of vanities, saith the Preacher;",
]


def prompts(n):
    """n prompts of varied lengths: short ones and ones spanning many KV blocks."""
    out = []
    for i in range(n):
        verse = VERSES[i % len(VERSES)]
        repeat = 1 + (i * 5) % 23  # up to ~23 verses: several hundred tokens
        out.append(" ".join([verse] * repeat) if i % 3 else verse)
    return out


def fleet_file(config, dest):
    """CONFIG with model.path absolute and the proxy's listeners on port 0."""
    base = os.path.dirname(os.path.abspath(config))
    lines, section = [], ""
    with open(config) as f:
        for line in f:
            m = re.match(r"^(\w[\w-]*):", line)
            if m:
                section = m.group(1)
            if section == "model":
                pm = re.match(r"^(\s+path:\s*)(\S+)(.*)$", line.rstrip("\n"))
                if pm and not os.path.isabs(pm.group(2)):
                    line = f"{pm.group(1)}{os.path.normpath(os.path.join(base, pm.group(2)))}{pm.group(3)}\n"
            if section == "proxy":
                line = re.sub(r"^(\s+(grpc|http|metrics):\s*)\S+", r"\g<1>127.0.0.1:0", line)
            lines.append(line)
    with open(dest, "w") as f:
        f.writelines(lines)


def reference(tandem, config, prompt, max_tokens, timeout):
    cmd = [tandem, "generate", "--config", config, "--prompt", prompt, "--temperature", "0",
           "--ignore-eos", "--max-tokens", str(max_tokens), "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"tandem generate exited {p.returncode}: {p.stderr.strip()[-400:]}")
    j = json.loads(p.stdout.strip().splitlines()[-1])
    return {"text": j["text"], "tokens": len(j["token_ids"])}


def post(url, body, timeout):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_health(http, deadline, launcher):
    while time.time() < deadline:
        if launcher.poll() is not None:
            raise RuntimeError(f"tandem launch exited {launcher.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"http://{http}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError("the fleet was not healthy in time")


def stop(launcher, grace):
    if launcher.poll() is not None:
        return launcher.returncode
    launcher.send_signal(signal.SIGTERM)
    try:
        return launcher.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)
        return launcher.wait(timeout=10)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tandem", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=240, help="whole check, seconds")
    ap.add_argument("--parallel-reference", type=int, default=4)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    deadline = t0 + a.timeout
    result = {"config": a.config, "prompts": a.prompts, "max_tokens": a.max_tokens, "ok": False}
    ps = prompts(a.prompts)
    launcher = None
    try:
        # 1. Reference, a few processes at a time (they share the device).
        with cf.ThreadPoolExecutor(a.parallel_reference) as ex:
            futs = [ex.submit(reference, a.tandem, a.config, p, a.max_tokens,
                              max(10, deadline - time.time())) for p in ps]
            want = [f.result() for f in futs]
        result["reference_seconds"] = round(time.time() - t0, 1)
        # 2. The fleet.
        cfg = os.path.join(a.out, "fleet.yaml")
        fleet_file(a.config, cfg)
        state = os.path.join(a.out, "state.json")
        if os.path.exists(state):
            os.remove(state)
        log = open(os.path.join(a.out, "launch.log"), "w")
        t1 = time.time()
        launcher = subprocess.Popen([a.tandem, "launch", cfg, "--state-file", state], stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        while not os.path.exists(state):
            if launcher.poll() is not None:
                raise RuntimeError(f"tandem launch exited {launcher.returncode} before it was "
                                   f"ready; see {log.name}")
            if time.time() > deadline:
                raise RuntimeError("tandem launch did not write its state file in time")
            time.sleep(0.5)
        http = json.load(open(state))["proxy"]["http"]
        wait_health(http, deadline, launcher)
        result["fleet_start_seconds"] = round(time.time() - t1, 1)
        t2 = time.time()

        def one(p):
            body = {"prompt": p, "max_tokens": a.max_tokens, "temperature": 0, "ignore_eos": True}
            r = post(f"http://{http}/v1/completions", body, max(10, deadline - time.time()))
            return {"text": r["choices"][0]["text"], "tokens": r["usage"]["completion_tokens"]}

        with cf.ThreadPoolExecutor(len(ps)) as ex:  # all at once: batched in the fleet
            got = list(ex.map(one, ps))
        result["fleet_seconds"] = round(time.time() - t2, 1)
        mismatches = []
        for i, (w, g) in enumerate(zip(want, got)):
            if w != g:
                k = next((j for j, (x, y) in enumerate(zip(w["text"], g["text"])) if x != y),
                         min(len(w["text"]), len(g["text"])))
                mismatches.append({"prompt": i, "first_difference_at_char": k,
                                   "generate": w, "fleet": g})
        result["matched"] = len(ps) - len(mismatches)
        result["mismatches"] = mismatches
        result["ok"] = not mismatches and all(w["tokens"] == a.max_tokens for w in want)
        if not all(w["tokens"] == a.max_tokens for w in want):
            result["error"] = "a reference generation stopped short of max_tokens"
    except Exception as e:  # recorded, not raised: the JSON is the report
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        if launcher is not None:
            result["launch_exit"] = stop(launcher, 30)
        result["seconds"] = round(time.time() - t0, 1)
        with open(os.path.join(a.out, "fleet_check.json"), "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k != "mismatches"}))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
