#!/usr/bin/env bash
# Creates (once) a virtual environment under the build dir with the packages
# the Python tests need (HTTP API, deploy; the tracing test's OTLP receiver:
# grpcio + opentelemetry-proto), then runs the given command in it.
# Usage: venv.sh VENV_DIR -- COMMAND...
set -euo pipefail
venv="$1"; shift
[ "$1" = "--" ] && shift
# kubernetes-validate: tests/deploy (the Kubernetes manifests' schema check).
# grpcio, opentelemetry-proto: tests/integration/tracing (the OTLP receiver).
pkgs="openai jinja2 tokenizers kubernetes-validate==1.37.0 grpcio opentelemetry-proto"
stamp="$venv/.tandem-$(echo "$pkgs" | tr ' ' '-')"
# Tests that share the venv may start together (ctest -j): one creates it
# while the others wait on the lock, then find the stamp.
exec 9>"$venv.lock"
flock 9
if [ ! -f "$stamp" ]; then
  rm -rf "$venv"
  python3 -m venv "$venv" || { echo "python3 -m venv failed: install python3-venv (tools/install_deps.sh)"; exit 1; }
  "$venv/bin/pip" install --quiet --disable-pip-version-check $pkgs
  touch "$stamp"
fi
exec 9>&-
exec "$venv/bin/python" "$@"
