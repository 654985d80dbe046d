#!/usr/bin/env bash
# The cost of internal mutual TLS on TTFT/ITL (bench/results/mtls_cost.md):
# the same 1P1D fleet, security.internal_tls auto vs off, alternated
# (auto, off, auto, off, ...) ROUNDS times in one session, each under the
# same `tandem bench serve` load; the load average is recorded before and
# after every run, and `openssl speed` AES-GCM (the cipher gRPC's TLS 1.3
# negotiates) as the machine's limit for the encryption itself.
# Usage: security_mtls.sh OUT_DIR [ROUNDS] [CONFIG] [BENCH ARGS...]
#   CONFIG: a fleet file under configs/ (default sim-1p1d.yaml)
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
bin="${TANDEM_BIN:-$root/build/tandem}"
out="$(mkdir -p "${1:?OUT_DIR}" && cd "$1" && pwd)"; rounds="${2:-3}"; config="${3:-sim-1p1d.yaml}"
shift $(( $# < 3 ? $# : 3 ))
bench_args=("$@")
if [ ${#bench_args[@]} -eq 0 ]; then
  bench_args=(--input-len uniform:256:1024 --output-len uniform:64:128 --request-rate 8
              --num-requests 200)
fi
name="${config%.yaml}"
for mode in auto off; do
  # Next to the original (its relative paths hold); configs/.run-*.yaml is git-ignored.
  f="$root/configs/.run-mtls-$name-$mode.yaml"
  sed -e 's/^\(  \(grpc\|http\|metrics\)\): 127\.0\.0\.1:[0-9]*$/\1: 127.0.0.1:0/' \
      -e 's/level: info/level: warn/' "$root/configs/$config" > "$f"
  printf "security:\n  internal_tls: %s\n" "$mode" >> "$f"
done
openssl speed -seconds 2 -evp aes-128-gcm 2>/dev/null | tail -2 > "$out/openssl_speed.txt"
nproc > "$out/nproc.txt"
for r in $(seq 1 "$rounds"); do
  for mode in auto off; do
    state="$out/state-$mode-$r.json"; rm -f "$state"
    "$bin" launch "$root/configs/.run-mtls-$name-$mode.yaml" --state-file "$state" \
      > "$out/launch-$mode-$r.log" 2>&1 &
    launcher=$!
    for _ in $(seq 1 240); do [ -f "$state" ] && break; sleep 0.5; done
    [ -f "$state" ] || { echo "fleet did not start: $out/launch-$mode-$r.log" >&2; kill "$launcher"; exit 1; }
    echo "round $r internal_tls $mode: before load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/load.txt"
    "$bin" bench serve --state-file "$state" "${bench_args[@]}" --ignore-eos --seed 0 --no-progress \
      --label "$name internal_tls $mode round $r" --json "$out/serve-$mode-$r.json" \
      > "$out/serve-$mode-$r.txt"
    echo "round $r internal_tls $mode: after load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/load.txt"
    kill -TERM "$launcher"; wait "$launcher" || true
  done
done
rm -f "$root"/configs/.run-mtls-"$name"-*.yaml
