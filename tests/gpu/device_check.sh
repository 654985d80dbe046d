#!/usr/bin/env bash
# The one GPU check (docs/cuda.md): on a machine with one CUDA device it
# builds what it needs with the project's own scripts and proves the whole
# GPU path in one run, writing a JSON summary.
#
#   tests/gpu/device_check.sh [SUMMARY.json]
#     summary: $OUT/device_check.json when $OUT is set (the device runner),
#     else the argument, else build-device-check/device_check.json.
#     Logs and raw results go to device_check_files/ next to the summary.
#
# Stages, in order (each one's exit status, time and result recorded; a
# failed stage does not stop later ones):
#   deps        tools/install_deps.sh
#   build       tools/build.sh, only the targets below (release preset, build/)
#   gpu_tests   ctest -L gpu: CUDA kernels vs kernels/reference, golden
#               fixtures on the cuda backend, graph vs eager decode bits, the
#               NCCL communicator on one device, the cuda backend's tensor
#               parallel with both ranks on one device (two-device cases
#               excluded)
#   nccl_two_devices
#               only where nvidia-smi lists >= 2 devices: the NCCL
#               communicator across 2 processes on devices 0 and 1
#               (all-reduce bits, all-gather, broadcast, send/recv);
#               with fewer devices the stage is not run and the log says so
#   cuda_tp_two_devices
#               only where nvidia-smi lists >= 2 devices: the cuda backend's
#               tensor parallel, TP = 2 on devices 0 and 1 vs TP = 1 on device
#               0 (greedy tokens equal, the max logit difference printed);
#               with fewer devices the stage is not run and the log says so
#   fleet_1p1d  tests/gpu/fleet_check.py: configs/cuda-1p1d.yaml launched
#               (prefiller and decoder on the same GPU), 16 prompts at once,
#               greedy text == `tandem generate --config` for each
#   memcheck    compute-sanitizer --tool memcheck (where the toolkit has it)
#               over the kernels' own tests and one whole model's decode
#               (tandem-kjv's golden test, CUDA graphs on); any error fails
#   kernels     bench_kernels_cuda: device copy (D2D) bandwidth, cuBLASLt bf16
#               GEMM rate, decode attention bandwidth, prefill attention TFLOP/s
#   kvtransfer  tandem bench kvtransfer --memory host: the host-memory UCX path
#   kvtransfer_device
#               tandem bench kvtransfer --memory device: device pool to device
#               pool through the path a cuda worker takes (direct UCX or
#               staged, as `tandem version` reports), vs the device copy
#   e2e         tools/make_random_model.py (Llama-3-8B shape, random bf16,
#               written to $TMPDIR during the build, deleted at exit) loaded by
#               bench_cuda_engine: prefill/decode tokens/s per mode
# Exit: 0 when every stage passed; 1 when any failed or mismatched; 2 when
# there is no GPU (nothing built or measured; the summary says so).
#
# Time: 69 s on one H100 with 16 cores from a bundle (below; 2026-12-06,
# bench/results/gpu_device_check.md); a build there adds ~4-5 min (an
# estimate: no device with a package registry has run it).
# DEVICE_CHECK_BUDGET_S (default 470) caps the whole run: a stage gets at
# most what is left, and stages with no time left are recorded as skipped
# (which fails the run). A rerun on the same machine finds build/ warm.
#
# Where the GPU machine has no package registry (the device machines lent
# here: no apt, so no gRPC, UCX, ... to build with), build here and pack:
#   tools/device_bundle.sh build .devbundle/bundle.tar.gz
# and run with DEVICE_CHECK_BUNDLE=.devbundle/bundle.tar.gz: stage `unpack`
# (tools/device_bundle.sh --unpack) replaces deps and build.
#
# Environment: DEVICE_CHECK_FORCE=1 runs the stages even when no GPU is
# seen (to test this script); DEVICE_CHECK_SKIP_BUILD=1 skips deps and
# build (use an existing build/); DEVICE_CHECK_STAGES="gpu_tests kernels"
# runs only those stages; DEVICE_CHECK_MODEL_ARGS="--layers 2 ..." makes
# the e2e model smaller (tools/make_random_model.py flags).
set -u
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
if [ -n "${OUT:-}" ]; then
  SUMMARY="$OUT/device_check.json"
else
  SUMMARY="${1:-$ROOT/build-device-check/device_check.json}"
