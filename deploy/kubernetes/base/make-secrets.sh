#!/bin/sh
# Creates the fleet's secrets once, before the first `kubectl apply -k`
# (docs/kubernetes.md): a fleet CA in secrets/ca.pem + secrets/ca.key
# (`tandem certs`, which also issues secrets/operator.pem/.key: an identity
# for tools on the internal plane) and a random cache salt in
# secrets/cache-salt (docs/security.md#fleet-salt). kustomization.yaml turns
# them into the Secrets tandem-fleet-ca and tandem-cache-salt. Existing
# files are kept (the CA and the salt must outlive pods). Keep them safe:
# whoever has ca.key can join workers to the fleet.
# Usage: make-secrets.sh [TANDEM_BINARY]   (default: tandem on PATH)
set -eu
here=$(cd "$(dirname "$0")" && pwd)
tandem=${1:-tandem}
mkdir -p "$here/secrets"
chmod 0700 "$here/secrets"
"$tandem" certs --dir "$here/secrets" --name operator >/dev/null
if [ ! -s "$here/secrets/cache-salt" ]; then
  (umask 077; od -An -tx1 -N16 /dev/urandom | tr -d ' \n' > "$here/secrets/cache-salt")
fi
echo "secrets in $here/secrets: ca.pem ca.key cache-salt (and operator.pem/.key)"
