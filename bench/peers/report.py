#!/usr/bin/env python3
"""Markdown tables from one bench/peers/run.sh result folder: tandem against
llama.cpp per model, thread count and benchmark, the decode scaling from 1
to 2 threads, and batch-1 decode against the read bandwidth measured in the
same run.

A run is ROUNDS rounds per model; in each, every thread count, both engines
back to back (run.sh). Each table gives the mean over the rounds (each
round's number is the mean of its repetitions), the spread of the round
means, and every round's own ratio: the two numbers of a round were measured
a minute apart at most, so on a host whose memory bandwidth drifts from
minute to minute the per-round ratios are the comparisons the drift does
not decide. Folders of runs before the rounds (files without `-rN`) read as
one round.

    report.py RESULT_DIR
"""
import glob
import json
import os
import re
import statistics
import sys


def load_json(path):
    with open(path) as f:
        return json.load(f)


def load_jsonl(path):
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                rows.append(json.loads(line))
    return rows


def collect(d, prefix, ext, loader):
    """{(model, threads): {round: data}} for PREFIX-MODEL-tT[-rR].EXT."""
    out = {}
    for p in glob.glob(os.path.join(d, f"{prefix}-*-t*.{ext}")):
        mt = re.match(rf".*{prefix}-(.+)-t(\d+)(?:-r(\d+))?\.{ext}$", p)
        if not mt:
            continue
        m, t, r = mt.groups()
        out.setdefault((m, int(t)), {})[int(r or 1)] = loader(p)
    return out


