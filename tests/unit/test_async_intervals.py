"""Async training with send_interval n and recv_interval m, a whole job in one process
(two pservers on threads, the trainer here): what goes over the wire and when.

The trainer's Runtime is wrapped to record every SEND and GET it makes (with the step
it was made at and the values); each step's gradients are recomputed independently
by a local Executor on the original program at the parameters the trainer used. The
pservers' own view (stats, the values they end with) is checked too.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from job_harness import PserverThreads
from rpc_harness import SECRET

import fluidps
from fluidps import layers
from fluidps.executor.ps.strategies import ASYNC_BACKLOG
from fluidps.executor.transport.settings import RpcSettings
from fluidps.ops.selected_rows import SelectedRows

SETTINGS = RpcSettings(heartbeat_interval=0.1, peer_timeout=20.0, request_timeout=120.0, secret=SECRET)
WAIT = 30.0  # bound of every wait on another thread
STEPS = 7
LR = {"dense": 0.1, "sparse": 0.5}


# -- models and batches ------------------------------------------------------------------


def dense_model():
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 11
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [8])
        y = layers.data("y", [1], dtype="int64")
        h = layers.fc(x, 16, act="tanh")
        loss = layers.mean(layers.softmax_with_cross_entropy(layers.fc(h, 3), y))
        fluidps.optimizer.SGD(LR["dense"]).minimize(loss)
    return main, startup, loss


def sparse_model():
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 12
    with fluidps.program_guard(main, startup):
        ids = layers.data("ids", [1], dtype="int64")
        y = layers.data("y", [1], dtype="int64")
        emb = layers.embedding(ids, [20, 4], is_sparse=True)
        loss = layers.mean(layers.softmax_with_cross_entropy(layers.fc(emb, 3), y))
        fluidps.optimizer.SGD(LR["sparse"]).minimize(loss)
    return main, startup, loss


MODELS: dict[str, Callable] = {"dense": dense_model, "sparse": sparse_model}


def batch(kind: str, step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    y = rng.integers(0, 3, (6, 1)).astype("int64")
    if kind == "dense":
        return {"x": rng.normal(size=(6, 8)).astype("float32"), "y": y}
    # repeated ids inside a batch, and rows on both pservers' slices
    return {"ids": rng.integers(0, 20, (6, 1)).astype("int64"), "y": y}


def copy_value(value: Any) -> Any:
    return value.copy() if isinstance(value, SelectedRows) else np.array(value, copy=True)


# -- the job -----------------------------------------------------------------------------


class Recorder:
    """Wraps what a trainer's client puts on the wire, gradients pushed and parameters
    pulled: (step, items) of every step's pushes and of every pull."""

    def __init__(self, runtime):
        self.sends: list[tuple[int, list[tuple[str, str, Any]]]] = []
        self.gets: list[tuple[int, list[tuple[str, str]], list[Any]]] = []
        push, pull = runtime._push, runtime._pull

        def recording_push(items, trainer_id, bucket_bytes=0, tag=None):
            # A send op per gradient: one step's pushes make one entry.
            pushed = [(ep, n, copy_value(v)) for ep, n, v in items]
            if self.sends and self.sends[-1][0] == runtime.step:
                self.sends[-1][1].extend(pushed)
            else:
                self.sends.append((runtime.step, pushed))
            return push(items, trainer_id, bucket_bytes, tag)

        def recording_pull(items, trainer_id):
            values = pull(items, trainer_id)
            self.gets.append((runtime.step, list(items), [copy_value(v) for v in values]))
            return values

        runtime._push, runtime._pull = recording_push, recording_pull


def endpoints() -> list[str]:
    tag = uuid.uuid4().hex[:8]
    return [f"inproc://ps0-{tag}", f"inproc://ps1-{tag}"]


def transpile(kind: str, n: int, m: int):
    main, startup, loss = MODELS[kind]()
    eps = endpoints()
    # Without the communicator: every send and pull happens in its step, so when each
    # goes is exact (tests/unit/test_communicator.py has the communicator's).
    config = fluidps.DistributeTranspilerConfig(
        mode="async", send_interval=n, recv_interval=m, min_block_size=8, communicator=False
    )
    t = fluidps.DistributeTranspiler(config)
    t.transpile(0, main, ",".join(eps), trainers=1, startup_program=startup)
    return main, startup, loss, eps, t


