"""The containers of deploy/kubernetes run the same binary and flags as the
children of `tandem launch` (docs/kubernetes.md).

Launches the manifests' own fleet file (the ConfigMap's, with loopback
addresses, free ports and the repository's model) with `tandem launch`,
reads each child's command line from /proc, and compares it with the
rendered manifest's container (command + args) for the same role:
 - the program: the container's command is the path the Containerfile
   installs the launcher's binary (build/tandem) at, and its ENTRYPOINT;
 - the global flags, the subcommand and the set of flags are the same, except
   the documented Kubernetes substitutions: --join becomes --join-dns (the
   proxies' headless Service), --advertise is added (the pod IP) and the
   launcher's --ready-fd pipe is not used (probes instead);
 - the values: --log-level/--log-format and --drain-seconds are equal; --name
   is the pod's name, which for ordinal 0 of the StatefulSet ROLE is the
   launcher's ROLE-0; --grpc/--metrics are each file's role address; --config
   is the ConfigMap's fleet.yaml; --tls-* are the files issue-cert.sh writes.
Every flag of the manifests is also one the binary accepts (`--help`).
Env: TANDEM_SOURCE_DIR, TANDEM_BIN. Exit 0 when all hold.
"""
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "integration", "http"))
import k8s_render  # noqa: E402
from fleet import forget, reap_on_exit  # noqa: E402  (kills our children if we die)

SRC = os.environ["TANDEM_SOURCE_DIR"]
TANDEM = os.environ["TANDEM_BIN"]
ADDED_IN_K8S = {"--advertise"}
RENAMED_IN_K8S = {"--join": "--join-dns"}
# The launcher's readiness pipe (a pod's readiness is its probe instead).
LAUNCHER_ONLY = {"--ready-fd"}
GLOBAL_FLAGS = {"--log-level", "--log-format"}

failures = []


def check(cond, what):
    print(("ok    " if cond else "FAIL  ") + what)
    if not cond:
        failures.append(what)


def parse(args):
    """[globals..., SUB, --flag value, ...] -> (globals, SUB, {flag: value})."""
    g, i = {}, 0
    while args[i] in GLOBAL_FLAGS:
        g[args[i]] = args[i + 1]
        i += 2
    sub, rest = args[i], args[i + 1:]
    flags = {}
    for j in range(0, len(rest), 2):
        assert rest[j].startswith("--"), f"not a flag: {rest[j]} in {args}"
        flags[rest[j]] = rest[j + 1]
    return g, sub, flags


def env_of(c):
    return {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath", e.get("value"))
            for e in c.get("env", [])}


def launch(fleet_file, work):
    state = os.path.join(work, "state.json")
    log = open(os.path.join(work, "launch.log"), "w")
    proc = subprocess.Popen([TANDEM, "launch", fleet_file, "--state-file", state], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    reap_on_exit(proc.pid)
    deadline = time.time() + 120
    while not os.path.exists(state):  # renamed into place complete once all are ready
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"tandem launch did not become ready: {open(log.name).read()}")
        time.sleep(0.1)
    with open(state) as f:
        st = json.load(f)
    cmdlines = {}
    for name, pid in [("proxy", st["proxy"]["pid"])] + [(w["name"], w["pid"]) for w in st["workers"]]:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdlines[name] = [a.decode() for a in f.read().split(b"\0") if a]
    return proc, cmdlines


def stop(proc):
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    forget(proc.pid)


