#!/bin/bash
# Per-thread CPU and wake-ups of a sim fleet's proxy, decoder and prefiller:
# a 10 s idle window, then per prompt over one `prompt` run, then
# `strace -c -f` of the proxy over a second run (issue 23,
# bench/results/proxy_cost.md). Launches its own fleet and stops it.
#   bench/scripts/proxy_prompt_breakdown.sh BIN CONFIG WORKDIR [PROMPTS [BENCH ARGS...]]
# BENCH ARGS go to both `bench proxy` runs (e.g. --prompt-concurrency 1).
# BIN launches the fleet and runs the bench; CONFIG must use ports of its
# own (not configs/sim-1p1d.yaml's). Needs python3 and strace.
set -u
BIN=$1; CONFIG=$2; D=$3; N=${4:-64}
shift $(( $# < 4 ? $# : 4 ))
S=$(dirname "$0")/proc_threads.py
mkdir -p "$D"; rm -f "$D/fleet.json"
"$BIN" launch "$CONFIG" --state-file "$D/fleet.json" > "$D/fleet.log" 2>&1 &
LP=$!
for _ in $(seq 120); do [ -f "$D/fleet.json" ] && break; sleep 1; done
[ -f "$D/fleet.json" ] || { echo "fleet did not start: $D/fleet.log"; kill $LP; exit 1; }
sleep 4
read -r P DP FP < <(python3 -c "import json,sys;j=json.load(open(sys.argv[1]));w={x['role']:x['pid'] for x in j['workers']};print(j['proxy']['pid'],w['decode'],w['prefill'])" "$D/fleet.json")
echo "== idle 10 s, load $(cut -d' ' -f1 /proc/loadavg)"
python3 "$S" snap "$D/i0.json" "$P" "$DP" "$FP"; sleep 10; python3 "$S" snap "$D/i1.json" "$P" "$DP" "$FP"
python3 "$S" diff "$D/i0.json" "$D/i1.json" 10 proxy,decoder,prefiller
echo "== prompt, $N requests, per prompt, load $(cut -d' ' -f1 /proc/loadavg)"
python3 "$S" snap "$D/a0.json" "$P" "$DP" "$FP"
"$BIN" bench proxy --state-file "$D/fleet.json" --workloads prompt --prompt-requests "$N" "$@" 2>&1 | tail -2
python3 "$S" snap "$D/a1.json" "$P" "$DP" "$FP"
python3 "$S" diff "$D/a0.json" "$D/a1.json" "$N" proxy,decoder,prefiller
echo "== strace -c -f of the proxy over a second run, load $(cut -d' ' -f1 /proc/loadavg)"
strace -c -f -p "$P" -o "$D/strace.txt" > /dev/null 2>&1 &
ST=$!
sleep 0.5
"$BIN" bench proxy --state-file "$D/fleet.json" --workloads prompt --prompt-requests "$N" "$@" 2>&1 | tail -1
kill -INT $ST; wait $ST 2>/dev/null
head -16 "$D/strace.txt"
kill $LP; wait $LP 2>/dev/null
echo "== done, load $(cut -d' ' -f1 /proc/loadavg)"