@dataclass
class Job:
    kind: str
    main: Any
    startup: Any
    loss: Any
    plan: Any
    params: list[str]
    sends: list = field(default_factory=list)
    gets: list = field(default_factory=list)
    used: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)  # step -> parameters it ran with
    stats: dict[str, dict] = field(default_factory=dict)  # endpoint -> pserver stats at the end
    served: dict[str, np.ndarray] = field(default_factory=dict)  # slice name -> pserver value at the end


def run_job(kind: str, n: int, m: int, fetch_lists: Callable[[int, list], list] | None = None) -> Job:
    """STEPS async steps; `fetch_lists(step, params)` gives each step's fetch list
    (default: the same every step: the loss and every parameter)."""
    main, startup, loss, eps, t = transpile(kind, n, m)
    params = [p.name for p in main.all_parameters()]
    job = Job(kind, main, startup, loss, t.plan, params)
    assert {s.endpoint for s in job.plan.slices} == set(eps)  # both pservers own slices
    assert any(len(job.plan.slices_of(p)) > 1 for p in params)  # and a parameter is cut in two
    servers = PserverThreads(t, eps, SETTINGS, wait=WAIT)
    exe = servers.trainer_executor()
    recorder = Recorder(exe.runtime.trainer)
    try:
        exe.run(t.get_trainer_startup_program())
        job.used[1] = {p: np.array(exe.scope[p], copy=True) for p in params}
        trainer = t.get_trainer_program()
        for step in range(1, STEPS + 1):
            fetch = [loss, *params] if fetch_lists is None else fetch_lists(step, [loss, *params])
            exe.run(trainer, feed=batch(kind, step), fetch_list=fetch)
            job.used[step + 1] = {p: np.array(exe.scope[p], copy=True) for p in params}
        for ep in eps:
            servers.drain(ep)
            server = servers.server(ep)
            job.stats[ep] = server.stats()
            for s in job.plan.slices_on(ep):
                job.served[s.name] = np.array(server.env[s.name], copy=True)
        sent_while_training = len(recorder.sends)
    finally:
        problems = exe.close()  # the steps since the last upload go too, then COMPLETE
        servers.join()
    assert problems == []
    job.sends, job.gets = recorder.sends[:sent_while_training], recorder.gets
    job.flushed = recorder.sends[sent_while_training:]
    return job


# -- references --------------------------------------------------------------------------


def local_gradients(job: Job) -> dict[int, dict[str, Any]]:
    """Each step's gradient of every parameter, by a local Executor on the original
    program, the step's batch and the parameters the trainer ran the step with."""
    local = fluidps.Executor()
    local.run(job.startup)
    grads = [f"{p}@GRAD" for p in job.params]
    assert all(g in job.main.global_block().vars for g in grads)
    out = {}
    for step in range(1, STEPS + 1):
        for p in job.params:
            local.scope[p] = job.used[step][p].copy()
        values = local.run(job.main, feed=batch(job.kind, step), fetch_list=grads)
        out[step] = {p: copy_value(v) for p, v in zip(job.params, values, strict=True)}
    return out


def slice_of(grad: Any, s) -> Any:
    """The part of a whole gradient that slice `s` owns (sparse rows renumbered)."""
    if isinstance(grad, SelectedRows):
        mask = (grad.rows >= s.offset) & (grad.rows < s.offset + s.rows)
        return SelectedRows(grad.rows[mask] - s.offset, grad.value[mask], s.rows)
    return grad[s.offset : s.offset + s.rows]


def expected_push(grads: dict[int, dict[str, Any]], s, steps: list[int]) -> Any:
    """What one SEND should carry for slice `s` after `steps`: the mean of the
    step gradients (sparse: their rows concatenated, values scaled by 1/n)."""
    parts = [slice_of(grads[step][s.param], s) for step in steps]
    if s.sparse:
        rows = np.concatenate([p.rows for p in parts])
        value = np.concatenate([p.value for p in parts]) / np.float32(len(parts))
        return SelectedRows(rows, value.astype(np.float32), s.rows)
    return (sum(parts[1:], parts[0].copy()) / np.float32(len(parts))).astype(np.float32)


def assert_same(got: Any, want: Any, what: str) -> None:
    if isinstance(want, SelectedRows):
        assert isinstance(got, SelectedRows), what
        assert got.height == want.height, what
        np.testing.assert_array_equal(got.rows, want.rows, err_msg=what)
        np.testing.assert_allclose(got.value, want.value, rtol=1e-5, atol=1e-7, err_msg=what)
    else:
        assert isinstance(got, np.ndarray), what
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=what)


