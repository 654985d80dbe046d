#!/usr/bin/env bash
# The unit tests under ThreadSanitizer (preset `tsan`, build-tsan/): builds
# every unit-labelled test binary (target unit_tests) and the tandem binary,
# then runs ctest -L unit there. Extra arguments go to ctest (e.g. -R FrameConn).
# A data-race report does not stop the test (halt_on_error=0) but makes its
# binary exit 66 at the end, so the test fails with every report printed.
#   TANDEM_BUILD_JOBS    parallel compile and test jobs (default: nproc)
#   TANDEM_TSAN_TARGETS  build only these targets (default: unit_tests tandem)
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${TANDEM_BUILD_JOBS:-$(nproc)}
export CCACHE_BASEDIR="$PWD"
# Objects built with -g hash their build directory unless told not to, so a
# second worktree or clone would rebuild every sanitizer object.
export CCACHE_NOHASHDIR=true
cmake --preset tsan >/dev/null
# shellcheck disable=SC2086  # a space-separated target list, split on purpose
cmake --build --preset tsan -j "$jobs" --target ${TANDEM_TSAN_TARGETS:-unit_tests tandem}
# gRPC, protobuf, UCX and OpenSSL are not instrumented: the suppressions file
# names the library frames whose own synchronisation TSan cannot see, each
# with the reason.
export TSAN_OPTIONS="halt_on_error=0:second_deadlock_stack=1:suppressions=$PWD/tools/sanitizers/tsan.supp"
# UCX (linked for the KV transports) must not install its own crash handler,
# nor patch mmap/madvise (its memory hooks): glibc's madvise of an exiting
# thread's stack then runs UCX's hook, whose rwlock TSan intercepts after it
# has let go of the thread (SEGV in __tsan::MutexPreReadLock under
# ucm_madvise, worker_unit_test's first case). The hooks only keep UCX's
# registration cache fresh; the tests' transports work without them.
export UCX_HANDLE_ERRORS=none UCX_MEM_MMAP_HOOK_MODE=none
ctest --test-dir build-tsan -L unit -j "$jobs" --output-on-failure "$@"
