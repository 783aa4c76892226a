"""`fluidps serve` and `fluidps keys gen` as separate processes: servers a RemoteExecutor
connects to (encrypted, reused across jobs), and a pserver run from transpiled files."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import zmq
from rpc_harness import free_port

import fluidps
from fluidps import layers, optimizer
from fluidps.errors import RemoteError, TransportError
from fluidps.executor.transport.proof import JobSecret
from fluidps.executor.transport.rpc import RpcClient
from fluidps.executor.transport.settings import RpcSettings
from fluidps.executor.transport.wire import Kind, Message
from helpers import stop_group

FLUIDPS = [sys.executable, "-m", "fluidps"]
READY = " ready on "


@contextmanager
def _serve(*args: str, name: str, timeout: float = 60) -> Iterator[tuple[subprocess.Popen, str]]:
    """A `fluidps serve` process and the address from its ready line; stopped by its pid."""
    process = subprocess.Popen(
        [*FLUIDPS, "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        line = b""
        while READY.encode() not in line:
            ready, _, _ = select.select([process.stdout], [], [], timeout)
            line = process.stdout.readline() if ready else b""
            if not line:
                pytest.fail(f"{name} did not say it was ready (exit status {process.poll()})")
        yield process, line.decode().split(READY, 1)[1].strip()
    finally:
        stop_group(process)
        process.stdout.close()


def _secret_file(tmp_path) -> Path:
    """A job secret made as a person would: `fluidps secret gen FILE`."""
    path = tmp_path / "job.secret"
    done = subprocess.run([*FLUIDPS, "secret", "gen", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return path


def _model(seed: int = 5) -> tuple[fluidps.Program, fluidps.Program, fluidps.Variable]:
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = seed
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [8])
        y = layers.data("y", [1], dtype="int64")
        loss = layers.mean(layers.softmax_with_cross_entropy(layers.fc(layers.fc(x, 16, act="tanh"), 3), y))
        optimizer.SGD(0.2).minimize(loss)
    return main, startup, loss


def _batch(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(32, 8)).astype("float32")
    return {"x": x, "y": (x[:, :3].argmax(axis=1)).reshape(-1, 1).astype("int64")}


def test_keys_gen_writes_pairs_and_refuses_to_overwrite(tmp_path):
    keys = tmp_path / "keys"
    done = subprocess.run([*FLUIDPS, "keys", "gen", str(keys)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for name in ("server.key", "server.key_secret", "client.key", "client.key_secret", "allowed/client.key"):
        assert (keys / name).is_file(), name
    assert (keys / "server.key_secret").stat().st_mode & 0o077 == 0
    again = subprocess.run([*FLUIDPS, "keys", "gen", str(keys)], capture_output=True, text=True, timeout=60)
    assert again.returncode == 2
    assert "already holds keys" in again.stderr and "--force" in again.stderr
    forced = subprocess.run(
        [*FLUIDPS, "keys", "gen", str(keys), "--force"], capture_output=True, text=True, timeout=60
    )
    assert forced.returncode == 0, forced.stderr


def test_serve_refuses_a_public_address_without_keys():
    done = subprocess.run(
        [*FLUIDPS, "serve", "--endpoint", "tcp://0.0.0.0:0"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "without encryption" in done.stderr and "fluidps keys gen" in done.stderr


def test_serve_refuses_to_start_without_the_jobs_secret_and_secret_gen_makes_one(tmp_path):
    done = subprocess.run([*FLUIDPS, "serve"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "without the job's secret" in done.stderr and "fluidps secret gen FILE" in done.stderr
    secret = _secret_file(tmp_path)
    assert secret.stat().st_mode & 0o777 == 0o600
    again = subprocess.run(
        [*FLUIDPS, "secret", "gen", str(secret)], capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 2 and "already exists" in again.stderr
    secret.chmod(0o644)  # readable by others: refused, as ssh refuses such a key
    shared = subprocess.run(
        [*FLUIDPS, "serve", "--secret-file", str(secret)], capture_output=True, text=True, timeout=60
    )
    assert shared.returncode == 2 and "may be read by other users" in shared.stderr


def test_servers_run_by_hand_serve_a_job_that_names_their_secret_and_nobody_else(tmp_path):
    secret = _secret_file(tmp_path)
    main, startup, loss = _model()
    with (
        _serve("--secret-file", str(secret), "--name", "ps", name="pserver server") as (_, ps_address),
        _serve("--secret-file", str(secret), "--name", "tr", name="trainer server") as (_, tr_address),
    ):
        servers = {"pserver_servers": [ps_address], "trainer_servers": [tr_address]}
        endpoints = {"pserver_endpoints": [f"127.0.0.1:{free_port()}"]}
        with pytest.raises(fluidps.BuilderError, match=r"give JobDesc\(secret_file=...\)"):
            fluidps.RemoteExecutor(fluidps.JobDesc(**servers, **endpoints))
        other = tmp_path / "other"
        other.mkdir()
        stranger = fluidps.JobDesc(**servers, **endpoints, secret_file=str(_secret_file(other)))
        with pytest.raises(TransportError, match="answered without this job's proof"):
            fluidps.RemoteExecutor(stranger)
        job = fluidps.JobDesc(**servers, **endpoints, secret_file=str(secret))
        with fluidps.RemoteExecutor(job) as exe:
            exe.run(startup)
            losses = [float(exe.run(main, feed=_batch(), fetch_list=[loss])[0]) for _ in range(10)]
        assert losses[-1] < losses[0] * 0.8


def test_running_encrypted_servers_serve_one_job_after_another(tmp_path):
    keys = tmp_path / "keys"
    subprocess.run([*FLUIDPS, "keys", "gen", str(keys)], check=True, capture_output=True, timeout=60)
    main, startup, loss = _model()
    with (
        _serve("--keys", str(keys), "--name", "ps", name="pserver server") as (ps, ps_address),
        _serve("--keys", str(keys), "--name", "tr", name="trainer server") as (tr, tr_address),
    ):
        losses = []
        for mode in ("sync", "async"):
            job = fluidps.JobDesc(
                pservers=1,
                trainers=1,
                mode=mode,
                pserver_servers=[ps_address],
                trainer_servers=[tr_address],
                pserver_endpoints=[f"127.0.0.1:{free_port()}"],
                keys_dir=str(keys),
            )
            with fluidps.RemoteExecutor(job) as exe:
                assert exe.server_pids == {}  # nothing started: it connected
                exe.run(startup)
                run = [float(exe.run(main, feed=_batch(), fetch_list=[loss])[0]) for _ in range(15)]
            losses.append(run)
            # The job is over; the servers were reset, not stopped.
            assert ps.poll() is None and tr.poll() is None
        for run in losses:
            assert run[-1] < run[0] * 0.8
        # Both jobs started from the same startup values, so they began at the same loss.
        assert losses[0][0] == pytest.approx(losses[1][0], rel=1e-6)
    assert ps.returncode == 0 and tr.returncode == 0  # SIGTERM stops a server cleanly


def test_serve_runs_a_pserver_from_transpiled_files(tmp_path, monkeypatch):
    main, startup, loss = _model()
    (tmp_path / "main.pb").write_bytes(main.serialize_to_string())
    (tmp_path / "startup.pb").write_bytes(startup.serialize_to_string())
    endpoint = f"127.0.0.1:{free_port()}"
    files = [str(tmp_path / "main.pb"), "--startup", str(tmp_path / "startup.pb")]
    done = subprocess.run(
        [*FLUIDPS, "transpile", *files, "--pservers", endpoint, "-o", str(tmp_path / "job")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    job = tmp_path / "job"
    args = [
        "--role",
        "pserver",
        "--program",
        str(job / "pserver_0.pb"),
        "--startup",
        str(job / "pserver_0_startup.pb"),
    ]
    secret = _secret_file(tmp_path)
    with _serve(*args, "--secret-file", str(secret), name="pserver") as (process, address):
        assert address == endpoint
        monkeypatch.setenv("FLUIDPS_JOB_SECRET_FILE", str(secret))  # the trainer, started by hand too
        trainer_program = fluidps.Program.parse_from_string((job / "trainer.pb").read_bytes())
        trainer_startup = fluidps.Program.parse_from_string((job / "trainer_startup.pb").read_bytes())
        exe = fluidps.Executor()
        exe.run(trainer_startup)
        local = fluidps.Executor()
        local.run(startup)
        for name in [p.name for p in main.all_parameters()]:
            local.scope[name] = exe.scope[name].copy()  # the pserver's initial values
        for step in range(5):
            (got,) = exe.run(trainer_program, feed=_batch(step), fetch_list=[loss.name])
            (want,) = local.run(main, feed=_batch(step), fetch_list=[loss])
            assert float(got) == pytest.approx(float(want), rel=1e-5)
        assert exe.close() == []
        process.wait(30)  # its only trainer is done: the pserver loop ends and the process exits
    assert process.returncode == 0


def test_a_run_of_several_batches_runs_them_in_order_and_answers_each_ones_fetches(tmp_path):
    """A RUN carrying several batches (what RemoteExecutor.run_batches sends) runs them as
    so many steps and answers with each one's fetches; a failing batch is named, and a
    program reading a dataset, whose end cannot be answered batch by batch, is run one
    batch a RUN."""
    records = np.random.default_rng(3).normal(size=(40, 2)).astype("float32")
    fluidps.io.Dataset.write(tmp_path / "data", {"r": records}, records_per_shard=40)
    fed, reading, startup = fluidps.Program(), fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(fed, fluidps.Program()):
        doubled = layers.scale(layers.data("x", [2]), 2.0)
    with fluidps.program_guard(reading, startup):
        r = layers.data("r", [2])
        layers.dataset_reader(tmp_path / "data", [r], batch_size=16, shuffle=False)
        total = layers.reduce_sum(r)
    context = zmq.Context()
    secret = _secret_file(tmp_path)
    with _serve("--name", "batches", "--secret-file", str(secret), name="executor server") as (_, address):
        settings = RpcSettings(secret=JobSecret.read(secret))
        client = RpcClient(context, address, "the executor server", settings)
        try:
            for name, program in (("fed", fed), ("reading", reading), ("startup", startup)):
                client.call(Message(Kind.LOAD, text=name, blobs=[program.serialize_to_string()]))
            client.call(Message(Kind.RUN, text="startup"))
            xs = [np.full((k, 2), k, dtype="float32") for k in (1, 2, 3)]
            reply = client.call(
                Message(Kind.RUN, text="fed", batches=[{"x": x} for x in xs], names=[doubled.name])
            )
            assert reply.kind == Kind.VALUES and not reply.tensors
            for got, x in zip(reply.batches, xs, strict=True):
                np.testing.assert_array_equal(got[doubled.name], 2 * x)
            bad = [{"x": xs[0]}, {"x": xs[1].astype("float64")}]
            with pytest.raises(RemoteError, match=r"batch 2 of the 2 this RUN carried: .*'x'"):
                client.call(Message(Kind.RUN, text="fed", batches=bad, names=[doubled.name]))
            # 40 records, 16 a batch: two batches, then one of 8, then the end of the data.
            two = client.call(Message(Kind.RUN, text="reading", batches=[{}, {}], names=[total.name]))
            assert [float(b[total.name]) for b in two.batches] == pytest.approx(
                [records[:16].sum(), records[16:32].sum()], rel=1e-5
            )
            with pytest.raises(RemoteError, match="reads a dataset: run it one batch a RUN, not 2"):
                client.call(Message(Kind.RUN, text="reading", batches=[{}, {}], names=[total.name]))
            status = json.loads(client.call(Message(Kind.STATUS)).text)
            assert status["ran"]["fed"] == {"runs": 1, "batches": 3}  # failed RUNs are not counted
            assert status["ran"]["reading"] == {"runs": 1, "batches": 2}
        finally:
            client.close()
            context.term()
