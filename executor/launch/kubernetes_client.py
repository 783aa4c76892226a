"""A rendered job on a cluster, through the official `kubernetes` client
(`pip install fluidps[k8s]`): create its objects, wait until its pservers are ready,
report failed pods with their last log lines, and status, logs and delete.

The client finds its cluster as kubectl does (KUBECONFIG or ~/.kube/config, else the
service account of the pod it runs in), or takes an `ApiClient`. Objects are sent as the
client's own models (V1Job.from_dict(...)), so a field the client does not know fails
here, not on the server; PodGroups, a CRD, go as plain objects.

A pserver is ready when its pod is (its readiness probe: its port accepts connections).
The headless Services publish the pods' addresses before they are ready, so that peers
find each other while they start; readiness is read from the pods themselves.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from fluidps.errors import ExecutionError, UnsupportedError
from fluidps.executor.launch.kubernetes import INDEX_ANNOTATION

LOG_LINES = 20  # of a failed pod, in the error that reports it
POLL_SECONDS = 1.0


def _client_modules() -> Any:
    try:
        import kubernetes.client
        import kubernetes.config
    except ImportError:
        raise UnsupportedError(
            "fluidps k8s submit / status / logs / delete need the kubernetes client: pip install 'fluidps[k8s]'"
        ) from None
    return kubernetes


def default_api_client() -> Any:
    """An ApiClient of its own (the client's global configuration is left alone) for the
    cluster kubectl would talk to: KUBECONFIG, read now, or ~/.kube/config; else, in a
    pod, its service account's."""
    kubernetes = _client_modules()
    try:
        return kubernetes.config.new_client_from_config(config_file=os.environ.get("KUBECONFIG") or None)
    except (kubernetes.config.ConfigException, FileNotFoundError, TypeError):
        configuration = kubernetes.client.Configuration()
        try:
            kubernetes.config.load_incluster_config(client_configuration=configuration)
        except kubernetes.config.ConfigException as e:
            raise ExecutionError(
                f"no Kubernetes cluster is configured ({e}): set KUBECONFIG or run inside a pod"
            ) from None
        return kubernetes.client.ApiClient(configuration)


def instance_selector(name: str, role: str | None = None) -> str:
    selector = f"app.kubernetes.io/instance={name},app.kubernetes.io/managed-by=fluidps"
    return selector + (f",app.kubernetes.io/component={role}" if role else "")


class KubernetesClient:
    """A job's objects on one cluster. `api_client`: a kubernetes.client.ApiClient
    (default: default_api_client())."""

    def __init__(self, api_client: Any = None):
        kubernetes = _client_modules()
        self._k8s = kubernetes.client
        self.api_client = api_client if api_client is not None else default_api_client()
        self.core = kubernetes.client.CoreV1Api(self.api_client)
        self.batch = kubernetes.client.BatchV1Api(self.api_client)
        self.custom = kubernetes.client.CustomObjectsApi(self.api_client)

    # -- creating ----------------------------------------------------------------------------

    def model(self, obj: dict[str, Any]) -> Any:
        """The client's model of a built-in object (its own check of every field)."""
        models = {
            "ConfigMap": self._k8s.V1ConfigMap,
            "Secret": self._k8s.V1Secret,
            "Service": self._k8s.V1Service,
            "Job": self._k8s.V1Job,
        }
        if obj.get("kind") not in models:
            raise UnsupportedError(f"{obj.get('kind')!r} objects are not part of a fluidps job")
        return models[obj["kind"]].from_dict(obj)

    def create(self, obj: dict[str, Any]) -> None:
        kind, namespace = obj["kind"], obj["metadata"]["namespace"]
        if kind == "PodGroup":
            group, _, version = obj["apiVersion"].partition("/")
            self.custom.create_namespaced_custom_object(group, version, namespace, "podgroups", obj)
            return
        create: Callable[..., Any] = {
            "ConfigMap": self.core.create_namespaced_config_map,
            "Secret": self.core.create_namespaced_secret,
            "Service": self.core.create_namespaced_service,
            "Job": self.batch.create_namespaced_job,
        }[kind]
        create(namespace, self.model(obj))

    def create_all(self, objects: Sequence[dict[str, Any]]) -> None:
        """Create the job's objects in order. An object that exists already is an error
        (the job's name is taken: delete it first); when one cannot be created, those
        created before it are deleted again, so that nothing is left half made."""
        name = _job_name(objects)
        api_exception = self._k8s.exceptions.ApiException
        created: list[dict[str, Any]] = []
        for obj in objects:
            try:
                self.create(obj)
            except api_exception as e:
                self._remove(created)
                what = f"{obj['kind']} {obj['metadata']['namespace']}/{obj['metadata']['name']}"
                if e.status == 409:
                    raise ExecutionError(
                        f"{what} exists already: a job named {name!r} runs there (fluidps k8s delete {name})"
                    ) from None
                raise ExecutionError(f"creating {what} failed: {e.status} {e.reason}: {_body(e)}") from None
            created.append(obj)

    def submit(
        self,
        objects: Sequence[dict[str, Any]],
        timeout: float | None = 600.0,
        roles: Sequence[str] = ("pserver",),
    ) -> list[Any]:
        """create_all, then (unless `timeout` is None) wait until every pod of `roles` is
        ready, and return the pods; a pod that fails meanwhile raises an ExecutionError
        with its last log lines (the objects stay, for status and logs)."""
        self.create_all(objects)
        if timeout is None:
            return []
        replicas = {r: _replicas(objects, r) for r in roles}
        return self.wait_ready(_job_name(objects), _namespace(objects), replicas, timeout)

    # -- watching ----------------------------------------------------------------------------

    def pods(self, name: str, namespace: str, role: str | None = None) -> list[Any]:
        return list(
            self.core.list_namespaced_pod(namespace, label_selector=instance_selector(name, role)).items
        )

    def wait_ready(self, name: str, namespace: str, replicas: dict[str, int], timeout: float) -> list[Any]:
        """Until the pods of each role in `replicas` are ready (that many of them); the
        pods. Raises naming a failed pod (with its last log lines) or, after `timeout`
        seconds, the pods not ready."""
        deadline = time.monotonic() + timeout
        while True:
            pods = self.pods(name, namespace)
            for pod in pods:
                if pod.status is not None and pod.status.phase == "Failed":
                    raise ExecutionError(self._failure(pod, namespace))
            waiting = {
                role: sum(1 for p in pods if _component(p) == role and _is_ready(p)) for role in replicas
            }
            if all(waiting[role] >= count for role, count in replicas.items()):
                return pods
            if time.monotonic() > deadline:
                role = next(r for r, count in replicas.items() if waiting[r] < count)
                not_ready = sorted(
                    p.metadata.name for p in pods if _component(p) == role and not _is_ready(p)
                )
                raise ExecutionError(
                    f"job {name!r}: {waiting[role]} of {replicas[role]} {role}s ready after {timeout:.0f} s "
                    f"(not ready: {', '.join(not_ready) or 'no pods yet'}); see fluidps k8s status {name}"
                )
            time.sleep(POLL_SECONDS)

    def addresses(self, pods: Sequence[Any]) -> dict[tuple[str, int], str]:
        """Each pod's IP by (role, completion index)."""
        out = {}
        for pod in pods:
            index = (pod.metadata.annotations or {}).get(INDEX_ANNOTATION)
            if index is not None and pod.status is not None and pod.status.pod_ip:
                out[(_component(pod) or "", int(index))] = pod.status.pod_ip
        return out

    def _failure(self, pod: Any, namespace: str) -> str:
        name = pod.metadata.name
        status = ""
        for container in pod.status.container_statuses or []:
            terminated = container.state.terminated if container.state is not None else None
            if terminated is not None:
                status = f" (exit status {terminated.exit_code}{', ' + terminated.reason if terminated.reason else ''})"
        return (
            f"pod {namespace}/{name} failed{status}; its last lines:\n{self.log(name, namespace, LOG_LINES)}"
        )

    def log(self, pod: str, namespace: str, tail: int | None = None) -> str:
        try:
            return self.core.read_namespaced_pod_log(pod, namespace, tail_lines=tail)
        except self._k8s.exceptions.ApiException as e:
            return f"(no log: {e.status} {e.reason})"

    def status(self, name: str, namespace: str) -> dict[str, Any]:
        """Each role's Job counters and each pod's phase, readiness and restarts."""
        jobs = self.batch.list_namespaced_job(namespace, label_selector=instance_selector(name)).items
        if not jobs:
            raise ExecutionError(f"no job {name!r} in namespace {namespace!r}")
        roles = {}
        for job in jobs:
            s = job.status
            roles[job.metadata.labels.get("app.kubernetes.io/component", job.metadata.name)] = {
                "completions": job.spec.completions,
                "active": (s.active or 0) if s else 0,
                "succeeded": (s.succeeded or 0) if s else 0,
                "failed": (s.failed or 0) if s else 0,
                "failed_indexes": (s.failed_indexes or "") if s else "",
            }
        pods = {
            p.metadata.name: {
                "phase": p.status.phase if p.status else None,
                "ready": _is_ready(p),
                "restarts": sum(c.restart_count for c in (p.status.container_statuses or []))
                if p.status
                else 0,
            }
            for p in self.pods(name, namespace)
        }
        return {"job": name, "namespace": namespace, "roles": roles, "pods": pods}

    def logs(
        self, name: str, namespace: str, role: str | None = None, tail: int | None = None
    ) -> dict[str, str]:
        """Each pod's log (of `role`'s pods only when given), by pod name."""
        return {
            p.metadata.name: self.log(p.metadata.name, namespace, tail)
            for p in self.pods(name, namespace, role)
        }

    # -- deleting ----------------------------------------------------------------------------

    def _delete_object(self, kind: str, name: str, namespace: str, api_version: str = "") -> None:
        """Delete one object of the job (a Job with its pods)."""
        if kind == "PodGroup":
            group, _, version = api_version.partition("/")
            self.custom.delete_namespaced_custom_object(group, version, namespace, "podgroups", name)
        elif kind == "Job":
            self.batch.delete_namespaced_job(name, namespace, propagation_policy="Background")
        else:
            delete: Callable[..., Any] = {
                "ConfigMap": self.core.delete_namespaced_config_map,
                "Secret": self.core.delete_namespaced_secret,
                "Service": self.core.delete_namespaced_service,
            }[kind]
            delete(name, namespace)

    def _remove(self, objects: Sequence[dict[str, Any]]) -> None:
        """Delete these objects (best effort: a rollback)."""
        for obj in reversed(objects):
            with contextlib.suppress(self._k8s.exceptions.ApiException):
                meta = obj["metadata"]
                self._delete_object(obj["kind"], meta["name"], meta["namespace"], obj["apiVersion"])

    def delete(self, name: str, namespace: str) -> list[str]:
        """Delete the job's objects (Jobs with their pods); what it deleted, as Kind/name."""
        selector = instance_selector(name)
        gone = []
        for kind, listing in (
            ("Job", self.batch.list_namespaced_job),
            ("Service", self.core.list_namespaced_service),
            ("ConfigMap", self.core.list_namespaced_config_map),
            ("Secret", self.core.list_namespaced_secret),
        ):
            for obj in listing(namespace, label_selector=selector).items:
                self._delete_object(kind, obj.metadata.name, namespace)
                gone.append(f"{kind}/{obj.metadata.name}")
        for api_version in ("scheduling.volcano.sh/v1beta1", "scheduling.x-k8s.io/v1alpha1"):
            try:
                self._delete_object("PodGroup", name, namespace, api_version)
                gone.append(f"PodGroup/{name}")
            except self._k8s.exceptions.ApiException as e:
                if e.status != 404:  # (none there, or no such CRD on this cluster)
                    raise ExecutionError(
                        f"deleting PodGroup {namespace}/{name} failed: {e.status} {e.reason}"
                    ) from None
        if not gone:
            raise ExecutionError(f"no job {name!r} in namespace {namespace!r}")
        return gone


def _job_name(objects: Sequence[dict[str, Any]]) -> str:
    names = {o["metadata"].get("labels", {}).get("app.kubernetes.io/instance") for o in objects}
    if len(names) != 1 or None in names:
        raise ExecutionError("these objects are not one fluidps job (render them with fluidps k8s render)")
    return names.pop()


def _namespace(objects: Sequence[dict[str, Any]]) -> str:
    return objects[0]["metadata"]["namespace"]


def _replicas(objects: Sequence[dict[str, Any]], role: str) -> int:
    return sum(
        o["spec"]["completions"]
        for o in objects
        if o["kind"] == "Job" and o["metadata"]["labels"].get("app.kubernetes.io/component") == role
    )


def _component(pod: Any) -> str | None:
    return (pod.metadata.labels or {}).get("app.kubernetes.io/component")


def _is_ready(pod: Any) -> bool:
    conditions = pod.status.conditions if pod.status is not None else None
    return any(c.type == "Ready" and c.status == "True" for c in conditions or [])


def _body(e: Any) -> str:
    return (e.body or "")[:500] if isinstance(e.body, str) else str(e.body)[:500]