def expected_get_steps(m: int) -> list[int]:
    # The startup program's recv (step 0; the trainer program's recv pulls the same
    # slices, so it starts from those), then every step divisible by m.
    return [0, *(s for s in range(1, STEPS + 1) if s % m == 0)]


# -- tests -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dense", "sparse"])
@pytest.mark.parametrize(("n", "m"), [(2, 3), (3, 2)])
def test_sends_every_n_steps_the_mean_and_gets_every_m(kind, n, m):
    job = run_job(kind, n, m)
    plan = job.plan
    every_slice = sorted((s.endpoint, s.grad) for s in plan.slices)

    # SEND: exactly at steps n, 2n, ...: one call carrying every slice
    assert [step for step, _ in job.sends] == list(range(n, STEPS + 1, n))
    for _, items in job.sends:
        assert sorted((ep, name) for ep, name, _ in items) == every_slice

    # GET: startup, then every m steps; every slice each time
    assert [step for step, _, _ in job.gets] == expected_get_steps(m)
    for _, items, _ in job.gets:
        assert sorted(items) == sorted((s.endpoint, s.name) for s in plan.slices)

    # Between GETs the trainer runs with the values of the last GET.
    downloads = {}
    for step, items, values in job.gets:
        by_slice = dict(zip([name for _, name in items], values, strict=True))
        downloads[step] = {
            p: np.concatenate([by_slice[s.name] for s in plan.slices_of(p)])
            if len(plan.slices_of(p)) > 1
            # a whole parameter: its one value
            else by_slice[plan.slices_of(p)[0].name]
            for p in job.params
        }
    for step in range(1, STEPS + 2):
        last = max(s for s in downloads if s < step)  # the forward of `step` runs before its recv
        for p in job.params:
            np.testing.assert_array_equal(
                job.used[step][p], downloads[last][p], err_msg=f"{p} at step {step}"
            )

    # The pushed gradient is the mean of the n local gradients.
    grads = local_gradients(job)
    for k, (step, items) in enumerate(job.sends):
        steps = list(range(step - n + 1, step + 1))
        assert steps == list(range(k * n + 1, (k + 1) * n + 1))
        pushed = {name: value for _, name, value in items}
        for s in plan.slices:
            assert_same(pushed[s.grad], expected_push(grads, s, steps), f"{s.grad} sent at step {step}")
    # Closing uploads the mean of the steps since the last upload (none are lost).
    leftover = list(range(STEPS - STEPS % n + 1, STEPS + 1))
    assert [step for step, _ in job.flushed] == ([STEPS] if leftover else [])
    for _, items in job.flushed:
        pushed = {name: value for _, name, value in items}
        for s in plan.slices:
            assert_same(pushed[s.grad], expected_push(grads, s, leftover), f"{s.grad} sent at close")

    # The pservers' side: one clock event per SEND, the sparse rows they received,
    # and what they end with: the initial values minus lr times every pushed gradient.
    lr = LR[kind]
    for ep, stats in job.stats.items():
        clocks = [e for e in stats["clock_log"] if e["event"] == "clock"]
        assert len(clocks) == len(job.sends), clocks
        assert [e["trainer"] for e in clocks] == [0] * len(job.sends)
        assert all(a["step"] < b["step"] for a, b in itertools.pairwise(clocks))
        sparse = [s for s in plan.slices_on(ep) if s.sparse]
        want_rows = {
            s.grad: [
                int(r) for _, items in job.sends for _, name, v in items if name == s.grad for r in v.rows
            ]
            for s in sparse
        }
        assert stats["received_rows"] == {g: rows for g, rows in want_rows.items() if rows}
    initial = job.used[1]
    for s in plan.slices:
        total = np.zeros(s.shape, np.float32)
        for _, items in job.sends:
            (value,) = [v for _, name, v in items if name == s.grad]
            total += value.to_dense() if isinstance(value, SelectedRows) else value
        want = slice_of(initial[s.param], s) - np.float32(lr) * total
        np.testing.assert_allclose(job.served[s.name], want, rtol=1e-5, atol=1e-6, err_msg=s.name)


