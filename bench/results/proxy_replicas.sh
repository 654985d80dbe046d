#!/usr/bin/env bash
# Issue 21: routing quality with 1, 2 and 4 proxy replicas on the same
# workload. A sim 4P4D fleet (configs/sim-4p4d.yaml, kv_aware) replays
# requests 3601-3900 of the Mooncake synthetic trace (the window with the
# most prefix reuse; bench/results/sim_routing.md) with `proxy.replicas`
# set to N; `tandem bench serve --all-proxies` sends request i to proxy
# i mod N, so each proxy routes 1/N of the requests with its own index and
# its own in-flight predictions, and learns the others' load only from the
# workers' load reports. Prints one markdown row per N; raw output in
# bench/results/sim_raw/proxy_replicas_<N>.*
#
#   bash bench/results/proxy_replicas.sh [BUILD_DIR]     # default build
#   REPLICAS="1 4" TIME_SCALE=0.25 bash bench/results/proxy_replicas.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
raw=bench/results/sim_raw
mkdir -p "$raw"
trace=${TRACE:-/work/shared/workloads/mooncake_synthetic_trace.jsonl}
TIME_SCALE=${TIME_SCALE:-0.5}
TAG=${TAG:-}
echo "| proxy replicas | completed/failed | prefix hit rate (workers) | cached prompt ratio (client) | TTFT p50 ms | TTFT p99 ms | e2e p50 ms | req/s | load avg (1/5/15) |"
echo "|---|---|---|---|---|---|---|---|---|"
for n in ${REPLICAS:-1 2 4}; do
  out=$raw/proxy_replicas${TAG}_$n
  python3 bench/sim/run_sim.py --tandem "$build/tandem" --config configs/sim-4p4d.yaml \
    --set proxy.replicas=$n --set logging.level=warn --set proxy.grpc=127.0.0.1:0 \
    --set proxy.http=127.0.0.1:0 --set proxy.metrics=127.0.0.1:0 --out "$out" -- \
    --label "replicas-$n" --all-proxies --trace "$trace" --trace-skip 3600 \
    --trace-block-tokens 16 --num-requests 300 --time-scale "$TIME_SCALE" --duration 90 \
    --ignore-eos --seed 5 > /dev/null
  python3 - "$out" "$n" <<'PY'
import json, sys
out, n = sys.argv[1], sys.argv[2]
j = json.load(open(out + ".json")); c = json.load(open(out + ".cpu.json"))
h, q = c["prefix_hits_tokens"], c["prefix_query_tokens"]
la = "/".join(f"{x:.1f}" for x in c["loadavg_1_5_15"])
print(f"| {n} | {j['completed']}/{j['failed']} | {h/q if q else 0:.3f} | {j['cached_token_ratio']:.3f} | "
      f"{j['median_ttft_ms']:.1f} | {j['p99_ttft_ms']:.1f} | {j['median_e2el_ms']:.1f} | "
      f"{j['request_throughput']:.2f} | {la} |")
PY
done
