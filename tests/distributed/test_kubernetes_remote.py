"""RemoteExecutor(JobDesc(cluster=...)): the job's executor servers run as pods. No cluster
is reachable here, so tests/k8s_api.py stands in for its API server, and its
LocalKubelet runs each pod for real as a local process on its own loopback address (as
pods have their own IPs, all of them listen on the same port). The client creates the
pods' objects through the kubernetes client, waits for them, talks to them at their pod
IPs, trains as local training does, and deletes them when it closes."""

from __future__ import annotations

import numpy as np
import pytest
from k8s_api import FakeApiServer, LocalKubelet

import fluidps
from fluidps import optimizer
from fluidps.endpoints import pick_free_ports
from fluidps.executor.launch.kubernetes import KubernetesCluster
from fluidps.executor.transport.security import generate_keys
from helpers import build_mlp

pytestmark = pytest.mark.timeout(300)


def _mlp():
    main, startup, loss = build_mlp(hidden=16, classes=4, seed=3)
    with fluidps.program_guard(main, startup):
        optimizer.Adam(0.01).minimize(loss)
    return main, startup, loss


def _batches(n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(5)
    return [
        {"x": rng.normal(size=(8, 64)).astype("float32"), "y": rng.integers(0, 4, (8, 1))} for _ in range(n)
    ]


@pytest.fixture
def cluster_api(tmp_path, monkeypatch):
    server = FakeApiServer(kubelet=LocalKubelet(tmp_path))
    (tmp_path / "kubeconfig").write_text(server.kubeconfig())
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "kubeconfig"))
    yield server
    server.close()  # (stops any pod a failed test left running)


def test_a_remote_executor_runs_its_servers_as_pods_and_deletes_them(cluster_api):
    main, startup, loss = _mlp()
    batches = _batches(5)
    local = fluidps.Executor(compile=False)
    local.run(startup)
    expected = [float(local.run(main, feed=b, fetch_list=[loss])[0]) for b in batches]

    (port,) = pick_free_ports("127.0.0.1", 1)
    cluster = KubernetesCluster(image="registry.example/fluidps:0.1", namespace="ml", port=port)
    config = fluidps.DistributeTranspilerConfig(min_block_size=64)  # cut across both pservers
    job = fluidps.JobDesc(pservers=2, trainers=2, name="mlp", insecure=True, cluster=cluster, config=config)
    with fluidps.RemoteExecutor(job) as exe:
        exe.run(startup)
        got = [float(exe.run(main, feed=b, fetch_list=[loss])[0]) for b in batches]
        kinds = sorted(o["kind"] for o in cluster_api.objects.values())
        assert kinds == ["ConfigMap", "Job", "Job", "Secret", "Service", "Service"]  # Secret: the job's
        pods = cluster_api.kubelet.processes
        assert sorted(pods) == [
            ("mlp-pserver", 0),
            ("mlp-pserver", 1),
            ("mlp-trainer", 0),
            ("mlp-trainer", 1),
        ]
        # the pserver loops listen at their pods' addresses, one port above the servers'
        ips = [pods[("mlp-pserver", i)][1] for i in range(2)]
        assert sorted(exe.plan.endpoints) == sorted(f"{ip}:{port + 1}" for ip in ips)
        assert all(ip.startswith("127.0.") and ip != "127.0.0.1" for ip in ips)
        stats = exe.pserver_stats()
        assert [s["completed_steps"] for s in stats.values()] == [len(batches)] * 2
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert cluster_api.objects == {} and cluster_api.kubelet.processes == {}  # deleted, pods gone


def test_pods_that_fail_are_reported_and_the_objects_deleted(cluster_api, tmp_path):
    (port,) = pick_free_ports("127.0.0.1", 1)
    cluster = KubernetesCluster(image="registry.example/fluidps:0.1", port=port)
    # keys the pods cannot use: FLUIDPS_KEYS points at the Secret's mount path, not here
    generate_keys(tmp_path / "keys")
    job = fluidps.JobDesc(name="broken", keys_dir=str(tmp_path / "keys"), cluster=cluster, start_timeout=120)
    with pytest.raises(fluidps.ExecutionError, match=r"pod default/broken-(pserver|trainer)-0-abcde failed"):
        fluidps.RemoteExecutor(job)
    assert cluster_api.objects == {} and cluster_api.kubelet.processes == {}


def test_a_job_on_a_cluster_gives_no_servers_and_reads_no_dataset_yet():
    cluster = KubernetesCluster(image="x")
    with pytest.raises(fluidps.BuilderError, match="with cluster, the job's servers are its pods"):
        fluidps.JobDesc(cluster=cluster, trainer_servers=["tcp://127.0.0.1:5000"])
    with pytest.raises(fluidps.BuilderError, match="a RemoteExecutor's pods run `fluidps serve`"):
        fluidps.JobDesc(
            cluster=KubernetesCluster(image="x", command=("python", "t.py")), insecure=True
        ).kubernetes_servers()
