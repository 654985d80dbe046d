"""The pods of deploy/kubernetes, run as plain processes on loopback
(docs/kubernetes.md): what each container would run, taken from the rendered
manifests, with only what a cluster provides replaced:
 - volumes: the ConfigMap's files, the Secret's files and each pod's
   emptyDirs become folders (their mountPaths in args, env and probes are
   rewritten to them); the fleet file's 0.0.0.0:PORT become 127.0.0.1:0 and
   its model the repository's;
 - the downward API: POD_NAME (the StatefulSet pod's name, e.g. prefill-0),
   POD_IP 127.0.0.1, POD_NAMESPACE default; secretKeyRef: the Secret's file;
 - DNS: --join-dns tandem-proxy-internal:PORT resolves with `localhost` to
   the proxy's real internal port; the image's /usr/local/bin/tandem is the
   build's binary; --ready-fd tells the test the ports the processes took.
Then: every initContainer issues its pod's certificate; the proxy and the
workers start with those; each worker's readiness probe (the manifest's exec
command) passes, as does the proxy's readiness (GET /health); a completion
through the proxy equals `tandem generate`; SIGTERM, as the kubelet sends
it, makes every process drain and exit 0 within terminationGracePeriodSeconds.
Env: TANDEM_SOURCE_DIR, TANDEM_BIN. Exit 0 when all hold.
"""
import base64
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "integration", "http"))
import k8s_render  # noqa: E402
from fleet import forget, reap_on_exit, reference  # noqa: E402

SRC = os.environ["TANDEM_SOURCE_DIR"]
TANDEM = os.environ["TANDEM_BIN"]
IMAGE_TANDEM = "/usr/local/bin/tandem"
PROMPT = "In the beginning God created"

failures = []


def check(cond, what):
    print(("ok    " if cond else "FAIL  ") + what)
    if not cond:
        failures.append(what)


class Pod:
    """One pod of a workload: its volumes as folders, its env, its name."""

    def __init__(self, objs, wl, name, work):
        self.wl, self.name = wl, name
        self.spec = wl["spec"]["template"]["spec"]
        self.dirs = {}
        for v in self.spec["volumes"]:
            d = os.path.join(work, name, v["name"])
            os.makedirs(d, exist_ok=True)
            if "configMap" in v or "secret" in v:
                src = next(o for o in objs if o["kind"] in ("ConfigMap", "Secret") and o["metadata"]["name"] ==
                           (v.get("configMap") or {}).get("name", (v.get("secret") or {}).get("secretName")))
                for key, val in src["data"].items():
                    raw = base64.b64decode(val) if src["kind"] == "Secret" else val.encode()
                    if key == "fleet.yaml":  # the cluster's network and model -> this machine's
                        text = re.sub(r"0\.0\.0\.0:\d+", "127.0.0.1:0", raw.decode())
                        text = re.sub(r"(?m)^(  path: ).*$", r"\g<1>" + os.path.join(SRC, "models", "tandem-kjv"), text)
                        raw = text.encode()
                    with open(os.path.join(d, key), "wb") as f:
                        f.write(raw)
            self.dirs[v["name"]] = d
        self.objs = objs

    def localize(self, c, s):
        """A path in container `c` -> the folder of its volume (the longest mountPath prefix)."""
        if s == IMAGE_TANDEM:
            return TANDEM
        for m in sorted(c.get("volumeMounts", []), key=lambda m: -len(m["mountPath"])):
            if s == m["mountPath"] or s.startswith(m["mountPath"] + "/"):
                return self.dirs[m["name"]] + s[len(m["mountPath"]):]
        return s

    def env(self, c):
        env = dict(os.environ)
        for e in c.get("env", []):
            ref = e.get("valueFrom", {})
            if "fieldRef" in ref:
                env[e["name"]] = {"metadata.name": self.name, "status.podIP": "127.0.0.1",
                                  "metadata.namespace": "default"}[ref["fieldRef"]["fieldPath"]]
            elif "secretKeyRef" in ref:
                sec = next(o for o in self.objs if o["kind"] == "Secret" and
                           o["metadata"]["name"] == ref["secretKeyRef"]["name"])
                env[e["name"]] = base64.b64decode(sec["data"][ref["secretKeyRef"]["key"]]).decode()
            else:
                env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], e["value"])
        return env

    def argv(self, c, env, extra_subs=()):
        out = []
        for a in c["command"] + c.get("args", []):
            a = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a)
            a = self.localize(c, a)
            a = re.sub(r"^0\.0\.0\.0:\d+$", "127.0.0.1:0", a)
            for old, new in extra_subs:
                a = a.replace(old, new)
            out.append(a)
        return out

    def run_init(self):
        for c in self.spec.get("initContainers", []):
            env = self.env(c)
            mounts = {m["mountPath"]: self.dirs[m["name"]] for m in c["volumeMounts"]}
            # issue-cert.sh's defaults are the mountPaths; point them at the folders.
            env.update(TANDEM_CA_SECRET_DIR=mounts["/var/run/tandem/ca"],
                       TANDEM_TLS_DIR=mounts["/var/run/tandem/tls"], TANDEM_BIN=TANDEM,
                       TMPDIR=mounts["/tmp"])
            r = subprocess.run(self.argv(c, env), env=env, capture_output=True, text=True, timeout=60)
            check(r.returncode == 0, f"{self.name}: initContainer {c['name']} ({r.stdout.strip() or r.stderr.strip()})")

    def start(self, extra_subs=()):
        c = self.spec["containers"][0]
        env = self.env(c)
        rfd, wfd = os.pipe()
        argv = self.argv(c, env, extra_subs) + ["--ready-fd", str(wfd)]
        self.log = os.path.join(os.path.dirname(self.dirs["tls"]), "log.txt")
        self.proc = subprocess.Popen(argv, env=env, pass_fds=(wfd,), stdout=open(self.log, "w"),
                                     stderr=subprocess.STDOUT)
        reap_on_exit(self.proc.pid)
        os.close(wfd)
        with os.fdopen(rfd) as r:
            line = r.readline()  # the ready line, or "" when it died first
        check(bool(line), f"{self.name}: started and ready ({' '.join(argv[1:6])} ...)")
        if not line:
            print(open(self.log).read())
            return None
        return json.loads(line)

    def probe(self, kind, ports):
        c = self.spec["containers"][0]
        p = c[kind]
        if "exec" in p:
            cmd = [self.localize(c, a) for a in p["exec"]["command"]]
            cmd = [re.sub(r"^127\.0\.0\.1:\d+$", ports["grpc"], a) for a in cmd]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            return r.returncode == 0, (r.stdout + r.stderr).strip()
        if "httpGet" in p:
            try:
                with urllib.request.urlopen(f"http://{ports['http']}{p['httpGet']['path']}", timeout=10) as r:
                    return r.status == 200, r.read().decode()
            except urllib.error.HTTPError as e:
                return False, f"{e.code} {e.read().decode()}"
        raise AssertionError(f"{kind}: no exec/httpGet")

    def terminate(self):
        """SIGTERM as the kubelet sends it; the exit status within the grace period."""
        grace = self.spec["terminationGracePeriodSeconds"]
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            rc = None
        forget(self.proc.pid)
        return rc, grace


