"""A real pserver process (`fluidps serve --role pserver`) fed malformed and oversized
messages on raw ZeroMQ DEALER sockets: it rejects each one, counts it in its stats,
keeps serving other clients, and a real trainer trains against it afterwards.
Also: FLUIDPS_MAX_MESSAGE_BYTES is validated."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import zmq
from rpc_harness import SECRET, free_port, signed

import fluidps
from fluidps import layers, optimizer
from fluidps.errors import TransportError
from fluidps.executor.env import rpc_settings_from_env
from fluidps.executor.ps.keepalive import Keepalive
from fluidps.executor.ps.message_limit import FLOOR
from fluidps.executor.transport import wire_pb2 as pb
from fluidps.executor.transport.proof import JobSecret
from fluidps.executor.transport.rpc import RpcClient
from fluidps.executor.transport.settings import RpcSettings
from fluidps.executor.transport.wire import Kind, Message, decode, encode
from fluidps.ir.types import VarType
from fluidps.ops.selected_rows import SelectedRows
from helpers import stop_group

FLUIDPS = [sys.executable, "-m", "fluidps"]
READY = " ready on "
WAIT = 30.0  # seconds: the bound of every wait for an answer
MAX_BYTES = 100_000
SETTINGS = RpcSettings(heartbeat_interval=0.1, peer_timeout=20.0, request_timeout=120.0, secret=SECRET)
TRAINER = 0x7A1  # the incarnation (sender) of these tests' trainer 0


def _model() -> tuple[fluidps.Program, fluidps.Program, fluidps.Variable]:
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 7
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [8])
        y = layers.data("y", [1], dtype="int64")
        loss = layers.mean(layers.softmax_with_cross_entropy(layers.fc(layers.fc(x, 16, act="tanh"), 3), y))
        optimizer.SGD(0.2).minimize(loss)
    return main, startup, loss


def _gradients() -> dict[str, np.ndarray]:
    """One step's gradients of _model()'s four parameters, each a distinct constant."""
    return {
        "fc_0.w_0@GRAD": np.full((8, 16), 0.5, np.float32),
        "fc_0.b_0@GRAD": np.full(16, 0.25, np.float32),
        "fc_1.w_0@GRAD": np.full((16, 3), -1.0, np.float32),
        "fc_1.b_0@GRAD": np.full(3, 2.0, np.float32),
    }


def _batch(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(16, 8)).astype("float32")
    return {"x": x, "y": x[:, :3].argmax(axis=1).reshape(-1, 1).astype("int64")}


def _pserver_files(tmp_path: Path) -> tuple[list[str], str, fluidps.DistributedPlan]:
    """The pserver programs of a one-pserver sync job of _model, written into `tmp_path`:
    (`fluidps serve` arguments naming them, the pserver's endpoint, the job's plan)."""
    main, startup, _ = _model()
    endpoint = f"127.0.0.1:{free_port()}"
    role = fluidps.RoleInfo(
        "PSERVER", trainer_id=0, trainers=1, pserver_endpoints=(endpoint,), current_endpoint=endpoint
    )
    pserver = fluidps.transpile_for_role(
        role, main, startup, fluidps.DistributeTranspilerConfig(min_block_size=8)
    )
    (tmp_path / "ps.pb").write_bytes(pserver.main.serialize_to_string())
    (tmp_path / "ps_startup.pb").write_bytes(pserver.startup.serialize_to_string())
    files = ["--program", str(tmp_path / "ps.pb"), "--startup", str(tmp_path / "ps_startup.pb")]
    return ["--role", "pserver", *files], endpoint, pserver.plan


@contextmanager
def _pserver(
    tmp_path: Path, env: dict[str, str]
) -> Iterator[tuple[subprocess.Popen, str, fluidps.DistributedPlan]]:
    """A one-pserver sync job: the pserver as a `fluidps serve` process (its output in a
    log file), stopped by its pid; yields (process, endpoint, the job's plan)."""
    args, endpoint, plan = _pserver_files(tmp_path)
    log_path = tmp_path / "pserver.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [*FLUIDPS, "serve", *args],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1", FLUIDPS_JOB_SECRET=SECRET.hex(), **env),
        )
    try:
        deadline = time.monotonic() + 60
        while READY not in log_path.read_text(errors="replace"):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"the pserver did not say it was ready ({process.poll()}):\n{log_path.read_text()}"
                )
            time.sleep(0.05)
        yield process, endpoint, plan
    finally:
        stop_group(process)


