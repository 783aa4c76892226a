"""A job rendered as Kubernetes objects (fluidps.executor.launch.kubernetes): valid for
Kubernetes by its own schemas (kubernetes-validate, strict, pinned version), and keeping
the rules the schemas do not state: enums, the environment contract of every role, DNS
names that match their Services, selectors that match their pods, ports that agree.
No API server is reachable here; tests/distributed/test_kubernetes_env.py runs the
rendered environment for real."""

from __future__ import annotations

import base64
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml
from k8s_pods import find, pod_env, role_job

import fluidps
from fluidps.executor.env import SECRET_ENV, role_from_env, rpc_settings_from_env
from fluidps.executor.launch.kubernetes import (
    CHECKPOINT_MOUNT,
    INDEX_ANNOTATION,
    KEYS_MOUNT,
    KubernetesCluster,
    Resources,
    to_yaml,
)
from fluidps.executor.transport.proof import JobSecret
from fluidps.executor.transport.security import generate_keys

KUBERNETES_VERSION = "1.33.0"  # the oldest release with backoffLimitPerIndex and podFailurePolicy GA
COMMAND = ("python", "/app/train.py")


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys")
    generate_keys(path, overwrite=True)
    return str(path)


def cluster(**fields) -> KubernetesCluster:
    return KubernetesCluster(**{"image": "registry.example/fluidps:0.1", "command": COMMAND, **fields})


def full_job(keys: str, scheduler: str = "volcano") -> list[dict]:
    """2 pservers x 3 trainers reading a dataset, with keys, resources, gang scheduling,
    volumes, a node selector and a toleration."""
    job = fluidps.JobDesc(
        pservers=2,
        trainers=3,
        mode="async",
        name="ctr",
        keys_dir=keys,
        resources=Resources(cpu="2", memory="4Gi", cpu_limit="4", memory_limit="6Gi"),
        gang=True,
    )
    return job.to_kubernetes(
        cluster(
            namespace="ml",
            node_selector={"pool": "cpu"},
            tolerations=({"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"},),
            checkpoint_volume={"persistentVolumeClaim": {"claimName": "ctr-checkpoints"}},
            data_volume={"persistentVolumeClaim": {"claimName": "clicks"}},
            gang_scheduler=scheduler,
        ),
        dataset="/var/lib/fluidps/data/clicks",
    )


def small_job() -> list[dict]:
    return fluidps.JobDesc(name="demo", insecure=True).to_kubernetes(image="fluidps:0.1", command=COMMAND)


def kinds(objects: list[dict]) -> list[tuple[str, str]]:
    return [(o["kind"], o["metadata"]["name"]) for o in objects]


def test_the_objects_of_a_job_in_the_order_to_create_them(keys):
    assert kinds(full_job(keys)) == [
        ("ConfigMap", "ctr-env"),
        ("Secret", "ctr-keys"),
        ("Secret", "ctr-job"),  # the job's secret: every message of the job proves it
        ("PodGroup", "ctr"),
        ("Service", "ctr-pserver"),
        ("Job", "ctr-pserver"),
        ("Service", "ctr-trainer"),
        ("Job", "ctr-trainer"),
        ("Service", "ctr-coordinator"),  # the job reads a dataset: a coordinator hands out its tasks
        ("Job", "ctr-coordinator"),
    ]
    assert kinds(small_job()) == [  # no keys (insecure), no gang, no dataset; still a secret
        ("ConfigMap", "demo-env"),
        ("Secret", "demo-job"),
        ("Service", "demo-pserver"),
        ("Job", "demo-pserver"),
        ("Service", "demo-trainer"),
        ("Job", "demo-trainer"),
    ]