def mean_sd(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


def fmt(x, sd=None):
    if x is None:
        return "–"
    return f"{x:,.1f}" + (f" ± {sd:,.1f}" if sd is not None else "")


def main() -> int:
    d = sys.argv[1]
    tandem = collect(d, "tandem", "json", load_json)
    lb = collect(d, "llamabench", "json", load_json)
    batched = collect(d, "batched", "jsonl", load_jsonl)
    loads = {}
    lp = os.path.join(d, "load.txt")
    if os.path.exists(lp):
        for line in open(lp):
            parts = line.split()
            # model threads engine start|end HH:MM:SS l1 l5 l15 [round]
            loads.setdefault((parts[0], int(parts[1]), parts[2]), []).append(parts[5])

    def ld(m, t, engine):
        v = loads.get((m, t, engine))
        return f"{min(v, key=float)}–{max(v, key=float)}" if v else "?"

    def llama_ts(m, t, r, n_prompt, n_gen):
        for row in lb.get((m, t), {}).get(r, []):
            if row.get("n_prompt") == n_prompt and row.get("n_gen") == n_gen:
                return row["avg_ts"]
        return None

    def batched_tg(m, t, r, pl):
        for row in batched.get((m, t), {}).get(r, []):
            if row.get("pl") == pl:
                return row["speed_tg"]
        return None

    def tandem_json(m, t, r):
        return tandem.get((m, t), {}).get(r)

    def tandem_run(m, t, r):
        j = tandem_json(m, t, r)
        return j["runs"][0] if j else None

    def tandem_prefill(m, t, r):
        run = tandem_run(m, t, r)
        return run["prefill_tps"]["mean"] if run else None

    def tandem_decode(m, t, r, batch):
        run = tandem_run(m, t, r)
        d = run["decode_tps"].get(str(batch)) if run else None
        return d["mean"] if d else None

    def rounds(m, t):
        return sorted(set(tandem.get((m, t), {})) | set(lb.get((m, t), {})))

    benchmarks = [
        ("prefill, 512-token prompt",
         lambda m, t, r: tandem_prefill(m, t, r), lambda m, t, r: llama_ts(m, t, r, 512, 0)),
        ("decode, batch 1 (llama-bench tg128)",
         lambda m, t, r: tandem_decode(m, t, r, 1), lambda m, t, r: llama_ts(m, t, r, 0, 128)),
        ("decode, batch 1 (batched-bench)",
         lambda m, t, r: tandem_decode(m, t, r, 1), lambda m, t, r: batched_tg(m, t, r, 1)),
        ("decode, batch 8 (batched-bench)",
         lambda m, t, r: tandem_decode(m, t, r, 8), lambda m, t, r: batched_tg(m, t, r, 8)),
    ]

    models = sorted({k[0] for k in tandem}, key=lambda m: (m != "kjv", m))
    print("Tokens/s: the mean over the rounds of each round's mean ± the spread of the round means; "
          "per-round ratios in round order.")
    print()
    print("| model | threads | benchmark | tandem tokens/s | llama.cpp tokens/s | tandem / llama.cpp "
          "| per round | rounds ahead | load (1-min avg) tandem | load llama.cpp |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for m in models:
        for t in sorted(k[1] for k in tandem if k[0] == m):
            rs = rounds(m, t)
            for name, tf, lf in benchmarks:
                tv = [tf(m, t, r) for r in rs]
                lv = [lf(m, t, r) for r in rs]
                if all(x is None for x in tv):
                    continue
                tm, tsd = mean_sd(tv)
                lm, lsd = mean_sd(lv)
                ratio = f"{tm / lm:.2f}" if tm and lm else "–"
                per = [a / b for a, b in zip(tv, lv) if a and b]
                per_s = " ".join(f"{x:.2f}" for x in per) if per else "–"
                ahead = f"{sum(x >= 1 for x in per)} of {len(per)}" if per else "–"
                print(f"| {m} | {t} | {name} | {fmt(tm, tsd)} | {fmt(lm, lsd)} | {ratio} | {per_s} | "
                      f"{ahead} | {ld(m, t, 'tandem')} | {ld(m, t, 'llama.cpp')} |")
    print()
    print("Decode scaling, batch 1 (2 threads / 1 thread): the ratio of the means, then each round's "
          "(its 1- and 2-thread parts run back to back); the read probe's ratio is this host's "
          "limit for a decode that reads its weights at memory bandwidth (`paired`: the probes taken "
          "after each decode repetition, runs since session 44):")
    print()
    print("| model | tandem | per round | llama.cpp (llama-bench tg128) | per round "
          "| read probe 2 / 1 thread | per round | paired probe 2 / 1 | per round |")
    print("|---|---|---|---|---|---|---|---|---|")

    def probe(m, t, r):
        j = tandem_json(m, t, r)
        return j["read_GBps"][str(t)] if j else None

    def paired_probe(m, t, r):
        run = tandem_run(m, t, r)
        d = run["decode_tps"]["1"] if run else {}
        return d["paired_read_GBps"]["mean"] if "paired_read_GBps" in d else None

    for m in models:
        if not (tandem.get((m, 1)) and tandem.get((m, 2))):
            continue
        rs = sorted(set(rounds(m, 1)) & set(rounds(m, 2)))
        cols = []
        for f in (lambda t, r: tandem_decode(m, t, r, 1), lambda t, r: llama_ts(m, t, r, 0, 128),
                  lambda t, r: probe(m, t, r), lambda t, r: paired_probe(m, t, r)):
            v2 = [f(2, r) for r in rs]
            v1 = [f(1, r) for r in rs]
            m2, _ = mean_sd(v2)
            m1, _ = mean_sd(v1)
            overall = f"{m2 / m1:.2f}×" if m1 and m2 else "–"
            per = " ".join(f"{a / b:.2f}" for a, b in zip(v2, v1) if a and b) or "–"
            cols += [overall, per]
        print(f"| {m} | " + " | ".join(cols) + " |")
    print()
    print("Batch-1 decode against memory bandwidth (same run; weights read per token × tokens/s; "
          "means over the rounds):")
    print()
    print("`paired`: tandem's decode against the read probe taken right after each of its repetitions "
          "(the mean of the per-repetition fractions; runs since session 44).")
    print()
    print("| model | threads | weight MB | tandem weight GB/s | read bandwidth GB/s | fraction "
          "| paired read GB/s | paired fraction | llama.cpp weight GB/s | fraction | memcpy GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for m in models:
        for t in sorted(k[1] for k in tandem if k[0] == m):
            js = [tandem[(m, t)][r] for r in sorted(tandem[(m, t)])]
            wb = js[0]["weight_bytes"]
            bw, _ = mean_sd([j["read_GBps"][str(t)] for j in js])
            tg, _ = mean_sd([j["runs"][0]["decode_tps"]["1"]["weight_GBps"] for j in js])
            mc, _ = mean_sd([j["memcpy_GBps"] for j in js])
            d1s = [j["runs"][0]["decode_tps"]["1"] for j in js]
            pr, _ = mean_sd([x["paired_read_GBps"]["mean"] for x in d1s if "paired_read_GBps" in x])
            pf, _ = mean_sd([x["paired_fraction"]["mean"] for x in d1s if "paired_fraction" in x])
            pcols = f"{pr:.2f} | {pf:.2f}" if pr else "– | –"
            # llama.cpp reads the same f32 matrices (its model_size adds the
            # token embedding table, of which a decode reads one row).
            ll, _ = mean_sd([llama_ts(m, t, r, 0, 128) for r in rounds(m, t)])
            lg = ll * wb / 1e9 if ll else None
            lcols = f"{fmt(lg)} | {lg / bw:.2f}" if lg else "– | –"
            print(f"| {m} | {t} | {wb / 1e6:,.1f} | {tg:.2f} | {bw:.2f} | {tg / bw:.2f} | {pcols} | "
                  f"{lcols} | {mc:.2f} |")
    op = os.path.join(d, "others.txt")
    if os.path.exists(op):
        print()
        print("CPU time of other processes while each engine ran (share of both cores):")
        print()
        for line in open(op):
            print(f"- {line.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
