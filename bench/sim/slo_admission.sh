#!/usr/bin/env bash
# Issue 22, SLO admission: `proxy.admission: slo` against `queue` at twice
# the fleet's capacity on a sim 2P2D fleet (configs/sim-2p2d.yaml). Writes
# bench/results/sim_raw/slo_{capacity,queue,slo}.{json,cpu.json,launch.log}
# and prints the summary quoted in bench/results/slo_admission.md.
#   bench/sim/slo_admission.sh [BUILD_DIR]
# Knobs (environment): TTFT / TPOT (the SLOs, ms), EFF (sim compute
# efficiency: lower = slower prefill = fewer requests for the same load),
# IN / OUT (tokens), DUR (seconds of arrivals per run).
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
raw=bench/results/sim_raw
mkdir -p "$raw"
TTFT=${TTFT:-4000} TPOT=${TPOT:-100} EFF=${EFF:-0.05} IN=${IN:-4000} OUT=${OUT:-16} DUR=${DUR:-40}
run() { python3 bench/sim/run_sim.py --tandem "$build/tandem" --config configs/sim-2p2d.yaml \
          --set sim.compute_efficiency=$EFF --set proxy.slo.ttft_ms=$TTFT --set proxy.slo.tpot_ms=$TPOT "$@"; }
wl="--input-len $IN --output-len $OUT --ignore-eos --slo-ttft-ms $TTFT --slo-tpot-ms $TPOT"

# 1. Capacity: the fleet saturated (more requests in flight than it prefills
#    at once), admission queue; completed requests per second.
run --set proxy.admission=queue --out $raw/slo_capacity -- --label capacity --concurrency 16 \
  --num-requests ${CAP_N:-40} $wl --seed 21
cap=$(python3 -c "import json; print(json.load(open('$raw/slo_capacity.json'))['request_throughput'])")
rate=$(python3 -c "print(round(2 * $cap, 3))")
echo "capacity $cap req/s -> offered load $rate req/s"

# 2. Twice the capacity, Poisson arrivals, the same seed for both.
for adm in queue slo; do
  run --set proxy.admission=$adm --out $raw/slo_$adm -- --label $adm --request-rate $rate \
    --duration $DUR --num-requests 100000 $wl --seed 22
done
python3 bench/sim/slo_report.py $raw/slo_capacity.json $raw/slo_queue.json $raw/slo_slo.json $TTFT
