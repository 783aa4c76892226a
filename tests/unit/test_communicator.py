"""The async communicator, a whole job in one process (two pservers on threads, the
trainer here): gradients leave on the communicator's thread, merged while the pservers
are slow, nothing lost or counted twice; a full queue blocks the step and says so; a
failure on that thread reaches the trainer.

The pservers are made slow by a gate around the communicator's exchanges (closed: its
first message waits), which also records each round: what was merged and what was sent.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import numpy as np
import pytest
from job_harness import PserverThreads
from rpc_harness import SECRET

import fluidps
from fluidps import layers
from fluidps.errors import BuilderError, ExecutionError
from fluidps.executor.ps.communicator import Communicator
from fluidps.executor.transport.settings import RpcSettings
from fluidps.executor.transport.wire import Kind
from fluidps.ops.selected_rows import SelectedRows

SETTINGS = RpcSettings(heartbeat_interval=0.1, peer_timeout=20.0, request_timeout=120.0, secret=SECRET)
WAIT = 60.0  # bound of every wait on another thread
STEPS = 6
LR = 0.1


def model(kind: str, optimizer: str = "sgd"):
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 5
    with fluidps.program_guard(main, startup):
        y = layers.data("y", [1], dtype="int64")
        if kind == "dense":
            h = layers.fc(layers.data("x", [8]), 16, act="tanh")
        else:
            h = layers.embedding(layers.data("ids", [1], dtype="int64"), [20, 4], is_sparse=True)
        loss = layers.mean(layers.softmax_with_cross_entropy(layers.fc(h, 3), y))
        opt = fluidps.optimizer.SGD(LR) if optimizer == "sgd" else fluidps.optimizer.Adam(0.01)
        opt.minimize(loss)
    return main, startup, loss


def batch(kind: str, step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    y = rng.integers(0, 3, (6, 1)).astype("int64")
    if kind == "dense":
        return {"x": rng.normal(size=(6, 8)).astype("float32"), "y": y}
    return {"ids": rng.integers(0, 20, (6, 1)).astype("int64"), "y": y}


def dense(value: Any) -> np.ndarray:
    return value.to_dense() if isinstance(value, SelectedRows) else np.asarray(value)


class Gate:
    """Holds every exchange of the communicator until opened; records each round's
    gradient counts (per (endpoint, name)) and the SENDs it made, and every gradient
    the trainer handed over."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: bool = False):
        self.opened = threading.Event()
        self.counts: list[dict[tuple[str, str], int]] = []
        self.sends: list[dict[str, tuple[int, dict[str, Any]]]] = []  # per round: endpoint -> (step, tensors)
        self.put: dict[str, list[Any]] = {}  # gradient name -> every value handed over
        take, exchange, put = Communicator._take, Communicator._exchange, Communicator.put

        def recording_put(communicator, items, step, merge):
            for _, name, value in items:
                self.put.setdefault(name, []).append(value.copy())
            return put(communicator, items, step, merge)

        def counting_take(communicator):
            taken = take(communicator)
            if taken:
                self.counts.append({key: len(values) for key, (_, _, values) in taken.items()})
            return taken

        def gated_exchange(communicator, clients, messages):
            if any(m.kind == Kind.SEND for m in messages.values()):
                self.sends.append({ep: (m.step, dict(m.tensors)) for ep, m in messages.items()})
            assert self.opened.wait(WAIT), "the test never opened the gate"
            return exchange(communicator, clients, messages)

        monkeypatch.setattr(Communicator, "put", recording_put)
        monkeypatch.setattr(Communicator, "_take", counting_take)
        monkeypatch.setattr(Communicator, "_exchange", gated_exchange)


def start_job(kind: str, settings: RpcSettings = SETTINGS, optimizer: str = "sgd", **config):
    main, startup, loss = model(kind, optimizer)
    tag = uuid.uuid4().hex[:8]
    eps = [f"inproc://ps0-{tag}", f"inproc://ps1-{tag}"]
    config = fluidps.DistributeTranspilerConfig(mode="async", communicator=True, min_block_size=8, **config)
    t = fluidps.DistributeTranspiler(config)
    t.transpile(0, main, ",".join(eps), trainers=1, startup_program=startup)
    servers = PserverThreads(t, eps, settings, wait=WAIT)
    exe = servers.trainer_executor(settings)
    exe.run(t.get_trainer_startup_program())
    return t, servers, exe, loss


