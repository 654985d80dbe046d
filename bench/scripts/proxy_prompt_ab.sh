#!/bin/bash
# Two tandem binaries alternated on the issue's `prompt` workload (issue 23,
# bench/results/proxy_cost.md): per run, `BIN bench proxy --config CONFIG
# --workloads prompt` (200 8k prompts, 16 in flight, its own fleet), and
# from WINDOW_AT s in, WINDOW s of the proxy's per-thread CPU and wake-ups
# (proc_threads.py over /proc/PID/task); then the run's `prompt` row
# (whole-run proxy, decoder and prefiller CPU per prompt). The pairs run
# A then B, then B then A, and so on, so neither binary always goes first.
#   bench/scripts/proxy_prompt_ab.sh PAIRS BIN_A BIN_B CONFIG OUTDIR [BENCH ARGS...]
# CONFIG's proxy must not be running already (the bench launches the fleet,
# and the script finds the proxy by `proxy --config CONFIG` in its command
# line); BENCH ARGS go to every run. WINDOW_AT (default 22) and WINDOW
# (default 15) from the environment; CONFIG_B (default CONFIG): the fleet
# file B runs with, to compare two settings (one binary given twice) or a
# change with its setting (session 42: prefill.load_interval_ms). Needs
# python3. Used since session 41 (session 36-40's /tmp/sNN/ab.sh did the
# same with a shell reader).
set -u
PAIRS=$1; A=$2; B=$3; CONFIG=$4; D=$5
shift 5
AT=${WINDOW_AT:-22}; W=${WINDOW:-15}; CB=${CONFIG_B:-$CONFIG}
S=$(dirname "$0")/proc_threads.py
mkdir -p "$D"

run() {  # run TAG BIN CONFIG
  local tag=$1 bin=$2 cfg=$3 pid="" bp
  shift 3
  "$bin" bench proxy --config "$cfg" --workloads prompt --json "$D/p-$tag.json" "$@" \
    > "$D/p-$tag.log" 2>&1 &
  bp=$!
  sleep "$AT"
  pid=$(pgrep -f -- "proxy --config $cfg" | grep -v "^$bp\$" | head -1)
  echo "== $tag $(basename "$bin") proxy pid ${pid:-none} $(date -u +%H:%M:%S) load1 $(cut -d' ' -f1 /proc/loadavg)"
  if [ -n "$pid" ]; then
    python3 "$S" snap "$D/w0-$tag.json" "$pid"
    sleep "$W"
    python3 "$S" snap "$D/w1-$tag.json" "$pid"
    python3 "$S" diff "$D/w0-$tag.json" "$D/w1-$tag.json" 1 proxy
  fi
  wait "$bp"
  grep -E "^prompt" "$D/p-$tag.log" | head -1
}

for p in $(seq "$PAIRS"); do
  if [ $((p % 2)) -eq 1 ]; then
    run "a$p" "$A" "$CONFIG" "$@"; run "b$p" "$B" "$CB" "$@"
  else
    run "b$p" "$B" "$CB" "$@"; run "a$p" "$A" "$CONFIG" "$@"
  fi
done
