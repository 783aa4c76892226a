"""A trainer's reader: mini-batches from dataset tasks, task after task.

The `read` op asks it for the next batch. It holds one task at a time: the
batches of its records in order, then (once the step using the last batch
has run, that is, at the next read) it reports the task done with the
samples and mean loss it saw, and takes the next. Tasks come from the job's
coordinator, or, for a plain Executor with no coordinator, from a queue in
this process over the same dataset, so local and distributed training read
the same tasks in the same order.

When the coordinator says "wait" (the pass ends once other trainers finish
their tasks) the reader pauses this trainer at the pservers, so that no
barrier waits for it, and asks again; an executor driven step by step by a
RemoteExecutor raises NoDataYet instead, and skips the step without data
(Runtime.skip_step), keeping in step with the other trainers. (A trainer resuming
computes its first step on the parameters it last received, a few steps old:
the staleness of one pass boundary.) When every pass is done
it raises EOFException, and training loops end, as in Fluid.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from fluidps.errors import DatasetError, EOFException, Error, NoDataYet
from fluidps.executor.tasks.coordinator import CoordinatorClient
from fluidps.executor.tasks.task_queue import Lease, QueueConfig, TaskQueue
from fluidps.executor.transport.wire import Kind, json_fields
from fluidps.io.dataset import Dataset
from fluidps.ops.reader import ReaderSpec

WAIT_POLL_S = 0.2
# Tasks are made small enough that a dataset has many (trainers come and go at task
# boundaries) and large enough to hold several batches (each task costs round trips).
TASKS_PER_DATASET = 256
BATCHES_PER_TASK = 4


@dataclass(frozen=True)
class TaskLease:
    lease: int
    task: int
    shard: int
    start: int
    stop: int
    pass_index: int
    timeout: float


class TaskReader:
    def __init__(self, spec: ReaderSpec):
        self.spec = spec
        self.dataset = Dataset(spec.dataset)
        missing = [f for f in spec.fields if f not in self.dataset.fields]
        if missing:
            raise DatasetError(
                f"dataset {spec.dataset} has no field {', '.join(map(repr, missing))} (it has "
                f"{', '.join(self.dataset.fields)})"
            )
        self.records_per_task = spec.records_per_task or max(
            spec.batch_size * BATCHES_PER_TASK, math.ceil(self.dataset.records / TASKS_PER_DATASET)
        )
        self.config = QueueConfig(
            self.dataset.fingerprint, self.records_per_task, spec.passes, spec.shuffle, spec.seed
        )
        self._source: LocalSource | CoordinatorSource | None = None
        self._lease: TaskLease | None = None
        self._data: dict[str, np.ndarray] = {}
        self._cursor = 0
        self._samples = 0
        self._loss_sum, self._loss_samples = 0.0, 0
        self._batch = 0  # samples in the last batch handed out
        self._paused = False
        self._renewed = 0.0
        self.tasks_done = 0
        self.exhausted = False  # every pass is done (EOFException raised)

    @property
    def last_batch(self) -> int:
        """Records in the batch handed out last."""
        return self._batch

    @property
    def reading(self) -> bool:
        """Started reading and not at the end: a trainer stopping now leaves data unread."""
        return self._source is not None and not self.exhausted

    # -- what the read op calls ---------------------------------------------------------

    def next_batch(self, runtime: Any) -> dict[str, np.ndarray]:
        source = self._source or self._bind(runtime)
        while True:
            left = self._lease.stop - self._lease.start - self._cursor if self._lease else 0
            if left > 0 and not (self.spec.drop_last and left < self.spec.batch_size):
                return self._take(min(left, self.spec.batch_size), source)
            if self._lease is not None:
                self._finish(source)
            got = source.acquire()
            if got == "finished":
                self.exhausted = True
                raise EOFException(
                    f"the reader of {self.spec.dataset} is done: {self.spec.passes} pass(es) over the dataset"
                )
            if got == "wait":
                if not runtime.wait_for_tasks:  # the executor skips the step (Runtime.skip_step)
                    raise NoDataYet("no task for this trainer now: the others are finishing the pass")
                if not self._paused:
                    runtime.pause()
                    self._paused = True
                time.sleep(WAIT_POLL_S)
                continue
            self._paused = False
            self._lease, self._cursor, self._renewed = got, 0, time.monotonic()
            self._samples, self._loss_sum, self._loss_samples = 0, 0.0, 0
            self._data = self.dataset.read(got.shard, got.start, got.stop)

    def observe(self, fetched: list[Any]) -> None:
        """After a step: its first scalar floating fetch counts as this batch's loss."""
        for value in fetched:
            if isinstance(value, np.ndarray) and value.size == 1 and np.issubdtype(value.dtype, np.floating):
                loss = float(value.reshape(-1)[0])
                if math.isfinite(loss):
                    self._loss_sum += loss * self._batch
                    self._loss_samples += self._batch
                return

    def fail_current(self, reason: str) -> None:
        """The step using this task's batch failed: the task goes back (or is discarded)."""
        if self._lease is not None and self._source is not None:
            lease, self._lease = self._lease, None
            self._source.fail(
                lease, reason.splitlines()[0][:500] if reason else "failed"
            )  # the gist, for its log

    def close(self) -> None:
        """Report a task whose every batch was used; give back one left half done."""
        if self._lease is not None and self._source is not None:
            lease, self._lease = self._lease, None
            if self._cursor >= lease.stop - lease.start:
                self._source.finish(lease, self._samples, self._mean_loss())
            else:
                self._source.release(lease)
        if self._source is not None:
            self._source.close()
            self._source = None

    # -- inside --------------------------------------------------------------------------

    def _take(self, count: int, source: Any) -> dict[str, np.ndarray]:
        start = self._cursor
        self._cursor += count
        self._samples += count
        self._batch = count
        lease = self._lease
        assert lease is not None
        if time.monotonic() - self._renewed > lease.timeout / 3:
            source.renew(lease)  # a long task: keep the lease
            self._renewed = time.monotonic()
        return {field: self._data[field][start : start + count] for field in self.spec.fields}

    def _finish(self, source: Any) -> None:
        lease, self._lease = self._lease, None
        assert lease is not None
        source.finish(lease, self._samples, self._mean_loss())
        self.tasks_done += 1

    def _mean_loss(self) -> float | None:
        return self._loss_sum / self._loss_samples if self._loss_samples else None

    def _bind(self, runtime: Any) -> LocalSource | CoordinatorSource:
        if runtime.coordinator is None:
            self._source = LocalSource(self.dataset, self.config, self.records_per_task)
        else:
            request = {
                "dataset": str(self.dataset.path.resolve()),
                "fingerprint": self.config.fingerprint,
                "records_per_task": self.config.records_per_task,
                "passes": self.config.passes,
                "shuffle": self.config.shuffle,
                "seed": self.config.seed,
            }
            self._source = CoordinatorSource(runtime.coordinator_client(), request)
        return self._source


