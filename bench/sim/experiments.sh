#!/usr/bin/env bash
# The sim experiments of issue 11 (docs/sim.md). Each writes
# bench/results/sim_raw/<name>.{json,txt,cpu.json,launch.log}; the reports
# bench/results/sim_*.md quote the numbers. Usage:
#   bench/sim/experiments.sh cpu|interference|bandwidth|bandwidth-agg|streaming|routing|routing-reuse|pd|kv-tiers [BUILD_DIR]
# Every run is bounded (request count and duration); one fleet at a time.
set -euo pipefail
cd "$(dirname "$0")/../.."
what=${1:?cpu|interference|bandwidth|routing|pd}
build=${2:-build-sim}
raw=bench/results/sim_raw
mkdir -p "$raw"
run() { python3 bench/sim/run_sim.py --tandem "$build/tandem" "$@"; }
trace=${TRACE:-../shared/workloads/mooncake_synthetic_trace.jsonl}

case "$what" in
cpu)  # tandem's own CPU per generated token and per routed request, same workload on every layout
  for c in aggregated 1p1d 2p2d 4p4d 8p8d; do
    run --config configs/sim-$c.yaml --out $raw/cpu_$c -- --label cpu-$c --request-rate 4 \
      --num-requests 80 --duration 40 --input-len 512 --output-len 128 --ignore-eos --seed 1
  done ;;
interference)  # decode streams + periodic long prompts; aggregated x2 vs 1P1D (2 devices each)
  for long in 4096 512; do
    for c in aggregated 1p1d; do
      run --config configs/sim-$c.yaml --out $raw/interference_${c}_long$long \
        --also-delay 5 --also "--label long-$long --request-rate 2 --num-requests 60 --duration 30 --input-len $long --output-len 8 --ignore-eos --seed 2" \
        -- --label streams --concurrency 12 --num-requests 1000 --duration 30 --input-len 128 \
        --output-len 256 --ignore-eos --seed 3
    done
  done ;;
bandwidth)  # the 30 % rule: 1P1D, long prompts, link 10..400 Gb/s
  for g in 10 25 50 100 200 400; do
    run --config configs/sim-1p1d.yaml --set sim.link_gbps=$g --out $raw/bandwidth_${g}gbps -- \
      --label link-${g}gbps --request-rate 2 --num-requests 30 --duration 60 --input-len 4096 \
      --output-len 16 --ignore-eos --seed 4
    "$build/tandem" plan --config configs/sim-1p1d.yaml --link-gbps $g --rate 2 \
      --input-tokens 4096 --output-tokens 16 > $raw/bandwidth_${g}gbps.plan.txt
  done
  # The same workload on aggregated x2 (no KV transfer), for comparison.
  run --config configs/sim-aggregated.yaml --out $raw/bandwidth_aggregated -- \
    --label aggregated --request-rate 2 --num-requests 30 --duration 60 --input-len 4096 \
    --output-len 16 --ignore-eos --seed 4 ;;
streaming)  # issue 17: transport.push streaming vs after_prefill, ~8k-token prompts one at a time
  for g in 25 50 100; do
    for m in streaming after_prefill; do
      run --config configs/sim-1p1d.yaml --set sim.link_gbps=$g --set transport.push=$m \
        --out $raw/streaming_${m}_${g}gbps -- --label $m-${g}gbps --concurrency 1 \
        --num-requests ${N:-12} --duration 90 --input-len 8000 --output-len 16 --ignore-eos --seed 6
    done
  done ;;
bandwidth-agg)  # only the aggregated baseline of `bandwidth`
  run --config configs/sim-aggregated.yaml --out $raw/bandwidth_aggregated -- \
    --label aggregated --request-rate 2 --num-requests 30 --duration 60 --input-len 4096 \
    --output-len 16 --ignore-eos --seed 4 ;;
routing)  # Mooncake synthetic trace on 4P4D per policy (lengths scaled by 1/32)
  for p in kv_aware least_loaded round_robin; do
    run --config configs/sim-4p4d.yaml --set router.policy=$p --out $raw/routing_$p -- \
      --label $p --trace "$trace" --trace-block-tokens 16 --num-requests 300 --time-scale 0.5 \
      --duration 90 --ignore-eos --seed 5
  done ;;
routing-reuse)  # the same on requests 3601-3900, the trace's window with the most prefix reuse
  for p in kv_aware least_loaded round_robin; do
    run --config configs/sim-4p4d.yaml --set router.policy=$p --out $raw/routing_skip3600_$p -- \
      --label $p-skip3600 --trace "$trace" --trace-skip 3600 --trace-block-tokens 16 \
      --num-requests 300 --time-scale 0.5 --duration 90 --ignore-eos --seed 5
  done ;;
kv-tiers)  # issue 17: host KV tiers 0, 2x, 8x the device; kv_aware vs round_robin; unscaled trace, 128k model
  # WINDOW="--trace-skip N --num-requests M" (default: the trace's last 993 requests)
  win=${WINDOW:---trace-skip 3000 --num-requests 993}
  for t in 0 53348 213392; do
    for p in kv_aware round_robin; do
      run --config configs/sim-4p4d-128k.yaml --set router.policy=$p --set cache.host_tier_blocks=$t \
        --out $raw/kv_tiers_host${t}_$p -- --label $p-host$t --trace "$trace" $win \
        --trace-block-tokens 512 --duration 600 --ignore-eos --seed 17
    done
  done
  python3 bench/sim/kv_tiers_ideal.py $win > $raw/kv_tiers_ideal.txt 2>&1 || true ;;
pd)  # P:D at 4 devices, one workload, goodput under TTFT and ITL SLOs
  for pd in 1:3 2:2 3:1; do
    p=${pd%:*}; d=${pd#*:}
    run --config configs/sim-2p2d.yaml --set prefill.replicas=$p --set decode.replicas=$d \
      --out $raw/pd_${p}p${d}d -- --label ${p}p${d}d --request-rate 6 --num-requests 180 \
      --duration 60 --input-len uniform:1024:3072 --output-len 128 --ignore-eos --seed 6 \
      --slo-ttft-ms 500 --slo-itl-ms 30
  done ;;
*) echo "unknown experiment $what" >&2; exit 1 ;;
esac
