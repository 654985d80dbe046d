#!/usr/bin/env bash
# The unit tests under AddressSanitizer + UBSan (preset `asan`, build-asan/):
# builds every unit-labelled test binary (target unit_tests) and the tandem
# binary, then runs ctest -L unit there. Extra arguments go to ctest
# (e.g. -R FrameConn). A sanitizer report fails the test that made it.
#   TANDEM_BUILD_JOBS  parallel compile and test jobs (default: nproc)
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${TANDEM_BUILD_JOBS:-$(nproc)}
export CCACHE_BASEDIR="$PWD"
# Objects built with -g hash their build directory unless told not to, so a
# second worktree or clone would rebuild every sanitizer object.
export CCACHE_NOHASHDIR=true
cmake --preset asan -DTANDEM_BUILD_TESTS=ON >/dev/null
cmake --build --preset asan -j "$jobs" --target unit_tests tandem
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# Third-party leaks, each named in the file (c-ares's 'localhost' lookup).
export LSAN_OPTIONS="suppressions=$PWD/tools/sanitizers/lsan.supp:print_suppressions=0"
# UCX (linked for the KV transports) must not install its own crash handler.
export UCX_HANDLE_ERRORS=none
ctest --test-dir build-asan -L unit -j "$jobs" --output-on-failure "$@"
