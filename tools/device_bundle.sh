#!/usr/bin/env bash
# Packs what tests/gpu/device_check.sh runs, from a build made here, for a
# GPU machine that has the NVIDIA driver and CUDA's large libraries (cuBLASLt,
# NCCL) but none of the project's Debian packages and no package registry
# (docs/cuda.md, "The device check").
#
#   tools/device_bundle.sh [BUILD_DIR] [OUT.tar.gz]      (here: pack)
#     BUILD_DIR  default build/ (tools/build.sh's, with the CUDA targets)
#     OUT        default .devbundle/bundle.tar.gz
#   tools/device_bundle.sh --unpack BUNDLE.tar.gz        (on the GPU machine)
#     unpacks into build/ of this checkout (see "Unpack" below)
#
# The bundle holds: the check's binaries (stripped) at their paths under the
# build directory, every CTest file of that build (ctest -L gpu runs from it),
# and lib/: each shared library those binaries and UCX's shared-memory module
# load from this machine, except glibc's own (the target's is used, and must
# be as new: glibc is backward compatible), the driver (libcuda), cuBLAS and
# NCCL (hundreds of MB; the target's CUDA 13 installation provides them).
# libstdc++ and libgcc_s go to lib/fallback/, used only where the target's
# are older than this machine's. bundle.json records the build's absolute
# path: CTest files and compiled-in fixture paths name it, so the check links
# that path to its checkout on the target.
#
# Each binary X is stored as X.bin with a small X beside it that sources
# build/device-env.sh (written at unpack: lib/ and the target's CUDA library
# folders on LD_LIBRARY_PATH) and execs X.bin: ctest, fleet_check.py and the
# launcher's children (the same environment, /proc/self/exe) all reach the
# bundled libraries, and nothing else the target runs (its python, cmake)
# loads them.
#
# DEVICE_CHECK_BUNDLE=OUT.tar.gz tests/gpu/device_check.sh unpacks and runs it.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"

# ---- Unpack (on the GPU machine) ----
# build/ of this checkout receives the binaries, CTest files and lib/ (as
# build/device-lib/); the build's recorded root is linked to this checkout
# when it is another path (CTest files and compiled-in fixture paths name
# it); the target's libnccl.so.2 and libcublasLt.so.13 are looked up in its
# CUDA folders and Python's nvidia-* packages; then every binary's libraries
# must resolve, or the unpack fails naming what is missing.
if [ "${1:-}" = --unpack ]; then
  BUNDLE="$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"
  B="$ROOT/build"
  if [ -e "$B/CMakeCache.txt" ]; then
    echo "device_bundle: $B holds a build of its own (CMakeCache.txt), which the unpack would overwrite; unpack into a checkout without one" >&2
    exit 1
  fi
  mkdir -p "$B/device-lib"
  tmp="$(mktemp -d)"
  tar -C "$tmp" -xzf "$BUNDLE"
  cp -a "$tmp/build/." "$B/"
  cp -a "$tmp/lib/." "$B/device-lib/"
  cp "$tmp/bundle.json" "$B/device-bundle.json"
  rm -rf "$tmp"
  # The build's checkout, build folder and commit, one per line.
  { read -r src_root; read -r build_dir; read -r commit; } < <(python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
print(d["root"], d["build_dir"], d["commit"], sep="\n")' "$B/device-bundle.json")
  if [ "$src_root" != "$ROOT" ]; then
    if [ -e "$src_root" ] && [ "$(cd "$src_root" && pwd -P)" != "$(cd "$ROOT" && pwd -P)" ]; then
      echo "device_bundle: the build's root $src_root exists here and is not this checkout" >&2
      exit 1
    fi
    mkdir -p "$(dirname "$src_root")"
    ln -sfn "$ROOT" "$src_root"
    echo "device_bundle: linked $src_root -> $ROOT"
  fi
  if [ ! -e "$build_dir" ]; then
    mkdir -p "$(dirname "$build_dir")"
    ln -sfn "$B" "$build_dir"
    echo "device_bundle: linked $build_dir -> $B"
  fi
  cuda_dirs=""
  for want in libnccl.so.2 libcublasLt.so.13; do
    found=""
    for d in /usr/local/cuda/lib /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
        /usr/lib/x86_64-linux-gnu $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null | \
          xargs -I{} sh -c 'ls -d {}/nvidia/*/lib 2>/dev/null'); do
      if [ -e "$d/$want" ]; then found="$d"; break; fi
    done
    if [ -z "$found" ]; then
      found="$(find / -xdev -name "$want" -not -path '*/proc/*' -printf '%h\n' -quit 2>/dev/null)"
    fi
    if [ -z "$found" ]; then
      echo "device_bundle: $want is not on this machine (CUDA 13's NCCL and cuBLAS are needed)" >&2
      exit 1
    fi
    echo "device_bundle: $want in $found"
    case ":$cuda_dirs:" in *":$found:"*) ;; *) cuda_dirs="${cuda_dirs:+$cuda_dirs:}$found" ;; esac
  done
  libs="$B/device-lib"
  # awk reads to the end: an early exit would end ldconfig by SIGPIPE, which
  # pipefail turns into this script's failure.
  sys_cxx="$(ldconfig -p 2>/dev/null | awk '!f && /libstdc\+\+\.so\.6 .*x86-64/ { print $NF; f = 1 }')"
  if [ -z "$sys_cxx" ] || ! grep -qa "GLIBCXX_3.4.30" "$sys_cxx"; then
    libs="$libs:$B/device-lib/fallback"
    echo "device_bundle: this machine's libstdc++ (${sys_cxx:-none}) is older than the build's; using the bundled one"
  fi
  # shellcheck disable=SC2016  # expanded when the file is sourced
  printf 'export LD_LIBRARY_PATH="%s:%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"\nexport UCX_MODULE_DIR="%s"\n' \
    "$libs" "$cuda_dirs" "$B/device-lib/ucx" > "$B/device-env.sh"
  missing=0
  while read -r bin; do
    # shellcheck disable=SC1091  # written just above
    if (. "$B/device-env.sh" && ldd "$bin" | grep 'not found'); then
      echo "device_bundle: $bin has unresolved libraries (above)" >&2
      missing=1
    fi
  done < <(find "$B" -name '*.bin' -type f)
  echo "device_bundle: unpacked $commit into $B"
  exit "$missing"
