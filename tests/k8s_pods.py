"""What Kubernetes would make of rendered manifests, for tests that reach no cluster:
the environment a pod gets (its ConfigMap, its own variables with $(VAR) references
expanded, the Downward API's annotation), as the kubelet builds it."""

from __future__ import annotations

import base64
import re
from collections.abc import Sequence
from typing import Any

from fluidps.executor.launch.kubernetes import INDEX_ANNOTATION

_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_ANNOTATION = re.compile(r"metadata\.annotations\['([^']+)'\]")


def find(objects: Sequence[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def role_job(objects: Sequence[dict[str, Any]], role: str) -> dict[str, Any]:
    (job,) = [
        o
        for o in objects
        if o["kind"] == "Job" and o["metadata"]["labels"]["app.kubernetes.io/component"] == role
    ]
    return job


def pod_env(objects: Sequence[dict[str, Any]], role: str, index: int) -> dict[str, str]:
    """The environment of pod `index` of `role`'s Indexed Job: envFrom ConfigMaps first,
    then `env` in order (a secretKeyRef read from the Secret rendered with them) (a $(VAR) naming a variable defined before it is expanded, as the
    kubelet does), the completion index from the annotation the Job controller sets."""
    template = role_job(objects, role)["spec"]["template"]
    annotations = {**template["metadata"].get("annotations", {}), INDEX_ANNOTATION: str(index)}
    (container,) = template["spec"]["containers"]
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(find(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = _REFERENCE.sub(lambda m: env.get(m[1], m[0]), var["value"])
        elif "secretKeyRef" in var["valueFrom"]:
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = base64.b64decode(
                find(objects, "Secret", ref["name"])["data"][ref["key"]]
            ).decode()
        else:
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            match = _ANNOTATION.fullmatch(path)
            assert match, f"{var['name']}: a fieldRef this helper does not know: {path}"
            env[var["name"]] = annotations[match[1]]
    return env
