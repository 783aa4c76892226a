"""`fluidps launch --stages`: a pipeline script run the Fluid way, one real process per
stage on 127.0.0.1, against the same pipeline trained in one process.

Every process a test starts itself is stopped by its own pid in a `finally`, and every
wait is bounded."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import fluidps
from fluidps.endpoints import pick_free_ports
from fluidps.errors import BuilderError
from fluidps.executor.launch.launcher import Launcher, stage_environments
from helpers import read, wait_until

pytestmark = pytest.mark.timeout(300)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PIPELINE = EXAMPLES / "digits_pipeline.py"
JOB_TIMEOUT = 240.0  # a job that has not ended by then is stuck
PEER_TIMEOUT = 2.0  # FLUIDPS_PEER_TIMEOUT of the job that loses a stage
FAIL_SLACK = 30.0  # how much later than PEER_TIMEOUT a stage may notice, on a loaded machine


def _example(name: str):
    sys.path.insert(0, str(EXAMPLES))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(EXAMPLES))


def fluidps_launch(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "fluidps", "launch", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=JOB_TIMEOUT)


def test_a_launched_pipeline_trains_each_stage_as_the_pipeline_does_in_one_process(tmp_path):
    result = fluidps_launch("--stages", "2", str(PIPELINE), "--epochs", "1", "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[stage.1] epoch 1: loss" in result.stdout
    assert "[stage.0] stage 0: 4 parameters trained" in result.stdout
    assert "[launch] all processes exited with status 0" in result.stderr

    pipeline, digits_mlp = _example("digits_pipeline"), _example("digits_mlp")
    main, startup, _, loss, _ = pipeline.build(seed=1)
    x_train, _, y_train, _ = digits_mlp.load_data(0)
    exe = fluidps.Executor()
    exe.run(startup)
    for _, idx in digits_mlp.shuffled_batches(len(x_train), 1, 64, 0, drop_last=True):
        exe.run(main, feed={"image": x_train[idx], "label": y_train[idx]}, fetch_list=[loss])
    held = {}
    for k in (0, 1):
        with np.load(tmp_path / f"stage.{k}.npz") as saved:
            held[k] = {name: saved[name] for name in saved.files}
    assert len(held[0]) == 4 and len(held[1]) == 2 and not held[0].keys() & held[1].keys()
    for k, params in held.items():
        for name, value in params.items():
            np.testing.assert_allclose(
                value, exe.scope[name], rtol=1e-5, atol=1e-7, err_msg=f"stage {k}: {name}"
            )


def test_replicas_of_a_launched_pipeline_train_as_local_training_on_their_joined_batches(tmp_path):
    args = ("--stages", "2", "--trainers", "2", "--pservers", "1", str(PIPELINE), "--epochs", "1")
    result = fluidps_launch(*args, "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    for name in ("stage.0.0", "stage.0.1", "stage.1.0", "stage.1.1"):
        assert f"[{name}] stage {name.split('.')[1]}: " in result.stdout, name
    assert "[stage.1.0] epoch 1: loss" in result.stdout and "[stage.1.1] epoch 1: loss" in result.stdout

    # Local training of the same program on the batches both replicas took, joined.
    pipeline, digits_mlp = _example("digits_pipeline"), _example("digits_mlp")
    main, startup, _, loss, _ = pipeline.build(seed=1)
    x_train, _, y_train, _ = digits_mlp.load_data(0)
    exe = fluidps.Executor()
    exe.run(startup)
    for _, idx in digits_mlp.shuffled_batches(len(x_train), 1, 2 * 64, 0, drop_last=True):
        exe.run(main, feed={"image": x_train[idx], "label": y_train[idx]}, fetch_list=[loss])
    for k in (0, 1):
        with np.load(tmp_path / f"stage.{k}.npz") as saved:
            assert saved.files, f"stage {k} saved nothing"
            for name in saved.files:  # Adam over float32 sums in another order: 1e-4
                np.testing.assert_allclose(saved[name], exe.scope[name], rtol=1e-4, atol=1e-6, err_msg=name)


def test_a_killed_stage_fails_the_other_naming_it_within_the_peer_timeout(tmp_path):
    ports = pick_free_ports("127.0.0.1", 2)
    env = os.environ | {"FLUIDPS_PEER_TIMEOUT": str(PEER_TIMEOUT)}
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name, stage_env in stage_environments("127.0.0.1", ports, "sync", env):
            with open(tmp_path / f"{name}.out", "w") as so, open(tmp_path / f"{name}.err", "w") as se:
                procs[name] = subprocess.Popen(
                    [sys.executable, str(PIPELINE), "--epochs", "1000"], env=stage_env, stdout=so, stderr=se
                )
        wait_until(
            lambda: (
                "epoch 2:" in read(tmp_path / "stage.1.out")
                or any(p.poll() is not None for p in procs.values())
            ),
            JOB_TIMEOUT,
            "the stages are training",
        )
        assert all(p.poll() is None for p in procs.values()), {n: p.poll() for n, p in procs.items()}

        procs["stage.1"].send_signal(signal.SIGKILL)
        wait_until(lambda: procs["stage.0"].poll() is not None, PEER_TIMEOUT + FAIL_SLACK, "stage 0 fails")
        assert procs["stage.0"].returncode == 1
        errors = [
            line for line in read(tmp_path / "stage.0.err").splitlines() if line.startswith("fluidps.errors.")
        ]
        assert errors and "stage 1" in errors[-1], read(tmp_path / "stage.0.err")[-3000:]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)


def test_every_stage_process_is_told_its_stage_and_where_the_others_listen():
    base = {"PADDLE_PSERVERS_IP_PORT_LIST": "10.0.0.1:1", "FLUIDPS_DATASET": "/data"}
    processes = stage_environments("127.0.0.1", [7001, 7002, 7003], "sync", base)
    assert [name for name, _ in processes] == ["stage.0", "stage.1", "stage.2"]
    for k, (_, env) in enumerate(processes):
        role = fluidps.role_from_env(env)
        assert role.is_trainer and role.is_stage and role.stage == k and role.trainers == 1
        assert role.stage_endpoints == ("127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003")
        assert role.pserver_endpoints == () and role.dataset is None  # (nothing inherited)
        assert env["FLUIDPS_JOB_SECRET"] == processes[0][1]["FLUIDPS_JOB_SECRET"]


def test_replicas_with_pservers_of_their_stages_are_told_who_they_are():
    processes = dict(stage_environments("127.0.0.1", [7001, 7002, 7003, 7004], "sync", {}, replicas=2,
                                        pserver_ports=[7101, 7102, 7201, 7202]))  # fmt: skip
    assert sorted(processes) == [
        "pserver.0.0", "pserver.0.1", "pserver.1.0", "pserver.1.1",
        "stage.0.0", "stage.0.1", "stage.1.0", "stage.1.1",
    ]  # fmt: skip
    replica1_stage0 = fluidps.role_from_env(processes["stage.0.1"])
    assert (replica1_stage0.stage, replica1_stage0.trainer_id, replica1_stage0.trainers) == (0, 1, 2)
    assert replica1_stage0.stage_endpoints == ("127.0.0.1:7003", "127.0.0.1:7004")  # its replica's stages
    assert replica1_stage0.pserver_endpoints == ("127.0.0.1:7101", "127.0.0.1:7102")  # its stage's pservers
    pserver = fluidps.role_from_env(processes["pserver.1.1"])
    assert pserver.is_pserver and pserver.stage == 1 and pserver.current_endpoint == "127.0.0.1:7202"
    assert pserver.pserver_endpoints == ("127.0.0.1:7201", "127.0.0.1:7202") and pserver.trainers == 2
    # each stage's pservers know the incarnations of that stage's processes, in replica order
    incarnations = [processes[f"stage.1.{r}"]["FLUIDPS_INCARNATION"] for r in (0, 1)]
    assert processes["pserver.1.0"]["FLUIDPS_TRAINER_INCARNATIONS"] == ",".join(incarnations)


def test_replicas_without_pservers_are_refused(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("")
    with pytest.raises(
        BuilderError, match="2 replicas of a pipeline keep their parameters in step through pservers"
    ):
        Launcher(str(script), pservers=0, trainers=2, stages=2)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--stages", "2", "--pservers", "1", "x.py"], "give both --trainers (replicas) and --pservers"),
        (["--stages", "2", "--dataset", "d", "x.py"], "give no --dataset"),
        (["--stages", "0", "x.py"], "0 is not in the range"),
        (["x.py"], "give --pservers and --trainers (a parameter-server job), or --stages (a pipeline)"),
    ],
)
def test_bad_stage_arguments_are_one_line_and_status_2(args, message):
    result = fluidps_launch(*args)
    assert result.returncode == 2
    assert result.stderr.startswith("fluidps: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr
