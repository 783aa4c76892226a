"""How a pserver applies gradients and when it answers a GET: one class per mode.

- sync: trainers go in lockstep: every live trainer sends a barrier each round, with
  gradients when it had a batch, without when it waits for a task (see
  TrainerClient.idle_round), so every pserver pairs the same barriers into its rounds.
  A round with gradients is an optimization step; checkpoints and stats count those.
  Trainer i's gradient of a slice lands in `<grad>.trainer_<i>` (in `<grad>`
  itself when the job has one trainer). A slice whose
  gradient every trainer of the job has sent is optimized at once (the learning-rate
  block first, once a step), while the trainers still compute the gradients of the
  layers below. When every live trainer has sent its send barrier for the step, the
  other slices' optimize blocks run (they sum the copies and scale by 1/trainers:
  trainers that sent nothing this step, paused or done, count as the mean of those
  that did), and each trainer's GET is answered once the step holding its barrier is
  done. Either way each block runs once a step, on the same sums, so the order does
  not change the result; the blocks that become due at once (a message's slices) run
  joined as one block (fluidps.executor.ps.joined_blocks), one compiled call.
- async: each arriving gradient runs its receive block (an enqueue); an optimize
  thread takes the messages in order and applies each one's gradients, their optimize
  blocks joined as one (each dequeues its gradient), holding those slices' locks, and
  GETs copy under the lock. A SEND is acknowledged once its
  gradients are applied: a trainer (its communicator) never has more than its last
  message waiting here, so the queues stay short and what a fast trainer computes
  meanwhile is merged on its side. Clocks (the steps each trainer sent) drive the
  learning-rate schedule.
- ssp: async, but a GET waits until the trainer's clock is at most `staleness`
  steps ahead of the slowest live trainer's; every grant is logged.

The ParameterServer loop (fluidps.executor.ps.parameter_server) owns the socket,
the trainers' membership and the checkpoints, and calls its strategy at each event.
A strategy sees nothing of the server: it is given a StrategyContext, made once the
server is complete, of what it works with (the variables, the trainers, the blocks).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fluidps.executor.ps import gradients

if TYPE_CHECKING:
    from fluidps.executor.ps.membership import Membership
    from fluidps.executor.ps.optimize_blocks import OptimizeBlocks

_WORKER_POLL = 0.05  # seconds the async optimize thread waits for a message before checking for a stop
# An async SEND is acknowledged once at most this many gradients queued before and with
# each of its own are still to be applied: the optimize thread always has the next
# one at hand, and no trainer gets further ahead of its pserver than that.
ASYNC_BACKLOG = 2


@dataclass(frozen=True)
class StrategyContext:
    """What a strategy works with, and all it sees of its pserver."""

    env: dict[str, Any]  # the pserver's variables
    trainers: int  # the job's
    staleness: int  # SSP: how many steps a trainer may run ahead of the slowest
    # Per gradient, in block order: where each trainer's copy lands (ServeSpec.copies).
    copies: Mapping[str, tuple[str, ...]]
    members: Membership  # which trainers are live, and their clocks
    blocks: OptimizeBlocks
    # Sync: run the optimize blocks of these gradients (a distributed table's may be held
    # and applied after the answers: rows_first.py).
    apply: Callable[[list[str]], None]
    clock_log: deque[dict[str, Any]]  # clock and grant events, for the stats
    log: Callable[[str], None]
    applied: Callable[[], None]  # (thread-safe) an optimize thread applied gradients
    wake: Callable[[], None]  # (thread-safe) an optimize thread failed: the loop looks now


class Strategy:
    """What every mode answers; the defaults are async's."""

    mode = ""
    # Whether a worker thread updates the variables while the loop reads them: a value
    # sent is then copied under its block's lock; else it is sent as it is.
    updates_meanwhile = True
    # Gradients whose optimize block ran (for the metrics): one int, written by one thread.
    gradients_applied = 0

    def __init__(self, ctx: StrategyContext):
        self.ctx = ctx

    @property
    def steps(self) -> int:
        """Steps this pserver has counted (what checkpoints are numbered by)."""
        raise NotImplementedError

    @property
    def progress(self) -> int:
        """What moves whenever the job does: a stall is this standing still."""
        return self.steps

    def start(self, step: int) -> None:
        """The loop begins serving, at step `step` (a restored checkpoint's, else 0)."""

    def stop(self) -> None:
        """The loop ends: finish what was acknowledged."""

    @property
    def failure(self) -> BaseException | None:
        """An error of a worker thread, which ends the job."""
        return None

    def settle(self) -> None:
        """Return once every gradient accepted is applied (the serving loop accepts none
        meanwhile): what a checkpoint copies then is all of them."""

    def on_gradients(self, trainer: int, step: int, tensors: dict[str, Any]) -> Callable[[], bool] | None:
        """A trainer's SEND of its step `step` (tensors may be empty: a step without data).
        Returns None, or what says when the SEND may be acknowledged: once its gradients
        are applied (async), which keeps a trainer from running ahead of its pserver."""
        raise NotImplementedError

    def on_barrier(self, trainer: int, step: int) -> None:
        """A trainer's send barrier of its step `step` (already acknowledged)."""

    def on_members_changed(self) -> None:
        """A trainer paused, finished, left or was evicted: a step may be complete now."""

    def forget(self, trainer: int) -> None:
        """A trainer's old incarnation is gone (evicted or replaced): drop what it started."""

    def may_answer(self, trainer: int) -> bool:
        """Whether a GET of `trainer` can be answered now (else it waits)."""
        return True

    def answered(self, trainer: int) -> None:
        """A GET of `trainer` was answered."""

    def stats(self) -> dict[str, Any]:
        return {"completed_steps": 0}

    def describe_wait(self) -> str:
        """What the current step waits for, for a log line when it takes long."""
        return f"{self.steps} steps done"


