#!/usr/bin/env bash
# The main job: a local 1P1D fleet (proxy, 1 prefiller, 1 decoder) on the
# bundled model, CPU backend, in the foreground until Ctrl-C.
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:-configs/1p1d.yaml}
cat <<MSG
Starting the fleet of $config. Once it says it is ready, in another terminal:
  build/tandem generate --prompt "In the beginning" --max-tokens 40
  curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"prompt": "In the beginning", "max_tokens": 40}'
MSG
exec build/tandem launch "$config"
