"""The coordinator's task bookkeeping for a dataset: todo, pending, done and discarded,
pass by pass.

A trainer `acquire`s a task and gets a lease on it; it reports the lease `finish`ed or
`fail`ed (fluidps.executor.tasks.leases has the rules: expiry, failures, discarding, a
late report from a trainer thought dead). When todo and pending are both empty the pass
is over and the next one starts, with the surviving tasks in a new order.

Pure state, no clock and no I/O: callers pass `now` (seconds, monotonic) and
persist `to_snapshot()`, which `from_snapshot` restores exactly, pending
leases included (their deadlines restart from the restore).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from fluidps.errors import Error
from fluidps.executor.tasks.leases import Lease, LeaseBook
from fluidps.io.dataset import Task

__all__ = ["Lease", "QueueConfig", "TaskQueue"]

SNAPSHOT_VERSION = 1


@dataclass(frozen=True)
class QueueConfig:
    """What a queue hands out: a dataset's tasks, `passes` times."""

    fingerprint: str  # the dataset's
    records_per_task: int
    passes: int = 1
    shuffle: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.passes < 1 or self.records_per_task < 1:
            raise Error(f"passes and records_per_task must be >= 1: {self}")


class TaskQueue(LeaseBook):
    def __init__(
        self, config: QueueConfig, tasks: Sequence[Task], timeout: float = 60.0, max_failures: int = 3
    ):
        super().__init__(timeout, max_failures)
        self.config = config
        self.tasks = list(tasks)
        self.pass_index = 0
        self.todo = deque(self._order(0))
        self.done: list[int] = []  # this pass, in the order they finished
        self.history: list[dict[str, Any]] = []  # one summary per finished pass
        self.samples = 0  # this pass
        self.loss_sum = 0.0  # this pass: sum of loss x samples of tasks that reported a loss
        self.loss_samples = 0

    # -- the protocol --------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.pass_index >= self.config.passes

    def acquire(self, trainer: int, worker: str, now: float, allowed: float | None = None) -> Lease | str:
        """A lease on the next task, the same lease again if this worker already holds one,
        "wait" (the pass ends once the pending tasks finish) or "finished". Its deadline
        is `allowed` seconds away (default: the queue's timeout)."""
        self.expire(now)
        self.replaced(trainer, worker)
        if (held := self.held_by(worker)) is not None:
            return held
        if self.finished:
            return "finished"
        return self.lease_next(trainer, worker, now, allowed) or "wait"

    def finish(self, lease_id: int, worker: str, samples: int = 0, loss: float | None = None) -> bool:
        """Count the lease's task done; False for a lease that is no longer current."""
        lease = self.end_lease(lease_id, worker)
        if lease is None:
            return False
        self.done.append(lease.task)
        self.samples += samples
        if loss is not None and samples > 0:
            self.loss_sum += loss * samples
            self.loss_samples += samples
        self._changed()
        return True

    # -- inside ----------------------------------------------------------------------------

    def _order(self, pass_index: int) -> list[int]:
        ids = [t.id for t in self.tasks if t.id not in self.discarded]
        if self.config.shuffle:
            rng = np.random.default_rng([self.config.seed, pass_index])
            ids = [ids[i] for i in rng.permutation(len(ids))]
        return ids

    def _changed(self) -> None:
        """The pass is over once nothing is left to do or pending: the next one starts."""
        if self.todo or self.pending or self.finished:
            return
        self.history.append(
            {
                "pass": self.pass_index,
                "done": list(self.done),
                "discarded": sorted(self.discarded),
                "samples": self.samples,
                "loss": self.mean_loss,
            }
        )
        self.pass_index += 1
        self.done, self.samples, self.loss_sum, self.loss_samples = [], 0, 0.0, 0
        if not self.finished:
            self.todo = deque(self._order(self.pass_index))
            if not self.todo:  # everything was discarded: nothing left to read
                self.pass_index = self.config.passes

    @property
    def mean_loss(self) -> float | None:
        return self.loss_sum / self.loss_samples if self.loss_samples else None

    # -- reporting and persistence -------------------------------------------------------

    def status(self) -> dict[str, Any]:
        live = len(self.tasks) - len(self.discarded)
        return {
            "pass": min(self.pass_index, self.config.passes - 1),
            "passes": self.config.passes,
            "finished": self.finished,
            "tasks": len(self.tasks),
            "tasks_this_pass": len(self.done) + len(self.todo) + len(self.pending)
            if not self.finished
            else live,
            "done": len(self.done) if not self.finished else 0,
            "pending": len(self.pending),
            "todo": len(self.todo),
            "discarded": {str(t): why for t, why in sorted(self.discarded.items())},
            "samples": self.samples,
            "total_samples": self.samples + sum(h["samples"] for h in self.history),
            "loss": self.mean_loss,
            "history": self.history,
        }

    def to_snapshot(self) -> dict[str, Any]:
        return {
            "version": SNAPSHOT_VERSION,
            "config": asdict(self.config),
            "tasks": [[t.id, t.shard, t.start, t.stop] for t in self.tasks],
            "timeout": self.timeout,
            "max_failures": self.max_failures,
            "pass": self.pass_index,
            "todo": list(self.todo),
            "pending": self._lease_snapshot(),
            "done": self.done,
            "failures": {str(t): n for t, n in self.failures.items()},
            "discarded": {str(t): why for t, why in self.discarded.items()},
            "history": self.history,
            "samples": self.samples,
            "loss_sum": self.loss_sum,
            "loss_samples": self.loss_samples,
            "next_lease": self.next_lease,
        }

    @classmethod
    def from_snapshot(cls, snapshot: dict[str, Any], now: float) -> TaskQueue:
        """The queue a snapshot describes; raises Error when it is not a valid snapshot."""
        try:
            if snapshot["version"] != SNAPSHOT_VERSION:
                raise Error(f"snapshot version {snapshot['version']} is not {SNAPSHOT_VERSION}")
            tasks = [Task(int(i), int(s), int(a), int(b)) for i, s, a, b in snapshot["tasks"]]
            queue = cls(
                QueueConfig(**snapshot["config"]), tasks, snapshot["timeout"], snapshot["max_failures"]
            )
            queue.pass_index = int(snapshot["pass"])
            queue.todo = deque(int(t) for t in snapshot["todo"])
            queue._restore_leases(snapshot["pending"], now)
            queue.done = [int(t) for t in snapshot["done"]]
            queue.failures = {int(t): int(n) for t, n in snapshot["failures"].items()}
            queue.discarded = {int(t): str(why) for t, why in snapshot["discarded"].items()}
            queue.history = list(snapshot["history"])
            queue.samples = int(snapshot["samples"])
            queue.loss_sum = float(snapshot["loss_sum"])
            queue.loss_samples = int(snapshot["loss_samples"])
            queue.next_lease = int(snapshot["next_lease"])
        except (KeyError, TypeError, ValueError) as e:
            raise Error(f"not a valid coordinator snapshot: {type(e).__name__}: {e}") from None
        queue._check()
        return queue

    def _check(self) -> None:
        """Every task is in exactly one place (todo, pending, done, discarded) of this pass."""
        ids = {t.id for t in self.tasks}
        places = [*self.todo, *self.pending, *self.done, *self.discarded]
        if len(places) != len(set(places)) or (not self.finished and set(places) != ids):
            raise Error("not a valid coordinator snapshot: its tasks are not each in exactly one queue")
