#!/bin/sh
# initContainer of every tandem pod (docs/kubernetes.md): issues this pod's
# internal-plane certificate from the fleet CA (Secret tandem-fleet-ca:
# ca.pem, ca.key) with `tandem certs`. Its identity is the pod's name, which
# is also the worker's --name (the proxy binds worker names to certificate
# identities); its hosts are the pod IP (what the worker advertises and what
# --join-dns resolves the proxies to), 127.0.0.1 (the probes), the pod name
# and $TANDEM_CERT_HOSTS. Only ca.pem, tls.pem and tls.key reach the shared
# volume $TANDEM_TLS_DIR: the CA key stays in this container.
set -eu
ca_dir=${TANDEM_CA_SECRET_DIR:-/var/run/tandem/ca}
out=${TANDEM_TLS_DIR:-/var/run/tandem/tls}
tandem=${TANDEM_BIN:-/usr/local/bin/tandem}
: "${POD_NAME:?POD_NAME must be set (fieldRef metadata.name)}"
: "${POD_IP:?POD_IP must be set (fieldRef status.podIP)}"
for f in ca.pem ca.key; do
  if [ ! -s "$ca_dir/$f" ]; then
    echo "issue-cert: $ca_dir/$f is missing or empty: create the Secret tandem-fleet-ca" \
         "(deploy/kubernetes/make-secrets.sh, docs/kubernetes.md)" >&2
    exit 1
  fi
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$ca_dir/ca.pem" "$ca_dir/ca.key" "$work/"
chmod 0600 "$work/ca.key"
set -- --host "$POD_IP" --host 127.0.0.1 --host localhost --host "$POD_NAME"
for h in ${TANDEM_CERT_HOSTS:-}; do set -- "$@" --host "$h"; done
"$tandem" certs --dir "$work" --name "$POD_NAME" "$@" >/dev/null
mkdir -p "$out"
cp "$work/ca.pem" "$out/ca.pem"
cp "$work/$POD_NAME.pem" "$out/tls.pem"
cp "$work/$POD_NAME.key" "$out/tls.key"
chmod 0600 "$out/tls.key"
echo "issue-cert: $POD_NAME: certificate for $* in $out"