def test_sparse_push_concatenates_the_rows_of_the_n_steps():
    """The sparse case spelled out: after n=2 steps the pushed SelectedRows of each
    slice holds step 1's rows then step 2's (duplicates kept), values halved."""
    n = 2
    job = run_job("sparse", n, 3)
    grads = local_gradients(job)
    step, items = job.sends[0]
    assert step == n
    for s in [s for s in job.plan.slices if s.sparse]:
        (pushed,) = [v for _, name, v in items if name == s.grad]
        first, second = (slice_of(grads[i][s.param], s) for i in (1, 2))
        np.testing.assert_array_equal(pushed.rows, np.concatenate([first.rows, second.rows]))
        np.testing.assert_allclose(
            pushed.value, np.concatenate([first.value, second.value]) * np.float32(0.5), rtol=1e-6, atol=1e-8
        )
        assert pushed.height == s.rows


def alternating_fetch(step: int, fetch: list) -> list:
    return fetch if step % 2 else fetch[1:]  # the loss on odd steps only


@pytest.mark.parametrize("fetch_lists", [alternating_fetch], ids=["fetch-list-changes"])
def test_intervals_do_not_depend_on_the_fetch_list(fetch_lists):
    """Fetching something else on some steps (a metric every k steps) must not change
    when gradients are sent or what is sent: the interval counts steps of the job."""
    n, m = 2, 3
    job = run_job("dense", n, m, fetch_lists)
    assert [step for step, _ in job.sends] == list(range(n, STEPS + 1, n))
    assert [step for step, _, _ in job.gets] == expected_get_steps(m)
    grads = local_gradients(job)
    for step, items in job.sends:
        pushed = {name: value for _, name, value in items}
        for s in job.plan.slices:
            want = expected_push(grads, s, list(range(step - n + 1, step + 1)))
            assert_same(pushed[s.grad], want, f"{s.grad} sent at step {step}")


def test_a_send_is_acknowledged_once_its_gradients_are_applied():
    """An async pserver queues a gradient and a worker applies it; the SEND is
    acknowledged once at most ASYNC_BACKLOG gradients queued up to it are still to be
    applied, so a trainer never runs far ahead of its pservers (their queues stay
    short). Here the workers are held (the test takes their locks): the SENDs within
    the backlog are acknowledged, the next is not, and the trainer's close, which waits
    for every acknowledgement before saying COMPLETE, waits until the workers are
    released. Every gradient is applied."""
    main, _, loss, eps, t = transpile("dense", 1, 10)
    params = [p.name for p in main.all_parameters()]
    servers = PserverThreads(t, eps, SETTINGS, wait=WAIT)
    exe = servers.trainer_executor()
    recorder = Recorder(exe.runtime.trainer)
    held: list[threading.Lock] = []
    events: list[str] = []
    steps = 2 + ASYNC_BACKLOG
    try:
        exe.run(t.get_trainer_startup_program())
        initial = {p: np.array(exe.scope[p], copy=True) for p in params}
        loops = {ep: servers.server(ep) for ep in eps}  # they outlive their executors' runtimes
        trainer = t.get_trainer_program()
        exe.run(trainer, feed=batch("dense", 1), fetch_list=[loss])  # step 1: SEND (no GET: recv_interval 10)
        exe.runtime.trainer.settle()  # acknowledged
        for ep in eps:
            servers.drain(ep)  # and applied
            for lock in loops[ep].blocks.locks.values():
                assert lock.acquire(timeout=WAIT)
                held.append(lock)
        # Each step's start waits for the SEND of the step before: within the backlog, acknowledged.
        for step in range(2, steps + 1):
            exe.run(trainer, feed=batch("dense", step), fetch_list=[loss])
        deadline = time.monotonic() + WAIT
        while not all(loop.unapplied for loop in loops.values()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(len(loop.unapplied) == 1 for loop in loops.values())  # the last step's: not acknowledged

        closing = threading.Thread(target=lambda: events.append(f"closed {exe.close()}"), daemon=True)
        closing.start()
        closing.join(0.5)
        events.append("released")
        for lock in held:
            lock.release()
        held = []
        closing.join(WAIT)
        assert events == ["released", "closed []"]  # the close waited for the acknowledgements
    finally:
        for lock in held:
            lock.release()
        if not events:
            exe.close()
        servers.join()
    assert [s for s, _ in recorder.sends] == list(range(1, steps + 1)) and [
        s for s, _, _ in recorder.gets
    ] == [0]
    lr = np.float32(LR["dense"])
    for s in t.plan.slices:
        total = sum(v for _, items in recorder.sends for _, name, v in items if name == s.grad)
        want = slice_of(initial[s.param], s) - lr * total
        got = loops[s.endpoint].env[s.name]
        np.testing.assert_allclose(
            got, want, rtol=1e-5, atol=1e-6, err_msg=f"{s.name}: not every acknowledged gradient was applied"
        )
