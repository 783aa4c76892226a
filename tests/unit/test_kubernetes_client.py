"""fluidps's Kubernetes client path (fluidps.executor.launch.kubernetes_client, `fluidps k8s
submit / status / logs / delete`): every rendered object goes through the official
client's own models unchanged, and create / watch / delete run against tests/k8s_api.py,
a local HTTP server that answers the few API calls used. It stands in for a cluster,
which these tests cannot reach: it checks the calls and plays the pods' states."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import kubernetes.client
import pytest
from k8s_api import FakeApiServer

import fluidps
from fluidps.executor.launch.kubernetes import KubernetesCluster, to_yaml
from fluidps.executor.launch.kubernetes_client import LOG_LINES, KubernetesClient
from fluidps.executor.transport.security import generate_keys


@pytest.fixture(scope="module")
def objects(tmp_path_factory) -> list[dict]:
    keys = tmp_path_factory.mktemp("keys")
    generate_keys(keys, overwrite=True)
    job = fluidps.JobDesc(pservers=2, trainers=2, name="ctr", keys_dir=str(keys), gang=True)
    cluster = KubernetesCluster(
        image="registry.example/fluidps:0.1",
        namespace="ml",
        command=("python", "/app/train.py"),
        checkpoint_volume={"persistentVolumeClaim": {"claimName": "ckpt"}},
    )
    return job.to_kubernetes(cluster, dataset="/data/clicks")


@pytest.fixture
def api():
    servers = []

    def start(pod_state=None) -> tuple[FakeApiServer, KubernetesClient]:
        server = FakeApiServer(pod_state)
        servers.append(server)
        client = kubernetes.client.ApiClient(kubernetes.client.Configuration(host=server.url))
        return server, KubernetesClient(client)

    yield start
    for server in servers:
        server.close()


def test_every_built_in_object_goes_through_the_client_models_unchanged(objects, api):
    _, client = api()
    serialize = kubernetes.client.ApiClient().sanitize_for_serialization
    built_in = [o for o in objects if o["kind"] != "PodGroup"]
    assert {o["kind"] for o in built_in} == {"ConfigMap", "Secret", "Service", "Job"}
    for obj in built_in:
        # no field is lost or renamed on the way into the client's model and out again
        assert serialize(client.model(obj)) == obj, obj["kind"]


def test_submit_creates_the_objects_in_order_and_waits_until_the_pservers_are_ready(objects, api):
    # pserver 1 gets ready only at the third look: submit must keep watching until then
    server, client = api(
        lambda role, i, polls: ("Running", role != "pserver" or i == 0 or polls >= 2, None, "")
    )
    client.submit(objects, timeout=60)
    posts = [path for method, path in server.requests if method == "POST"]
    assert posts == [
        "/api/v1/namespaces/ml/configmaps",
        "/api/v1/namespaces/ml/secrets",
        "/api/v1/namespaces/ml/secrets",  # the keys, the job's secret
        "/apis/scheduling.volcano.sh/v1beta1/namespaces/ml/podgroups",
        *(
            path
            for role in ("pserver", "trainer", "coordinator")
            for path in ("/api/v1/namespaces/ml/services", "/apis/batch/v1/namespaces/ml/jobs")
        ),
    ]
    assert server.polls >= 3
    stored = {(o["kind"], o["metadata"]["name"]): o for o in server.objects.values()}
    assert stored == {(o["kind"], o["metadata"]["name"]): o for o in objects}  # what was rendered, as sent


def test_a_pod_that_fails_is_reported_with_its_last_log_lines(objects, api):
    log = "\n".join(f"line {i}" for i in range(40)) + "\nValueError: the dataset is empty"

    def state(role, index, polls):
        if role == "trainer" and index == 1:
            return ("Failed", False, 1, log)
        return ("Running", role != "pserver", None, "")  # the pservers never get ready

    _, client = api(state)
    with pytest.raises(fluidps.ExecutionError) as caught:
        client.submit(objects, timeout=60)
    message = str(caught.value)
    assert message.startswith("pod ml/ctr-trainer-1-abcde failed (exit status 1, Error); its last lines:")
    tail = message.splitlines()[1:]
    assert len(tail) == LOG_LINES and tail[-1] == "ValueError: the dataset is empty" and tail[0] == "line 21"


def test_pservers_not_ready_in_time_are_named(objects, api):
    _, client = api(
        lambda role, i, polls: ("Pending" if role == "pserver" and i == 1 else "Running", i == 0, None, "")
    )
    with pytest.raises(
        fluidps.ExecutionError, match=r"1 of 2 pservers ready after 1 s \(not ready: ctr-pserver-1-abcde\)"
    ):
        client.submit(objects, timeout=1.0)


def test_a_job_whose_name_is_taken_is_refused(objects, api):
    _, client = api()
    client.submit(objects, timeout=None)
    with pytest.raises(
        fluidps.ExecutionError, match="ConfigMap ml/ctr-env exists already: a job named 'ctr' runs"
    ):
        client.submit(objects, timeout=None)


def test_a_create_that_fails_midway_leaves_nothing_of_the_job_behind(objects, api):
    server, client = api()
    secret = next(o for o in objects if o["kind"] == "Secret")
    client.create(secret)  # somebody's Secret of that name is there already
    with pytest.raises(fluidps.ExecutionError, match="Secret ml/ctr-keys exists already"):
        client.submit(objects, timeout=None)
    # the ConfigMap it had created is deleted again; the Secret it did not create stays
    assert sorted(key[0] for key in server.objects) == ["secrets"]


def test_status_logs_and_delete(objects, api):
    def state(role, index, polls):
        return (
            ("Succeeded", False, 0, f"{role} {index} done")
            if role == "trainer"
            else ("Running", True, None, "")
        )

    server, client = api(state)
    client.submit(objects, timeout=30)
    status = client.status("ctr", "ml")
    assert status["roles"]["trainer"] == {
        "completions": 2,
        "active": 0,
        "succeeded": 2,
        "failed": 0,
        "failed_indexes": "",
    }
    assert status["roles"]["pserver"]["active"] == 2
    assert status["pods"]["ctr-pserver-0-abcde"] == {"phase": "Running", "ready": True, "restarts": 0}
    assert client.logs("ctr", "ml", role="trainer") == {
        "ctr-trainer-0-abcde": "trainer 0 done",
        "ctr-trainer-1-abcde": "trainer 1 done",
    }
    gone = client.delete("ctr", "ml")
    roles = ("pserver", "trainer", "coordinator")
    want = [f"{kind}/ctr-{role}" for kind in ("Job", "Service") for role in roles]
    assert sorted(gone) == sorted(
        [*want, "ConfigMap/ctr-env", "Secret/ctr-keys", "Secret/ctr-job", "PodGroup/ctr"]
    )
    assert server.objects == {}
    with pytest.raises(fluidps.ExecutionError, match="no job 'ctr' in namespace 'ml'"):
        client.delete("ctr", "ml")
    with pytest.raises(fluidps.ExecutionError, match="no job 'ctr' in namespace 'ml'"):
        client.status("ctr", "ml")


def test_the_cli_drives_a_job_through_the_kubeconfig(objects, tmp_path):
    server = FakeApiServer(lambda role, i, polls: ("Running", True, None, f"{role} {i} says hello"))
    try:
        (tmp_path / "kubeconfig").write_text(server.kubeconfig())
        (tmp_path / "job.yaml").write_text(to_yaml(objects))
        env = dict(os.environ, KUBECONFIG=str(tmp_path / "kubeconfig"))

        def k8s(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run(
                [sys.executable, "-m", "fluidps", "k8s", *args],
                capture_output=True,
                text=True,
                timeout=120,
                env=env,
            )

        submitted = k8s("submit", str(tmp_path / "job.yaml"), "--timeout", "60")
        assert submitted.returncode == 0, submitted.stderr
        assert submitted.stdout.strip() == "job ctr running: its pservers are ready"
        status = json.loads(k8s("status", "ctr", "-n", "ml").stdout)
        assert sorted(status["roles"]) == ["coordinator", "pserver", "trainer"]
        logs = k8s("logs", "ctr", "-n", "ml", "--role", "pserver").stdout.splitlines()
        assert logs == [
            "[ctr-pserver-0-abcde] pserver 0 says hello",
            "[ctr-pserver-1-abcde] pserver 1 says hello",
        ]
        again = k8s("submit", str(tmp_path / "job.yaml"), "--no-wait")
        assert again.returncode == 2 and "exists already" in again.stderr
        deleted = k8s("delete", "ctr", "-n", "ml")
        assert deleted.returncode == 0 and "deleted Job/ctr-pserver" in deleted.stdout.splitlines()
        (tmp_path / "bad.yaml").write_text("kind: [unclosed")
        bad = k8s("submit", str(tmp_path / "bad.yaml"))
        assert bad.returncode == 2 and "is not YAML" in bad.stderr
    finally:
        server.close()