def main():
    with tempfile.TemporaryDirectory(prefix="tandem-k8s-entry-") as work:
        tree = k8s_render.render_tree(SRC, TANDEM, work)
        objs = k8s_render.render(tree)
        cm = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "tandem-fleet")
        k8s_fleet = yaml.safe_load(cm["data"]["fleet.yaml"])
        # The same file on loopback: every 0.0.0.0:PORT -> 127.0.0.1:0, the model here.
        local_text = re.sub(r"0\.0\.0\.0:\d+", "127.0.0.1:0", cm["data"]["fleet.yaml"])
        local_text = local_text.replace(k8s_fleet["model"]["path"], os.path.join(SRC, "models", "tandem-kjv"))
        local_file = os.path.join(work, "fleet.yaml")
        with open(local_file, "w") as f:
            f.write(local_text)
        local_fleet = yaml.safe_load(local_text)

        with open(os.path.join(SRC, "Containerfile")) as f:
            containerfile = f.read()
        installed = re.search(r"^COPY --from=build /src/build/tandem (\S+)$", containerfile, re.M)
        entry = re.search(r'^ENTRYPOINT \["([^"]+)"\]$', containerfile, re.M)
        check(installed is not None and entry is not None and installed.group(1) == entry.group(1),
              "the Containerfile installs build/tandem as its ENTRYPOINT "
              f"({installed.group(1) if installed else None})")

        proc, cmdlines = launch(local_file, work)
        try:
            for role, kind, wl_name, cname, child in (
                    ("proxy", "Deployment", "tandem-proxy", "proxy", "proxy"),
                    ("prefill", "StatefulSet", "prefill", "worker", "prefill-0"),
                    ("decode", "StatefulSet", "decode", "worker", "decode-0")):
                wl, c = k8s_render.container(objs, kind, wl_name, cname)
                argv = cmdlines[child]
                check(os.path.realpath(argv[0]) == os.path.realpath(TANDEM),
                      f"{role}: tandem launch runs the built binary {argv[0]}")
                check(c["command"] == [entry.group(1) if entry else None],
                      f"{role}: the container's command {c['command']} is the image's tandem")
                lg, lsub, lflags = parse(argv[1:])
                kg, ksub, kflags = parse(c["args"])
                check(lsub == ksub == role, f"{role}: subcommand {ksub!r} (launch: {lsub!r})")
                check(lg == kg, f"{role}: global flags {kg} (launch: {lg})")
                want = {RENAMED_IN_K8S.get(f, f) for f in lflags if f not in LAUNCHER_ONLY} | (ADDED_IN_K8S if role != "proxy" else set())
                check(set(kflags) == want,
                      f"{role}: flags {sorted(kflags)} = launch's {sorted(lflags)} with "
                      f"--join -> --join-dns{', + --advertise' if role != 'proxy' else ''}, - --ready-fd")
                env = env_of(c)
                mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
                vols = {v["name"]: v for v in wl["spec"]["template"]["spec"]["volumes"]}
                fleet_vol = next(n for n, v in vols.items() if v.get("configMap", {}).get("name") == "tandem-fleet")
                check(kflags.get("--config") == os.path.join(mounts[fleet_vol], "fleet.yaml")
                      and lflags.get("--config") == local_file,
                      f"{role}: --config is the ConfigMap's fleet.yaml ({kflags.get('--config')})")
                tls_dir = mounts.get("tls")
                for flag, file in (("--tls-ca", "ca.pem"), ("--tls-cert", "tls.pem"), ("--tls-key", "tls.key")):
                    check(flag in lflags and kflags.get(flag) == f"{tls_dir}/{file}",
                          f"{role}: {flag} {kflags.get(flag)} (issue-cert.sh's {file}; launch passes its own)")
                section = "proxy" if role == "proxy" else role
                for flag in ("--grpc", "--http", "--metrics", "--internal"):
                    if flag in kflags or flag in lflags:
                        key = flag[2:]
                        check(kflags.get(flag) == k8s_fleet[section][key] and
                              lflags.get(flag) == local_fleet[section][key],
                              f"{role}: {flag} is the fleet file's {section}.{key} ({kflags.get(flag)})")
                if role == "proxy":
                    continue
                check(kflags["--name"] == "$(POD_NAME)" and env.get("POD_NAME") == "metadata.name"
                      and f"{wl_name}-0" == lflags["--name"] == child,
                      f"{role}: --name is the pod name; pod 0 of StatefulSet {wl_name} is the "
                      f"launcher's {lflags['--name']}")
                check(kflags["--advertise"] == "$(POD_IP)" and env.get("POD_IP") == "status.podIP",
                      f"{role}: --advertise is the pod IP")
                check(float(kflags["--drain-seconds"]) == float(lflags["--drain-seconds"])
                      == float(k8s_fleet["proxy"]["drain_seconds"]),
                      f"{role}: --drain-seconds {kflags['--drain-seconds']} is proxy.drain_seconds")
                internal_port = k8s_fleet["proxy"]["internal"].rsplit(":", 1)[1]
                check(kflags["--join-dns"] == f"tandem-proxy-internal:{internal_port}",
                      f"{role}: --join-dns names the proxies' headless Service and proxy.internal's port")
        finally:
            stop(proc)

        for role, kind, name, cname in (("proxy", "Deployment", "tandem-proxy", "proxy"),
                                        ("prefill", "StatefulSet", "prefill", "worker"),
                                        ("decode", "StatefulSet", "decode", "worker")):
            _, c = k8s_render.container(objs, kind, name, cname)
            _, sub, flags = parse(c["args"])
            helptext = subprocess.run([TANDEM, sub, "--help"], capture_output=True, text=True).stdout
            for flag in flags:
                check(re.search(re.escape(flag) + r"\b", helptext) is not None,
                      f"{role}: `tandem {sub}` accepts {flag}")
    print(f"{len(failures)} failed" if failures else "the containers run what tandem launch runs")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
