"""A job as Kubernetes objects: only built-in kinds, so no operator or CRD is needed.

For a job named NAME of P pservers and T trainers in namespace NS, `render` gives:

- a ConfigMap NAME-env with Paddle's environment contract (fluidps.executor.env) that
  every pod reads: PADDLE_PSERVERS_IP_PORT_LIST (the pservers' DNS names),
  PADDLE_TRAINERS_NUM, PADDLE_PORT, FLUIDPS_MODE, the keys' or FLUIDPS_INSECURE, and
  the checkpoint and dataset settings;
- a Secret NAME-keys with the CURVE keys (`fluidps keys gen`), mounted read-only;
- a Secret NAME-job with the job's secret (fluidps.executor.transport.proof), which every
  pod's FLUIDPS_JOB_SECRET takes: each message of the job proves it;
- per role (pserver, trainer, and coordinator when the job reads a dataset) a headless
  Service NAME-ROLE and an Indexed Job NAME-ROLE whose pods are NAME-ROLE-<i>, with
  `subdomain` set, so that pserver i is NAME-pserver-<i>.NAME-pserver.NS.svc. The index
  (JOB_COMPLETION_INDEX, from the pod's annotation) is a trainer's PADDLE_TRAINER_ID and
  names a pserver's own address (POD_IP);
- with `gang`, a PodGroup (Volcano's, or the scheduler-plugins one) of every pod.

A pod that fails is retried up to `restarts` times (backoffLimitPerIndex), unless the
policy says otherwise: a pod the node took away (preemption, eviction: the DisruptionTarget
condition) is retried without counting, and a program error (exit status 1 or 2: an
exception, a usage error) fails its index at once. A trainer that exits because a peer's
restart failed it (FLUIDPS_PEER_EXIT_STATUS) counts as a retry. A restarted pserver
restores its newest checkpoint from the checkpoint volume.

Everything is checked before anything is rendered: a bad field raises a fluidps.Error
naming it and the rule it breaks.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fluidps.errors import BuilderError
from fluidps.executor.peer_exit import PEER_FAILURE_STATUS
from fluidps.executor.transport.proof import JobSecret

SECRET_ENV = "FLUIDPS_JOB_SECRET"  # (fluidps.executor.env reads it)
SECRET_KEY = "secret"  # the job secret's key in the Secret NAME-job

CONTAINER = "fluidps"
PORT_NAME = "fluidps"
LOOP_PORT_NAME = "pserver-loop"  # a RemoteExecutor's pserver pods: where the pserver loop listens
KEYS_MOUNT = "/etc/fluidps/keys"
CHECKPOINT_MOUNT = "/var/lib/fluidps/checkpoints"
DATA_MOUNT = "/var/lib/fluidps/data"
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
INDEX_ENV = "FLUIDPS_POD_INDEX"  # a pserver's index, to spell its own DNS name
PROGRAM_ERRORS = (1, 2)  # a Python exception, a usage error: retrying would fail again
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
GANG_SCHEDULERS = {
    # scheduler: (PodGroup apiVersion, schedulerName, how a pod names its group)
    "volcano": ("scheduling.volcano.sh/v1beta1", "volcano", "annotation"),
    "scheduler-plugins": ("scheduling.x-k8s.io/v1alpha1", "scheduler-plugins-scheduler", "label"),
}
GROUP_KEYS = {"annotation": "scheduling.k8s.io/group-name", "label": "scheduling.x-k8s.io/pod-group"}

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
# A resource.Quantity: a decimal number with an optional suffix (binary, decimal or exponent).
_QUANTITY = re.compile(r"\+?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+|[KMGTPE]i|[numkMGTPE])?")
_SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]+")


@dataclass(frozen=True)
class Resources:
    """What each pod of a role asks for (requests) and may use (limits): Kubernetes
    quantities, e.g. cpu "500m" or "2", memory "4Gi"; None leaves one out."""

    cpu: str | None = None
    memory: str | None = None
    cpu_limit: str | None = None
    memory_limit: str | None = None

    def to_dict(self) -> dict[str, dict[str, str]]:
        out: dict[str, dict[str, str]] = {}
        for kind, name, value in (
            ("requests", "cpu", self.cpu),
            ("requests", "memory", self.memory),
            ("limits", "cpu", self.cpu_limit),
            ("limits", "memory", self.memory_limit),
        ):
            if value is not None:
                out.setdefault(kind, {})[name] = value
        return out

    def check(self, field_name: str) -> None:
        for name in ("cpu", "memory", "cpu_limit", "memory_limit"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and _QUANTITY.fullmatch(value)):
                raise BuilderError(
                    f"{field_name}.{name}={value!r} is not a Kubernetes quantity: write a number with an "
                    "optional suffix, e.g. '500m' or '2' CPUs, '512Mi' or '4Gi' of memory"
                )


@dataclass(frozen=True)
class KubernetesCluster:
    """Where and how a job's pods run.

    `image`: the container image (the repository's Dockerfile: python + fluidps and the
    training script). `command`: what every pserver and trainer pod runs, the Fluid way
    (`fluidps launch`'s contract: the same script in every process, its role from the
    environment), e.g. ("python", "/app/train.py"). `checkpoint_volume` / `data_volume`:
    pod volume sources (e.g. {"persistentVolumeClaim": {"claimName": "ckpt"}}) mounted at
    CHECKPOINT_MOUNT (pservers and coordinator: FLUIDPS_CHECKPOINT_DIR) and DATA_MOUNT
    (trainers). `restarts`: how often each pod may be retried. `gang_scheduler`:
    "volcano" or "scheduler-plugins", for JobDesc(gang=True). `user`: the uid and gid the
    pods run as (never root); the keys are readable by its group only."""

    image: str
    namespace: str = "default"
    command: tuple[str, ...] = ()
    image_pull_policy: str = "IfNotPresent"
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()
    checkpoint_volume: Mapping[str, Any] | None = None
    data_volume: Mapping[str, Any] | None = None
    port: int = 6174
    restarts: int = 3
    gang_scheduler: str = "volcano"
    user: int = 10001  # the pods' user and group (the Dockerfile's), which may read the keys


@dataclass(frozen=True)
class KubernetesJob:
    """What `render` needs of a job (JobDesc.to_kubernetes makes one): its name, its
    replicas, how its processes talk, and where they run. `dataset`: the dataset the
    trainers read, as a path inside their pods (a coordinator hands out its tasks).

    `serve`: the pods are a RemoteExecutor's executor servers (`fluidps serve`, listening
    on their pod's IP at `port`; a pserver's loop at `port + 1`), not `cluster.command`:
    the RemoteExecutor ships them their programs. `compile`: their `--compile` flag."""

    name: str
    pservers: int
    trainers: int
    cluster: KubernetesCluster
    mode: str = "sync"
    keys_dir: str | None = None
    insecure: bool = False
    peer_timeout: float | None = None
    resources: Resources = field(default_factory=Resources)
    gang: bool = False
    dataset: str | None = None
    serve: bool = False
    compile: bool | None = None
    secret: JobSecret | None = None  # the job's (JobDesc makes one); None: rendered without

    def roles(self) -> dict[str, int]:
        """Replicas by role, in the order the objects come."""
        roles = {"pserver": self.pservers, "trainer": self.trainers}
        if self.dataset:
            roles["coordinator"] = 1
        return roles

    def host(self, role: str, index: int) -> str:
        """The DNS name of pod `index` of `role`."""
        return f"{self.name}-{role}-{index}.{self.name}-{role}.{self.cluster.namespace}.svc"

    def pserver_list(self) -> str:
        return ",".join(f"{self.host('pserver', i)}:{self.cluster.port}" for i in range(self.pservers))


# -- checks ----------------------------------------------------------------------------------


def _dns_label(field_name: str, value: object) -> None:
    if not isinstance(value, str) or len(value) > 63 or not _DNS_LABEL.fullmatch(value):
        raise BuilderError(
            f"{field_name}={value!r} is not a DNS-1123 label: at most 63 characters of a-z, 0-9 and "
            "'-', starting and ending with a letter or digit"
        )


def check(job: KubernetesJob) -> None:
    """Raise a BuilderError naming the first field that breaks a rule, before anything
    is rendered."""
    cluster = job.cluster
    _dns_label("name", job.name)
    _dns_label("namespace", cluster.namespace)
    for role, replicas in (("pservers", job.pservers), ("trainers", job.trainers)):
        if not isinstance(replicas, int) or replicas < 1:
            raise BuilderError(f"{role}={replicas!r}: a job needs at least one of each role")
    for role, replicas in job.roles().items():  # every pod's host name is a label too
        longest = f"{job.name}-{role}-{replicas - 1}"
        if len(longest) > 63:
            raise BuilderError(
                f"name={job.name!r} is too long: pod host names such as {longest!r} must be DNS-1123 "
                f"labels of at most 63 characters; shorten it by {len(longest) - 63}"
            )
    if not cluster.image or any(c.isspace() for c in cluster.image):
        raise BuilderError(f"image={cluster.image!r}: give the container image, e.g. 'registry/fluidps:0.1'")
    if cluster.image_pull_policy not in PULL_POLICIES:
        raise BuilderError(
            f"image_pull_policy={cluster.image_pull_policy!r} is not one of {', '.join(PULL_POLICIES)}"
        )
    if job.serve:
        if cluster.command:
            raise BuilderError(
                f"command={tuple(cluster.command)!r}: a RemoteExecutor's pods run `fluidps serve` and "
                "get their programs from it; leave command empty (or render the script the Fluid way)"
            )
        if job.dataset is not None:
            raise BuilderError(
                "a RemoteExecutor on Kubernetes reads no dataset yet: render the script the Fluid way"
            )
    elif not cluster.command or not all(isinstance(c, str) and c for c in cluster.command):
        raise BuilderError(
            f"command={tuple(cluster.command)!r}: give what every pserver and trainer pod runs, "
            "e.g. ('python', '/app/train.py')"
        )
    highest = 65534 if job.serve else 65535  # (a RemoteExecutor's pserver loops take port + 1)
    if not isinstance(cluster.port, int) or not 1 <= cluster.port <= highest:
        raise BuilderError(f"port={cluster.port!r} is not a TCP port from 1 to {highest}")
    if not isinstance(cluster.user, int) or not 1 <= cluster.user <= 2**31 - 1:
        raise BuilderError(f"user={cluster.user!r} must be a uid from 1 to 2**31 - 1: pods never run as root")
    if not isinstance(cluster.restarts, int) or cluster.restarts < 0:
        raise BuilderError(f"restarts={cluster.restarts!r} must be an integer >= 0")
    if cluster.gang_scheduler not in GANG_SCHEDULERS:
        raise BuilderError(
            f"gang_scheduler={cluster.gang_scheduler!r} is not one of {', '.join(GANG_SCHEDULERS)}"
        )
    job.resources.check("resources")
    if job.keys_dir is None and not job.insecure:
        raise BuilderError(
            "keys_dir is not set: pods talk over the cluster's network, so give a key directory "
            "(fluidps keys gen DIR) or, on a network you trust, insecure=True"
        )
    if job.keys_dir is not None:
        key_files(job.keys_dir)  # raises when it holds no keys
    if job.dataset is not None and not job.dataset.startswith("/"):
        raise BuilderError(f"dataset={job.dataset!r} must be an absolute path inside the trainers' pods")


def key_files(keys_dir: str) -> dict[str, tuple[str, bytes]]:
    """The Secret's items of a key directory: Secret key -> (path in the mount, bytes)."""
    root = Path(keys_dir)
    wanted = ("server.key", "server.key_secret", "client.key_secret")
    missing = [n for n in wanted if not (root / n).is_file()]
    allowed = sorted((root / "allowed").glob("*.key")) if (root / "allowed").is_dir() else []
    if missing or not allowed:
        what = ", ".join(missing) if missing else "allowed/*.key"
        raise BuilderError(
            f"keys_dir={keys_dir!r} holds no fluidps keys (missing {what}): make them with "
            f"`fluidps keys gen {keys_dir}`"
        )
    files = {n: (n, (root / n).read_bytes()) for n in (*wanted, "client.key") if (root / n).is_file()}
    for path in allowed:
        key = f"allowed.{path.name}"
        if not _SECRET_KEY.fullmatch(key):
            raise BuilderError(f"keys_dir {keys_dir!r}: allowed/{path.name} is not a valid Secret key name")
        files[key] = (f"allowed/{path.name}", path.read_bytes())
    return files


