#!/usr/bin/env python3
"""Builds device_check.json from what tests/gpu/device_check.sh left in its
work folder: each stage's status (NAME.stage.json, NAME.log) and results.
Prints the summary and exits 0 when every stage that was due passed, 1 when
any failed, mismatched, timed out or was skipped, 2 when there was no GPU.

    device_summary.py WORK_DIR SUMMARY_JSON REPO_ROOT
"""
import glob
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

ORDER = ["unpack", "deps", "build", "gpu_tests", "nccl_two_devices", "cuda_tp_two_devices", "fleet_1p1d",
         "memcheck", "kernels", "kvtransfer", "kvtransfer_device", "e2e"]


def last_json_line(path):
    """The last line of a log that parses as a JSON object, or None."""
    try:
        lines = open(path, errors="replace").read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def tail(path, n=15):
    try:
        return open(path, errors="replace").read().splitlines()[-n:]
    except OSError:
        return []


def gpu_tests(work):
    t = {"passed": 0, "failed": 0, "skipped": 0, "failed_names": [], "skipped_names": [],
         "for_machines_without_a_gpu": []}
    try:
        for tc in ET.parse(os.path.join(work, "gpu_tests.xml")).getroot().iter("testcase"):
            st = tc.get("status", "")
            if tc.find("failure") is not None or st == "fail":
                t["failed"] += 1
                t["failed_names"].append(tc.get("name"))
            elif tc.find("skipped") is not None or st in ("notrun", "disabled"):
                out = tc.findtext("system-out") or ""
                if "a CUDA device is present: this test is for machines without one" in out:
                    # Skipped by design where a device exists (its check is
                    # the refusal on machines without one): not a failure.
                    t["for_machines_without_a_gpu"].append(tc.get("name"))
                    continue
                t["skipped"] += 1
                t["skipped_names"].append(tc.get("name"))
            else:
                t["passed"] += 1
    except (OSError, ET.ParseError) as e:
        t["error"] = f"no JUnit results: {e}"
    # On a GPU machine a skip means the device was not usable: a failure.
    t["ok"] = "error" not in t and t["failed"] == 0 and t["skipped"] == 0 and t["passed"] > 0
    return t


def kernels(work):
    k = {}
    try:
        data = json.load(open(os.path.join(work, "bench_kernels_cuda.json")))
    except (OSError, ValueError) as e:
        return {"ok": False, "error": f"no benchmark output: {e}"}
    best, errors = {}, []
    for b in data.get("benchmarks", []):
        if b.get("error_occurred"):
            errors.append(f"{b.get('name')}: {b.get('error_message')}")
            continue
        if b.get("run_type") != "iteration":
            continue
        rate = b.get("bytes_per_second") or b.get("TFLOP/s")
        name = b.get("run_name", b.get("name"))
        if rate is not None and rate > best.get(name, 0):
            best[name] = rate
    copy = next((v for n, v in best.items() if n.startswith("BM_CudaCopy")), None)
    gemm = next((v for n, v in best.items() if n.startswith("BM_CudaGemmBf16")), None)
    if copy:
        k["device_copy_GBps_read_plus_write"] = round(copy / 1e9, 1)
        k["decode_attention"] = {n: {"GBps": round(v / 1e9, 1), "fraction_of_copy": round(v / copy, 3)}
                                 for n, v in best.items() if n.startswith("BM_DecodeAttention")}
    if gemm:
        k["gemm_bf16_TFLOPs"] = round(gemm, 1)
        k["prefill_attention"] = {n: {"TFLOPs": round(v, 1), "fraction_of_gemm": round(v / gemm, 3)}
                                  for n, v in best.items() if n.startswith("BM_PrefillAttention")}
    if errors:
        unique = list(dict.fromkeys(errors))  # repetitions repeat the same error
        k["errors"] = unique[:5] + ([f"... and {len(unique) - 5} more"] if len(unique) > 5 else [])
    k["ok"] = not errors and copy is not None and gemm is not None
    return k


def kvtransfer(work, name, copy_moved_bps, memory):
    r = last_json_line(os.path.join(work, name + ".log"))
    if r is None:
        return {"ok": False, "error": "no JSON result in " + name + ".log"}
    out = {k: r[k] for k in ("memory", "path", "path_detail", "bandwidth_bytes_per_s",
                             "data_verified", "transports", "block_bytes", "blocks", "concurrency",
                             "p50_latency_s", "p99_latency_s", "memcpy_bytes_per_s") if k in r}
    bw = r.get("bandwidth_bytes_per_s")
    if bw and copy_moved_bps:
        out["fraction_of_device_copy"] = round(bw / copy_moved_bps, 4)
    out["ok"] = bool(bw) and r.get("data_verified", False) is True
    if r.get("memory") != memory:
        out["ok"] = False
        out["error"] = f"the bench measured memory {r.get('memory')!r}, not {memory!r}"
    elif memory == "device" and not copy_moved_bps:
        out["ok"] = False
        out["error"] = "no device copy bandwidth (kernels stage) to compare the device path with"
    return out


