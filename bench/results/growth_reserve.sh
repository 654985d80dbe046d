#!/usr/bin/env bash
# Session 26: a decoder's growth reserve (docs/engine.md, "Growth reserve")
# on and off, on a sim 1P1D fleet (configs/sim-1p1d.yaml: Llama-3-8B on a
# simulated H100) whose decoder is short of KV blocks (decode num_blocks
# 1024: about 12 requests of 1024 + 256 tokens at once) under 32 sessions.
# Runs the pair PAIRS times, alternating which goes first, and prints one
# markdown row per run: completed requests, output tokens/s, TTFT mean and
# p99, ITL median, p99 and max, TPOT p99, mean end-to-end, and from the
# decoder after the run its preemptions, Reserve calls that waited for KV
# blocks and the growth ratio.
#
# MODE=aggregated (session 27): the same on one aggregated sim worker
# (configs/sim-aggregated.yaml, one `both` replica of 1024 blocks), where
# the reserve applies to each new request's admission.
#
# EOS=p (session 28): requests end at an eos with probability p per token
# (sim.eos_probability; geometric lengths of mean 1/p, clipped at 256)
# instead of all running to max_tokens (--ignore-eos is left off).
# NUM=n: n requests instead of 96.
#
#   bash bench/results/growth_reserve.sh            # build/tandem, 2 pairs
#   TANDEM=build-x/tandem PAIRS=3 bash bench/results/growth_reserve.sh
#   MODE=aggregated bash bench/results/growth_reserve.sh
#   EOS=0.015625 MODE=aggregated bash bench/results/growth_reserve.sh
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN=${TANDEM:-$ROOT/build/tandem}
PAIRS=${PAIRS:-2}
MODE=${MODE:-1p1d}
NUM=${NUM:-96}
EOS=${EOS:-0}
IGNORE_EOS=--ignore-eos
[ "$EOS" = 0 ] || IGNORE_EOS=
W=$(mktemp -d /tmp/tandem-growth-XXXXXX)
trap 'rm -rf "$W"' EXIT
for c in 0 1; do
  python3 - "$ROOT" "$c" "$MODE" "$EOS" > "$W/c$c.yaml" <<'PY'
import sys
root, c, mode, eos = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
s = open(root + ("/configs/sim-aggregated.yaml" if mode == "aggregated" else "/configs/sim-1p1d.yaml")).read()
s = s.replace("path: ../models/", "path: %s/models/" % root)
s = s.replace("model_shape: sim/", "model_shape: %s/configs/sim/" % root)
s = s.replace("  threads: 1\n", "  threads: 1\n  schedule_conservativeness: %s\n" % c)
s = s.replace("decode:\n  replicas: 1\n", "decode:\n  replicas: 1\n  num_blocks: 1024\n")
s = s.replace("both:\n  replicas: 2\n", "both:\n  replicas: 1\n  num_blocks: 1024\n")
s = s.replace("level: info", "level: warn")
if eos != "0":
    s = s.replace("sim:\n", "sim:\n  eos_probability: %s\n" % eos, 1)
for a, b in (("50171", "5170"), ("8171", "870"), ("9171", "970")):
    s = s.replace("127.0.0.1:" + a, "127.0.0.1:%s%s" % (b, c))
print(s)
PY
done
run() {  # run TAG CONFIG
  local d=$W/$1
  mkdir -p "$d"
  "$BIN" launch "$2" --state-file "$d/fleet.json" > "$d/fleet.log" 2>&1 &
  local lp=$!
  for _ in $(seq 120); do [ -f "$d/fleet.json" ] && break; sleep 1; done
  sleep 3
  local dm
  dm=$(python3 -c "import json,sys;print([w['metrics'] for w in json.load(open(sys.argv[1]))['workers'] if w['role'] in ('decode','both')][0])" "$d/fleet.json")
  "$BIN" bench serve --state-file "$d/fleet.json" --no-progress --json "$d/serve.json" --label "$1" \
    --concurrency 32 --num-requests "$NUM" --input-len 1024 --output-len 256 $IGNORE_EOS > "$d/serve.txt" 2>&1
  curl -s "http://$dm/metrics" > "$d/dec.txt"
  kill $lp; wait $lp 2>/dev/null || true
  python3 - "$d" <<'PY'
import json, re, sys
d = sys.argv[1]
j = json.load(open(d + "/serve.json"))
m = open(d + "/dec.txt").read()
g = lambda n: float(re.search(r"^" + n + r"\{[^}]*\} (\S+)", m, re.M).group(1))
print("| %s | %d | %.0f | %.0f | %.0f | %.2f | %.2f | %.0f | %.2f | %.2f | %d | %d | %.3f |" % (
    j["label"], j["completed"], j["output_throughput"], j["mean_ttft_ms"], j["p99_ttft_ms"],
    j["median_itl_ms"], j["p99_itl_ms"], j["max_itl_ms"], j["p99_tpot_ms"], j["mean_e2el_ms"] / 1e3,
    g("tandem_preemptions_total"), g("tandem_decode_kv_waits_total"),
    g("tandem_kv_growth_reserve_ratio")))
PY
}
echo "| run | done | out tok/s | TTFT mean ms | TTFT p99 | ITL p50 ms | ITL p99 | ITL max | TPOT p99 | E2E mean s | preemptions | KV waits | ratio at end |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
for i in $(seq "$PAIRS"); do
  if (( i % 2 )); then run "off-$i" "$W/c0.yaml"; run "on-$i" "$W/c1.yaml"
  else run "on-$i" "$W/c1.yaml"; run "off-$i" "$W/c0.yaml"; fi
done