fi
mkdir -p "$(dirname "$SUMMARY")"
SUMMARY="$(cd "$(dirname "$SUMMARY")" && pwd)/$(basename "$SUMMARY")"
WORK="$(dirname "$SUMMARY")/device_check_files"
rm -rf "$WORK"
mkdir -p "$WORK"
BUILD="$ROOT/build"
BUDGET="${DEVICE_CHECK_BUDGET_S:-470}"
STAGES="${DEVICE_CHECK_STAGES:-unpack deps build gpu_tests nccl_two_devices cuda_tp_two_devices fleet_1p1d memcheck kernels kvtransfer kvtransfer_device e2e}"
# Never under $OUT (whatever is there is shipped back): 16 GB.
MODEL_DIR="${TMPDIR:-/tmp}/tandem-device-check-model.$$"
T0=$(date +%s)

log() { echo "[device_check $(( $(date +%s) - T0 ))s] $*" >&2; }
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
wanted() { case " $STAGES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
summarize() {
  python3 "$ROOT/tests/gpu/device_summary.py" "$WORK" "$SUMMARY" "$ROOT"
}

# stage NAME MAX_SECONDS CMD... : runs CMD under a timeout of at most what
# is left of the budget (minus 15 s for the summary), output in NAME.log,
# status in NAME.stage.json.
stage() {
  local name="$1" max="$2"
  shift 2
  wanted "$name" || return 0
  local budget_left=$(( $(left) - 15 ))
  local limit=$(( max < budget_left ? max : budget_left ))
  if [ "$limit" -lt 10 ]; then
    log "$name: skipped, ${budget_left}s of the budget left"
    printf '{"name": "%s", "rc": null, "seconds": 0, "skipped": "no time left in the %ss budget"}\n' \
      "$name" "$BUDGET" > "$WORK/$name.stage.json"
    return 0
  fi
  log "$name (limit ${limit}s)"
  local t rc
  t=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$WORK/$name.log" 2>&1
  rc=$?
  local timed_out=false
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then timed_out=true; fi
  printf '{"name": "%s", "rc": %d, "seconds": %d, "limit_s": %d, "timed_out": %s}\n' \
    "$name" "$rc" $(( $(date +%s) - t )) "$limit" "$timed_out" > "$WORK/$name.stage.json"
  log "$name: exit $rc"
}

# ---- is there a GPU at all? ----
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 \
    || echo "nvidia-smi failed or is absent"; } > "$WORK/nvidia-smi.txt"
gpu_seen=false
if nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then gpu_seen=true; fi
if [ "$gpu_seen" = false ] && ls /dev/nvidia[0-9]* >/dev/null 2>&1; then gpu_seen=true; fi
if [ "$gpu_seen" = false ] && [ "${DEVICE_CHECK_FORCE:-0}" != 1 ]; then
  msg="no GPU on this machine: nvidia-smi lists no device and there is no /dev/nvidia0; nothing was built or measured"
  echo "device_check: $msg" >&2
  printf '{"no_gpu": true, "reason": "%s"}\n' "$msg" > "$WORK/no_gpu.json"
  summarize > /dev/null
  exit 2
fi

# ---- build (the random model is written meanwhile: disk-bound, one core) ----
model_pid=""
cleanup() {
  if [ -n "$model_pid" ] && kill -0 "$model_pid" 2>/dev/null; then kill "$model_pid"; fi
  rm -rf "$MODEL_DIR"
}
trap cleanup EXIT
if wanted e2e; then
  # DEVICE_CHECK_MODEL_ARGS: shape flags for a smaller model (script tests).
  # shellcheck disable=SC2086  # a flag list, split on purpose
  python3 "$ROOT/tools/make_random_model.py" "$MODEL_DIR" ${DEVICE_CHECK_MODEL_ARGS:-} \
    > "$WORK/make_random_model.log" 2>&1 &
  model_pid=$!
fi
if [ -n "${DEVICE_CHECK_BUNDLE:-}" ]; then
  # A build made elsewhere (tools/device_bundle.sh): a machine with no
  # package registry cannot run install_deps.sh.
  stage unpack 90 bash "$ROOT/tools/device_bundle.sh" --unpack "$DEVICE_CHECK_BUNDLE"
elif [ "${DEVICE_CHECK_SKIP_BUILD:-0}" != 1 ]; then
  stage deps 150 bash "$ROOT/tools/install_deps.sh"
  stage build 360 env TANDEM_BUILD_TARGETS="tandem kernels_cuda_test engine_cuda_test nccl_communicator_test cuda_tp_forward_test bench_kernels_cuda bench_cuda_engine" \
    bash "$ROOT/tools/build.sh"
fi

