#!/usr/bin/env bash
# The bundle that carries a build to a GPU machine without a package
# registry (tools/device_bundle.sh; docs/cuda.md, "The device check") works
# away from this build: packed from BUILD_DIR, its recorded checkout made a
# path that does not exist (as the development checkout does not on the
# device), unpacked into another checkout, then
#   - the unpack links the recorded checkout to the new one and resolves
#     every binary's libraries (it fails naming any that do not);
#   - the wrappers run their binaries (`tandem version`), and every library
#     loaded comes from the bundle except glibc's, libstdc++/libgcc_s and
#     the target's NCCL (LD_DEBUG=libs);
#   - `tandem bench kvtransfer --memory host` through the wrapper (its peer
#     started as /proc/self/exe, i.e. the .bin with the wrapper's
#     environment) moves KV over the bundled UCX and verifies the data.
# What needs a GPU is the device check itself.
#
#   tests/gpu/device_bundle_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src="$1"
build="$2"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

bash "$src/tools/device_bundle.sh" "$build" "$tmp/bundle.tar.gz"

# The recorded checkout becomes a path that does not exist here.
mkdir "$tmp/repack"
tar -C "$tmp/repack" -xzf "$tmp/bundle.tar.gz"
python3 - "$tmp/repack/bundle.json" "$tmp/orig-root" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
d["root"] = sys.argv[2]
json.dump(d, open(sys.argv[1], "w"))
EOF
tar -C "$tmp/repack" -czf "$tmp/bundle2.tar.gz" .

co="$tmp/checkout"
mkdir -p "$co/tools"
cp "$src/tools/device_bundle.sh" "$co/tools/"
bash "$co/tools/device_bundle.sh" --unpack "$tmp/bundle2.tar.gz" > "$tmp/unpack.log" 2>&1 \
  || { cat "$tmp/unpack.log"; fail "unpack exited $?"; }
cat "$tmp/unpack.log"
[ "$(readlink "$tmp/orig-root")" = "$co" ] || fail "the recorded checkout is not linked to the new one"
grep -q "linked $tmp/orig-root -> $co" "$tmp/unpack.log" || fail "the unpack did not say it linked"

for b in tandem tests/unit/kernels/kernels_cuda_test tests/gpu/cuda_tp_forward_test bench/kernels/bench_cuda_engine; do
  if [ ! -x "$co/build/$b" ] || [ ! -x "$co/build/$b.bin" ]; then fail "$b: wrapper or binary missing"; fi
done

version="$("$co/build/tandem" version)" || fail "tandem version through the wrapper exited $?"
echo "$version"
grep -q '^cuda kernels: compiled' <<< "$version" || fail "tandem version does not say its CUDA kernels are compiled"

# Where each loaded library came from.
LD_DEBUG=libs "$co/build/tandem" version > /dev/null 2> "$tmp/ld.log" || true
loaded="$(sed -n 's/.*calling init: //p' "$tmp/ld.log" | sort -u)"
[ -n "$loaded" ] || fail "LD_DEBUG showed no library loads"
outside="$(grep -v "^$co/build/device-lib/" <<< "$loaded" \
  | grep -v -E '/(ld-linux-x86-64\.so\.2|libc\.so\.6|libm\.so\.6|libdl\.so\.2|librt\.so\.1|libpthread\.so\.0|libstdc\+\+\.so\.6|libgcc_s\.so\.1|libnccl\.so\.2)$' || true)"
[ -z "$outside" ] || fail "libraries loaded from outside the bundle: $outside"
grep -q "^$co/build/device-lib/libgrpc++" <<< "$loaded" || fail "gRPC was not loaded from the bundle"
grep -q "^$co/build/device-lib/libucp" <<< "$loaded" || fail "UCX was not loaded from the bundle"

out="$("$co/build/tandem" bench kvtransfer --json --memory host --block-bytes 65536 --blocks 8 \
  --requests 4 --warmup 1 --concurrency 1 --timeout 60 2> "$tmp/kv.err")" \
  || { cat "$tmp/kv.err"; fail "bench kvtransfer through the wrapper exited $?"; }
python3 - "$out" <<'EOF'
import json, sys
line = [l for l in sys.argv[1].splitlines() if l.startswith("{")][-1]
d = json.loads(line)
assert d["memory"] == "host" and d["backend"] == "ucx", d
assert d["data_verified"] is True, d
assert d["bandwidth_bytes_per_s"] > 0, d
print("kvtransfer through the bundle:", d["bandwidth_bytes_per_s"] / 1e9, "GB/s, data verified")
EOF
echo "device bundle: ok"