def e2e(work):
    r = last_json_line(os.path.join(work, "e2e.log"))
    if r is None:
        return {"ok": False, "error": "no JSON result in e2e.log"}
    runs = r.get("runs", [])
    r["ok"] = "error" not in r and len(runs) == 3 and all(x.get("graph_failures", 1) == 0 for x in runs)
    return r


def main():
    work, summary_path, root = sys.argv[1:4]
    s = {"ok": False}
    try:
        s["git"] = subprocess.run(["git", "-C", root, "rev-parse", "--short=12", "HEAD"],
                                  capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    s["gpu"] = (tail(os.path.join(work, "nvidia-smi.txt"), 1) or ["unknown"])[0]
    no_gpu = os.path.join(work, "no_gpu.json")
    if os.path.exists(no_gpu):
        s.update(json.load(open(no_gpu)))
        json.dump(s, open(summary_path, "w"), indent=2)
        print(json.dumps(s, indent=2))
        return 2

    stages = {}
    for path in glob.glob(os.path.join(work, "*.stage.json")):
        st = json.load(open(path))
        stages[st["name"]] = st
    failures = []
    for name in sorted(stages, key=lambda n: ORDER.index(n) if n in ORDER else 99):
        st = stages[name]
        st["ok"] = st.get("rc") == 0
        if st.get("skipped"):
            failures.append(f"{name}: skipped ({st['skipped']})")
        elif st.get("timed_out"):
            failures.append(f"{name}: timed out after {st.get('limit_s')} s")
        elif not st["ok"]:
            failures.append(f"{name}: exit status {st.get('rc')}")
        if not st["ok"]:
            st["log_tail"] = tail(os.path.join(work, name + ".log"))

    if "gpu_tests" in stages:
        s["gpu_tests"] = gpu_tests(work)
        if not s["gpu_tests"]["ok"]:
            failures.append("gpu_tests: {failed} failed, {skipped} skipped, {passed} passed".format(
                **s["gpu_tests"]))
    if "cuda_tp_two_devices" in stages:
        # One line per model: tokens equal, max logit difference TP=2 vs TP=1.
        try:
            lines = open(os.path.join(work, "cuda_tp_two_devices.log"), errors="replace").read()
            s["cuda_tp_two_devices"] = [l for l in lines.splitlines() if "TP=2 vs TP=1" in l]
        except OSError:
            s["cuda_tp_two_devices"] = []
    if "fleet_1p1d" in stages:
        try:
            s["fleet_1p1d"] = json.load(open(os.path.join(work, "fleet", "fleet_check.json")))
        except (OSError, ValueError) as e:
            s["fleet_1p1d"] = {"ok": False, "error": f"no fleet_check.json: {e}"}
        if not s["fleet_1p1d"].get("ok"):
            failures.append("fleet_1p1d: " + s["fleet_1p1d"].get(
                "error", f"{len(s['fleet_1p1d'].get('mismatches', []))} prompts differ from generate"))
    copy_moved = None
    if "kernels" in stages:
        s["kernels"] = kernels(work)
        if s["kernels"].get("device_copy_GBps_read_plus_write"):
            # A copy moves half the traffic it causes: the yardstick for a transfer.
            copy_moved = s["kernels"]["device_copy_GBps_read_plus_write"] * 1e9 / 2
        if not s["kernels"]["ok"]:
            failures.append("kernels: " + "; ".join(s["kernels"].get("errors", [])
                                                    or [s["kernels"].get("error", "no rates")]))
    for name, key, memory in (("kvtransfer", "kvtransfer_host", "host"),
                              ("kvtransfer_device", "kvtransfer_device", "device")):
        if name in stages:
            s[key] = kvtransfer(work, name, copy_moved, memory)
            if not s[key]["ok"]:
                failures.append(f"{name}: " + s[key].get("error", "no verified bandwidth"))
    notes = []
    if "e2e" in stages:
        s["e2e"] = e2e(work)
        if not s["e2e"]["ok"]:
            failures.append("e2e: " + str(s["e2e"].get("error", "runs missing or graph captures failed")))

    s["stages"] = stages
    s["total_seconds"] = sum(st.get("seconds", 0) for st in stages.values())
    s["failures"] = failures
    s["notes"] = notes
    s["ok"] = bool(stages) and not failures
    json.dump(s, open(summary_path, "w"), indent=2)
    print(json.dumps(s, indent=2))
    return 0 if s["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