# ---- correctness ----
# The gpu tests' references run on the CPU: several test processes at once.
stage gpu_tests 170 ctest --test-dir "$BUILD" -L gpu -E 'NcclCommunicatorTwoDevices|CudaTpTwoDevices' \
  -j "$(nproc)" --timeout 150 --output-on-failure --output-junit "$WORK/gpu_tests.xml"
# The NCCL communicator across two processes needs two devices (a skip in
# gpu_tests would count as a failure on a one-device machine).
gpu_count=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
if [ "${gpu_count:-0}" -ge 2 ]; then
  stage nccl_two_devices 90 "$BUILD/tests/gpu/nccl_communicator_test" \
    --gtest_filter='NcclCommunicatorTwoDevices.*'
elif wanted nccl_two_devices; then
  log "nccl_two_devices: not run, ${gpu_count:-0} device(s) listed and it needs 2"
fi
# TP = 2 on the cuda backend (two rank processes, devices 0 and 1).
if [ "${gpu_count:-0}" -ge 2 ]; then
  stage cuda_tp_two_devices 120 "$BUILD/tests/gpu/cuda_tp_forward_test" \
    --gtest_filter='*CudaTpTwoDevices.*'
elif wanted cuda_tp_two_devices; then
  log "cuda_tp_two_devices: not run, ${gpu_count:-0} device(s) listed and it needs 2"
fi
# Both workers of the fleet (and the reference processes) on the same GPU.
stage fleet_1p1d 150 env CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}" \
  python3 "$ROOT/tests/gpu/fleet_check.py" --tandem "$BUILD/tandem" \
  --config "$ROOT/configs/cuda-1p1d.yaml" --out "$WORK/fleet" --prompts 16 --max-tokens 32 \
  --timeout 140
# Out-of-bounds and misaligned accesses, leaks, API errors: the kernels'
# tests (but the GEMM shapes' CPU references, slow under the tool) and one
# model end to end. Not every machine's toolkit has the tool.
sanitizer="$(command -v compute-sanitizer || find /usr/local/cuda*/bin -name compute-sanitizer -print -quit 2>/dev/null)"
if [ -n "$sanitizer" ]; then
  # shellcheck disable=SC2016  # the inner script's variables are its own
  stage memcheck 150 bash -c '. "$1/device-env.sh" 2>/dev/null
    s="$2"; b="$1/tests/unit/kernels"
    k=kernels_cuda_test; e=engine_cuda_test
    [ -x "$b/$k.bin" ] && k="$k.bin" && e="$e.bin"
    "$s" --tool memcheck --leak-check full --error-exitcode 99 "$b/$k" \
      --gtest_filter="CudaOps.*:CudaSampling.*:CudaAttentionSmallHeads.*:CudaAttentionInvariance.*:CudaGemm.BatchInvariant*:CudaGemm.LoadsCublasLt*" || exit
    "$s" --tool memcheck --error-exitcode 99 "$b/$e" \
      --gtest_filter="Fixtures/CudaBackendGolden.*/tandem_kjv"' memcheck "$BUILD" "$sanitizer"
elif wanted memcheck; then
  log "memcheck: not run, no compute-sanitizer on this machine"
fi

# ---- speed, each next to its yardstick from the same run ----
stage kernels 120 "$BUILD/bench/kernels/bench_kernels_cuda" --benchmark_repetitions=2 \
  --benchmark_out="$WORK/bench_kernels_cuda.json" --benchmark_out_format=json
# Each bench prints one JSON line last in its log (the summary reads it).
kv_args=(bench kvtransfer --json --block-bytes 2097152 --blocks 64 --requests 40 --warmup 4
         --concurrency 4 --timeout 50)
stage kvtransfer 60 "$BUILD/tandem" "${kv_args[@]}" --memory host
# Device pool to device pool, the cuda worker's path (docs/kvtransfer.md).
stage kvtransfer_device 60 "$BUILD/tandem" "${kv_args[@]}" --memory device
if wanted e2e; then
  if [ -n "$model_pid" ]; then
    log "e2e: waiting for the random model"
    while kill -0 "$model_pid" 2>/dev/null && [ "$(left)" -gt 60 ]; do sleep 1; done
    if kill -0 "$model_pid" 2>/dev/null; then
      kill "$model_pid"
      log "e2e: the random model was not written in time"
    fi
    if ! wait "$model_pid"; then log "make_random_model.py failed or was stopped (see its log)"; fi
    model_pid=""
  fi
  stage e2e 240 "$BUILD/bench/kernels/bench_cuda_engine" --model "$MODEL_DIR" --prompt 1024 \
    --batch 64 --prefill-seqs 4 --steps 12
  rm -rf "$MODEL_DIR"
fi

log "summary: $SUMMARY"
summarize