class _JobDealer:
    """A raw DEALER of the job: whatever frames it sends, frame 0 gets the job's proof, so
    that what the pserver refuses is what they hold (`send_unsigned`: a stranger's)."""

    def __init__(self, sock: zmq.Socket):
        self.sock = sock

    def send_multipart(self, frames: list) -> None:
        self.sock.send_multipart(signed(frames))

    def send_unsigned(self, frames: list) -> None:
        self.sock.send_multipart(frames)

    def poll(self, timeout_ms: int) -> int:
        return self.sock.poll(timeout_ms)

    def recv_multipart(self) -> list:
        return self.sock.recv_multipart()


@contextmanager
def _dealer(context: zmq.Context, endpoint: str) -> Iterator[_JobDealer]:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{endpoint}")
    try:
        yield _JobDealer(sock)
    finally:
        sock.close(linger=0)


def _answer(sock: _JobDealer, timeout: float = WAIT, secret: JobSecret | None = SECRET) -> Message | None:
    """The next message the server sends this socket within `timeout` s (None: nothing),
    checked with `secret` (None: an unsigned refusal, as a stranger gets)."""
    if not sock.poll(int(timeout * 1000)):
        return None
    return decode(sock.recv_multipart(), secret)


def _hello(sock: _JobDealer, request_id: int) -> None:
    sock.send_multipart(encode(Message(Kind.HELLO, request_id=request_id)))
    reply = _answer(sock)
    assert reply is not None, "the pserver did not answer a HELLO"
    assert (reply.kind, reply.request_id) == (Kind.OK, request_id)


def _frames(msg: Message) -> list[bytes]:
    return [bytes(memoryview(f)) if not isinstance(f, bytes) else f for f in encode(msg)]


def _edit_header(frames: list[bytes], edit) -> list[bytes]:
    header = pb.Header()
    header.ParseFromString(frames[0])
    edit(header)
    return [header.SerializeToString(), *frames[1:]]


def _send(name: str, value, request_id: int = 1) -> Message:
    # trainer 0's gradient, as a trainer would send it (if one got through, it would count)
    return Message(
        Kind.SEND, tensors={name: value}, trainer_id=0, sender=TRAINER, step=1, request_id=request_id
    )


GRAD = np.ones((8, 16), np.float32)


def _malformed() -> list[tuple[str, list[bytes], str]]:
    """(what, frames, what the rejection must say)."""
    valid = _frames(_send("fc_0.w_0@GRAD", GRAD))
    sparse = _frames(_send("emb@GRAD", SelectedRows(np.array([1, 2]), np.ones((2, 4), np.float32), 20)))

    def set_dtype(dtype: int):
        def edit(header):
            header.tensors[0].dtype = dtype

        return edit

    def set_height(header):
        header.tensors[0].height = 2  # the rows 1 and 2 are not below 2

    def set_dims(header):
        del header.tensors[0].dims[:]
        header.tensors[0].dims.extend([-1, 16])

    return [
        ("garbage", [b"\xff\x00garbage, not a header"], "frame 0 is not a message header"),
        ("garbage frames", [b"junk", b"more junk", b"\x00" * 64], "frame 0 is not a message header"),
        ("an empty header", [b""], "the header has no known kind"),
        ("dims off the byte count", [valid[0], valid[1][:-4]], "need 512 bytes, the frame has 508"),
        (
            "dims off the byte count (more)",
            [valid[0], valid[1] + b"\x00" * 4],
            "need 512 bytes, the frame has 516",
        ),
        ("negative dims", _edit_header(valid, set_dims), "dims [-1, 16] are not valid"),
        (
            "dtype RAW",
            _edit_header(valid, set_dtype(int(VarType.RAW))),
            f"dtype {int(VarType.RAW)} is not allowed",
        ),
        ("dtype LOD_TENSOR", _edit_header(valid, set_dtype(int(VarType.LOD_TENSOR))), "is not allowed"),
        ("dtype 999", _edit_header(valid, set_dtype(999)), "dtype 999 is not allowed"),
        ("a missing data frame", valid[:1], "its data frames are missing"),
        ("an extra frame", [*valid, b"extra"], "the header describes 2 frames, the message has 3"),
        ("sparse rows out of range", _edit_header(sparse, set_height), "row ids must be in [0, 2)"),
    ]


