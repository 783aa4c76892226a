"""The pserver's strategies driven through their StrategyContext alone: no server, just
the variables, the trainers and stand-ins for the blocks they run."""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

from fluidps.executor.ps.membership import Membership
from fluidps.executor.ps.strategies import STRATEGIES, StrategyContext

WAIT = 10.0  # seconds: the bound of every wait for the optimize thread
GRADS = ("w@GRAD", "b@GRAD")


class Blocks:
    """Records what a strategy asks of its blocks (OptimizeBlocks' methods it calls)."""

    def __init__(self) -> None:
        self.lr_steps = 0
        self.queued: list[str] = []
        self.ran: list[list[str]] = []
        self.done = threading.Event()

    def advance_learning_rate(self, env: dict, steps: int = 1) -> None:
        self.lr_steps += steps

    def enqueue(self, grad: str, value: object) -> None:
        self.queued.append(grad)

    def run_locked(self, grads: list[str], env: dict) -> None:
        self.ran.append(list(grads))
        self.done.set()


def context(mode: str, trainers: int, staleness: int = 0):
    """(strategy, its context, what it applied (sync), what it logged)."""
    blocks, applied, log = Blocks(), [], []
    copies = {g: tuple(f"{g}.trainer_{t}" for t in range(trainers)) for g in GRADS}
    ctx = StrategyContext(
        env={},
        trainers=trainers,
        staleness=staleness,
        copies=copies,
        members=Membership(trainers, elastic=False),
        blocks=blocks,
        apply=applied.append,
        clock_log=deque(),
        log=log.append,
        applied=lambda: None,
        wake=lambda: None,
    )
    return STRATEGIES[mode](ctx), ctx, applied, log


def test_sync_applies_a_slice_once_every_trainer_sent_it_and_the_rest_at_the_barriers():
    strategy, ctx, applied, _ = context("sync", trainers=2)
    strategy.start(0)
    w0, b0, w1 = np.full(2, 1.0), np.full(2, 3.0), np.full(2, 5.0)
    strategy.on_gradients(0, 1, {"w@GRAD": w0, "b@GRAD": b0})
    strategy.on_gradients(1, 1, {"w@GRAD": w1})
    assert applied == [["w@GRAD"]] and ctx.blocks.lr_steps == 1  # both sent w: optimized at once
    assert ctx.env["w@GRAD.trainer_0"] is w0 and ctx.env["w@GRAD.trainer_1"] is w1
    strategy.on_barrier(0, 1)
    assert not strategy.may_answer(0) and strategy.steps == 0  # trainer 1's barrier is missing
    strategy.on_barrier(1, 1)
    # Trainer 1 sent no b: it counts as the mean of those that did (trainer 0's).
    assert applied == [["w@GRAD"], ["b@GRAD"]] and ctx.blocks.lr_steps == 1
    np.testing.assert_array_equal(ctx.env["b@GRAD.trainer_1"], b0)
    assert strategy.may_answer(0) and strategy.may_answer(1) and strategy.steps == 1


def test_sync_starts_counting_from_a_restored_step_and_drops_a_closed_steps_gradients():
    strategy, _, applied, log = context("sync", trainers=1)
    strategy.start(7)
    strategy.on_gradients(0, 1, {"w@GRAD": np.ones(2)})
    strategy.on_barrier(0, 1)
    assert strategy.steps == 8 and applied == [["w@GRAD"]]
    strategy.on_gradients(0, 1, {"b@GRAD": np.ones(2)})  # step 1 again: closed
    assert applied == [["w@GRAD"]] and "came after that step was closed" in log[-1]


def test_async_enqueues_each_gradient_and_its_thread_applies_each_message_as_one():
    strategy, ctx, _, _ = context("async", trainers=1)
    strategy.start(0)
    try:
        done = strategy.on_gradients(0, 1, {"w@GRAD": np.ones(2), "b@GRAD": np.ones(2)})
        assert ctx.blocks.queued == ["w@GRAD", "b@GRAD"]
        assert ctx.blocks.done.wait(WAIT) and ctx.blocks.ran == [["w@GRAD", "b@GRAD"]]
        assert done() and strategy.failure is None
        assert strategy.steps == 1 and ctx.blocks.lr_steps == 1  # the schedule follows the clock
    finally:
        strategy.stop()


def test_ssp_answers_a_trainer_at_most_staleness_steps_ahead_and_logs_each_grant():
    strategy, ctx, _, _ = context("ssp", trainers=2, staleness=1)
    strategy.start(0)
    try:
        for step in (1, 2):
            strategy.on_gradients(0, step, {})  # trainer 0 at clock 2, trainer 1 at 0
        assert not strategy.may_answer(0) and strategy.may_answer(1)
        strategy.on_gradients(1, 1, {})
        assert strategy.may_answer(0)
        strategy.answered(0)
        assert ctx.clock_log[-1] | {"t": 0} == {
            "t": 0,
            "event": "grant",
            "trainer": 0,
            "step": 2,
            "slowest": 1,
        }
    finally:
        strategy.stop()
