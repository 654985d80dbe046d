#!/usr/bin/env bash
# Runs every test (unit + integration; gpu tests skip without a device).
set -euo pipefail
cd "$(dirname "$0")/.."
ctest --preset release --output-on-failure "$@"
