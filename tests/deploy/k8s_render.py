"""Renders a kustomization the way `kubectl kustomize` does, for the subset
of kustomize that deploy/kubernetes uses (tests/deploy, docs/kubernetes.md):
resources (files and directories), configMapGenerator and secretGenerator
from files (behavior create or merge), generatorOptions.disableNameSuffixHash
(must be true), images (newName/newTag), patches (strategic merge, by path)
and namespace. Any other kustomization key is an error, never ignored: the
manifests cannot use a feature this renderer would silently skip. Where
kubectl is installed, the tests compare this rendering with its own.
"""
import base64
import copy
import os
import shutil
import subprocess

import yaml

KNOWN_KEYS = {"apiVersion", "kind", "resources", "configMapGenerator", "secretGenerator",
              "generatorOptions", "images", "patches", "namespace"}
# Strategic-merge keys of the lists the manifests patch (the Kubernetes API's
# patchMergeKey); any other list is replaced, as kustomize does.
MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name", "env": "name",
              "volumeMounts": "mountPath", "ports": "containerPort"}


class RenderError(Exception):
    pass


def _key(obj):
    return (obj["kind"], obj["metadata"]["name"])


def strategic_merge(base, patch, field=None):
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = strategic_merge(base[k], v, k) if k in base else copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list) and field in MERGE_KEYS:
        mk = MERGE_KEYS[field]
        out = [copy.deepcopy(x) for x in base]
        for item in patch:
            for i, existing in enumerate(out):
                if existing.get(mk) == item.get(mk):
                    out[i] = strategic_merge(existing, item, None)
                    break
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(patch)


def _generated(kind, gen, root):
    if gen.get("envs") or gen.get("literals"):
        raise RenderError(f"{root}: {kind} generator {gen['name']}: only `files` is supported")
    data = {}
    for f in gen.get("files", []):
        key, _, path = f.partition("=") if "=" in f else (os.path.basename(f), "", f)
        full = os.path.normpath(os.path.join(root, path))
        if not full.startswith(os.path.normpath(root) + os.sep):
            raise RenderError(f"{root}: {f} is outside the kustomization's folder")
        with open(full, "rb") as fh:
            raw = fh.read()
        data[key] = (base64.b64encode(raw).decode() if kind == "Secret" else raw.decode())
    obj = {"apiVersion": "v1", "kind": kind, "metadata": {"name": gen["name"]}}
    if kind == "Secret":
        obj["type"] = gen.get("type", "Opaque")
    obj["data"] = data
    return obj


def render(root):
    """Returns the list of objects `kubectl kustomize root` prints."""
    path = os.path.join(root, "kustomization.yaml")
    with open(path) as fh:
        k = yaml.safe_load(fh)
    unknown = set(k) - KNOWN_KEYS
    if unknown:
        raise RenderError(f"{path}: keys this renderer does not implement: {sorted(unknown)}")
    objs = []
    for r in k.get("resources", []):
        full = os.path.join(root, r)
        if os.path.isdir(full):
            objs.extend(render(full))
        else:
            with open(full) as fh:
                objs.extend(d for d in yaml.safe_load_all(fh) if d)
    gens = k.get("configMapGenerator", []) + k.get("secretGenerator", [])
    if gens and not k.get("generatorOptions", {}).get("disableNameSuffixHash"):
        raise RenderError(f"{path}: generators need generatorOptions.disableNameSuffixHash: true")
    for kind, key in (("ConfigMap", "configMapGenerator"), ("Secret", "secretGenerator")):
        for gen in k.get(key, []):
            obj = _generated(kind, gen, root)
            behavior = gen.get("behavior", "create")
            idx = [i for i, o in enumerate(objs) if _key(o) == _key(obj)]
            if behavior == "create":
                if idx:
                    raise RenderError(f"{path}: {kind} {gen['name']} exists already")
                objs.append(obj)
            elif behavior == "merge":
                if not idx:
                    raise RenderError(f"{path}: {kind} {gen['name']} to merge into is absent")
                objs[idx[0]]["data"].update(obj["data"])
            else:
                raise RenderError(f"{path}: behavior {behavior} is not supported")
    for img in k.get("images", []):
        for o in objs:
            spec = o.get("spec", {}).get("template", {}).get("spec", {})
            for c in spec.get("containers", []) + spec.get("initContainers", []):
                name, _, tag = c["image"].partition(":")
                if name == img["name"]:
                    c["image"] = f"{img.get('newName', name)}:{img.get('newTag', tag)}"
    for p in k.get("patches", []):
        if set(p) != {"path"}:
            raise RenderError(f"{path}: patches support `path` only, got {sorted(p)}")
        with open(os.path.join(root, p["path"])) as fh:
            patch = yaml.safe_load(fh)
        idx = [i for i, o in enumerate(objs) if _key(o) == _key(patch)]
        if not idx:
            raise RenderError(f"{path}: patch {p['path']}: no {_key(patch)} to patch")
        objs[idx[0]] = strategic_merge(objs[idx[0]], patch)
    if "namespace" in k:
        for o in objs:
            o["metadata"]["namespace"] = k["namespace"]
    return objs


def render_tree(src_dir, tandem, work):
    """Copies deploy/kubernetes of `src_dir` into `work`, creates its secrets
    with base/make-secrets.sh (the real `tandem certs`) and returns the copy's
    path; render(path) then works as on an operator's checkout."""
    tree = os.path.join(work, "kubernetes")
    shutil.copytree(os.path.join(src_dir, "deploy", "kubernetes"), tree,
                    ignore=shutil.ignore_patterns("ca.pem", "ca.key", "cache-salt", "operator.*"))
    subprocess.run(["sh", os.path.join(tree, "base", "make-secrets.sh"), tandem], check=True,
                   capture_output=True)
    return tree


def container(objs, kind, name, container_name):
    for o in objs:
        if o["kind"] == kind and o["metadata"]["name"] == name:
            for c in o["spec"]["template"]["spec"]["containers"]:
                if c["name"] == container_name:
                    return o, c
    raise KeyError(f"{kind}/{name} has no container {container_name}")