class SyncStrategy(Strategy):
    mode = "sync"
    updates_meanwhile = False  # nothing changes a value until every trainer has fetched it

    def __init__(self, ctx: StrategyContext):
        super().__init__(ctx)
        self.arrived: set[int] = set()  # send barriers of the current step
        self.sent: set[int] = set()  # trainers whose gradients of the current step arrived
        self.senders: dict[str, set[int]] = {}  # per gradient: the trainers that sent it this step
        self.applied: set[str] = set()  # gradients whose optimize block ran this step
        self.awaiting: dict[int, int] = {}  # the round each trainer's next GET waits for
        # Each trainer's own step number of its last barrier counted: anything it sends
        # numbered that or lower belongs to a step already closed (0: unnumbered, not checked).
        self.closed: dict[int, int] = {}
        self.rounds = 0  # rounds of barriers closed, those without gradients too
        self.completed = 0  # optimization steps done: rounds some trainer brought gradients to

    @property
    def steps(self) -> int:
        return self.completed

    @property
    def progress(self) -> int:
        return self.rounds

    def start(self, step: int) -> None:
        self.completed = step

    def on_gradients(self, trainer: int, step: int, tensors: dict[str, Any]) -> None:
        ctx = self.ctx
        if tensors and self._closed(trainer, step):
            ctx.log(
                f"trainer {trainer}'s gradients of its step {step} came after that step was closed "
                f"(its barrier counted); dropped: {', '.join(map(repr, tensors))}"
            )
            return
        everyone = set(range(ctx.trainers))
        ready = []
        for grad, value in tensors.items():
            if grad in self.applied:
                # Applied with every trainer's gradient already: this one is a resent message
                # or comes from a restarted trainer redoing the step; it counted once.
                ctx.log(
                    f"trainer {trainer}'s {grad!r} (its step {step}) came after this step applied "
                    "every trainer's; dropped (a resent message, or a restarted trainer)"
                )
                continue
            ctx.env[ctx.copies[grad][trainer]] = value
            self.sent.add(trainer)
            senders = self.senders.setdefault(grad, set())
            senders.add(trainer)
            if senders == everyone:  # the common case: no trainer paused, done or gone
                ready.append(grad)
        self._apply(ready)

    def on_barrier(self, trainer: int, step: int) -> None:
        if self._closed(trainer, step):  # counted once; a GET riding on it is answered as usual
            self.ctx.log(f"trainer {trainer}'s send barrier of its step {step} came again; ignored")
            return
        if step:
            self.closed[trainer] = step
        self.arrived.add(trainer)
        self.awaiting[trainer] = self.rounds + 1
        self._maybe_complete()

    def on_members_changed(self) -> None:
        self._maybe_complete()

    def forget(self, trainer: int) -> None:
        self.arrived.discard(trainer)
        self.awaiting.pop(trainer, None)
        self.closed.pop(trainer, None)  # a new incarnation numbers its steps from 1

    def _closed(self, trainer: int, step: int) -> bool:
        return 0 < step <= self.closed.get(trainer, 0)

    def may_answer(self, trainer: int) -> bool:
        return self.rounds >= self.awaiting.get(trainer, 0)

    def stats(self) -> dict[str, Any]:
        return {"completed_steps": self.completed, "rounds": self.rounds}

    def describe_wait(self) -> str:
        live = self.ctx.members.live
        return (
            f"round {self.rounds + 1} (step {self.completed + 1}) has the barriers of trainers {sorted(self.arrived)} and waits for "
            f"{sorted(live - self.arrived)} (live {sorted(live)}; gradients from {sorted(self.sent)}; GETs "
            f"await rounds {dict(sorted(self.awaiting.items()))})"
        )

    def _apply(self, grads: list[str]) -> None:
        """Run the optimize blocks of `grads` as one (and, first in a step, the
        learning-rate block)."""
        if not grads:
            return
        if not self.applied:
            self.ctx.blocks.advance_learning_rate(self.ctx.env)
        self.applied.update(grads)
        self.ctx.apply(grads)
        self.gradients_applied += len(grads)

    def _maybe_complete(self) -> None:
        ctx = self.ctx
        live = ctx.members.live
        if not self.arrived or not live <= self.arrived:
            return
        contributors = self.arrived & self.sent
        if contributors:
            everyone = set(range(ctx.trainers))
            waiting = [g for g in ctx.copies if g not in self.applied]  # (in block order)
            unsent, ready = [], []
            for grad in waiting:
                have = self.senders.get(grad, set()) & contributors
                if not have:  # its copies hold an earlier step's gradient: not applied again
                    unsent.append(grad)
                    continue
                # Trainers that sent no gradient of it this step (paused, done, evicted, at
                # the barrier with no batch, or sending no such gradient) count as the mean
                # of those that did, so the optimize block's sum / trainers is their mean.
                missing = everyone - have
                if missing:
                    mean = gradients.mean([ctx.env[ctx.copies[grad][t]] for t in sorted(have)])
                    for t in missing:
                        ctx.env[ctx.copies[grad][t]] = mean
                ready.append(grad)
            self._apply(ready)
            if unsent:
                ctx.log(
                    f"step {self.completed + 1}: trainers {sorted(contributors)} sent no gradient of "
                    f"{', '.join(map(repr, unsent))}; those slices stay as they were (does every trainer "
                    "run the trainer program transpiled with this pserver's?)"
                )
        if self.applied:
            self.completed += 1
        self.rounds += 1  # (a round nobody brought gradients to changes nothing)
        self.arrived.clear()
        self.sent -= contributors
        self.senders.clear()
        self.applied.clear()