# -- rendering -------------------------------------------------------------------------------


def labels(job: KubernetesJob, role: str | None = None) -> dict[str, str]:
    out = {
        "app.kubernetes.io/name": "fluidps",
        "app.kubernetes.io/instance": job.name,
        "app.kubernetes.io/managed-by": "fluidps",
    }
    if role is not None:
        out["app.kubernetes.io/component"] = role
    return out


def selector(job: KubernetesJob, role: str) -> dict[str, str]:
    """What picks a role's pods (its Service's selector)."""
    return {"app.kubernetes.io/instance": job.name, "app.kubernetes.io/component": role}


def _metadata(job: KubernetesJob, name: str, role: str | None = None) -> dict[str, Any]:
    return {"name": name, "namespace": job.cluster.namespace, "labels": labels(job, role)}


def contract(job: KubernetesJob) -> dict[str, str]:
    """The ConfigMap's data: the environment every pod shares."""
    cluster = job.cluster
    env = {
        "PADDLE_PSERVERS_IP_PORT_LIST": job.pserver_list(),
        "PADDLE_TRAINERS_NUM": str(job.trainers),
        "PADDLE_PORT": str(cluster.port),
        "FLUIDPS_MODE": job.mode,
        "FLUIDPS_PEER_EXIT_STATUS": str(PEER_FAILURE_STATUS),
        "PYTHONUNBUFFERED": "1",
    }
    if job.keys_dir is not None:
        env["FLUIDPS_KEYS"] = KEYS_MOUNT
    else:
        env["FLUIDPS_INSECURE"] = "1"
    if job.peer_timeout is not None:
        env["FLUIDPS_PEER_TIMEOUT"] = str(job.peer_timeout)
    if cluster.checkpoint_volume is not None:
        env["FLUIDPS_CHECKPOINT_DIR"] = CHECKPOINT_MOUNT
    if job.dataset:
        env["FLUIDPS_DATASET"] = job.dataset
        env["FLUIDPS_COORDINATOR"] = f"tcp://{job.host('coordinator', 0)}:{cluster.port}"
        env["FLUIDPS_ELASTIC"] = "1"  # trainers are restarted: pservers evict and readmit them
    return env