fi

BUILD="$(cd "${1:-$ROOT/build}" && pwd)"
OUT="${2:-$ROOT/.devbundle/bundle.tar.gz}"

BINS=(
  tandem
  tests/unit/kernels/kernels_cuda_test
  tests/unit/kernels/engine_cuda_test
  tests/gpu/nccl_communicator_test
  tests/gpu/cuda_tp_forward_test
  bench/kernels/bench_kernels_cuda
  bench/kernels/bench_cuda_engine
)
UCX_MODULES=(/usr/lib/x86_64-linux-gnu/ucx/libuct_cma.so.0)

for b in "${BINS[@]}"; do
  if [ ! -x "$BUILD/$b" ]; then
    echo "device_bundle: $BUILD/$b is not built (tools/build.sh with the CUDA toolkit present builds it)" >&2
    exit 1
  fi
done

STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
mkdir -p "$STAGE/build" "$STAGE/lib/ucx" "$STAGE/lib/fallback"

for b in "${BINS[@]}"; do
  install -D -m 755 "$BUILD/$b" "$STAGE/build/$b.bin"
  strip --strip-unneeded "$STAGE/build/$b.bin"
  up="$(dirname "$b" | sed -e 's|[^/][^/]*|..|g')"  # build/ from the binary's folder
  if [ "$(dirname "$b")" = . ]; then up=.; fi
  # shellcheck disable=SC2016  # expanded when the wrapper runs
  printf '#!/bin/sh\n. "${0%%/*}/%s/device-env.sh"\nexec "$0.bin" "$@"\n' "$up" > "$STAGE/build/$b"
  chmod 755 "$STAGE/build/$b"
done
(cd "$BUILD" && find . \( -name CTestTestfile.cmake -o -name '*_include.cmake' -o -name '*_tests.cmake' \) \
  -print0 | xargs -0 -I{} install -D -m 644 {} "$STAGE/build/{}")

# Libraries the target provides: glibc's, the driver, cuBLAS, NCCL.
provided='^(linux-vdso|ld-linux|libc\.so|libm\.so|libpthread\.so|libdl\.so|librt\.so|libresolv\.so|libutil\.so|libcuda\.so|libnvidia-|libnccl\.so|libcublas)'
declare -A seen=()
add_deps() {
  local name path
  while read -r name path; do
    [ -n "$name" ] || continue
    name="${name##*/}"
    if [[ "$name" =~ $provided ]] || [ -n "${seen[$name]:-}" ]; then continue; fi
    if [ ! -f "$path" ]; then
      echo "device_bundle: $1 needs $name, not found here" >&2
      exit 1
    fi
    seen[$name]=1
    case "$name" in
      libstdc++.so.*|libgcc_s.so.*) cp -L "$path" "$STAGE/lib/fallback/$name" ;;
      *) cp -L "$path" "$STAGE/lib/$name" ;;
    esac
  done < <(ldd "$1" | awk '/=>/ { print $1, $3; next } NF { print $1, $1 }')
}
for b in "${BINS[@]}"; do add_deps "$BUILD/$b"; done
for m in "${UCX_MODULES[@]}"; do
  cp -L "$m" "$STAGE/lib/ucx/"
  add_deps "$m"
done
strip --strip-unneeded "$STAGE"/lib/*.so* "$STAGE"/lib/ucx/*.so* 2>/dev/null || true

# The checkout the build was configured from (its paths are compiled in).
SRC="$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$BUILD/CMakeCache.txt")"
printf '{"build_dir": "%s", "root": "%s", "commit": "%s", "version": "%s", "made": "%s", "host_glibc": "%s"}\n' \
  "$BUILD" "$SRC" "$(git -C "$SRC" rev-parse HEAD 2>/dev/null || echo unknown)" \
  "$("$BUILD/tandem" version 2>/dev/null | sed -n 's/^git revision: //p')" \
  "$(date -u +%FT%TZ)" "$(ldd --version | awk 'NR == 1 {print $NF}')" > "$STAGE/bundle.json"

mkdir -p "$(dirname "$OUT")"
tar -C "$STAGE" -cf - . | gzip -9 > "$OUT"
echo "device_bundle: $OUT ($(du -h "$OUT" | cut -f1); $(find "$STAGE/lib" -maxdepth 1 -type f | wc -l) libraries in lib/)"