class AsyncStrategy(Strategy):
    mode = "async"

    def __init__(self, ctx: StrategyContext):
        super().__init__(ctx)
        self.max_step = 0  # the furthest clock
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None
        self._failure: BaseException | None = None
        # Per gradient: how many were queued (by the loop) and applied (by the worker).
        self._queued: dict[str, int] = dict.fromkeys(ctx.copies, 0)
        self._applied: dict[str, int] = dict.fromkeys(ctx.copies, 0)
        # The gradients of each SEND queued and not yet applied, in order (the worker
        # applies a message's gradients at once: each is at the head of its queue then).
        self._messages: deque[list[str]] = deque()
        self._arrived = threading.Condition()

    @property
    def steps(self) -> int:
        return self.max_step

    @property
    def failure(self) -> BaseException | None:
        return self._failure

    def start(self, step: int) -> None:
        self.max_step = step
        self._worker = threading.Thread(target=self._work, name="optimize", daemon=True)
        self._worker.start()

    def stop(self) -> None:
        self._stop.set()
        with self._arrived:
            self._arrived.notify()
        if self._worker is not None:
            self._worker.join(timeout=10)

    def settle(self) -> None:
        with self._arrived:
            while self._failure is None and any(self._applied[g] < n for g, n in self._queued.items()):
                self._arrived.wait(_WORKER_POLL)

    def on_gradients(self, trainer: int, step: int, tensors: dict[str, Any]) -> Callable[[], bool]:
        ticket = {}
        for grad, value in tensors.items():
            self.ctx.blocks.enqueue(grad, value)
            self._queued[grad] += 1
            ticket[grad] = self._queued[grad]
        if tensors:
            with self._arrived:
                self._messages.append(list(tensors))
                self._arrived.notify()
        self._tick(trainer, step)
        return lambda: all(self._applied[grad] >= n - ASYNC_BACKLOG for grad, n in ticket.items())

    def _tick(self, trainer: int, step: int) -> None:
        ctx = self.ctx
        if not ctx.members.tick(trainer, step):
            return
        clock = ctx.members.clock(trainer)
        ctx.clock_log.append({"t": time.monotonic(), "event": "clock", "trainer": trainer, "step": clock})
        if clock > self.max_step:
            # Without global steps, the schedule advances with the furthest trainer, a
            # step at a time (a trainer uploading every n steps moves it n steps).
            ctx.blocks.advance_learning_rate(ctx.env, clock - self.max_step)
            self.max_step = clock

    def _work(self) -> None:
        """Apply the messages' gradients in order, each message's blocks joined as one;
        until told to stop with none left: a gradient acknowledged to its trainer is
        applied, even when that trainer has just said it is done."""
        while True:
            with self._arrived:
                if not self._messages:
                    self._arrived.wait(_WORKER_POLL)
                if not self._messages:
                    if self._stop.is_set():
                        return
                    continue
                grads = self._messages.popleft()
            try:
                self.ctx.blocks.run_locked(grads, self.ctx.env)
            except BaseException as e:  # reported by the serving loop, which stops the job
                self._failure = e
                self.ctx.wake()
                return
            with self._arrived:  # (settle waits on it)
                for grad in grads:
                    self._applied[grad] += 1  # (this thread is its only writer)
                self.gradients_applied += len(grads)
                self._arrived.notify_all()
            self.ctx.applied()


class SspStrategy(AsyncStrategy):
    mode = "ssp"

    def may_answer(self, trainer: int) -> bool:
        members = self.ctx.members
        slowest = members.slowest()
        return slowest is None or members.clock(trainer) - slowest <= self.ctx.staleness

    def answered(self, trainer: int) -> None:
        members = self.ctx.members
        clock, slowest = members.clock(trainer), members.slowest()
        self.ctx.clock_log.append(
            {
                "t": time.monotonic(),
                "event": "grant",
                "trainer": trainer,
                "step": clock,
                "slowest": clock if slowest is None else slowest,
            }
        )


STRATEGIES: dict[str, type[Strategy]] = {s.mode: s for s in (SyncStrategy, AsyncStrategy, SspStrategy)}