@pytest.mark.parametrize("scheduler", ["volcano", "scheduler-plugins"])
def test_every_built_in_object_is_valid_by_kubernetes_own_schemas(keys, scheduler):
    objects = full_job(keys, scheduler) + small_job()
    for o in objects:
        if o["kind"] == "PodGroup":  # a CRD: no schema ships with Kubernetes (checked below)
            continue
        kubernetes_validate.validate(o, KUBERNETES_VERSION, strict=True)
    # strict validation rejects what Kubernetes does not know: a misspelled field fails
    job = role_job(small_job(), "trainer")
    broken = {**job, "spec": {**job["spec"], "completionsMode": "Indexed"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize(
    "scheduler, api_version, scheduler_name, where, key",
    [
        (
            "volcano",
            "scheduling.volcano.sh/v1beta1",
            "volcano",
            "annotations",
            "scheduling.k8s.io/group-name",
        ),
        (
            "scheduler-plugins",
            "scheduling.x-k8s.io/v1alpha1",
            "scheduler-plugins-scheduler",
            "labels",
            "scheduling.x-k8s.io/pod-group",
        ),
    ],
)
def test_a_gang_is_one_pod_group_of_every_pod(keys, scheduler, api_version, scheduler_name, where, key):
    objects = full_job(keys, scheduler)
    group = find(objects, "PodGroup", "ctr")
    assert group["apiVersion"] == api_version and group["metadata"]["namespace"] == "ml"
    jobs = [o for o in objects if o["kind"] == "Job"]
    assert group["spec"]["minMember"] == sum(j["spec"]["completions"] for j in jobs) == 2 + 3 + 1
    for j in jobs:
        template = j["spec"]["template"]
        assert template["spec"]["schedulerName"] == scheduler_name
        assert template["metadata"][where][key] == "ctr"


def test_jobs_are_indexed_and_retry_what_a_retry_can_fix(keys):
    for o in full_job(keys):
        if o["kind"] != "Job":
            continue
        spec, pod = o["spec"], o["spec"]["template"]["spec"]
        assert spec["completionMode"] == "Indexed"
        assert spec["completions"] == spec["parallelism"] >= 1
        assert spec["backoffLimitPerIndex"] == 3 and spec["maxFailedIndexes"] == 0
        assert pod["restartPolicy"] in ("Never", "OnFailure")
        assert pod["restartPolicy"] == "Never"  # podFailurePolicy requires it
        rules = spec["podFailurePolicy"]["rules"]
        # the node took the pod away: retried without counting; a program error: not retried
        assert rules[0] == {
            "action": "Ignore",
            "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
        }
        assert rules[1]["action"] == "FailIndex"
        assert rules[1]["onExitCodes"] == {"containerName": "fluidps", "operator": "In", "values": [1, 2]}
        # a peer's failure (FLUIDPS_PEER_EXIT_STATUS) matches no rule: it counts as a retry
        peer_status = int(find(full_job(keys), "ConfigMap", "ctr-env")["data"]["FLUIDPS_PEER_EXIT_STATUS"])
        assert peer_status not in rules[1]["onExitCodes"]["values"]


def test_every_pod_gets_the_whole_environment_contract_of_its_role(keys):
    objects = full_job(keys)
    endpoints = [f"ctr-pserver-{i}.ctr-pserver.ml.svc:6174" for i in range(2)]
    for i in range(2):
        env = pod_env(objects, "pserver", i)
        role = role_from_env(env)  # raises naming any variable missing or malformed
        assert role.is_pserver and role.pserver_endpoints == tuple(endpoints)
        assert role.current_endpoint == endpoints[i] and role.pserver_index == i
        assert role.mode == "async" and role.trainers == 3
        assert env["FLUIDPS_CHECKPOINT_DIR"] == CHECKPOINT_MOUNT and env["FLUIDPS_KEYS"] == KEYS_MOUNT
    for i in range(3):
        env = pod_env(objects, "trainer", i)
        role = role_from_env(env)
        assert role.is_trainer and role.trainer_id == i  # from the completion index
        assert role.dataset == "/var/lib/fluidps/data/clicks"
        assert env["FLUIDPS_COORDINATOR"] == "tcp://ctr-coordinator-0.ctr-coordinator.ml.svc:6174"
    # the trainer id comes from the annotation the Job controller gives each pod
    (trainer_id,) = [v for v in role_job(objects, "trainer")["spec"]["template"]["spec"]["containers"][0]["env"]
                     if v["name"] == "PADDLE_TRAINER_ID"]  # fmt: skip
    assert trainer_id["valueFrom"]["fieldRef"]["fieldPath"] == f"metadata.annotations['{INDEX_ANNOTATION}']"


def test_dns_names_selectors_and_ports_agree_with_the_services(keys):
    objects = full_job(keys)
    data = find(objects, "ConfigMap", "ctr-env")["data"]
    port = int(data["PADDLE_PORT"])
    for role, replicas in (("pserver", 2), ("trainer", 3), ("coordinator", 1)):
        service, job = find(objects, "Service", f"ctr-{role}"), role_job(objects, role)
        template = job["spec"]["template"]
        assert service["spec"]["clusterIP"] == "None"  # headless: a DNS name per pod
        assert template["spec"]["subdomain"] == service["metadata"]["name"]
        selected = service["spec"]["selector"]
        assert selected.items() <= template["metadata"]["labels"].items()
        others = [o for o in objects if o["kind"] == "Job" and o is not job]
        assert not any(
            selected.items() <= o["spec"]["template"]["metadata"]["labels"].items() for o in others
        )
        (service_port,) = service["spec"]["ports"]
        assert service_port["port"] == port
        (container,) = template["spec"]["containers"]
        if role != "trainer":
            (container_port,) = container["ports"]
            assert container_port["containerPort"] == port
            assert service_port["targetPort"] == container_port["name"]
            assert container["readinessProbe"]["tcpSocket"]["port"] == container_port["name"]
        # Indexed Job pods are named <job>-<index>: with the subdomain, <job>-<i>.<service>.<ns>.svc
        hosts = [
            f"{job['metadata']['name']}-{i}.{service['metadata']['name']}.ml.svc" for i in range(replicas)
        ]
        if role == "pserver":
            assert data["PADDLE_PSERVERS_IP_PORT_LIST"] == ",".join(f"{h}:{port}" for h in hosts)
        if role == "coordinator":
            assert data["FLUIDPS_COORDINATOR"] == f"tcp://{hosts[0]}:{port}"


def test_keys_are_a_secret_mounted_read_only_and_volumes_go_where_they_are_used(keys):
    objects = full_job(keys)
    secret = find(objects, "Secret", "ctr-keys")
    for role in ("pserver", "trainer", "coordinator"):
        pod = role_job(objects, role)["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
        assert volumes.keys() == mounts.keys()
        assert mounts["keys"] == {"name": "keys", "mountPath": KEYS_MOUNT, "readOnly": True}
        items = volumes["keys"]["secret"]["items"]
        assert {i["key"] for i in items} == set(secret["data"])
        for item in items:  # every file of the key directory, at its place
            with open(f"{keys}/{item['path']}", "rb") as f:
                assert base64.b64decode(secret["data"][item["key"]]) == f.read()
        assert ("checkpoints" in volumes) == (role != "trainer")
        assert ("data" in volumes) == (role == "trainer")
        assert pod["nodeSelector"] == {"pool": "cpu"} and pod["tolerations"][0]["key"] == "dedicated"
        # never root; the keys readable by the pod's group only (fsGroup owns the volume)
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["fsGroup"] == 10001
        assert volumes["keys"]["secret"]["defaultMode"] == 0o440
        resources = pod["containers"][0]["resources"]
        assert resources == {
            "requests": {"cpu": "2", "memory": "4Gi"},
            "limits": {"cpu": "4", "memory": "6Gi"},
        }


def test_every_pod_reads_the_jobs_secret_and_each_rendering_makes_a_new_one(keys):
    objects = full_job(keys)
    secret = find(objects, "Secret", "ctr-job")
    (text,) = {pod_env(objects, role, 0)[SECRET_ENV] for role in ("pserver", "trainer", "coordinator")}
    assert base64.b64decode(secret["data"]["secret"]).decode() == text
    assert rpc_settings_from_env({SECRET_ENV: text}).secret == JobSecret.from_hex(text, SECRET_ENV)
    assert text not in to_yaml([o for o in objects if o["kind"] != "Secret"])  # only in the Secret
    again = find(full_job(keys), "Secret", "ctr-job")
    assert again["data"] != secret["data"]  # a job of its own, a secret of its own


def test_the_yaml_stream_holds_the_objects_and_the_cli_writes_it(keys, tmp_path):
    objects = full_job(keys)
    assert list(yaml.safe_load_all(to_yaml(objects))) == objects
    out = tmp_path / "job.yaml"
    args = ["--name", "ctr", "--pservers", "2", "--trainers", "2", "--image", "fluidps:0.1", "--keys", keys]
    args += ["--gang", "--cpu", "2", "--memory", "4Gi", "--checkpoint-claim", "ckpt", "-o", str(out)]
    result = subprocess.run(
        [sys.executable, "-m", "fluidps", "k8s", "render", *args, "python", "/app/train.py", "--epochs", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    written = list(yaml.safe_load_all(out.read_text()))
    for o in written:
        if o["kind"] != "PodGroup":
            kubernetes_validate.validate(o, KUBERNETES_VERSION, strict=True)
    trainer = role_job(written, "trainer")["spec"]["template"]["spec"]["containers"][0]
    assert trainer["command"] == ["python", "/app/train.py", "--epochs", "3"]  # its options stay its own
    assert trainer["resources"] == {"requests": {"cpu": "2", "memory": "4Gi"}}


@pytest.mark.parametrize(
    "job_fields, cluster_fields, message",
    [
        ({"name": "Bad_Name"}, {}, "name='Bad_Name' is not a DNS-1123 label"),
        ({"name": "x" * 60}, {}, "is too long: pod host names such as"),
        ({}, {"namespace": "ML"}, "namespace='ML' is not a DNS-1123 label"),
        ({"resources": Resources(memory="4GB")}, {}, "resources.memory='4GB' is not a Kubernetes quantity"),
        ({"resources": Resources(cpu="two")}, {}, "resources.cpu='two' is not a Kubernetes quantity"),
        ({"insecure": False}, {}, "keys_dir is not set"),
        ({}, {"image": ""}, "image='': give the container image"),
        ({}, {"command": ()}, "command=(): give what every pserver and trainer pod runs"),
        ({}, {"image_pull_policy": "Sometimes"}, "image_pull_policy='Sometimes' is not one of"),
        ({}, {"port": 70000}, "port=70000 is not a TCP port"),
        ({}, {"restarts": -1}, "restarts=-1 must be an integer >= 0"),
        ({}, {"gang_scheduler": "yunikorn"}, "gang_scheduler='yunikorn' is not one of"),
        ({}, {"user": 0}, "user=0 must be a uid from 1 to 2\\*\\*31 - 1: pods never run as root"),
    ],
)
def test_bad_input_names_the_field_and_the_rule_before_anything_is_rendered(
    job_fields, cluster_fields, message
):
    job = fluidps.JobDesc(**{"insecure": True, **job_fields})
    with pytest.raises(fluidps.BuilderError, match=message.replace("(", r"\(").replace(")", r"\)")):
        job.to_kubernetes(cluster(**cluster_fields))


def test_zero_replicas_and_a_key_directory_without_keys_are_refused(tmp_path):
    with pytest.raises(
        fluidps.BuilderError, match="pservers=0: a job needs at least one pserver and one trainer"
    ):
        fluidps.JobDesc(pservers=0)
    with pytest.raises(fluidps.BuilderError, match="trainers=0: a job needs"):
        fluidps.JobDesc(trainers=0)
    empty = tmp_path / "keys"
    empty.mkdir()
    with pytest.raises(
        fluidps.BuilderError, match=r"holds no fluidps keys \(missing server.key.*fluidps keys gen"
    ):
        fluidps.JobDesc(keys_dir=str(empty)).to_kubernetes(cluster())
    args = [
        "--name",
        "a",
        "--pservers",
        "0",
        "--trainers",
        "1",
        "--image",
        "x",
        "--insecure",
        "python",
        "t.py",
    ]
    result = subprocess.run(
        [sys.executable, "-m", "fluidps", "k8s", "render", *args], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "fluidps: error: --pservers 0: a job needs at least one pserver and one trainer"
    ]
