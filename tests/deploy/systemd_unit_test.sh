#!/usr/bin/env bash
# deploy/systemd (docs/security.md#systemd): the shipped unit runs as the
# dedicated user `tandem` (declared by the sysusers file), parses, and
# systemd's own hardening audit (`systemd-analyze security`, offline) rates
# its exposure at most 2.5 of 10; the same unit without its hardening
# lines must fail that audit (so the check can fail).
# Usage: systemd_unit_test.sh SOURCE_DIR
set -euo pipefail
src=${1:?usage: systemd_unit_test.sh SOURCE_DIR}
unit=$src/deploy/systemd/tandem.service
users=$src/deploy/systemd/tandem.sysusers.conf
if ! command -v systemd-analyze >/dev/null 2>&1; then
  echo "FAIL: systemd-analyze not found (package systemd; tools/install_deps.sh installs it)" >&2
  exit 1
fi
fail() { echo "FAIL: $*" >&2; exit 1; }
grep -qx 'User=tandem' "$unit" || fail "$unit: no User=tandem"
grep -qx 'Group=tandem' "$unit" || fail "$unit: no Group=tandem"
grep -Eq '^(User|Group)=(root|0)$' "$unit" && fail "$unit runs as root"
grep -Eq '^u tandem ' "$users" || fail "$users does not declare the user tandem"
for opt in NoNewPrivileges=yes ProtectSystem=strict ProtectHome=yes PrivateTmp=yes \
           CapabilityBoundingSet= UMask=0077 RestrictSUIDSGID=yes SystemCallFilter=@system-service; do
  grep -qx "$opt" "$unit" || fail "$unit lacks $opt"
done

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# verify needs an executable ExecStart and an existing working directory.
sed -e 's#/opt/tandem/build/tandem#/bin/true#' -e 's#^WorkingDirectory=.*#WorkingDirectory=/#' \
  "$unit" > "$tmp/tandem.service"
systemd-analyze verify "$tmp/tandem.service" || fail "systemd-analyze verify $unit"
systemd-analyze security --offline=yes --threshold=25 "$tmp/tandem.service" > "$tmp/audit.txt" \
  || { cat "$tmp/audit.txt"; fail "exposure above 2.5 (systemd-analyze security)"; }
grep 'Overall exposure level' "$tmp/audit.txt"
# The same unit without its hardening section must fail the audit.
sed '/^# Hardening/,/^\[Install\]/{/^\[Install\]/!d}' "$tmp/tandem.service" > "$tmp/bare.service"
grep -q NoNewPrivileges "$tmp/bare.service" && fail "could not strip the hardening lines"
if systemd-analyze security --offline=yes --threshold=25 "$tmp/bare.service" > "$tmp/bare.txt"; then
  fail "the unit without hardening passed the audit: the check cannot fail"
fi
grep 'Overall exposure level' "$tmp/bare.txt"
echo "systemd unit: user tandem, hardened"
