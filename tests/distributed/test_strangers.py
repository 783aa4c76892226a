"""Only the job writes. Live jobs on 127.0.0.1 probed by processes outside them (no
secret, or another job's), by a process of the job writing what a variable is not, by
a first speaker taking a trainer's id, and by floods of fake peers: nothing of it is
applied, the jobs train to the numbers they would have without it, and what servers
keep of their peers stays bounded (bench/flood.py drives the floods)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zmq
from remote_models import mlp, mlp_batches
from rpc_harness import free_port

import fluidps
from fluidps.errors import RemoteError
from fluidps.executor.transport.proof import JobSecret
from fluidps.executor.transport.rpc import RpcClient
from fluidps.executor.transport.settings import RpcSettings
from fluidps.executor.transport.wire import Kind, Message, decode, encode
from fluidps.ops.selected_rows import SelectedRows
from helpers import stop_group

ROOT = Path(__file__).resolve().parents[2]  # where `bench` lives
WAIT_MS = 30_000  # the bound of every wait for an answer


def _ask(
    context: zmq.Context, address: str, msg: Message, secret: JobSecret | None, of_the_job: bool = True
) -> Message:
    """`msg` sent on a new raw connection, proven with `secret` (None: not proven); the
    answer, read with that secret when it is the job's, else as the unsigned refusal a
    process outside the job gets."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart(encode(msg, secret))
        assert sock.poll(WAIT_MS), f"no answer to {msg.kind_name}"
        frames = sock.recv_multipart()
    finally:
        sock.close(linger=0)
    return decode(frames, secret) if of_the_job else decode(frames)


def test_no_stranger_writes_a_parameter_and_the_job_sets_only_what_a_variable_is(tmp_path):
    secret_file = tmp_path / "job.secret"
    secret = JobSecret.generate()
    secret.write(secret_file)
    main, startup, loss, _, _ = mlp()
    batches = mlp_batches(6)
    local = fluidps.Executor()
    local.run(startup)
    context = zmq.Context()
    try:
        with fluidps.RemoteExecutor(fluidps.JobDesc(secret_file=str(secret_file))) as exe:
            exe.run(startup)
            for batch in batches[:3]:
                exe.run(main, feed=batch, fetch_list=[loss])
                local.run(main, feed=batch, fetch_list=[loss])
            (endpoint,) = exe.plan.endpoints
            pserver = f"tcp://{endpoint}"
            rows = SelectedRows(np.array([0, 1]), np.ones((2, 32), np.float32), 64)
            writes = [
                {"fc_0.w_0": rows},  # the probe's: a dense parameter made a SelectedRows
                {"fc_2.b_0": np.full(10, 100.0, np.float32)},  # well-formed, mid-training
            ]
            for tensors in writes:  # strangers: no secret, or another job's
                for signer in (None, JobSecret.generate()):
                    set_ = Message(Kind.SET, tensors=tensors, request_id=1)
                    reply = _ask(context, pserver, set_, signer, of_the_job=False)
                    assert reply.kind == Kind.ERROR and "without this job's proof" in reply.text
            # A process of the job may write a variable only as what it is.
            bad = {
                "a SelectedRows for a dense parameter": ({"fc_0.w_0": rows}, "got a SelectedRows"),
                "another shape": ({"fc_2.b_0": np.zeros(4, np.float32)}, "got float32[4], it is float32[10]"),
                "another dtype": (
                    {"fc_2.b_0": np.zeros(10, np.float64)},
                    "got float64[10], it is float32[10]",
                ),
                "no such variable": ({"nothing": np.zeros(3, np.float32)}, "holds no such variable"),
            }
            for what, (tensors, words) in bad.items():
                reply = _ask(context, pserver, Message(Kind.SET, tensors=tensors, request_id=2), secret)
                assert reply.kind == Kind.ERROR and words in reply.text, (what, reply.text)
            for batch in batches[3:]:
                exe.run(main, feed=batch, fetch_list=[loss])
                local.run(main, feed=batch, fetch_list=[loss])
            for p in main.all_parameters():  # nothing of the probe was applied
                np.testing.assert_allclose(exe.scope[p.name], local.scope[p.name], rtol=2e-5, atol=1e-6)
            stats = exe.pserver_stats()[endpoint]
            assert stats["unproven"] == 4
    finally:
        context.term()


