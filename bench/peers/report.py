#!/usr/bin/env python3
"""Markdown tables from one bench/peers/run.sh result folder: tandem against
llama.cpp per model, thread count and benchmark, the decode scaling from 1
to 2 threads, and batch-1 decode against the read bandwidth measured in the
same run.

    report.py RESULT_DIR
"""
import glob
import json
import os
import re
import sys


def load_json(path):
    with open(path) as f:
        return json.load(f)


def main() -> int:
    d = sys.argv[1]
    tandem, lb, batched = {}, {}, {}
    for p in glob.glob(os.path.join(d, "tandem-*-t*.json")):
        m, t = re.match(r".*tandem-(.+)-t(\d+)\.json$", p).groups()
        tandem[(m, int(t))] = load_json(p)
    for p in glob.glob(os.path.join(d, "llamabench-*-t*.json")):
        m, t = re.match(r".*llamabench-(.+)-t(\d+)\.json$", p).groups()
        lb[(m, int(t))] = load_json(p)
    for p in glob.glob(os.path.join(d, "batched-*-t*.jsonl")):
        m, t = re.match(r".*batched-(.+)-t(\d+)\.jsonl$", p).groups()
        rows = []
        with open(p) as f:
            for line in f:
                line = line.strip()
                if line.startswith("{"):
                    rows.append(json.loads(line))
        batched[(m, int(t))] = rows
    loads = {}
    lp = os.path.join(d, "load.txt")
    if os.path.exists(lp):
        for line in open(lp):
            parts = line.split()
            # model threads engine start|end HH:MM:SS l1 l5 l15
            loads.setdefault((parts[0], int(parts[1]), parts[2]), []).append(parts[5])

    def ld(m, t, engine):
        v = loads.get((m, t, engine))
        return "–".join(v) if v else "?"

    def llama_ts(m, t, n_prompt, n_gen):
        for r in lb.get((m, t), []):
            if r.get("n_prompt") == n_prompt and r.get("n_gen") == n_gen:
                return r["avg_ts"], r["stddev_ts"]
        return None

    def batched_tg(m, t, pl):
        for r in batched.get((m, t), []):
            if r.get("pl") == pl:
                return r["speed_tg"]
        return None

    def fmt(x, sd=None):
        if x is None:
            return "–"
        return f"{x:,.1f}" + (f" ± {sd:,.1f}" if sd is not None else "")

    models = sorted({k[0] for k in tandem}, key=lambda m: (m != "kjv", m))
    print("| model | threads | benchmark | tandem tokens/s | llama.cpp tokens/s | tandem / llama.cpp "
          "| load (1-min avg) tandem | load llama.cpp |")
    print("|---|---|---|---|---|---|---|---|")
    for m in models:
        for t in sorted(k[1] for k in tandem if k[0] == m):
            tj = tandem[(m, t)]
            run = tj["runs"][0]
            rows = []
            pf = run["prefill_tps"]
            rows.append(("prefill, 512-token prompt", pf["mean"], pf["sd"], llama_ts(m, t, 512, 0)))
            d1 = run["decode_tps"]["1"]
            rows.append(("decode, batch 1 (llama-bench tg128)", d1["mean"], d1["sd"],
                         llama_ts(m, t, 0, 128)))
            b1 = batched_tg(m, t, 1)
            rows.append(("decode, batch 1 (batched-bench)", d1["mean"], d1["sd"],
                         (b1, None) if b1 else None))
            d8 = run["decode_tps"].get("8")
            b8 = batched_tg(m, t, 8)
            if d8:
                rows.append(("decode, batch 8 (batched-bench)", d8["mean"], d8["sd"],
                             (b8, None) if b8 else None))
            for name, tm, tsd, ll in rows:
                ratio = f"{tm / ll[0]:.2f}" if ll and ll[0] else "–"
                print(f"| {m} | {t} | {name} | {fmt(tm, tsd)} | "
                      f"{fmt(ll[0], ll[1]) if ll else '–'} | {ratio} | {ld(m, t, 'tandem')} | "
                      f"{ld(m, t, 'llama.cpp')} |")
    print()
    print("Decode scaling, batch 1 (2 threads / 1 thread):")
    print()
    print("| model | tandem | llama.cpp (llama-bench tg128) |")
    print("|---|---|---|")
    for m in models:
        if (m, 1) in tandem and (m, 2) in tandem:
            a = tandem[(m, 2)]["runs"][0]["decode_tps"]["1"]["mean"]
            b = tandem[(m, 1)]["runs"][0]["decode_tps"]["1"]["mean"]
            l2, l1 = llama_ts(m, 2, 0, 128), llama_ts(m, 1, 0, 128)
            lr = f"{l2[0] / l1[0]:.2f}×" if l1 and l2 else "–"
            print(f"| {m} | {a / b:.2f}× | {lr} |")
    print()
    print("Batch-1 decode against memory bandwidth (same run; weights read per token × tokens/s):")
    print()
    print("| model | threads | weight MB | tandem weight GB/s | read bandwidth GB/s | fraction "
          "| llama.cpp weight GB/s | fraction | memcpy GB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for m in models:
        for t in sorted(k[1] for k in tandem if k[0] == m):
            tj = tandem[(m, t)]
            wb = tj["weight_bytes"]
            bw = tj["read_GBps"][str(t)]
            tg = tj["runs"][0]["decode_tps"]["1"]["weight_GBps"]
            ll = llama_ts(m, t, 0, 128)
            # llama.cpp reads the same f32 matrices (its model_size adds the
            # token embedding table, of which a decode reads one row).
            lg = ll[0] * wb / 1e9 if ll else None
            print(f"| {m} | {t} | {wb / 1e6:,.1f} | {tg:.2f} | {bw:.2f} | {tg / bw:.2f} | "
                  f"{fmt(lg) if lg else '–'} | {lg / bw:.2f} | {tj['memcpy_GBps']:.2f} |"
                  if lg else
                  f"| {m} | {t} | {wb / 1e6:,.1f} | {tg:.2f} | {bw:.2f} | {tg / bw:.2f} | – | – | "
                  f"{tj['memcpy_GBps']:.2f} |")
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
