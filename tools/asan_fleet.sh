#!/usr/bin/env bash
# The tests that start real processes (every ctest label but unit:
# integration, chaos, deploy) under AddressSanitizer + UBSan (preset `asan`,
# build-asan/): builds the tandem binary and those test binaries (target
# fleet_tests), runs those labels' tests there, then lists every sanitizer report
# and fails if there is one. Extra arguments go to ctest (e.g. -R FleetTest,
# -L chaos).
#
# The fleets' processes (tandem launch, its workers, ranks) are the ASan
# tandem of build-asan/ (the tests run TANDEM_BINARY_DIR/tandem) and inherit
# this environment. Their reports would go to a log file that no test reads,
# so every process (tests too) writes its report to a file of its own,
# REPORTS/san.<exe>.<pid>; a process killed with SIGKILL writes none.
#   TANDEM_BUILD_JOBS    parallel compile jobs (default: nproc); tests run one at a time
#   TANDEM_ASAN_REPORTS  the reports' directory (default /tmp/tandem-asan-fleet), emptied first
#   TANDEM_ASAN_NO_BUILD=1  runs what build-asan/ holds
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${TANDEM_BUILD_JOBS:-$(nproc)}
reports=${TANDEM_ASAN_REPORTS:-/tmp/tandem-asan-fleet}
export CCACHE_BASEDIR="$PWD"
# Objects built with -g hash their build directory unless told not to (see
# tools/asan_unit.sh): the unit run's objects are reused.
export CCACHE_NOHASHDIR=true
if [ "${TANDEM_ASAN_NO_BUILD:-0}" != 1 ]; then
  cmake --preset asan -DTANDEM_BUILD_TESTS=ON >/dev/null
  cmake --build --preset asan -j "$jobs" --target fleet_tests
fi
rm -rf "$reports"
mkdir -p "$reports"
# log_path in both: UBSan reads its own variable for the flags the two share.
san="log_path=$reports/san:log_exe_name=1"
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:$san"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:$san"
# Third-party leaks only, each explained in the file.
export LSAN_OPTIONS="suppressions=$PWD/tools/sanitizers/lsan.supp:print_suppressions=0"
# UCX (linked for the KV transports) must not install its own crash handler.
export UCX_HANDLE_ERRORS=none
rc=0
# One test at a time: fleets under ASan are slow, and several at once on a
# small machine turn the tests' bounded waits into failures.
# By label, not -LE unit: a unit binary that build-asan/ lacks stands in ctest
# as an unlabelled <target>_NOT_BUILT test that would fail here.
ctest --test-dir build-asan -L '^(integration|chaos|deploy)$' -j 1 --output-on-failure "$@" || rc=$?
found=$(find "$reports" -type f | sort)
if [ -n "$found" ]; then
  echo "sanitizer reports ($(echo "$found" | wc -l)) in $reports:"
  for f in $found; do
    echo "=== $f"
    head -n 60 "$f"
  done
  exit 1
fi
echo "no sanitizer report in $reports"
exit "$rc"
