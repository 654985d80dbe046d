#!/usr/bin/env bash
# Installs what a fresh Debian 12 machine lacks to build and test tandem.
# Idempotent: packages already present are not fetched again, and
# `apt-get update` runs at most once (only when something is missing).
# Runs as root; uses sudo only if it is not root and sudo exists.
set -euo pipefail

PACKAGES=(
  build-essential cmake pkg-config ccache git python3 python3-venv
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler python3-grpcio
  libucx-dev ucx-utils
  libspdlog-dev libfmt-dev libyaml-cpp-dev prometheus-cpp-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  nlohmann-json3-dev libcli11-dev libboost-dev
  libopenblas-dev libpcre2-dev libxxhash-dev libssl-dev
  libnghttp2-dev  # the proxy's native HTTP/2 gRPC front end (docs/grpc-frontend.md)
  curl procps
  clang-14 libclang-rt-14-dev  # libFuzzer targets (tests/fuzz, tools/fuzz.sh)
  iproute2  # ip, tc: the chaos suite's loopback delay/loss (tests/chaos)
  systemd  # systemd-analyze: the shipped unit's check (tests/deploy/systemd_unit_test.sh)
)

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
    echo "install_deps.sh: run as root (or install sudo)" >&2; exit 1
  fi
fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -gt 0 ]; then
  echo "install_deps.sh: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "install_deps.sh: all build dependencies present"
fi