def main():
    with tempfile.TemporaryDirectory(prefix="tandem-k8s-pods-") as work:
        tree = k8s_render.render_tree(SRC, TANDEM, work)
        objs = k8s_render.render(tree)
        wls = {o["metadata"]["name"]: o for o in objs if o["kind"] in ("Deployment", "StatefulSet")}
        pods = {"proxy": Pod(objs, wls["tandem-proxy"], "tandem-proxy-7d9f8-abcde", work),
                "prefill": Pod(objs, wls["prefill"], "prefill-0", work),
                "decode": Pod(objs, wls["decode"], "decode-0", work)}
        for p in pods.values():
            p.run_init()
        started = []
        try:
            proxy = pods["proxy"].start()
            if proxy is None:
                return 1
            started.append(pods["proxy"])
            internal_port = proxy["internal"].rsplit(":", 1)[1]
            k8s_internal = re.search(r"tandem-proxy-internal:(\d+)", json.dumps(wls["prefill"])).group(0)
            dns = [(k8s_internal, f"localhost:{internal_port}")]
            ports = {}
            for role in ("decode", "prefill"):
                ready = pods[role].start(dns)
                if ready is None:
                    return 1
                started.append(pods[role])
                ports[role] = ready
                for kind in ("startupProbe", "readinessProbe"):
                    ok, out = pods[role].probe(kind, ready)
                    check(ok and out == "SERVING", f"{role}: the manifest's {kind} passes ({out})")
            ok, out = pods["proxy"].probe("readinessProbe", proxy)
            check(ok, f"proxy: the manifest's readinessProbe passes ({out})")
            r = subprocess.run([TANDEM, "client", "--proxy", proxy["grpc"], "--prompt", PROMPT,
                                "--max-tokens", "12"], capture_output=True, text=True, timeout=120)
            want = reference(prompt=PROMPT, max_tokens=12)["text"]
            check(r.returncode == 0 and r.stdout.strip() == want.strip(),
                  f"a completion through the proxy equals tandem generate ({r.stdout.strip()!r}; {r.stderr.strip()})")
            for p in reversed(started):  # workers first: the proxy still routes around them
                rc, grace = p.terminate()
                check(rc == 0, f"{p.name}: SIGTERM drains and exits 0 within {grace} s (exit {rc})")
            started = []
        finally:
            for p in started:
                p.proc.kill()
                p.proc.wait()
                forget(p.proc.pid)
    print(f"{len(failures)} failed" if failures else "the pods run as the manifests say")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
