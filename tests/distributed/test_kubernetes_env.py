"""The rendered Kubernetes job, run for real without a cluster: each pod's process starts
here with exactly the environment the kubelet would give it (tests/k8s_pods.py: its
ConfigMap, its own variables, its completion index), the DNS names of the pservers
replaced by 127.0.0.1 (each with a port of its own, as they share one host here) and
the keys' mount by the key directory; the job must train as `fluidps launch` trains the
same script."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from k8s_pods import pod_env

import fluidps
from fluidps.endpoints import pick_free_ports
from fluidps.executor.env import CONTRACT_VARS
from fluidps.executor.launch.kubernetes import KEYS_MOUNT, KubernetesCluster
from fluidps.executor.transport.security import generate_keys

pytestmark = pytest.mark.timeout(300)

CTR_JOB = Path(__file__).with_name("ctr_job.py")
JOB_TIMEOUT = 180.0
STEPS = "6"


def _local_env(env: dict[str, str], hosts: dict[str, int], keys: str) -> dict[str, str]:
    """A pod's environment for a process on this machine."""
    env = dict(env)
    endpoints = []
    for endpoint in env["PADDLE_PSERVERS_IP_PORT_LIST"].split(","):
        host, _, _ = endpoint.rpartition(":")
        endpoints.append(f"127.0.0.1:{hosts[host]}")
    env["PADDLE_PSERVERS_IP_PORT_LIST"] = ",".join(endpoints)
    if "POD_IP" in env:  # a pserver: its own DNS name, and the port it alone has here
        env["PADDLE_PORT"] = str(hosts[env["POD_IP"]])
        env["POD_IP"] = "127.0.0.1"
    assert env["FLUIDPS_KEYS"] == KEYS_MOUNT
    env["FLUIDPS_KEYS"] = keys
    inherited = {
        k: v for k, v in os.environ.items() if k not in CONTRACT_VARS and not k.startswith("FLUIDPS_")
    }
    return {**inherited, **env}


def _run_pods(objects: list[dict], keys: str, log_dir: Path) -> dict[str, int]:
    """Start every pserver and trainer pod's process; their exit statuses by pod name."""
    hosts = dict(
        zip(
            [f"ctr-pserver-{i}.ctr-pserver.default.svc" for i in range(2)],
            pick_free_ports("127.0.0.1", 2),
            strict=True,
        )
    )
    pods = [("pserver", i) for i in range(2)] + [("trainer", i) for i in range(2)]
    processes: dict[str, subprocess.Popen] = {}
    try:
        for role, i in pods:
            job = next(o for o in objects if o["kind"] == "Job" and o["metadata"]["name"] == f"ctr-{role}")
            command = job["spec"]["template"]["spec"]["containers"][0]["command"]
            name = f"ctr-{role}-{i}"
            with open(log_dir / f"{name}.log", "wb") as log:
                processes[name] = subprocess.Popen(
                    command,
                    env=_local_env(pod_env(objects, role, i), hosts, keys),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        statuses = {}
        for name, process in processes.items():
            try:
                statuses[name] = process.wait(timeout=JOB_TIMEOUT)
            except subprocess.TimeoutExpired:
                logs = {n: (log_dir / f"{n}.log").read_text()[-2000:] for n in processes}
                pytest.fail(f"{name} did not end in {JOB_TIMEOUT:.0f} s: {logs}")
        return statuses
    finally:
        for process in processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)


def test_the_rendered_pods_train_as_the_fluidps_launch_job(tmp_path):
    keys = tmp_path / "keys"
    generate_keys(keys)
    launched, pods = tmp_path / "launched", tmp_path / "pods"
    launched.mkdir()
    pods.mkdir()
    command = (sys.executable, str(CTR_JOB), str(pods), STEPS, "sgd")
    job = fluidps.JobDesc(pservers=2, trainers=2, name="ctr", keys_dir=str(keys))
    objects = job.to_kubernetes(KubernetesCluster(image="fluidps:test", command=command))

    statuses = _run_pods(objects, str(keys), tmp_path)
    logs = {p.name: p.read_text()[-2000:] for p in tmp_path.glob("*.log")}
    assert statuses == dict.fromkeys(
        ["ctr-pserver-0", "ctr-pserver-1", "ctr-trainer-0", "ctr-trainer-1"], 0
    ), logs

    launch = [sys.executable, "-m", "fluidps", "launch", "--pservers", "2", "--trainers", "2"]
    reference = subprocess.run(
        [*launch, str(CTR_JOB), str(launched), STEPS, "sgd"],
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT,
    )
    assert reference.returncode == 0, reference.stderr[-3000:]
    for i in range(2):
        want = (launched / f"trainer.{i}.json").read_text()
        got = (pods / f"trainer.{i}.json").read_text()
        np.testing.assert_allclose(_losses(got), _losses(want), rtol=1e-6)
        with np.load(pods / f"trainer.{i}.final.npz") as g, np.load(launched / f"trainer.{i}.final.npz") as w:
            assert sorted(g.files) == sorted(w.files)
            for name in w.files:
                np.testing.assert_allclose(g[name], w[name], rtol=1e-6, atol=1e-7, err_msg=name)
    # each pserver found its own address in the list: it wrote its stats under its index
    assert sorted(p.name for p in pods.glob("pserver.*.json")) == ["pserver.0.json", "pserver.1.json"]


def _losses(text: str) -> list[float]:
    return json.loads(text)["losses"]
