#!/usr/bin/env bash
# Issue 7: replay a window of the Mooncake trace through `tandem bench serve`
# against a 2P2D CPU fleet (configs/mooncake-2p2d.yaml) once per router
# policy. Writes router_mooncake_<policy>.json next to this script and prints
# one markdown row per policy: the client's cached-token ratio, the
# prefillers' prefix-cache hit rate (tandem_prefix_cache_hits_tokens_total /
# tandem_prefix_cache_queries_tokens_total, scraped after the run) and
# TTFT p50/p99.
#
#   bash bench/results/router_mooncake.sh            # build/tandem
#   TANDEM=build-x/tandem SKIP=3600 N=300 TIME_SCALE=2 bash bench/results/router_mooncake.sh
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN=${TANDEM:-$ROOT/build/tandem}
TRACE=${TRACE:-/work/shared/workloads/mooncake_synthetic_trace.jsonl}
SKIP=${SKIP:-3600}           # replay lines SKIP+1 .. SKIP+N of the trace
N=${N:-300}
TIME_SCALE=${TIME_SCALE:-2}  # 2 = half the trace's request rate
BLOCK_TOKENS=${BLOCK_TOKENS:-16}  # input lengths x 16/512
OUT=${OUT:-$ROOT/bench/results}
POLICIES=${POLICIES:-"kv_aware least_loaded round_robin"}

# The ideal hit rate of the window: a full 16-token block is a hit when an
# earlier request of the window has the same prefix up to that block.
python3 - "$TRACE" "$SKIP" "$N" "$BLOCK_TOKENS" <<'PY'
import json, math, sys
trace, skip, n, bt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rows = [json.loads(l) for l in open(trace) if l.strip()][skip:skip + n]
seen, hit, tot, cut = set(), 0, 0, 0
for r in rows:
    length = math.ceil(r["input_length"] * bt / 512)
    if length + r["output_length"] > 1024:
        length = 1024 - r["output_length"]; cut += 1
    tot += length
    for i in range(length // 16):
        # KV block i holds tokens 16i..16i+15: the hash blocks up to the
        # one holding its last token, and where it starts inside its block.
        key = (tuple(r["hash_ids"][: (16 * i + 15) // bt + 1]), (16 * i) % bt)
        if key in seen: hit += 16
        else: seen.add(key)
print(f"window: trace lines {skip+1}..{skip+len(rows)}, {tot} prompt tokens, "
      f"{cut} prompts cut to the context, ideal prefix hit rate {hit/tot:.3f}")
PY

echo "| policy | requests ok/failed | cached-token ratio (client) | prefiller prefix hit rate | TTFT p50 (ms) | TTFT p99 (ms) | e2e p50 (ms) | output tok/s |"
echo "|---|---|---|---|---|---|---|---|"
for policy in $POLICIES; do
  dir=$(mktemp -d /tmp/tandem-mooncake-XXXXXX)
  sed -e "s|policy: kv_aware|policy: $policy|" -e "s|path: ../models/|path: $ROOT/models/|" \
    "$ROOT/configs/mooncake-2p2d.yaml" > "$dir/fleet.yaml"
  "$BIN" launch "$dir/fleet.yaml" --state-file "$dir/state.json" > "$dir/launch.log" 2>&1 &
  launcher=$!
  for _ in $(seq 240); do [ -f "$dir/state.json" ] && break; sleep 0.5; done
  [ -f "$dir/state.json" ] || { echo "fleet did not start: $dir/launch.log" >&2; kill $launcher; exit 1; }
  timeout 1200 "$BIN" bench serve --state-file "$dir/state.json" --trace "$TRACE" \
    --trace-skip "$SKIP" --num-requests "$N" --trace-block-tokens "$BLOCK_TOKENS" \
    --time-scale "$TIME_SCALE" --ignore-eos --no-progress --label "mooncake $policy" \
    --json "$OUT/router_mooncake_$policy.json" > "$dir/table.txt" 2> "$dir/bench.err"
  hits=0; queries=0
  for m in $(python3 -c "import json,sys; print(' '.join(w['metrics'] for w in json.load(open(sys.argv[1]))['workers'] if w['role']=='prefill'))" "$dir/state.json"); do
    text=$(curl -s "http://$m/metrics")
    h=$(echo "$text" | awk '/^tandem_prefix_cache_hits_tokens_total/ {s+=$NF} END {print s+0}')
    q=$(echo "$text" | awk '/^tandem_prefix_cache_queries_tokens_total/ {s+=$NF} END {print s+0}')
    hits=$(python3 -c "print($hits+$h)"); queries=$(python3 -c "print($queries+$q)")
  done
  kill -TERM $launcher; wait $launcher || true
  python3 - "$OUT/router_mooncake_$policy.json" "$policy" "$hits" "$queries" <<'PY'
import json, sys
j = json.load(open(sys.argv[1])); h, q = float(sys.argv[3]), float(sys.argv[4])
rate = f"{h/q:.3f} ({int(h)}/{int(q)} tokens)" if q else "-"
print(f"| {sys.argv[2]} | {j['completed']}/{j['failed']} | {j['cached_token_ratio']:.3f} | {rate} | "
      f"{j['median_ttft_ms']:.0f} | {j['p99_ttft_ms']:.0f} | {j['median_e2el_ms']:.0f} | {j['output_throughput']:.0f} |")
PY
  rm -rf "$dir"
done
