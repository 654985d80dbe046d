#!/usr/bin/env bash
# Runs COMMAND... in a network namespace of its own with loopback up, so that
# the chaos suite can put delay and loss on `lo` (tc) without touching the
# host's network; TANDEM_CHAOS_NETNS=1 tells the test it may. Where that is
# not possible (not root, no unshare/ip/tc, namespaces refused) it runs
# COMMAND as it is, with the reason in TANDEM_CHAOS_NETNS_WHY: the network
# fault is then skipped and its row says why.
set -u
why=""
if [ "$(id -u)" != 0 ]; then
  why="not root"
else
  for tool in unshare ip tc; do
    command -v "$tool" >/dev/null 2>&1 || why="${why:+$why, }no '$tool' (iproute2/util-linux)"
  done
  if [ -z "$why" ] && ! unshare -n true 2>/dev/null; then
    why="unshare -n refused (no CAP_SYS_ADMIN in this container?)"
  fi
fi
if [ -z "$why" ]; then
  exec unshare -n -- bash -c 'ip link set lo up && TANDEM_CHAOS_NETNS=1 exec "$@"' chaos-netns "$@"
fi
echo "chaos_netns.sh: no network namespace: $why" >&2
TANDEM_CHAOS_NETNS_WHY="$why" exec "$@"