class LocalSource:
    """Tasks from a queue in this process (a plain Executor, no coordinator)."""

    def __init__(self, dataset: Dataset, config: QueueConfig, records_per_task: int):
        self.queue = TaskQueue(config, dataset.tasks(records_per_task), timeout=math.inf)

    def acquire(self) -> TaskLease | str:
        got = self.queue.acquire(0, "local", 0.0)
        if isinstance(got, str):
            return got
        return _lease(got, self.queue)

    def finish(self, lease: TaskLease, samples: int, loss: float | None) -> None:
        self.queue.finish(lease.lease, "local", samples, loss)

    def fail(self, lease: TaskLease, reason: str) -> None:
        self.queue.fail(lease.lease, "local", reason)

    def release(self, lease: TaskLease) -> None:
        self.queue.release(lease.lease, "local")

    def renew(self, lease: TaskLease) -> None:
        pass  # nothing expires in this process

    def close(self) -> None:
        pass


def _lease(got: Lease, queue: TaskQueue) -> TaskLease:
    task = queue.tasks[got.task]
    return TaskLease(got.id, task.id, task.shard, task.start, task.stop, queue.pass_index, queue.timeout)


_TASK_REPLY = {
    "lease": int,
    "task": int,
    "shard": int,
    "start": int,
    "stop": int,
    "pass": int,
    "attempt": int,
    "timeout": float,
}


class CoordinatorSource:
    """Tasks from the job's coordinator."""

    def __init__(self, client: CoordinatorClient, request: dict[str, Any]):
        self.client = client
        self.request = request

    def acquire(self) -> TaskLease | str:
        reply = self.client.call(Kind.TASK_GET, self.request)
        if reply.kind == Kind.NO_TASK and reply.text in ("wait", "finished"):
            return reply.text
        if reply.kind != Kind.TASK:
            raise Error(
                f"the coordinator answered a task request with {reply.kind_name} {reply.text[:200]!r}"
            )
        f = json_fields(reply.text, _TASK_REPLY)
        if not (0 <= f["start"] <= f["stop"]) or f["timeout"] <= 0:
            raise Error(f"the coordinator sent an invalid task {reply.text!r}")
        return TaskLease(f["lease"], f["task"], f["shard"], f["start"], f["stop"], f["pass"], f["timeout"])

    def finish(self, lease: TaskLease, samples: int, loss: float | None) -> None:
        self.client.call(Kind.TASK_DONE, {"lease": lease.lease, "samples": samples, "loss": loss})

    def fail(self, lease: TaskLease, reason: str) -> None:
        self.client.call(Kind.TASK_FAILED, {"lease": lease.lease, "reason": reason})

    def release(self, lease: TaskLease) -> None:
        # Given back as a failure the coordinator can count: it cannot tell a trainer that
        # stops early from one that stops because of the task.
        self.client.call(Kind.TASK_FAILED, {"lease": lease.lease, "reason": "its trainer stopped early"})

    def renew(self, lease: TaskLease) -> None:
        self.client.call(Kind.TASK_RENEW, {"lease": lease.lease})

    def close(self) -> None:
        self.client.close()
