"""A trainer's reader: mini-batches from dataset tasks, task after task.

The `read` op asks it for the next batch. It holds one task at a time: the
batches of its records in order, then (once the step using the last batch
has run, that is, at the next read) it reports the task done with the
samples and mean loss it saw, and takes the next. Tasks come from the job's
coordinator, or, for a plain Executor with no coordinator, from a queue in
this process over the same dataset, so local and distributed training read
the same tasks in the same order.

When the coordinator says "wait" (the pass ends once other trainers finish
their tasks) the reader lets its trainer idle and asks again: in sync mode the
trainer takes part in the others' rounds without gradients (TrainerClient.idle_round),
otherwise it pauses at the pservers so that no SSP bound waits for it. An executor
driven step by step by a RemoteExecutor raises NoDataYet instead, and skips the
step without data (TrainerClient.skip_step), keeping in step with the other
trainers. (A trainer getting a task again computes its first step on the
parameters it last received, a few steps old: the staleness of one pass
boundary.) When every pass is done it raises EOFException, and training loops
end, as in Fluid.

`Readers` holds a process's readers, one per READER variable: what the
runtime gives the create_dataset_reader and create_stream_reader kernels (a stream's
reader is fluidps.executor.tasks.stream_reader's).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from fluidps.errors import DatasetError, EOFException, Error, NoDataYet
from fluidps.executor.tasks.task_queue import Lease, QueueConfig, TaskQueue
from fluidps.io.dataset import Dataset
from fluidps.ops.reader import ReaderSpec, StreamReaderSpec

if TYPE_CHECKING:
    from fluidps.executor.ps.applied_batches import Delivered
    from fluidps.executor.tasks.stream_reader import StreamReader, WindowSource

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


class TaskSource(Protocol):
    """Where a reader's tasks come from: a queue in this process or the coordinator."""

    def acquire(self) -> TaskLease | str: ...  # a lease, "wait" or "finished"

    def finish(self, lease: TaskLease, samples: int, loss: float | None) -> None: ...

    def fail(self, lease: TaskLease, reason: str) -> None: ...

    def release(self, lease: TaskLease) -> None: ...

    def renew(self, lease: TaskLease) -> bool: ...  # False: the lease is no longer this trainer's

    def close(self) -> None: ...


class LossTally:
    """A task's (or a window's) mean loss: each step's first scalar floating fetch,
    weighted by its batch's records (steps whose loss is not finite do not count)."""

    def __init__(self) -> None:
        self.total, self.samples = 0.0, 0

    def observe(self, fetched: list[Any], batch: int) -> None:
        for value in fetched:
            if isinstance(value, np.ndarray) and value.size == 1 and np.issubdtype(value.dtype, np.floating):
                loss = float(value.reshape(-1)[0])
                if math.isfinite(loss):
                    self.total += loss * batch
                    self.samples += batch
                return

    def mean(self) -> float | None:
        return self.total / self.samples if self.samples else None


class TaskReader:
    def __init__(self, spec: ReaderSpec, readers: Readers):
        self.spec = spec
        self._readers = readers
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
        self._source: TaskSource | None = None
        self._lease: TaskLease | None = None
        self._data: dict[str, np.ndarray] = {}
        self._cursor = 0
        self._samples = 0
        self._losses = LossTally()
        self._batch = 0  # samples in the last batch handed out
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

    def next_batch(self) -> dict[str, np.ndarray]:
        source = self._source or self._bind()
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
                if not self._readers.wait_for_tasks:  # the executor skips the step (skip_step)
                    raise NoDataYet("no task for this trainer now: the others are finishing the pass")
                if not self._readers.idle_trainer():  # nothing moved meanwhile: no need to ask at once
                    time.sleep(WAIT_POLL_S)
                continue
            self._lease, self._cursor, self._renewed = got, 0, time.monotonic()
            self._samples, self._losses = 0, LossTally()
            self._data = self.dataset.read(got.shard, got.start, got.stop)

    def observe(self, fetched: list[Any]) -> None:
        """After a step: its first scalar floating fetch counts as this batch's loss."""
        self._losses.observe(fetched, self._batch)

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
                self._source.finish(lease, self._samples, self._losses.mean())
            else:
                self._source.release(lease)
        if self._source is not None:
            self._source.close()
            self._source = None

    # -- inside --------------------------------------------------------------------------

    def _take(self, count: int, source: TaskSource) -> dict[str, np.ndarray]:
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

    def _finish(self, source: TaskSource) -> None:
        lease, self._lease = self._lease, None
        assert lease is not None
        source.finish(lease, self._samples, self._losses.mean())
        self.tasks_done += 1

    def _bind(self) -> TaskSource:
        if self._readers.coordinator is None:
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
            self._source = self._readers.coordinator_source(request)
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

    def renew(self, lease: TaskLease) -> bool:
        return True  # nothing expires in this process

    def close(self) -> None:
        pass


