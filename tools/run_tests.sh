#!/usr/bin/env bash
# Runs every test (unit + integration; gpu tests skip without a device), then
# — on a full run (no arguments) — builds the libFuzzer targets with clang
# (build-fuzz/) and runs each briefly (ctest label `fuzz`, tools/fuzz.sh ci).
set -euo pipefail
cd "$(dirname "$0")/.."
ctest --preset release --output-on-failure "$@"
if [ $# -eq 0 ]; then
  bash tools/fuzz.sh ci
else
  echo "run_tests.sh: arguments given, so the fuzz targets were not run (tools/fuzz.sh ci runs them)"
fi
