#!/usr/bin/env bash
# One-shot GPU check for a machine with a CUDA device. Builds Release with
# only what is needed, runs every ctest test labelled `gpu`, the CUDA kernel
# benchmarks and the end-to-end benchmark, and writes a JSON summary. Sized
# for one H200 in under 8 minutes (build ~2-3 min on 16 cores, gpu tests
# ~2 min, kernel benchmarks ~1 min, end-to-end ~1 min: estimates, not yet
# measured); each step has a timeout so a hang cannot eat the device budget.
#
#   tests/gpu/device_check.sh [OUT_DIR]     (default: $OUT, else build-device-check)
#   DEVICE_CHECK_BUILD=DIR overrides the build folder (default build-device).
#
# Writes OUT_DIR/summary.json, gpu_tests.xml (JUnit), gpu_tests.log,
# bench_kernels_cuda.json, bench_cuda_engine.json (prefill and decode
# tokens/s of a Llama-3-8B-shaped model with random weights), build.log,
# nvidia-smi.txt. Exit status: 0 when the build succeeded and every gpu test
# ran and passed (a skip means no usable device), 1 otherwise; the summary
# is written either way.
set -u
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT_DIR="${1:-${OUT:-$ROOT/build-device-check}}"
BUILD="${DEVICE_CHECK_BUILD:-$ROOT/build-device}"
JOBS="$(nproc 2>/dev/null || echo 4)"
mkdir -p "$OUT_DIR"
t0=$(date +%s)
stamp() { echo "[device_check $(( $(date +%s) - t0 ))s] $*"; }

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv \
  > "$OUT_DIR/nvidia-smi.txt" 2>&1 || echo "nvidia-smi failed" >> "$OUT_DIR/nvidia-smi.txt"

stamp "configure + build ($JOBS jobs)"
build_rc=0
{
  timeout 120 cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DTANDEM_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DTANDEM_BUILD_TESTS=ON -DTANDEM_BUILD_BENCH=ON &&
  timeout 300 cmake --build "$BUILD" -j "$JOBS" --target kernels_cuda_test engine_cuda_test bench_kernels_cuda bench_cuda_engine
} > "$OUT_DIR/build.log" 2>&1 || build_rc=$?
t_build=$(( $(date +%s) - t0 ))

tests_rc=-1
bench_rc=-1
e2e_rc=-1
if [ "$build_rc" -eq 0 ]; then
  stamp "gpu tests"
  # Tests are CPU-bound on their double-precision references: run them in
  # parallel (one device is shared fine by several processes).
  timeout 240 ctest --test-dir "$BUILD" -L gpu -j "$JOBS" --timeout 200 \
    --output-on-failure --output-junit "$OUT_DIR/gpu_tests.xml" > "$OUT_DIR/gpu_tests.log" 2>&1
  tests_rc=$?
  stamp "benchmarks"
  timeout 150 "$BUILD/bench/kernels/bench_kernels_cuda" --benchmark_repetitions=3 \
    --benchmark_report_aggregates_only=false \
    --benchmark_out="$OUT_DIR/bench_kernels_cuda.json" --benchmark_out_format=json \
    > "$OUT_DIR/bench_kernels_cuda.txt" 2>&1
  bench_rc=$?
  stamp "end-to-end (Llama-3-8B shape, random weights)"
  timeout 240 "$BUILD/bench/kernels/bench_cuda_engine" > "$OUT_DIR/bench_cuda_engine.json" \
    2> "$OUT_DIR/bench_cuda_engine.log"
  e2e_rc=$?
fi
t_total=$(( $(date +%s) - t0 ))
stamp "summary"

python3 - "$OUT_DIR" "$build_rc" "$tests_rc" "$bench_rc" "$t_build" "$t_total" "$ROOT" "$e2e_rc" <<'PY'
import json, os, subprocess, sys, xml.etree.ElementTree as ET
out, build_rc, tests_rc, bench_rc, t_build, t_total, root, e2e_rc = sys.argv[1:9]
s = {"build_rc": int(build_rc), "tests_rc": int(tests_rc), "bench_rc": int(bench_rc),
     "e2e_rc": int(e2e_rc),
     "build_seconds": int(t_build), "total_seconds": int(t_total)}
try:
    s["git"] = subprocess.run(["git", "-C", root, "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True).stdout.strip()
except OSError:
    pass
try:
    s["gpu"] = open(os.path.join(out, "nvidia-smi.txt")).read().strip().splitlines()[-1]
except (OSError, IndexError):
    s["gpu"] = "unknown"
tests = {"passed": 0, "failed": 0, "skipped": 0, "failed_names": []}
try:
    for tc in ET.parse(os.path.join(out, "gpu_tests.xml")).getroot().iter("testcase"):
        st = tc.get("status", "")
        if tc.find("failure") is not None or st == "fail":
            tests["failed"] += 1
            tests["failed_names"].append(tc.get("name"))
        elif tc.find("skipped") is not None or st in ("notrun", "disabled"):
            tests["skipped"] += 1
        else:
            tests["passed"] += 1
except (OSError, ET.ParseError) as e:
    tests["error"] = str(e)
s["gpu_tests"] = tests
bench = {}
try:
    data = json.load(open(os.path.join(out, "bench_kernels_cuda.json")))
    best = {}
    for b in data["benchmarks"]:
        if b.get("run_type") != "iteration" or b.get("error_occurred"):
            continue
        name = b["run_name"]
        rate = b.get("bytes_per_second") or b.get("TFLOP/s")
        if rate is not None and rate > best.get(name, 0):
            best[name] = rate
    bench["best_of_repetitions"] = best
    copy = next((v for k, v in best.items() if k.startswith("BM_CudaCopy")), None)
    gemm = next((v for k, v in best.items() if k.startswith("BM_CudaGemmBf16")), None)
    if copy:
        bench["copy_GBps_read_plus_write"] = copy / 1e9
        bench["decode_fraction_of_copy"] = {k: v / copy for k, v in best.items()
                                            if k.startswith("BM_DecodeAttention")}
    if gemm:
        bench["gemm_bf16_TFLOPs"] = gemm
        bench["prefill_fraction_of_gemm"] = {k: v / gemm for k, v in best.items()
                                             if k.startswith("BM_PrefillAttention")}
except (OSError, KeyError, ValueError) as e:
    bench["error"] = str(e)
s["bench"] = bench
try:
    s["end_to_end"] = json.load(open(os.path.join(out, "bench_cuda_engine.json")))
except (OSError, ValueError) as e:
    s["end_to_end"] = {"error": str(e)}
# A skipped gpu test on this machine means the device was not usable.
s["ok"] = (s["build_rc"] == 0 and s["tests_rc"] == 0 and tests.get("failed", 1) == 0
           and tests.get("skipped", 1) == 0 and tests.get("passed", 0) > 0)
json.dump(s, open(os.path.join(out, "summary.json"), "w"), indent=2)
print(json.dumps(s, indent=2))
sys.exit(0 if s["ok"] else 1)
PY
