#!/usr/bin/env bash
# The autoscaling bench (bench/results/autoscale.md): launches an autoscaled
# sim fleet (configs/sim-autoscale.yaml: starts 1P1D, bounds 1..4 per role),
# offers a Poisson load stepping through RATES req/s for PHASE_S seconds
# each with `tandem bench serve`, then stays idle IDLE_S seconds; sample.py
# records the proxy's planner/fleet gauges, latency histograms and the state
# file every second. Then report.py writes the per-phase table and plot.py
# the figure (matplotlib: any venv, not needed by CI).
#
#   bench/autoscale/ramp.sh OUT_DIR            (from the repository root)
#   AUTOSCALE=off bench/autoscale/ramp.sh OUT  the same on a fixed 1P1D fleet
set -euo pipefail
OUT=${1:?usage: ramp.sh OUT_DIR}
BIN=${TANDEM:-build/tandem}
CFG=${CFG:-configs/sim-autoscale.yaml}
RATES=${RATES:-"1 2 4 8 8 4 2 1"}
PHASE_S=${PHASE_S:-30}
IDLE_S=${IDLE_S:-45}
INPUT_LEN=${INPUT_LEN:-1024}
OUTPUT_LEN=${OUTPUT_LEN:-256}
SLO_TTFT_MS=${SLO_TTFT_MS:-2000}
SLO_TPOT_MS=${SLO_TPOT_MS:-50}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUT"
rm -f "$OUT"/phase-*.json "$OUT"/phases.txt "$OUT"/state.json
if [ "${AUTOSCALE:-on}" = off ]; then
  sed 's/^  enabled: true/  enabled: false/' "$CFG" > "$(dirname "$CFG")/.autoscale-off.yaml"
  CFG="$(dirname "$CFG")/.autoscale-off.yaml"
fi
"$BIN" launch "$CFG" --state-file "$OUT/state.json" > "$OUT/launch.log" 2>&1 &
LPID=$!
SPID=
cleanup() {
  [ -n "$SPID" ] && kill "$SPID" 2>/dev/null || true
  kill -TERM "$LPID" 2>/dev/null || true
  wait "$LPID" 2>/dev/null || true
  if [ "${AUTOSCALE:-on}" = off ]; then rm -f "$CFG"; fi
}
trap cleanup EXIT
for _ in $(seq 1 300); do [ -s "$OUT/state.json" ] && break; sleep 0.2; done
[ -s "$OUT/state.json" ] || { echo "the fleet did not start; see $OUT/launch.log" >&2; exit 1; }
python3 "$HERE/sample.py" "$OUT/state.json" "$OUT/samples.jsonl" &
SPID=$!
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)" > "$OUT/load.txt"
i=0
for rate in $RATES; do
  echo "$(date +%s.%N) $rate" >> "$OUT/phases.txt"
  "$BIN" bench serve --state-file "$OUT/state.json" --request-rate "$rate" --duration "$PHASE_S" \
    --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --ignore-eos \
    --slo-ttft-ms "$SLO_TTFT_MS" --slo-tpot-ms "$SLO_TPOT_MS" --seed $((i + 1)) \
    --label "rate-$rate" --json "$OUT/phase-$i.json" --no-progress > "$OUT/phase-$i.txt" 2>&1
  i=$((i + 1))
done
echo "$(date +%s.%N) 0" >> "$OUT/phases.txt"
sleep "$IDLE_S"
echo "$(date +%s.%N) end" >> "$OUT/phases.txt"
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/load.txt"
kill "$SPID"; SPID=
python3 "$HERE/report.py" "$OUT" > "$OUT/report.md"
cat "$OUT/report.md"