def _lease(got: Lease, queue: TaskQueue) -> TaskLease:
    task = queue.tasks[got.task]
    return TaskLease(got.id, task.id, task.shard, task.start, task.stop, queue.pass_index, queue.timeout)


def _nothing_to_deliver() -> Delivered:
    """What a process with no pservers delivers: nothing (a stream reader's windows are its own)."""
    from fluidps.executor.ps.applied_batches import Delivered  # (local training loads no ps room)

    return Delivered()


class Readers:
    """A process's dataset readers, by READER variable (fluidps.ops.runtime_api.ReaderHost).

    Their tasks come from the coordinator at `coordinator` (an address) when there is
    one, through `connect(address, request)`; from a queue in this process otherwise.
    `wait_for_tasks`: a reader with no task now waits for one, calling `idle_trainer`
    between its asks (which returns whether to ask again at once: the job moved on
    meanwhile), unless a client drives this executor step by step (an executor
    server): then it raises NoDataYet and the step is skipped. `deliver`: wait until the
    pservers acknowledged every gradient sent (a stream reader calls it before it
    reports a window done: its records are applied then); it returns what they came to
    (applied_batches.Delivered: the windows whose batches went unnamed, what the
    acknowledgements said of the pservers' checkpoints).
    """

    def __init__(
        self,
        coordinator: str | None,
        connect: Callable[[str, dict[str, Any]], TaskSource],
        idle_trainer: Callable[[], bool],
        deliver: Callable[[], Delivered] | None = None,
    ):
        self.coordinator = coordinator
        self.wait_for_tasks = True
        self.idle_trainer = idle_trainer
        self.deliver = deliver or _nothing_to_deliver
        self._connect = connect
        self._open: dict[str, TaskReader | StreamReader] = {}

    def open(self, name: str, spec: ReaderSpec | StreamReaderSpec) -> TaskReader | StreamReader:
        """A new reader for the READER variable `name` (of a dataset, or of a stream),
        closing the one it replaces."""
        from fluidps.executor.tasks.stream_reader import StreamReader

        reader = StreamReader(spec, self) if isinstance(spec, StreamReaderSpec) else TaskReader(spec, self)
        previous = self._open.pop(name, None)
        if previous is not None:
            previous.close()
        self._open[name] = reader
        return reader

    def stop_streams(self) -> int:
        """Drain every stream reader: each finishes the window in hand, then its next read
        raises EOFException (a job told to stop). Returns how many there were."""
        streams = [r for r in self._open.values() if isinstance(r.spec, StreamReaderSpec)]
        for reader in streams:
            reader.stop()
        return len(streams)

    def batch_tag(self) -> str | None:
        """The stream batch this step trains on, as its gradients' SENDs name it
        (fluidps.executor.ps.applied_batches); None when no stream reader gave one."""
        for reader in self._open.values():
            if isinstance(reader.spec, StreamReaderSpec) and (tag := reader.batch_tag) is not None:
                return tag
        return None

    def coordinator_source(self, request: dict[str, Any]) -> TaskSource | WindowSource:
        assert self.coordinator is not None
        return self._connect(self.coordinator, request)

    @property
    def reading(self) -> bool:
        """Some reader started and has not reached the end of its data."""
        return any(r.reading for r in self._open.values())

    def samples_read(self) -> int | None:
        """Records the readers handed out in the last step (None: there is no reader)."""
        if not self._open:
            return None
        return sum(r.last_batch for r in self._open.values())

    def close(self) -> list[str]:
        """Each reader's last task: reported done, or given back. Returns the problems met."""
        problems = []
        for reader in self._open.values():
            try:
                reader.close()
            except Error as e:
                what = (
                    reader.spec.source if isinstance(reader.spec, StreamReaderSpec) else reader.spec.dataset
                )
                problems.append(f"reader of {what}: {e}")
        self._open.clear()
        return problems