def train_on_a_thread(exe, program, kind: str, loss, done: list[int]) -> threading.Thread:
    def steps() -> None:
        for step in range(1, STEPS + 1):
            exe.run(program, feed=batch(kind, step), fetch_list=[loss])
            done.append(step)

    thread = threading.Thread(target=steps, daemon=True)
    thread.start()
    return thread


def served_values(servers: PserverThreads, plan) -> dict[str, np.ndarray]:
    out = {}
    for ep in servers.endpoints:
        servers.drain(ep)
        for s in plan.slices_on(ep):
            out[s.name] = np.array(servers.server(ep).env[s.name], copy=True)
    return out


@pytest.mark.parametrize("kind", ["dense", "sparse"])
@pytest.mark.parametrize("merge", ["sum", "mean"])
def test_steps_go_on_while_the_pservers_are_slow_and_their_gradients_are_merged(monkeypatch, kind, merge):
    gate = Gate(monkeypatch)
    t, servers, exe, loss = start_job(kind, communicator_merge=merge)
    plan = t.plan
    initial = {s.name: np.array(exe.scope[s.param][s.offset : s.offset + s.rows]) for s in plan.slices}
    done: list[int] = []
    try:
        trainer = train_on_a_thread(exe, t.get_trainer_program(), kind, loss, done)
        # Every step runs while the communicator's first message is still unanswered.
        trainer.join(WAIT)
        assert done == list(range(1, STEPS + 1)) and not gate.opened.is_set()
        gate.opened.set()
        exe.runtime.trainer._communicator.drain()
        served = served_values(servers, plan)
    finally:
        gate.opened.set()
        problems = exe.close()
        servers.join()
    assert problems == []

    # At most two rounds: the first (stuck at the gate; it has what was queued when the
    # thread woke) and one with everything queued behind it.
    assert len(gate.sends) == len(gate.counts) <= 2
    assert all(step == STEPS for step, _ in gate.sends[-1].values())  # numbered by the latest step
    grads = sorted({s.grad for s in plan.slices})
    for grad in grads:
        counts = [c[key] for c in gate.counts for key in c if key[1] == grad]
        assert sum(counts) == STEPS and len(gate.put[grad]) == STEPS
        # What was sent accounts for every gradient exactly once: a sum as it is, a mean times its count.
        sent = [tensors[grad] for r in gate.sends for _, tensors in r.values() if grad in tensors]
        weights = counts if merge == "mean" else [1] * len(counts)
        total = sum(np.float32(w) * dense(v) for w, v in zip(weights, sent, strict=True))
        np.testing.assert_allclose(total, sum(dense(g) for g in gate.put[grad]), rtol=1e-5, atol=1e-6)
    # The pservers applied exactly what was sent (SGD); with sums, that is every step's gradient.
    for s in plan.slices:
        sent = sum(
            dense(tensors[s.grad]) for r in gate.sends for _, tensors in r.values() if s.grad in tensors
        )
        np.testing.assert_allclose(
            served[s.name], initial[s.name] - np.float32(LR) * sent, rtol=1e-5, atol=1e-6
        )
        if merge == "sum":
            every_step = sum(dense(g) for g in gate.put[s.grad])
            np.testing.assert_allclose(
                served[s.name], initial[s.name] - LR * every_step, rtol=1e-5, atol=1e-6
            )


