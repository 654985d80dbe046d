#!/usr/bin/env bash
# Configures and builds tandem (release preset: build/, binary build/tandem).
# Uses ccache when present; CI=true turns warnings into errors (the preset's
# default anyway) and prints timings.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${TANDEM_BUILD_JOBS:-$(nproc)}
# ccache keys on paths relative to the checkout, so a clone elsewhere hits too.
export CCACHE_BASEDIR="$PWD"
cmake --preset release -DTANDEM_BUILD_TESTS=${TANDEM_BUILD_TESTS:-ON} >/dev/null
cmake --build --preset release -j "$jobs"