def test_a_pserver_rejects_bad_messages_and_goes_on_serving(tmp_path):
    cases = _malformed()
    context = zmq.Context()
    try:
        with (
            _pserver(tmp_path, {"FLUIDPS_MAX_MESSAGE_BYTES": str(MAX_BYTES)}) as (process, endpoint, plan),
            _dealer(context, endpoint) as bystander,
        ):
            _hello(bystander, 1)  # a client that behaves, connected all along

            # (a)-(c): each malformed message gets an ERROR saying what was wrong
            for what, frames, reason in cases:
                with _dealer(context, endpoint) as sock:
                    sock.send_multipart(frames)
                    reply = _answer(sock)
                    assert reply is not None, f"{what}: no answer"
                    assert reply.kind == Kind.ERROR, f"{what}: {Kind.Name(reply.kind)}"
                    assert "rejected a malformed message" in reply.text, (what, reply.text)
                    assert reason in reply.text, (what, reply.text)
            # one socket sending them all in a row gets all the errors, in order
            with _dealer(context, endpoint) as sock:
                for _, frames, _ in cases:
                    sock.send_multipart(frames)
                for what, _, reason in cases:
                    reply = _answer(sock)
                    assert reply is not None and reply.kind == Kind.ERROR and reason in reply.text, what
                _hello(sock, 2)  # and is served afterwards
            _hello(bystander, 2)

            # (d): a message over FLUIDPS_MAX_MESSAGE_BYTES: ZeroMQ drops it and the connection
            big = np.zeros(MAX_BYTES // 4 + 1000, np.float32)
            assert big.nbytes > MAX_BYTES
            with _dealer(context, endpoint) as sock:
                _hello(sock, 1)  # connected
                # (a gradient it does not own and a new request id: had it been read, an ERROR would come at once)
                sock.send_multipart(_frames(_send("oversized@GRAD", big, request_id=2)))
                assert _answer(sock, timeout=2.0) is None  # dropped unread
            _hello(bystander, 3)
            with _dealer(context, endpoint) as sock:  # a new connection is served
                _hello(sock, 1)

            # STATS: the malformed messages were counted (the oversized one never reached it)
            stats_client = RpcClient(context, endpoint, "pserver", SETTINGS, trainer_id=-1)
            try:
                reply = stats_client.call(Message(Kind.STATS, trainer_id=-1), timeout=WAIT)
            finally:
                stats_client.close()
            stats = json.loads(reply.text)
            assert stats["rejected"] == 2 * len(cases)
            assert stats["mode"] == "sync" and stats["completed_steps"] == 0  # nothing got through
            assert stats["trainers"] == {"0": "live"}

            # A real trainer: the startup pulls the parameters, then it trains as local training does.
            main, startup, loss = _model()
            exe = fluidps.Executor(runtime_config=fluidps.RuntimeConfig(rpc=SETTINGS))
            closed = False
            try:
                exe.run(plan.trainer_startup)  # (trainer 0's programs: the plan's, not copies)
                local = fluidps.Executor()
                local.run(startup)
                for name in [p.name for p in main.all_parameters()]:
                    local.scope[name] = exe.scope[name].copy()  # the pserver's initial values
                trainer = plan.trainer_program
                for step in range(3):
                    (got,) = exe.run(trainer, feed=_batch(step), fetch_list=[loss.name])
                    (want,) = local.run(main, feed=_batch(step), fetch_list=[loss])
                    assert float(got) == pytest.approx(float(want), rel=1e-5)
                problems, closed = exe.close(), True
                assert problems == []
            finally:
                if not closed:
                    exe.close()
            process.wait(WAIT)  # its only trainer is done: the loop ends, the process exits
            assert process.returncode == 0, (tmp_path / "pserver.log").read_text()
    finally:
        context.term()


@pytest.mark.parametrize(
    "value", ["abc", "0", "-1", "", " 100", "100.0", "1e5", "0x10", "١٠٠", str((1 << 40) + 1)]
)
def test_an_invalid_max_message_bytes_is_refused_naming_the_variable(value):
    with pytest.raises(TransportError, match=f"FLUIDPS_MAX_MESSAGE_BYTES={value!r} is invalid"):
        rpc_settings_from_env({"FLUIDPS_MAX_MESSAGE_BYTES": value})


def test_a_valid_max_message_bytes_is_used():
    for value in (1, MAX_BYTES, 1 << 40):
        assert rpc_settings_from_env({"FLUIDPS_MAX_MESSAGE_BYTES": str(value)}).max_message_bytes == value
    assert rpc_settings_from_env({}).max_message_bytes == RpcSettings().max_message_bytes


def test_serve_with_an_invalid_max_message_bytes_exits_naming_it(tmp_path):
    args, _, _ = _pserver_files(tmp_path)
    done = subprocess.run(
        [*FLUIDPS, "serve", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, FLUIDPS_MAX_MESSAGE_BYTES="abc"),
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "FLUIDPS_MAX_MESSAGE_BYTES='abc' is invalid" in done.stderr
    assert READY not in done.stdout


def test_a_gradient_sent_again_in_a_step_counts_once(tmp_path):
    """A sync pserver applies a slice once every trainer's gradient of it is in. The same
    gradient again in that step (a retried request, or a new one: a restarted trainer
    redoing its step) is dropped, with a log line, not applied twice or mixed into the
    next step."""
    grads = _gradients()
    params = [g.removesuffix("@GRAD") for g in grads]
    context = zmq.Context()
    try:
        with _pserver(tmp_path, {}) as (_, endpoint, _plan), _dealer(context, endpoint) as sock:
            sock.send_multipart(encode(Message(Kind.GET, names=params, request_id=1)))  # an observer
            before = _answer(sock)
            assert before is not None and before.kind == Kind.VALUES
            first = Message(Kind.SEND, tensors=grads, trainer_id=0, sender=TRAINER, step=1, request_id=2)
            for request_id in (2, 3):  # 2: the same request retried; 3: the same gradients anew
                sock.send_multipart(encode(Message(**{**vars(first), "request_id": request_id})))
            step = Message(
                Kind.SEND, names=params, barrier=True, trainer_id=0, sender=TRAINER, step=1, request_id=4
            )
            sock.send_multipart(encode(step))
            replies = [_answer(sock) for _ in range(3)]
            assert [(r.kind, r.request_id) for r in replies] == [(Kind.OK, 2), (Kind.OK, 3), (Kind.VALUES, 4)]
            for name in params:  # SGD(0.2), each gradient once
                want = before.tensors[name] - np.float32(0.2) * grads[f"{name}@GRAD"]
                np.testing.assert_allclose(replies[2].tensors[name], want, rtol=1e-6, err_msg=name)
            sock.send_multipart(encode(Message(Kind.STATS, request_id=5)))
            stats = json.loads(_answer(sock).text)
            assert stats["completed_steps"] == 1
            dropped = [line for line in stats["log"] if "dropped" in line]
            assert len(dropped) == len(grads) and all("trainer 0's" in line for line in dropped)
    finally:
        context.term()


def test_gradients_of_a_step_already_closed_are_dropped(tmp_path):
    """Once a trainer's barrier of its step s is counted, whatever else it sends numbered
    s or lower (a late or duplicated message with a new request id) belongs to a step
    already closed: it is dropped with a log line, not mixed into the next step, and a
    repeated barrier does not close a step on its own."""
    first = _gradients()
    second = {name: -3 * value for name, value in first.items()}
    params = [g.removesuffix("@GRAD") for g in first]
    context = zmq.Context()
    try:
        with _pserver(tmp_path, {}) as (_, endpoint, _plan), _dealer(context, endpoint) as sock:
            sock.send_multipart(encode(Message(Kind.GET, names=params, request_id=1)))
            before = _answer(sock)
            assert before is not None and before.kind == Kind.VALUES
            requests = [
                Message(
                    Kind.SEND,
                    tensors=first,
                    names=params,
                    barrier=True,
                    trainer_id=0,
                    sender=TRAINER,
                    step=1,
                    request_id=2,
                ),
                # step 1 again, late: its gradients, then its barrier alone
                Message(Kind.SEND, tensors=first, trainer_id=0, sender=TRAINER, step=1, request_id=3),
                Message(
                    Kind.SEND, names=params, barrier=True, trainer_id=0, sender=TRAINER, step=1, request_id=4
                ),
                Message(
                    Kind.SEND,
                    tensors=second,
                    names=params,
                    barrier=True,
                    trainer_id=0,
                    sender=TRAINER,
                    step=2,
                    request_id=5,
                ),
            ]
            for msg in requests:
                sock.send_multipart(encode(msg))
            replies = [_answer(sock) for _ in requests]
            assert [(r.kind, r.request_id) for r in replies] == [
                (Kind.VALUES, 2),
                (Kind.OK, 3),
                (Kind.VALUES, 4),  # the values as they are: no step closed by it
                (Kind.VALUES, 5),
            ]
            for name in params:  # SGD(0.2) of step 1's gradients once, then step 2's
                after_one = before.tensors[name] - np.float32(0.2) * first[f"{name}@GRAD"]
                np.testing.assert_allclose(replies[0].tensors[name], after_one, rtol=1e-6, err_msg=name)
                np.testing.assert_allclose(replies[2].tensors[name], after_one, rtol=1e-6, err_msg=name)
                after_two = after_one - np.float32(0.2) * second[f"{name}@GRAD"]
                np.testing.assert_allclose(replies[3].tensors[name], after_two, rtol=1e-6, err_msg=name)
            sock.send_multipart(encode(Message(Kind.STATS, request_id=6)))
            stats = json.loads(_answer(sock).text)
            assert stats["completed_steps"] == 2
            dropped = [line for line in stats["log"] if "after that step was closed" in line]
            assert len(dropped) == 1 and "its step 1" in dropped[0] and "'fc_0.w_0@GRAD'" in dropped[0]
            assert any("send barrier of its step 1 came again; ignored" in line for line in stats["log"])
    finally:
        context.term()


def test_a_step_without_a_gradient_leaves_its_slice_as_it_was(tmp_path):
    """A trainer's barrier that comes without one of the gradients this pserver
    optimizes (a trainer program that does not match): the step completes with the
    others, that slice keeps its value (its copy holds the step before's gradient,
    which is not applied again), and the pserver says which gradient it missed."""
    grads = _gradients()
    partial = {name: value for name, value in grads.items() if name != "fc_1.b_0@GRAD"}
    params = [g.removesuffix("@GRAD") for g in grads]
    context = zmq.Context()
    try:
        with _pserver(tmp_path, {}) as (_, endpoint, _plan), _dealer(context, endpoint) as sock:
            steps = [
                Message(
                    Kind.SEND,
                    tensors=grads,
                    names=params,
                    barrier=True,
                    trainer_id=0,
                    sender=TRAINER,
                    step=1,
                    request_id=1,
                ),
                Message(
                    Kind.SEND,
                    tensors=partial,
                    names=params,
                    barrier=True,
                    trainer_id=0,
                    sender=TRAINER,
                    step=2,
                    request_id=2,
                ),
            ]
            for msg in steps:
                sock.send_multipart(encode(msg))
            first, second = (_answer(sock) for _ in steps)
            assert (first.kind, second.kind) == (Kind.VALUES, Kind.VALUES)
            np.testing.assert_array_equal(second.tensors["fc_1.b_0"], first.tensors["fc_1.b_0"])
            for name in params[:-1]:  # updated again
                assert not np.allclose(second.tensors[name], first.tensors[name]), name
            sock.send_multipart(encode(Message(Kind.STATS, request_id=3)))
            stats = json.loads(_answer(sock).text)
            assert stats["completed_steps"] == 2
            (line,) = [line for line in stats["log"] if "sent no gradient of" in line]
            assert "step 2" in line and "'fc_1.b_0@GRAD'" in line
    finally:
        context.term()


def test_a_gradient_of_the_wrong_shape_or_dtype_is_refused_whole(tmp_path):
    """A well-formed SEND whose gradient does not fit its slice (another shape, another
    dtype, dense for sparse) is refused, naming the gradient, what it must be and what
    it is; nothing of it is stored or applied (the good gradient beside it neither), the
    step is not closed by its barrier, and the right gradients train on afterwards."""
    good = _gradients()
    params = [g.removesuffix("@GRAD") for g in good]
    bad = [
        ({"fc_0.w_0@GRAD": np.ones((3, 3), np.float64)}, r"'fc_0.w_0@GRAD' must be float32, got float64\[3, 3\]"),
        ({"fc_0.w_0@GRAD": np.ones((3, 3), np.float32)}, r"'fc_0.w_0@GRAD' must have shape \[8, 16\], got float32\[3, 3\]"),
        (
            {"fc_1.b_0@GRAD": SelectedRows(np.array([0]), np.ones((1,), np.float32), 3)},
            r"'fc_1.b_0@GRAD' must be a dense tensor, got rows",
        ),
    ]  # fmt: skip
    context = zmq.Context()
    try:
        with _pserver(tmp_path, {}) as (_, endpoint, _plan), _dealer(context, endpoint) as sock:
            sock.send_multipart(encode(Message(Kind.GET, names=params, request_id=1)))
            before = _answer(sock)
            for i, (tensors, why) in enumerate(bad):
                with_good = {**good, **tensors}
                msg = Message(
                    Kind.SEND,
                    tensors=with_good,
                    names=params,
                    barrier=True,
                    trainer_id=0,
                    sender=TRAINER,
                    step=1,
                    request_id=10 + i,
                )
                sock.send_multipart(encode(msg))
                reply = _answer(sock)
                assert reply.kind == Kind.ERROR and reply.request_id == 10 + i
                assert re.search(why, reply.text), reply.text
            sock.send_multipart(encode(Message(Kind.STATS, request_id=20)))
            stats = json.loads(_answer(sock).text)
            assert stats["completed_steps"] == 0
            assert sum("refused trainer 0's SEND of its step 1" in line for line in stats["log"]) == len(bad)
            sock.send_multipart(
                encode(
                    Message(
                        Kind.SEND,
                        tensors=good,
                        names=params,
                        barrier=True,
                        trainer_id=0,
                        sender=TRAINER,
                        step=1,
                        request_id=21,
                    )
                )
            )
            after = _answer(sock)
            assert after.kind == Kind.VALUES
            for name in params:  # one SGD(0.2) step of the good gradients, nothing of the refused ones
                expected = before.tensors[name] - np.float32(0.2) * good[f"{name}@GRAD"]
                np.testing.assert_allclose(after.tensors[name], expected, rtol=1e-6, err_msg=name)
    finally:
        context.term()


def test_a_forged_or_corrupted_header_cannot_take_over_a_trainer_id(tmp_path):
    """In an elastic job, trainer 0 (a raw socket, with a keepalive) trains. Then:
    - a header of its own connection claiming another incarnation or trainer is refused;
    - a new connection claiming trainer 0 without naming its incarnation waits, and is
      refused once trainer 0 kept proving alive, which trains on meanwhile;
    - a restarted incarnation that names it (as a launcher's does) takes over at once,
      and the old one is refused from then on."""
    grads = _gradients()
    params = [g.removesuffix("@GRAD") for g in grads]
    forged, restarted = 0xF0F0, 0xBEEF

    def step(n: int, sender: int, request_id: int, replaces: int = 0) -> list:
        return encode(
            Message(
                Kind.SEND,
                tensors=grads,
                names=params,
                barrier=True,
                trainer_id=0,
                step=n,
                request_id=request_id,
                sender=sender,
                replaces=replaces,
            )
        )

    env = {"FLUIDPS_ELASTIC": "1", "FLUIDPS_PEER_TIMEOUT": "2"}
    context = zmq.Context()
    keepalive = None
    try:
        with _pserver(tmp_path, env) as (_, endpoint, _plan), _dealer(context, endpoint) as real:
            real.send_multipart(step(1, TRAINER, 1))
            assert _answer(real).kind == Kind.VALUES
            keepalive = Keepalive(SETTINGS, 0, TRAINER, lambda _: context)
            keepalive.add(f"tcp://{endpoint}")

            for trainer_id, sender in ((0, TRAINER ^ 1 << 20), (1, TRAINER)):  # bit-flipped headers
                msg = Message(
                    Kind.SEND, tensors=grads, trainer_id=trainer_id, sender=sender, step=2, request_id=2
                )
                real.send_multipart(encode(msg))
                reply = _answer(real)
                assert reply.kind == Kind.ERROR, reply
                assert (
                    "a connection speaks for one incarnation" in reply.text
                    or "serves trainers 0..0" in reply.text
                )

            with _dealer(context, endpoint) as forger:
                forger.send_multipart(step(2, forged, 1))
                real.send_multipart(step(2, TRAINER, 3))  # trainer 0 trains on while the claim waits
                assert _answer(real).kind == Kind.VALUES
                refusal = _answer(forger)
                assert refusal.kind == Kind.ERROR and "which is alive" in refusal.text, refusal.text

            with _dealer(context, endpoint) as new:
                new.send_multipart(step(3, restarted, 1, replaces=TRAINER))
                assert _answer(new).kind == Kind.VALUES
                real.send_multipart(step(3, TRAINER, 4))
                reply = _answer(real)
                assert reply.kind == Kind.ERROR and "evicted after going silent or replaced" in reply.text

                new.send_multipart(encode(Message(Kind.STATS, request_id=2)))
                stats = json.loads(_answer(new).text)
            assert stats["completed_steps"] == 3
            log = stats["log"]
            claim = next(
                i for i, line in enumerate(log) if f"incarnation {forged:x} claims trainer 0" in line
            )
            refused = next(i for i, line in enumerate(log) if "which is alive" in line)
            taken = next(
                i
                for i, line in enumerate(log)
                if f"restarted (incarnation {TRAINER:x} -> {restarted:x})" in line
            )
            assert claim < refused < taken
    finally:
        if keepalive is not None:
            keepalive.close()
        context.term()


def test_a_pserver_derives_its_message_limit_from_its_plan(tmp_path):
    """Without FLUIDPS_MAX_MESSAGE_BYTES, the pserver of a small model accepts messages up
    to the floor of fluidps.executor.ps.message_limit (not 16 GiB): one just over it is
    dropped unread with its connection, and a new connection is served."""
    context = zmq.Context()
    try:
        with _pserver(tmp_path, {}) as (_, endpoint, _plan), _dealer(context, endpoint) as sock:
            sock.send_multipart(encode(Message(Kind.STATS, request_id=1)))
            limit = json.loads(_answer(sock).text)["max_message_bytes"]
            assert limit == FLOOR
            sock.send_multipart(_frames(_send("oversized@GRAD", np.zeros(limit // 4 + 256, np.float32), 2)))
            assert _answer(sock, timeout=2.0) is None  # dropped unread: an unknown gradient would be an ERROR
            with _dealer(context, endpoint) as other:
                other.send_multipart(_frames(_send("unknown@GRAD", np.zeros(limit // 8, np.float32), 1)))
                reply = _answer(other)
                assert reply.kind == Kind.ERROR and "owns no gradient named 'unknown@GRAD'" in reply.text
    finally:
        context.term()


def _garbage(rng: np.random.Generator, template: list[bytes]) -> list[bytes]:
    """One message of the probe: random frames, a bit-flipped header, a frame declared
    far larger than it is, thousands of frames, or an unknown dtype."""
    kind = rng.integers(5)
    if kind == 0:
        return [rng.bytes(int(rng.integers(0, 4096))) for _ in range(int(rng.integers(1, 6)))]
    if kind == 1:
        header = bytearray(template[0])
        for bit in rng.integers(0, 8 * len(header), size=int(rng.integers(1, 4))):
            header[bit // 8] ^= 1 << (bit % 8)
        return [bytes(header), *template[1:]]
    if kind == 2:

        def huge(h):
            del h.tensors[0].dims[:]
            h.tensors[0].dims.extend([1 << 28])  # 1 GiB of float32, in a 512-byte frame

        return _edit_header(template, huge)
    if kind == 3:
        return [template[0], *[b"\x00"] * 10_000]

    def dtype(h):
        h.tensors[0].dtype = int(rng.integers(100, 1 << 20))

    return _edit_header(template, dtype)


def test_a_pserver_fed_garbage_keeps_serving_in_bounded_memory_and_logs_it_rate_limited(tmp_path):
    """300 bad messages on raw sockets (a new connection every 10), most of them forged
    as trainer 0 by another incarnation: each is answered with an ERROR or ignored, the
    real trainer 0 (announced as a launcher does) trains before and after with exact SGD
    results, the process's memory stays within 64 MiB of what it was, and the log holds a
    few rate-limited lines, not one per message."""
    grads = _gradients()
    params = [g.removesuffix("@GRAD") for g in grads]
    forger = 0x0F0F0F0F  # many bits away from TRAINER: a few flips do not make it trainer 0's
    template = _frames(
        Message(Kind.SEND, tensors={"fc_0.w_0@GRAD": GRAD}, trainer_id=0, sender=forger, step=1)
    )
    rng = np.random.default_rng(14)
    keepalive = None

    def step(n: int, request_id: int) -> list:
        msg = Message(
            Kind.SEND, tensors=grads, names=params, barrier=True, trainer_id=0, step=n, sender=TRAINER
        )
        msg.request_id = request_id
        return encode(msg)

    context = zmq.Context()
    try:
        env = {"FLUIDPS_TRAINER_INCARNATIONS": f"{TRAINER:x}"}
        with _pserver(tmp_path, env) as (_, endpoint, _plan), _dealer(context, endpoint) as real:
            real.send_multipart(encode(Message(Kind.GET, names=params, request_id=1)))
            before = _answer(real)
            real.send_multipart(step(1, 2))
            first = _answer(real)
            assert first.kind == Kind.VALUES
            keepalive = Keepalive(SETTINGS, 0, TRAINER, lambda _: context)  # the trainer is not silent
            keepalive.add(f"tcp://{endpoint}")
            real.send_multipart(encode(Message(Kind.STATS, request_id=3)))
            rss_before = json.loads(_answer(real).text)["rss_bytes"]

            for _ in range(30):
                with _dealer(context, endpoint) as sock:
                    for _message in range(10):
                        sock.send_multipart(_garbage(rng, template))
                    while _answer(sock, timeout=0.5) is not None:  # whatever it answers
                        pass

            real.send_multipart(step(2, 4))
            second = _answer(real)
            assert second.kind == Kind.VALUES
            for name in params:  # SGD(0.2) of the real trainer's two steps, nothing of the garbage
                want = before.tensors[name] - 2 * np.float32(0.2) * grads[f"{name}@GRAD"]
                np.testing.assert_allclose(second.tensors[name], want, rtol=1e-5, err_msg=name)
            real.send_multipart(encode(Message(Kind.STATS, request_id=5)))
            stats = json.loads(_answer(real).text)
            assert stats["completed_steps"] == 2 and stats["trainers"] == {"0": "live"}
            assert stats["rejected"] > 50
            assert stats["rss_bytes"] - rss_before < 64 << 20, (rss_before, stats["rss_bytes"])
        lines = (tmp_path / "pserver.log").read_text(errors="replace").splitlines()
        logged = [line for line in lines if "rejected a malformed message" in line or "refused" in line]
        assert 1 <= len(logged) <= 6, logged
    finally:
        if keepalive is not None:
            keepalive.close()
        context.term()