def test_a_full_queue_blocks_the_step_and_says_so_until_the_pservers_catch_up(monkeypatch, caplog):
    gate = Gate(monkeypatch)
    settings = SETTINGS.with_(send_queue_log_after=0.2)
    t, servers, exe, loss = start_job("dense", settings, communicator_send_queue_size=2)
    done: list[int] = []
    try:
        with caplog.at_level(logging.WARNING, logger="fluidps.executor.ps.communicator"):
            trainer = train_on_a_thread(exe, t.get_trainer_program(), "dense", loss, done)
            deadline = time.monotonic() + WAIT
            while "has been full" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.02)
            assert "has been full (2 gradients)" in caplog.text, caplog.text
            blocked_at = len(done)
            assert blocked_at < STEPS and trainer.is_alive()  # waiting in a send, not growing its queue
            gate.opened.set()
            trainer.join(WAIT)
        assert done == list(range(1, STEPS + 1))
        exe.runtime.trainer._communicator.drain()
    finally:
        gate.opened.set()
        problems = exe.close()
        servers.join()
    assert problems == []
    assert "communicator_send_queue_size" in caplog.text
    # The bound held (no round took more than a queue holds) and nothing was lost.
    for grad in {s.grad for s in t.plan.slices}:
        counts = [c[key] for c in gate.counts for key in c if key[1] == grad]
        assert max(counts) <= 2 and sum(counts) == STEPS


def test_a_failed_send_reaches_the_trainer_at_its_next_call(monkeypatch):
    main, startup, loss = model("dense")
    tag = uuid.uuid4().hex[:8]
    eps = [f"inproc://ps0-{tag}", f"inproc://ps1-{tag}"]
    config = fluidps.DistributeTranspilerConfig(mode="async", communicator=True, min_block_size=8)
    t = fluidps.DistributeTranspiler(config)
    t.transpile(0, main, ",".join(eps), trainers=1, startup_program=startup)
    program = t.get_trainer_program()
    # A trainer program that does not match its pservers': one gradient they do not own.
    send = next(op for op in program.global_block().ops if op.type == "send")
    send.set_attr("send_varnames", ["no_such@GRAD", *send.attr("send_varnames")[1:]])
    servers = PserverThreads(t, eps, SETTINGS, wait=WAIT)
    exe = servers.trainer_executor()
    try:
        exe.run(t.get_trainer_startup_program())
        # Raised by whichever send or recv comes first, naming the op and the pserver's reason.
        failure = r"\((send|recv)\) failed: trainer 0's communicator failed: .*owns no gradient named 'no_such@GRAD'"
        with pytest.raises(ExecutionError, match=failure):
            for step in range(1, 100):  # the failure is seen at the first call after it
                exe.run(program, feed=batch("dense", step), fetch_list=[loss])
    finally:
        problems = exe.close()
        servers.join()
    assert any("no_such@GRAD" in p for p in problems)


def test_the_transpiler_merges_sgd_gradients_by_sum_and_others_by_mean():
    def send_ops(optimizer: str, **config):
        main, startup, _ = model("dense", optimizer)
        t = fluidps.DistributeTranspiler(fluidps.DistributeTranspilerConfig(min_block_size=8, **config))
        t.transpile(0, main, "127.0.0.1:6170,127.0.0.1:6171", trainers=1, startup_program=startup)
        ops = t.get_trainer_program().global_block().ops
        return [op for op in ops if op.type in ("send", "recv")]

    for optimizer, merge in (("sgd", "sum"), ("adam", "mean")):
        ops = send_ops(optimizer, mode="async", communicator=True)
        assert all(op.attr("use_communicator") for op in ops)
        assert {op.attr("merge_mode") for op in ops if op.type == "send"} == {merge}
    mean = send_ops("sgd", mode="async", communicator=True, communicator_merge="mean")
    assert {op.attr("merge_mode") for op in mean if op.type == "send"} == {"mean"}
    assert not any(op.attr("use_communicator") for op in send_ops("sgd", mode="async"))  # opt-in
    assert not any(op.attr("use_communicator") for op in send_ops("sgd", mode="sync"))
    with pytest.raises(BuilderError, match="communicator applies to mode 'async' only"):
        fluidps.DistributeTranspilerConfig(mode="sync", communicator=True)
    with pytest.raises(BuilderError, match="communicator_merge must be one of"):
        fluidps.DistributeTranspilerConfig(mode="async", communicator_merge="max")
