"""deploy/kubernetes passes the Kubernetes schemas (docs/kubernetes.md).

Renders every kustomization under deploy/kubernetes (the top one = base,
overlays/cuda, autoscale/...; k8s_render.py, compared with `kubectl
kustomize` where kubectl is installed), then checks every object: core
kinds with kubernetes-validate (strict: unknown fields fail) against
Kubernetes 1.29 and the newest its offline schemas cover; the custom
resources (in no core schema) against a structural schema of their CRD in
schemas/ (PodMonitor, KEDA ScaledObject); any other kind fails. The checkers are shown
to fail on a broken copy. Then the wiring the schemas cannot see: ports
agree with the fleet file, probes and Services name real ports, GPUs only
in the cuda overlay, grace periods cover the drain.
Env: TANDEM_SOURCE_DIR, TANDEM_BIN. Exit 0 when all hold.
"""
import base64
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile

import jsonschema
import kubernetes_validate
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import k8s_render  # noqa: E402

SRC = os.environ["TANDEM_SOURCE_DIR"]
TANDEM = os.environ["TANDEM_BIN"]
HERE = os.path.dirname(os.path.abspath(__file__))
VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]
CRD_SCHEMAS = {("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor.schema.json",
               ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject.schema.json"}

failures = []


def check(cond, what):
    print(("ok    " if cond else "FAIL  ") + what)
    if not cond:
        failures.append(what)


def validate(obj):
    """Raises when `obj` fails its schema; returns what checked it."""
    crd = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
    if crd:
        with open(os.path.join(HERE, "schemas", crd)) as fh:
            jsonschema.validate(obj, json.load(fh))
        return f"schemas/{crd}"
    for v in VERSIONS:
        kubernetes_validate.validate(obj, v, strict=True)
    return "kubernetes-validate " + ", ".join(VERSIONS)


def kubectl_render(root):
    kubectl = shutil.which("kubectl")
    if not kubectl:
        return None
    out = subprocess.run([kubectl, "kustomize", root], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {root}: {out.stderr}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_key(objs):
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def decoded(objs):
    """by_key with Secret data decoded (kustomize wraps its base64 lines)."""
    out = by_key(copy.deepcopy(objs))
    for (kind, _), o in out.items():
        if kind == "Secret":
            o["data"] = {k: base64.b64decode("".join(v.split())) for k, v in o["data"].items()}
    return out


def containers(obj):
    spec = obj["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def main():
    work = tempfile.mkdtemp(prefix="tandem-k8s-")
    try:
        # The operator's first step (base/make-secrets.sh, the real `tandem certs`).
        tree = k8s_render.render_tree(SRC, TANDEM, work)
        rendered = {}
        # Every kustomization under deploy/kubernetes: the top one (base), the
        # overlays and any other (e.g. autoscale/, applied on its own).
        roots = [("base", tree), ("cuda", os.path.join(tree, "overlays", "cuda"))]
        for d, _, files in sorted(os.walk(tree)):
            if "kustomization.yaml" in files and d not in (r for _, r in roots) and \
                    d != os.path.join(tree, "base"):
                roots.append((os.path.relpath(d, tree), d))
        for name, root in roots:
            objs = k8s_render.render(root)
            rendered[name] = objs
            ref = kubectl_render(root)
            if ref is None:
                print(f"note  kubectl not installed: the {name} rendering is k8s_render.py's alone")
            else:
                check(decoded(ref) == decoded(objs),
                      f"{name}: k8s_render.py renders what `kubectl kustomize` does "
                      f"({len(objs)} objects)")
            for o in objs:
                what = f"{name}: {o['kind']}/{o['metadata']['name']}"
                try:
                    check(True, f"{what} passes {validate(o)}")
                except Exception as e:  # noqa: BLE001 (any checker error is a failure)
                    check(False, f"{what}: {type(e).__name__}: {str(e).splitlines()[0]}")

        base = by_key(rendered["base"])
        for name, objs in rendered.items():
            for o in objs:
                if o["kind"] == "ScaledObject":
                    ref = o["spec"]["scaleTargetRef"]
                    check((ref.get("kind", "Deployment"), ref["name"]) in base,
                          f"{name}: ScaledObject {o['metadata']['name']} scales an existing "
                          f"{ref.get('kind', 'Deployment')}/{ref['name']}")
        cuda = by_key(rendered["cuda"])
        # The checkers can fail: a misspelt field in a core kind and in the CRD.
        broken = copy.deepcopy(base[("StatefulSet", "prefill")])
        broken["spec"]["template"]["spec"]["containers"][0]["containerPorts"] = []
        broken_pm = copy.deepcopy(base[("PodMonitor", "tandem")])
        broken_pm["spec"]["podMetricsEndpoints"][0]["prot"] = "metrics"
        bad_interval = copy.deepcopy(base[("PodMonitor", "tandem")])
        bad_interval["spec"]["podMetricsEndpoints"][0]["interval"] = "15 seconds"
        for b, what in ((broken, "a container with an unknown field"),
                        (broken_pm, "a PodMonitor endpoint with an unknown field"),
                        (bad_interval, "a PodMonitor with a malformed interval")):
            try:
                validate(b)
                check(False, f"the schema check refuses {what}")
            except Exception as e:  # noqa: BLE001
                check(True, f"the schema check refuses {what} ({type(e).__name__})")
        unknown = {"apiVersion": "example.com/v1", "kind": "Gadget", "metadata": {"name": "x"}}
        try:
            validate(unknown)
            check(False, "an unknown kind fails (no silent skip)")
        except Exception as e:  # noqa: BLE001
            check(True, f"an unknown kind fails (no silent skip: {type(e).__name__})")

        # The wiring.
        expected = {("Deployment", "tandem-proxy"), ("Service", "tandem-proxy"),
                    ("Service", "tandem-proxy-internal"), ("StatefulSet", "prefill"),
                    ("Service", "prefill"), ("StatefulSet", "decode"), ("Service", "decode"),
                    ("ConfigMap", "tandem-fleet"), ("Secret", "tandem-fleet-ca"),
                    ("Secret", "tandem-cache-salt"), ("PodMonitor", "tandem")}
        check(expected <= set(base), f"base has {sorted(expected)}")
        fleet = yaml.safe_load(base[("ConfigMap", "tandem-fleet")]["data"]["fleet.yaml"])
        fleet_cuda = yaml.safe_load(cuda[("ConfigMap", "tandem-fleet")]["data"]["fleet.yaml"])
        check(fleet["model"]["backend"] == "cpu" and fleet_cuda["model"]["backend"] == "cuda",
              "model.backend: cpu in the base, cuda in the overlay")
        check(set(base[("Secret", "tandem-fleet-ca")]["data"]) == {"ca.pem", "ca.key"},
              "Secret tandem-fleet-ca holds ca.pem and ca.key")
        port = lambda addr: int(addr.rsplit(":", 1)[1])  # noqa: E731
        want_ports = {
            ("Deployment", "tandem-proxy"): {
                "grpc": port(fleet["proxy"]["grpc"]), "http": port(fleet["proxy"]["http"]),
                "metrics": port(fleet["proxy"]["metrics"]),
                "internal": port(fleet["proxy"]["internal"])},
            ("StatefulSet", "prefill"): {"grpc": port(fleet["prefill"]["grpc"]),
                                         "metrics": port(fleet["prefill"]["metrics"])},
            ("StatefulSet", "decode"): {"grpc": port(fleet["decode"]["grpc"]),
                                        "metrics": port(fleet["decode"]["metrics"])},
        }
        drain = float(fleet["proxy"]["drain_seconds"])
        for key, want in want_ports.items():
            w = base[key]
            c = w["spec"]["template"]["spec"]["containers"][0]
            got = {p["name"]: p["containerPort"] for p in c["ports"]}
            check(got == want, f"{key[1]}: containerPorts {got} are the fleet file's {want}")
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                p = c.get(probe)
                check(p is not None, f"{key[1]}: has a {probe}")
                if not p:
                    continue
                if "grpc" in p:
                    ok = p["grpc"]["port"] == want["grpc"]
                elif "exec" in p:
                    cmd = p["exec"]["command"]
                    ok = (cmd[1] == "health" and
                          cmd[cmd.index("--addr") + 1] == f"127.0.0.1:{want['grpc']}")
                else:
                    target = (p.get("httpGet") or p.get("tcpSocket"))["port"]
                    ok = target in want or target in want.values()
                check(ok, f"{key[1]}: {probe} targets a port it serves ({json.dumps(p)[:90]})")
            grace = w["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            check(grace > drain, f"{key[1]}: terminationGracePeriodSeconds {grace} > drain {drain}")
            has_metrics = "metrics" in got
            check(has_metrics, f"{key[1]}: a port named metrics (the PodMonitor's)")
            for ctr in containers(w):
                check(ctr["image"] == "tandem:latest", f"{key[1]}/{ctr['name']}: image tandem:latest")
            cw = cuda[key]
            cuda_res = cuda[key]["spec"]["template"]["spec"]["containers"][0]["resources"]
            base_res = c["resources"]
            gpu = key[0] == "StatefulSet"
            check(("nvidia.com/gpu" in cuda_res.get("limits", {})) == gpu and
                  "nvidia.com/gpu" not in base_res.get("limits", {}),
                  f"{key[1]}: nvidia.com/gpu limit {'in the cuda overlay only' if gpu else 'nowhere'}")
            check(all(ct["image"] == "tandem:cuda" for ct in containers(cw)),
                  f"{key[1]}: the cuda overlay runs image tandem:cuda")
        for name in ("tandem-proxy", "tandem-proxy-internal", "prefill", "decode"):
            svc = base[("Service", name)]
            wl = [o for o in rendered["base"] if o["kind"] in ("Deployment", "StatefulSet") and
                  all(o["spec"]["template"]["metadata"]["labels"].get(k) == v
                      for k, v in svc["spec"]["selector"].items())]
            names = {p["name"] for o in wl for p in o["spec"]["template"]["spec"]["containers"][0]["ports"]}
            check(len(wl) == 1 and all(p["targetPort"] in names for p in svc["spec"]["ports"]),
                  f"Service {name} selects one workload and targets its named ports")
        for name in ("prefill", "decode", "tandem-proxy-internal"):
            svc = base[("Service", name)]["spec"]
            check(svc.get("clusterIP") == "None" and svc.get("publishNotReadyAddresses") is True,
                  f"Service {name} is headless and lists pods before they are ready")
        for name in ("prefill", "decode"):
            check(base[("StatefulSet", name)]["spec"]["serviceName"] == name,
                  f"StatefulSet {name} is governed by its headless Service")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{len(failures)} failed" if failures else "all manifest checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
