#!/usr/bin/env bash
# The main job: a local 1P1D fleet (proxy, 1 prefiller, 1 decoder) on the
# bundled model, CPU backend, in the foreground until Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:-configs/1p1d.yaml}
cat <<MSG
Starting the fleet of $config (proxy on 127.0.0.1:50051). Once it prints
its table, send a request from another terminal:
  build/tandem client --prompt "In the beginning God created" --max-tokens 40
The same prompt in one process, no fleet (same tokens, greedy):
  build/tandem generate --prompt "In the beginning God created" --max-tokens 40 --temperature 0
Ctrl-C stops the fleet.
MSG
exec build/tandem launch "$config"
