#!/usr/bin/env bash
# The libFuzzer targets of tests/fuzz (docs/security.md, "Fuzzing").
#   tools/fuzz.sh ci                  build (preset `fuzz`, build-fuzz/) and run ctest -L fuzz:
#                                     each target TANDEM_FUZZ_RUNS (2000) executions over its seeds
#   tools/fuzz.sh long TARGET RUNS    one long run (e.g. 1000000) of fuzz_TARGET; findings and
#                                     the grown corpus go to build-fuzz/long/TARGET
#                                     (h2_server, http_server: configured and built first;
#                                     not in `ci`)
#   tools/fuzz.sh seeds               rewrites tests/fuzz/corpus/* from the repository's fixtures
#   tools/fuzz.sh run BIN SEEDS RUNS  (what ctest calls) BIN over a scratch copy of SEEDS
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
targets=(safetensors tokenizer config request http_request kv_notice descriptor grpc_request h2_client
  worker_frames tls_records api_key)

need_clang() {
  if ! command -v clang++-14 >/dev/null 2>&1; then
    echo "fuzz.sh: clang++-14 not found; install clang-14 and libclang-rt-14-dev (tools/install_deps.sh)" >&2
    exit 1
  fi
}

build() {
  need_clang
  export CCACHE_BASEDIR="$root"
  cmake --preset fuzz >/dev/null
  cmake --build --preset fuzz -j "${TANDEM_BUILD_JOBS:-$(nproc)}"
}

case "${1:-}" in
  run)
    bin=$2 seeds=$3 runs=$4
    scratch=$(mktemp -d)
    trap 'rm -rf "$scratch"' EXIT
    # New inputs go to the first folder (scratch); the seeds stay as committed.
    # UCX (linked for the KV formats) must not install its own crash handler.
    export UCX_HANDLE_ERRORS=none
    "$bin" -runs="$runs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 "$scratch" "$seeds"
    ;;
  ci)
    build
    ctest --test-dir build-fuzz -L fuzz -j 2 --output-on-failure
    ;;
  long)
    target=$2 runs=$3
    if [[ $target == h2_server || $target == http_server ]]; then
      # Not in CI's fuzz build (tests/fuzz/CMakeLists.txt): configure it in.
      need_clang
      export CCACHE_BASEDIR="$root"
      cmake --preset fuzz -DTANDEM_FUZZ_SERVER=ON >/dev/null
      cmake --build --preset fuzz -j "${TANDEM_BUILD_JOBS:-$(nproc)}" --target "fuzz_$target"
    fi
    out="$root/build-fuzz/long/$target"
    mkdir -p "$out/corpus" "$out/artifacts"
    cd "$out"
    export UCX_HANDLE_ERRORS=none
    dict=()
    # A target's dictionary, when it has one (tests/fuzz/dict/).
    if [[ -f $root/tests/fuzz/dict/$target.dict ]]; then dict=(-dict="$root/tests/fuzz/dict/$target.dict"); fi
    "$root/build-fuzz/tests/fuzz/fuzz_$target" "${dict[@]}" -runs="$runs" -max_total_time="${TANDEM_FUZZ_MAX_SECONDS:-0}" -timeout=10 -rss_limit_mb=2048 \
      -print_final_stats=1 -artifact_prefix="$out/artifacts/" \
      corpus "$root/tests/fuzz/corpus/$target"
    ;;
  seeds)
    c="$root/tests/fuzz/corpus"
    mkdir -p "${targets[@]/#/$c/}" "$c/h2_server" "$c/http_server"
    fx="$root/tests/fixtures/model"
    for f in "$fx"/models/*/*.safetensors; do
      cp "$f" "$c/safetensors/$(basename "$(dirname "$f")")_$(basename "$f")"
    done
    for f in "$fx"/tokenizers/*/tokenizer.json; do
      cp "$f" "$c/tokenizer/$(basename "$(dirname "$f")").json"
    done
    for f in "$root"/configs/*.yaml; do cp "$f" "$c/config/"; done
    UCX_HANDLE_ERRORS=none "$root/build-fuzz/tests/fuzz/fuzz_make_seeds" "$c/kv_notice" "$c/descriptor"
    UCX_HANDLE_ERRORS=none "$root/build-fuzz/tests/fuzz/fuzz_make_seeds" --wire "$c"
    ;;
  *)
    echo "usage: tools/fuzz.sh ci | long TARGET RUNS | seeds | run BIN SEEDS RUNS" >&2
    exit 2
    ;;
esac