def _role_env(job: KubernetesJob, role: str) -> list[dict[str, Any]]:
    secret = []
    if job.secret is not None:
        reference = {"name": f"{job.name}-job", "key": SECRET_KEY}
        secret = [{"name": SECRET_ENV, "valueFrom": {"secretKeyRef": reference}}]
    if job.serve:  # an executor server listens on its pod's own address
        return [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}, *secret]
    index = {"valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}}}
    if role == "trainer":
        return [
            {"name": "TRAINING_ROLE", "value": "TRAINER"},
            {"name": "PADDLE_TRAINER_ID", **index},
            *secret,
        ]
    env = [{"name": INDEX_ENV, **index}, *secret]
    if role == "pserver":
        own = f"{job.name}-pserver-$({INDEX_ENV}).{job.name}-pserver.{job.cluster.namespace}.svc"
        env += [{"name": "TRAINING_ROLE", "value": "PSERVER"}, {"name": "POD_IP", "value": own}]
    return env


def _command(job: KubernetesJob, role: str) -> list[str]:
    if job.serve:
        flags = [] if job.compile is None else ["--compile" if job.compile else "--no-compile"]
        return ["fluidps", "serve", "--endpoint", f"tcp://$(POD_IP):{job.cluster.port}", *flags]
    if role != "coordinator":
        return list(job.cluster.command)
    snapshot_dir = CHECKPOINT_MOUNT if job.cluster.checkpoint_volume is not None else "/tmp"
    return [
        *("fluidps", "serve", "--role", "coordinator"),
        *("--endpoint", f"tcp://0.0.0.0:{job.cluster.port}"),
        *("--snapshot", f"{snapshot_dir}/coordinator.json"),
    ]


def _volumes(job: KubernetesJob, role: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the pod's volumes, the container's mounts)."""
    volumes, mounts = [], []
    if job.keys_dir is not None:
        items = [{"key": key, "path": path} for key, (path, _) in key_files(job.keys_dir).items()]
        # readable by root and the pod's group (fsGroup) only
        secret = {"secretName": f"{job.name}-keys", "items": items, "defaultMode": 0o440}
        volumes.append({"name": "keys", "secret": secret})
        mounts.append({"name": "keys", "mountPath": KEYS_MOUNT, "readOnly": True})
    cluster = job.cluster
    if cluster.checkpoint_volume is not None and role in ("pserver", "coordinator"):
        volumes.append({"name": "checkpoints", **dict(cluster.checkpoint_volume)})
        mounts.append({"name": "checkpoints", "mountPath": CHECKPOINT_MOUNT})
    if cluster.data_volume is not None and role == "trainer":
        volumes.append({"name": "data", **dict(cluster.data_volume)})
        mounts.append({"name": "data", "mountPath": DATA_MOUNT, "readOnly": True})
    return volumes, mounts


def _container(job: KubernetesJob, role: str, mounts: list[dict[str, Any]]) -> dict[str, Any]:
    cluster = job.cluster
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": cluster.image,
        "imagePullPolicy": cluster.image_pull_policy,
        "command": _command(job, role),
        "envFrom": [{"configMapRef": {"name": f"{job.name}-env"}}],
        "env": _role_env(job, role),
    }
    if role != "trainer" or job.serve:  # it listens: the Service's port, ready once it accepts connections
        container["ports"] = [{"name": PORT_NAME, "containerPort": cluster.port, "protocol": "TCP"}]
        if job.serve and role == "pserver":
            container["ports"].append(
                {"name": LOOP_PORT_NAME, "containerPort": cluster.port + 1, "protocol": "TCP"}
            )
        container["readinessProbe"] = {"tcpSocket": {"port": PORT_NAME}, "periodSeconds": 2}
    if resources := job.resources.to_dict():
        container["resources"] = resources
    if mounts:
        container["volumeMounts"] = mounts
    return container


def _gang(job: KubernetesJob) -> tuple[str, str, str]:
    return GANG_SCHEDULERS[job.cluster.gang_scheduler]


def _job(job: KubernetesJob, role: str, replicas: int) -> dict[str, Any]:
    cluster = job.cluster
    volumes, mounts = _volumes(job, role)
    pod_metadata: dict[str, Any] = {"labels": labels(job, role)}
    pod: dict[str, Any] = {
        "subdomain": f"{job.name}-{role}",
        "restartPolicy": "Never",  # the Job retries a failed pod (podFailurePolicy needs Never)
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": cluster.user,
            "runAsGroup": cluster.user,
            "fsGroup": cluster.user,  # volumes (the keys, checkpoints) belong to its group
        },
        "containers": [_container(job, role, mounts)],
    }
    if volumes:
        pod["volumes"] = volumes
    if cluster.node_selector:
        pod["nodeSelector"] = dict(cluster.node_selector)
    if cluster.tolerations:
        pod["tolerations"] = [dict(t) for t in cluster.tolerations]
    if job.gang:
        _, scheduler, how = _gang(job)
        pod["schedulerName"] = scheduler
        key = GROUP_KEYS[how]
        pod_metadata.setdefault("annotations" if how == "annotation" else "labels", {})[key] = job.name
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(job, f"{job.name}-{role}", role),
        "spec": {
            "completionMode": "Indexed",
            "completions": replicas,
            "parallelism": replicas,
            "backoffLimitPerIndex": cluster.restarts,
            "maxFailedIndexes": 0,  # the job needs every pod: one failed index fails it
            "podFailurePolicy": {
                "rules": [
                    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                    {
                        "action": "FailIndex",
                        "onExitCodes": {
                            "containerName": CONTAINER,
                            "operator": "In",
                            "values": list(PROGRAM_ERRORS),
                        },
                    },
                ]
            },
            "template": {"metadata": pod_metadata, "spec": pod},
        },
    }


def _service(job: KubernetesJob, role: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(job, f"{job.name}-{role}", role),
        "spec": {
            "clusterIP": "None",  # headless: one DNS name per pod
            "publishNotReadyAddresses": True,  # peers find a pod before it listens (and retry)
            "selector": selector(job, role),
            "ports": [
                {"name": PORT_NAME, "port": job.cluster.port, "targetPort": PORT_NAME, "protocol": "TCP"}
            ],
        },
    }


def render(job: KubernetesJob) -> list[dict[str, Any]]:
    """The job's objects as plain dicts, in the order to create them (`kubectl apply -f`
    takes them as one YAML stream: to_yaml)."""
    check(job)
    objects: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _metadata(job, f"{job.name}-env"),
            "data": contract(job),
        }
    ]
    if job.keys_dir is not None:
        data = {
            key: base64.b64encode(content).decode() for key, (_, content) in key_files(job.keys_dir).items()
        }
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": _metadata(job, f"{job.name}-keys"),
                "type": "Opaque",
                "data": data,
            }
        )
    if job.secret is not None:
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": _metadata(job, f"{job.name}-job"),
                "type": "Opaque",
                "data": {SECRET_KEY: base64.b64encode(job.secret.hex().encode()).decode()},
            }
        )
    if job.gang:
        api_version, _, _ = _gang(job)
        members = sum(job.roles().values())
        objects.append(
            {
                "apiVersion": api_version,
                "kind": "PodGroup",
                "metadata": _metadata(job, job.name),
                "spec": {"minMember": members},  # all or nothing: a job without all its pods waits
            }
        )
    for role, replicas in job.roles().items():
        objects += [_service(job, role), _job(job, role, replicas)]
    return objects


def to_yaml(objects: Sequence[Mapping[str, Any]]) -> str:
    """One YAML stream ("---" between documents), as `kubectl apply -f` reads it."""
    import yaml  # PyYAML, a dependency of the k8s extra and of the CLI's render

    return yaml.safe_dump_all([dict(o) for o in objects], sort_keys=False, default_flow_style=False)
