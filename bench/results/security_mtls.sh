#!/usr/bin/env bash
# The cost of internal mutual TLS on TTFT/ITL (bench/results/security_mtls.md):
# the same 1P1D fleet of the bundled model (configs/1p1d.yaml with free
# ports), security.internal_tls auto vs off, alternated ROUNDS times, each
# under the same `tandem bench serve` load. Usage: security_mtls.sh OUT_DIR [ROUNDS]
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
bin="$root/build/tandem"
out="${1:?OUT_DIR}"; rounds="${2:-2}"
mkdir -p "$out"
for mode in auto off; do
  sed -e 's/127.0.0.1:50051/127.0.0.1:0/; s/127.0.0.1:8000/127.0.0.1:0/; s/127.0.0.1:9090/127.0.0.1:0/' \
      -e 's/level: info/level: warn/' "$root/configs/1p1d.yaml" |
    sed "s#path: ../models/tandem-kjv#path: $root/models/tandem-kjv#" > "$out/fleet-$mode.yaml"
  printf "security:\n  internal_tls: %s\n" "$mode" >> "$out/fleet-$mode.yaml"
done
openssl speed -seconds 2 -evp aes-128-gcm 2>/dev/null | tail -2 > "$out/openssl_speed.txt"
for r in $(seq 1 "$rounds"); do
  for mode in auto off; do
    state="$out/state-$mode-$r.json"; rm -f "$state"
    "$bin" launch "$out/fleet-$mode.yaml" --state-file "$state" > "$out/launch-$mode-$r.log" 2>&1 &
    launcher=$!
    for _ in $(seq 1 240); do [ -f "$state" ] && break; sleep 0.5; done
    echo "round $r internal_tls $mode: load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/load.txt"
    "$bin" bench serve --state-file "$state" --input-len uniform:64:512 --output-len uniform:16:128 \
      --request-rate 4 --num-requests 100 --ignore-eos --seed 0 --no-progress \
      --label "1P1D internal_tls $mode round $r" --json "$out/serve-$mode-$r.json" > "$out/serve-$mode-$r.txt"
    echo "  after: load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/load.txt"
    kill -TERM "$launcher"; wait "$launcher" || true
  done
done
