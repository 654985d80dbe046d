#!/usr/bin/env bash
# Issue 18's sim experiment (docs/sim.md "Tensor and pipeline parallelism",
# bench/results/sim_tp_pp.md): Llama-3-70B on one aggregated worker of 8
# simulated H100s in four layouts, the same bounded closed-loop load on each:
#   TP 8 in one node | TP 4 x PP 2 across two nodes (PP over 100 GbE) |
#   TP 8 across two nodes over 100 GbE | TP 8 across two nodes over 400 Gb/s RDMA.
# Writes bench/results/sim_raw/tp_pp_<layout>.{json,txt,cpu.json,launch.log,plan.txt}
# and prints the table. Usage: bench/sim/tp_pp.sh [BUILD_DIR]
# Env: CONC (32), N (160 requests), DUR (60 s), IN (512), OUT (256), TAG (a
# suffix of the output names: tp_pp${TAG}_<layout>.*).
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
raw=bench/results/sim_raw
mkdir -p "$raw"
tag=${TAG:-}
conc=${CONC:-32}; n=${N:-160}; dur=${DUR:-60}; in=${IN:-512}; out=${OUT:-256}
layouts="tp8 tp4pp2-2nodes tp8-2nodes-rdma tp8-2nodes-ethernet"
for l in $layouts; do
  cfg=configs/sim/llama-3-70b-$l.yaml
  echo "== $l ($(uptime | sed 's/.*load/load/'))"
  python3 bench/sim/run_sim.py --tandem "$build/tandem" --config "$cfg" --out "$raw/tp_pp${tag}_$l" -- \
    --label "$l" --concurrency "$conc" --num-requests "$n" --duration "$dur" \
    --input-len "$in" --output-len "$out" --ignore-eos --seed 18
  # The model's own prediction for a decode step at this batch and context.
  "$build/tandem" plan --config "$cfg" --rate 1 --input-tokens "$in" --output-tokens "$out" \
    --decode-batch "$conc" > "$raw/tp_pp${tag}_$l.plan.txt"
  tail -1 "$raw/tp_pp${tag}_$l.plan.txt"
done
python3 - "$raw/tp_pp${tag}" $layouts <<'PY'
import json, sys
prefix, layouts = sys.argv[1], sys.argv[2:]
print("| layout | completed | ITL p50 ms | ITL p99 ms | TTFT p50 ms | output tok/s | load (1 min) |")
print("|---|---|---|---|---|---|---|")
for l in layouts:
    b = json.load(open(f"{prefix}_{l}.json"))
    c = json.load(open(f"{prefix}_{l}.cpu.json"))
    load = "%.1f" % c["loadavg_1_5_15"][0]
    print(f"| {l} | {b['completed']} | {b['median_itl_ms']:.1f} | {b['p99_itl_ms']:.1f} | "
          f"{b['median_ttft_ms']:.1f} | {b['output_throughput']:.0f} | {load} |")
PY