def test_a_first_speaker_cannot_take_a_trainer_id_the_pserver_was_told(tmp_path):
    """What RemoteExecutor's deploy does: before anything runs, it CONFIGUREs every pserver's
    executor server with the trainers' incarnations. A process of the job speaking first
    as trainer 0 with another incarnation is refused; the trainer is served."""
    secret = JobSecret.generate()
    secret.write(tmp_path / "job.secret")
    main, startup, *_ = mlp()
    endpoint = f"127.0.0.1:{free_port()}"
    role = fluidps.RoleInfo(
        "PSERVER", trainer_id=0, trainers=1, pserver_endpoints=(endpoint,), current_endpoint=endpoint
    )
    pserver = fluidps.transpile_for_role(role, main, startup)
    command = [sys.executable, "-m", "fluidps", "serve", "--secret-file", str(tmp_path / "job.secret")]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    context = zmq.Context()
    try:
        line = process.stdout.readline().decode()
        assert " ready on " in line, line
        settings = RpcSettings(peer_timeout=20.0, secret=secret)
        server = RpcClient(context, line.split(" ready on ", 1)[1].strip(), "executor server", settings)
        trainer = 0xABC
        server.call(Message(Kind.CONFIGURE, text=json.dumps({"trainer_incarnations": f"{trainer:x}"})))
        for name, program in (("startup", pserver.startup), ("pserver", pserver.main)):
            server.call(Message(Kind.LOAD, text=name, blobs=[program.serialize_to_string()]))
        with pytest.raises(RemoteError, match="before the job loads or runs anything"):
            server.call(Message(Kind.CONFIGURE, text=json.dumps({"incarnation": "1"})))
        server.call(Message(Kind.RUN, text="startup"))
        server.call(Message(Kind.START, text="pserver"))
        names = [p.name for p in main.all_parameters()]
        first = Message(Kind.GET, names=names, trainer_id=0, sender=0xDEAD, request_id=1)
        refusal = _ask(context, f"tcp://{endpoint}", first, secret)
        assert (
            refusal.kind == Kind.ERROR and f"trainer 0 of this job is incarnation {trainer:x}" in refusal.text
        )
        real = _ask(
            context, f"tcp://{endpoint}", Message(Kind.GET, names=names, trainer_id=0, sender=trainer), secret
        )
        assert real.kind == Kind.VALUES and set(real.tensors) == set(names)
        server.close()
    finally:
        stop_group(process)
        process.stdout.close()
        context.term()


def _flood(*args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "bench.flood", *args], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (row,) = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return row


def test_a_pserver_flooded_by_100000_fake_peers_forgets_them_and_trains_on():
    """Fake peers proven with the job's secret (the worst: a process of the job gone
    wrong), each a distinct (trainer id, incarnation): every one is answered, nothing of
    them is kept once they are silent, the server's memory returns to within 10% of
    where it started, and its trainer trains to local training's parameters."""
    row = _flood("--target", "pserver", "--peers", "100000", "--connections", "200", "--steps", "6")
    assert row["fake_peers"] == 100_000 and row["unanswered"] == 0
    assert sum(row["answers"].values()) == row["messages"]
    assert row["kept"]["connections"] <= 4 and row["kept"]["clocks"] == 1  # the trainer's own
    assert row["after_vs_start"] <= 1.10, row
    assert row["params_match_local"] and row["losses_equal_local"]


def test_a_flooded_2x2_job_trains_to_the_parameters_of_an_unprobed_one():
    """Strangers' SETs, GETs, LOADs, RUNs and SHUTDOWNs to every server of a live job,
    malformed frames, another job's messages and fake peers between its steps: all
    refused unread, and the job ends with the unprobed run's parameters, bit for bit,
    each server within 10% of its unprobed peak memory."""
    row = _flood("--target", "job", "--peers", "20000", "--steps", "6")
    assert row["params_equal_unprobed"], row
    assert row["unanswered"] == 0 and set(row["answers"]) == {"refused: no proof"}
    assert all(ratio <= 1.10 for ratio in row["peak_vs_unprobed"].values()), row
