#!/usr/bin/env bash
# Session 21: SLO admission when the decoders' seats, not the prefill, are
# what fills up (docs/router.md, "Seat waits in the TTFT prediction"). A sim
# 1P1D fleet (configs/sim-1p1d.yaml) with few decode seats and long outputs
# is offered twice its measured capacity; `proxy.admission: slo` with the
# build BEFORE (its TTFT prediction sees only the prefill) against AFTER
# (the seat wait added). Writes bench/results/sim_raw/seat_*.{json,...} and
# prints (bench/sim/slo_report.py) the table quoted in bench/results/slo_admission.md.
#   bench/sim/slo_seat_wait.sh BEFORE_BUILD_DIR AFTER_BUILD_DIR
# Knobs (environment): TTFT (the SLO, ms), SEQS (decode seats =
# scheduler.max_num_seqs), IN / OUT (tokens), DUR (seconds of arrivals).
set -euo pipefail
cd "$(dirname "$0")/../.."
before=$1
after=$2
raw=bench/results/sim_raw
mkdir -p "$raw"
TTFT=${TTFT:-2000} SEQS=${SEQS:-8} IN=${IN:-64} OUT=${OUT:-256} DUR=${DUR:-30}
run() { local build=$1; shift
        python3 bench/sim/run_sim.py --tandem "$build/tandem" --config configs/sim-1p1d.yaml \
          --set scheduler.max_num_seqs=$SEQS --set proxy.slo.ttft_ms=$TTFT "$@"; }
wl="--input-len $IN --output-len $OUT --ignore-eos --slo-ttft-ms $TTFT"

# 1. Capacity (the physical limit, this session): the decoder's seats kept
#    full, admission queue; completed requests per second.
run "$after" --set proxy.admission=queue --out $raw/seat_capacity -- --label capacity \
  --concurrency $((2 * SEQS)) --num-requests ${CAP_N:-48} $wl --seed 31
cap=$(python3 -c "import json; print(json.load(open('$raw/seat_capacity.json'))['request_throughput'])")
rate=$(python3 -c "print(round(2 * $cap, 3))")
echo "capacity $cap req/s -> offered load $rate req/s"

# 2. Twice the capacity, Poisson arrivals, the same requests for each build.
for label in before after; do
  build=$before
  [ "$label" = after ] && build=$after
  run "$build" --set proxy.admission=slo --out $raw/seat_$label -- --label $label \
    --request-rate $rate --duration $DUR --num-requests 100000 $wl --seed 32
done
python3 bench/sim/slo_report.py $raw/seat_capacity.json $raw/seat_before.json $raw/seat_after.json $TTFT before after
