#!/usr/bin/env bash
# Configures and builds tandem (release preset: build/, binary build/tandem).
# Uses ccache when present; CI=true turns warnings into errors (the preset's
# default anyway) and prints timings. TANDEM_BUILD_TARGETS="a b" builds only
# those targets (tests/gpu/device_check.sh builds what it runs).
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${TANDEM_BUILD_JOBS:-$(nproc)}
# ccache keys on paths relative to the checkout, so a clone elsewhere hits too.
export CCACHE_BASEDIR="$PWD"
cmake --preset release -DTANDEM_BUILD_TESTS="${TANDEM_BUILD_TESTS:-ON}" >/dev/null
# shellcheck disable=SC2086  # a space-separated target list, split on purpose
cmake --build --preset release -j "$jobs" ${TANDEM_BUILD_TARGETS:+--target $TANDEM_BUILD_TARGETS}
