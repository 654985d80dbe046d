#!/usr/bin/env bash
# Session 22: SLO admission with its prediction error calibrated
# (`proxy.slo.attainment`, docs/scheduling.md "Calibrated admission"): one
# build, admission `slo`, the prediction alone (`proxy.slo.attainment=0`)
# against the margin for 90 % (`0.9`, the default), at LOAD x the capacity
# measured in the same run. Two fleets (FLEET):
#   seat     (default) the seat-bound sim 1P1D of slo_seat_wait.sh: 8 decode
#            seats, 64-token prompts, 256 output tokens, TTFT SLO 2000 ms;
#   prefill  the prefill-bound sim 2P2D of slo_admission.sh: prefill 20x
#            slower, 4000-token prompts, 16 output tokens, TTFT SLO 4000 ms;
#   mooncake the sim 4P4D 128k fleet of kv_tiers_mooncake.md replaying the
#            Mooncake trace's requests 3001-3300 (prompts of 0.5k-128k
#            tokens, mean ~20k, with their reuse; the trace's output
#            lengths) at TIME_SCALE (0.5: twice the trace's pace), TTFT SLO
#            3000 ms; instead of a capacity run, the same replay under
#            admission `queue` (its throughput is the fleet's capacity).
# Writes bench/results/sim_raw/calib_FLEET_*.{json,...} and prints
# (bench/sim/slo_report.py) the table quoted in bench/results/slo_admission.md.
#   bench/sim/slo_calibration.sh BUILD_DIR
# Knobs (environment): FLEET, LOAD (offered load, times the capacity), Q (the
# attainment asked for), DUR (seconds of arrivals), TTFT (the SLO, ms).
set -euo pipefail
cd "$(dirname "$0")/../.."
build=$1
raw=bench/results/sim_raw
mkdir -p "$raw"
FLEET=${FLEET:-seat} LOAD=${LOAD:-2} Q=${Q:-0.9}
if [ "$FLEET" = seat ]; then
  TTFT=${TTFT:-2000} DUR=${DUR:-30}
  cfg=(--config configs/sim-1p1d.yaml --set scheduler.max_num_seqs=8)
  wl="--input-len 64 --output-len 256"
  cap_args="--concurrency 16 --num-requests 48 --seed 31"
  seed=32
elif [ "$FLEET" = mooncake ]; then
  TTFT=${TTFT:-3000}
  cfg=(--config configs/sim-4p4d-128k.yaml)
  trace=${TRACE:-../shared/workloads/mooncake_synthetic_trace.jsonl}
  wl="--trace $trace --trace-skip 3000 --num-requests 300 --trace-block-tokens 512 \
      --time-scale ${TIME_SCALE:-0.5} --duration 600"
  seed=17
else
  TTFT=${TTFT:-4000} DUR=${DUR:-40}
  cfg=(--config configs/sim-2p2d.yaml --set sim.compute_efficiency=0.05)
  wl="--input-len 4000 --output-len 16"
  cap_args="--concurrency 16 --num-requests 40 --seed 21"
  seed=22
fi
run() { python3 bench/sim/run_sim.py --tandem "$build/tandem" "${cfg[@]}" \
          --set proxy.slo.ttft_ms=$TTFT "$@"; }
wl="$wl --ignore-eos --slo-ttft-ms $TTFT"
out=$raw/calib_$FLEET

if [ "$FLEET" = mooncake ]; then
  # The trace's own arrivals: under `queue`, then `slo` without and with the margin.
  run --set proxy.admission=queue --out ${out}_capacity -- --label queue $wl --seed $seed
  for q in 0 $Q; do
    run --set proxy.admission=slo --set proxy.slo.attainment=$q --out ${out}_q$q -- \
      --label "attainment $q" $wl --seed $seed
  done
else
  # 1. Capacity (the physical limit, this run): the fleet saturated,
  #    admission queue; completed requests per second.
  run --set proxy.admission=queue --out ${out}_capacity -- --label capacity $cap_args $wl
  cap=$(python3 -c "import json; print(json.load(open('${out}_capacity.json'))['request_throughput'])")
  rate=$(python3 -c "print(round($LOAD * $cap, 3))")
  echo "capacity $cap req/s -> offered load $rate req/s"

  # 2. LOAD x the capacity, Poisson arrivals, the same requests for each setting.
  for q in 0 $Q; do
    run --set proxy.admission=slo --set proxy.slo.attainment=$q --out ${out}_q$q -- \
      --label "attainment $q" --request-rate $rate --duration $DUR --num-requests 100000 $wl \
      --seed $seed
  done
fi
python3 bench/sim/slo_report.py ${out}_capacity.json ${out}_q0.json ${out}_q$Q.json $TTFT \
  "attainment 0" "attainment $Q"
