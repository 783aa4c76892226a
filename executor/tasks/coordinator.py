"""The coordinator: a TaskQueue served over ZeroMQ, snapshotted after every change.

Trainers' readers ask it for tasks (TASK_GET, saying what they read: dataset,
records per task, passes), report them done or failed, and renew long ones. In a
streaming job the tasks are windows of a stream (fluidps.executor.tasks.stream_windows:
a stream reader's TASK_GET names the stream and the window), and a window reported
done moves the stream's committed offset, after the snapshot is written.
The first trainer's request configures a fresh coordinator; later ones must
read the same. Every change is written to the snapshot (atomically: temporary
file, fsync, rename) before it is answered, so a coordinator killed at any
moment and restarted from its snapshot neither loses nor double-counts a task:
a report it never answered is retried by the trainer
(fluidps.executor.tasks.coordinator_client) and counted then; one it answered
is in the snapshot.

Every message's text is JSON, parsed into checked fields (`wire.json_fields`): nothing
received is evaluated.
"""

from __future__ import annotations

import json
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import zmq

from fluidps.errors import Error, StreamError
from fluidps.executor.ps.applied_batches import ack_text, parse_ack, stream_id
from fluidps.executor.tasks.checkpoint_watch import CheckpointWatch
from fluidps.executor.tasks.lease_times import LeaseTimes
from fluidps.executor.tasks.leases import LeaseBook
from fluidps.executor.tasks.stream_windows import StreamWindows
from fluidps.executor.tasks.task_queue import Lease, QueueConfig, TaskQueue
from fluidps.executor.tasks.window_queue import WindowConfig
from fluidps.executor.transport.liveness import SilenceClock
from fluidps.executor.transport.rpc import Request, RpcServer
from fluidps.executor.transport.settings import RpcSettings
from fluidps.executor.transport.wire import OPTIONAL_FLOAT, Kind, Message, json_fields
from fluidps.io.atomic import write_atomic
from fluidps.io.dataset import Dataset
from fluidps.io.stream import open_stream

DEFAULT_TASK_TIMEOUT = 60.0
# What a trainer's TASK_GET says it reads.
READ_REQUEST = {
    "dataset": str,
    "fingerprint": str,
    "records_per_task": int,
    "passes": int,
    "shuffle": bool,
    "seed": int,
}
# What a stream reader's TASK_GET says it reads (fluidps.executor.tasks.stream_reader).
STREAM_REQUEST = {
    "stream": str,
    "group": str,
    "window_records": int,
    "window_seconds": OPTIONAL_FLOAT,
    "follow": bool,
}
DEFAULT_MAX_FAILURES = 3
# A lease stretches to this many times the longest gap between its trainer's messages:
# they come every timeout / 3 while it works, so only a slower trainer stretches it.
LEASE_STRETCH = 2.0
MAX_CLOCKS = 4096  # trainer processes whose silences it keeps (the least recently heard go)
REASON_CHARS = 500  # of a failure's reason, kept in the books
MAX_PSERVERS = 4096  # pservers a window's report may name
# How often the pservers' checkpoints are looked at for windows waiting on them (seconds).
WATCH_S = 0.5
# A request that held the loop this long (a slow stream source) pushes every lease's
# deadline back by as much: the trainers' renewals waited unread meanwhile.
STALL_S = 1.0


class Coordinator:
    def __init__(
        self,
        endpoint: str,
        settings: RpcSettings | None = None,
        snapshot: str | None = None,
        task_timeout: float = DEFAULT_TASK_TIMEOUT,
        max_failures: int = DEFAULT_MAX_FAILURES,
        name: str = "coordinator",
        stream: str | None = None,
        drain: bool = False,
        checkpoints: str | None = None,
        pservers: int = 0,
    ):
        """`stream`: this is a streaming job's coordinator, of that stream (its trainers must
        read it; SIGTERM drains the job); `drain`: start draining (a coordinator started
        again while its job drains). `checkpoints`: the directory where the job's
        `pservers` pservers checkpoint: a window's offsets are committed once their
        checkpoints hold it, and a window a restored pserver lost is handed out again
        (checkpoint_watch.py)."""
        if checkpoints is not None and (stream is None or pservers < 1):
            raise Error(
                "a coordinator watches the pservers' checkpoints in a streaming job, given their count"
            )
        self.settings = settings or RpcSettings()
        self.stream = stream
        self.checkpoints, self.pservers = checkpoints, pservers
        self._watch: CheckpointWatch | None = None  # of the pservers' checkpoints, once windows exist
        self._watched_at = 0.0
        self._drain_pending = drain  # drain once the windows exist (none were asked for yet)
        self.name = name
        self.snapshot = Path(snapshot) if snapshot else None
        self.task_timeout, self.max_failures = task_timeout, max_failures
        self.queue: TaskQueue | None = None
        self.dataset_path: str | None = None
        self.windows: StreamWindows | None = None  # a streaming job's, instead of a queue
        self._context = zmq.Context()
        self._running = True
        self._sigterm = False  # set by a signal handler, acted on by the loop
        self._started = time.monotonic()
        # Per trainer process, its silences: the least recently heard first.
        self._clocks: OrderedDict[str, SilenceClock] = OrderedDict()
        self.lease_times = LeaseTimes()  # how long windows take, and the leases that failed
        self.ticks: list[
            Callable[[], None]
        ] = []  # called by the loop between requests (fluidps.executor.metrics)
        if self.snapshot is not None and self.snapshot.exists():
            self._resume()
        self.server = RpcServer(self._context, endpoint, name, self.settings)

    @property
    def address(self) -> str:
        return self.server.address

    def log(self, message: str) -> None:
        print(f"{self.name}: {message}", flush=True)

    # -- running ---------------------------------------------------------------------------

    def serve_forever(self) -> None:
        try:
            while self._running:
                for request in self.server.receive(0.2):
                    started = time.monotonic()
                    self._handle(request)
                    if (took := time.monotonic() - started) > STALL_S and (book := self._book) is not None:
                        book.postpone(took)
                self._expire()
                self._watch_checkpoints()
                for tick in self.ticks:
                    tick()
                if self._sigterm:
                    self._sigterm = False
                    self._terminated()
        finally:
            try:
                self._watch_checkpoints(now=True)  # (the pservers' last checkpoints, taken as they ended)
            finally:
                self.close()

    def stop(self) -> None:
        self._running = False

    def sigterm(self) -> None:
        """What SIGTERM asks (safe in a signal handler; the loop acts on it): a streaming
        job's coordinator drains, and stops at a second SIGTERM; any other stops."""
        self._sigterm = True

    def _terminated(self) -> None:
        self._watch_checkpoints(now=True)
        finished = self.windows is not None and self.windows.queue.drained
        if self.stream is not None and not self._drain_pending and not self._draining and not finished:
            self.drain()
        else:
            self.stop()

    @property
    def _draining(self) -> bool:
        return self.windows is not None and self.windows.queue.stopping

    def drain(self) -> None:
        """A streaming job told to stop: cut no more windows, and give those nobody holds
        back to the stream; the windows in hand are finished, then every reader is told
        "stopped" (its run ends). Before any window was asked for, the job drains as
        soon as its windows exist."""
        if self.windows is None:
            self._drain_pending = True
            self.log("draining: no window was handed out yet; the trainers will be told to stop")
        elif not self.windows.queue.stopping:
            self.windows.stop()
            self.log("draining: no new windows; the ones in hand are finished first")
            self._save()

    def _watch_checkpoints(self, now: bool = False) -> None:
        """Every WATCH_S (or `now`): windows the pservers' checkpoints saved may be
        committed; those a restored pserver lost go out again (checkpoint_watch.py)."""
        if self.windows is None or self.checkpoints is None or not self.windows.queue.unsaved:
            return
        if not now and time.monotonic() - self._watched_at < WATCH_S:
            return
        self._watched_at = time.monotonic()
        if self._watch is None:
            config = self.windows.queue.config
            self._watch = CheckpointWatch(
                self.checkpoints, self.pservers, stream_id(config.source, config.group)
            )
        if self._watch.settle(self.windows.queue, self.log):
            self._save()

    @property
    def _book(self) -> LeaseBook | None:
        """The leases of this job: its dataset's tasks or its stream's windows."""
        return self.queue if self.queue is not None else self.windows.queue if self.windows else None

    def close(self) -> None:
        self.server.close()
        self._context.term()

    def _expire(self) -> None:
        """Fail (and log) the leases past their deadline; before any request is handled,
        so that no task goes back to the queue without a word."""
        book = self._book
        if book is None or not book.pending:
            return
        expired = book.expire(time.monotonic())
        for lease, outcome in expired:
            why = f"timed out after {book.allowed(lease):g} s without word from its trainer"
            self._report_failure(lease, why, outcome)
        if expired:
            self._save()

    def _clock(self, msg: Message) -> SilenceClock:
        key = f"{msg.sender:x}"
        if key not in self._clocks:
            warmup = max(self.task_timeout, self.settings.warmup_timeout)
            self._clocks[key] = SilenceClock(self.task_timeout, warmup, time.monotonic(), LEASE_STRETCH)
            while len(self._clocks) > MAX_CLOCKS:  # (a forgotten process's next lease starts warm-up anew)
                self._clocks.popitem(last=False)
        self._clocks.move_to_end(key)
        return self._clocks[key]

    def _allowance(self, msg: Message) -> float:
        """How long the lease of this trainer's process may go without word: the task
        timeout, stretched to LEASE_STRETCH times the longest gap between its messages
        lately (a slow machine renews late, it is not dead), or the warm-up timeout
        until it finished a task."""
        clock = self._clock(msg)
        if (report := clock.stretch_report()) is not None:
            self.log(f"trainer {msg.trainer_id}'s task lease: {report}")
        return clock.allowance()

    def _handle(self, request: Request) -> None:
        msg = request.msg
        self._expire()
        if msg.kind in (Kind.TASK_GET, Kind.TASK_RENEW, Kind.TASK_DONE, Kind.TASK_FAILED):
            self._clock(msg).heard(time.monotonic())
        try:
            if msg.kind == Kind.HELLO:
                self.server.reply(request)
            elif msg.kind == Kind.SHUTDOWN:
                self.server.reply(request)
                self.stop()
            elif msg.kind == Kind.STATUS:
                self.server.reply(request, Message(Kind.VALUES, text=json.dumps(self.status())))
            elif msg.kind == Kind.TASK_GET:
                self.server.reply(request, self._get(msg))
            elif msg.kind in (Kind.TASK_DONE, Kind.TASK_FAILED, Kind.TASK_RENEW):
                self.server.reply(request, self._report(msg))
            else:
                raise Error(f"{self.name} does not handle {msg.kind_name} messages")
        except Error as e:
            self.server.error(request, f"{self.name}: {e}")

    # -- tasks ------------------------------------------------------------------------------

    def _get(self, msg: Message) -> Message:
        if _is_stream_request(msg.text):
            return self._get_window(msg)
        if self.windows is not None:
            raise Error(f"trainer {msg.trainer_id} asks for a dataset's task, but this job reads a stream")
        wanted = json_fields(msg.text, READ_REQUEST)
        config = QueueConfig(
            wanted["fingerprint"],
            wanted["records_per_task"],
            wanted["passes"],
            wanted["shuffle"],
            wanted["seed"],
        )
        if self.queue is None:
            self._configure(wanted["dataset"], config)
        elif config != self.queue.config:
            raise Error(
                f"trainer {msg.trainer_id} reads {wanted['dataset']} as {asdict(config)}, but this job's tasks are "
                f"{asdict(self.queue.config)}: every trainer must read the same dataset the same way"
            )
        queue = self.queue
        assert queue is not None
        pass_before, worker = queue.pass_index, f"{msg.sender:x}"
        for lease, outcome in queue.replaced(msg.trainer_id, worker):
            self._report_failure(lease, f"trainer {msg.trainer_id} restarted while it held the task", outcome)
        got = queue.acquire(msg.trainer_id, worker, time.monotonic(), self._allowance(msg))
        self._after_change(pass_before)
        if isinstance(got, str):
            return Message(Kind.NO_TASK, text=got)
        task = queue.tasks[got.task]
        reply = {
            "lease": got.id,
            "task": task.id,
            "shard": task.shard,
            "start": task.start,
            "stop": task.stop,
            "pass": queue.pass_index,
            "attempt": got.attempt,
            "timeout": queue.timeout,
        }
        return Message(Kind.TASK, text=json.dumps(reply))

    def _get_window(self, msg: Message) -> Message:
        wanted = json_fields(msg.text, STREAM_REQUEST)
        config = WindowConfig(
            wanted["stream"], wanted["group"], wanted["window_records"], wanted["window_seconds"]
        )
        if self.queue is not None:
            raise Error(f"trainer {msg.trainer_id} asks for a stream's window, but this job reads a dataset")
        if self.stream is not None and config.source != self.stream:
            raise Error(
                f"trainer {msg.trainer_id} reads stream {config.source}, but this job's stream is {self.stream}"
            )
        if self.windows is None:
            self.windows = StreamWindows.open(
                open_stream(config.source),
                config,
                wanted["follow"],
                self.task_timeout,
                self.max_failures,
                saved_by_pservers=self.checkpoints is not None,
            )
            self.log(
                f"windows of {config.window_records} records"
                + (f" or {config.window_seconds:g} s" if config.window_seconds else "")
                + f" from {config.source}, group {config.group}, offset {self.windows.queue.committed}"
                + ("" if wanted["follow"] else " up to the end it has now")
            )
            if self._drain_pending:
                self.drain()
        elif config != self.windows.queue.config or wanted["follow"] != self.windows.follow:
            raise Error(
                f"trainer {msg.trainer_id} reads the stream as {asdict(config)} (follow={wanted['follow']}), but "
                f"this job's windows are {asdict(self.windows.queue.config)} (follow={self.windows.follow}): every "
                "trainer must read the same stream the same way (to read it another way, start the coordinator "
                "without the books of the run that read it this way)"
            )
        windows, worker = self.windows, f"{msg.sender:x}"
        before = windows.queue.fingerprint()  # (a restarted trainer's window failing changes the books too)
        for lease, outcome in windows.queue.replaced(msg.trainer_id, worker):
            self._report_failure(
                lease, f"trainer {msg.trainer_id} restarted while it held the window", outcome
            )
        got = windows.acquire(msg.trainer_id, worker, time.monotonic(), self._allowance(msg))
        if windows.queue.fingerprint() != before:  # (a reader waiting for records changes nothing)
            self._save()
        if isinstance(got, str):
            return Message(Kind.NO_TASK, text=got)
        self.lease_times.leased(got.id, time.monotonic())
        window = windows.queue.window(got)
        reply = {
            "lease": got.id,
            "window": window.id,
            "start": window.start,
            "stop": window.stop,
            "attempt": got.attempt,
            "timeout": windows.queue.timeout,
        }
        return Message(Kind.TASK, text=json.dumps(reply))

    def _report_window(self, msg: Message) -> Message:
        windows = self.windows
        assert windows is not None
        if msg.kind == Kind.TASK_RENEW:
            return self._renew(msg, windows.queue)
        if msg.kind == Kind.TASK_DONE:
            fields = _done_fields(msg.text, window=True)
            finished = windows.queue.finish(
                fields["lease"], f"{msg.sender:x}", fields["samples"], fields["exact"], fields["checkpoints"]
            )
            outcome = self._counted(msg, finished)
            if outcome == "counted":
                self.lease_times.finished(fields["lease"], time.monotonic())
        else:
            outcome = self._fail(msg, windows.queue)
        self._save()
        return Message(Kind.OK, text=outcome)

    def _report(self, msg: Message) -> Message:
        if self.windows is not None:
            return self._report_window(msg)
        if self.queue is None:
            raise Error("no task was handed out yet: this report is from another job")
        queue = self.queue
        pass_before = queue.pass_index
        if msg.kind == Kind.TASK_RENEW:
            return self._renew(msg, queue)
        if msg.kind == Kind.TASK_DONE:
            fields = _done_fields(msg.text)
            counted = queue.finish(fields["lease"], f"{msg.sender:x}", fields["samples"], fields["loss"])
            outcome = self._counted(msg, counted)
        else:
            outcome = self._fail(msg, queue)
        self._after_change(pass_before)
        return Message(Kind.OK, text=outcome)

    def _renew(self, msg: Message, book: LeaseBook) -> Message:
        lease_id = json_fields(msg.text, {"lease": int})["lease"]
        ok = book.renew(lease_id, f"{msg.sender:x}", time.monotonic(), self._allowance(msg))
        return Message(Kind.OK, text="renewed" if ok else "stale")

    def _counted(self, msg: Message, counted: bool) -> str:
        """After a TASK_DONE: "counted", or "stale" (logged) for a lease no longer the trainer's."""
        self._clock(msg).warm = True  # it did a task: its first step's compiles are behind it
        if not counted:
            lease = json.loads(msg.text)["lease"]
            self.log(f"trainer {msg.trainer_id} finished lease {lease}, which is no longer its: not counted")
        return "counted" if counted else "stale"

    def _fail(self, msg: Message, book: LeaseBook) -> str:
        fields = json_fields(msg.text, {"lease": int, "reason": str})
        fields["reason"] = fields["reason"][:REASON_CHARS]  # (kept in the books: bounded)
        lease = next((le for le in book.pending.values() if le.id == fields["lease"]), None)
        outcome = book.fail(fields["lease"], f"{msg.sender:x}", fields["reason"])
        if lease is not None and outcome != "stale":
            self._report_failure(lease, fields["reason"], outcome)
        return outcome

    def _report_failure(self, lease: Lease, reason: str, outcome: str) -> None:
        book = self._book
        assert book is not None
        self.lease_times.failed_lease(lease.id)
        what_kind = "task" if self.queue is not None else "window"
        failures = book.failures.get(lease.task, 0)
        what = (
            f"discarded after {failures} failures (max {self.max_failures}): its records are not trained on"
            if outcome == "discarded"
            else f"back to the queue (failure {failures} of at most {self.max_failures})"
        )
        self.log(f"{what_kind} {lease.task} (trainer {lease.trainer}) failed: {reason}; {what}")

    def _configure(self, dataset_path: str, config: QueueConfig) -> None:
        dataset = Dataset(dataset_path)
        if dataset.fingerprint != config.fingerprint:
            raise Error(
                f"the trainers' dataset {dataset_path} has fingerprint {config.fingerprint}, but the coordinator "
                f"reads {dataset.fingerprint} there: do they see the same files?"
            )
        tasks = dataset.tasks(config.records_per_task)
        self.queue = TaskQueue(config, tasks, self.task_timeout, self.max_failures)
        self.dataset_path = dataset_path
        self.log(
            f"{len(tasks)} tasks of at most {config.records_per_task} records from {dataset.describe()}; "
            f"{config.passes} pass(es)"
        )
        self._save()

    def _after_change(self, pass_before: int) -> None:
        queue = self.queue
        assert queue is not None
        for summary in queue.history[pass_before:]:
            self.log(
                f"pass {summary['pass'] + 1} done: {len(summary['done'])} tasks, {summary['samples']:,} samples"
                + (f", {len(summary['discarded'])} discarded" if summary["discarded"] else "")
            )
        self._save()

    # -- persistence ------------------------------------------------------------------------

    def _save(self) -> None:
        """Write the books; then, in a streaming job, commit the stream's offset (a crash
        between the two commits it again on resuming: the books never fall behind it)."""
        if self.windows is not None:
            body = {"stream": self.windows.queue.config.source, "windows": self.windows.to_snapshot()}
        elif self.queue is not None:
            body = {"dataset": self.dataset_path, "queue": self.queue.to_snapshot()}
        else:
            return
        if self.snapshot is not None:
            write_atomic(str(self.snapshot), [json.dumps(body).encode()])
        if self.windows is not None:
            try:
                self.windows.commit()
            except StreamError as e:  # (the offset is committed at the next change)
                self.log(f"could not commit {self.windows.queue.config.source}'s offset now: {e}")

    def _resume(self) -> None:
        assert self.snapshot is not None
        try:
            body = json.loads(self.snapshot.read_text())
            if isinstance(body, dict) and "windows" in body:
                self.windows = StreamWindows.from_snapshot(open_stream(str(body["stream"])), body["windows"])
                q = self.windows.queue
                if q.saved_by_pservers and q.unsaved and self.checkpoints is None:
                    raise Error(
                        f"{len(q.unsaved)} window(s) wait for the pservers' checkpoints: start the coordinator "
                        "with --checkpoints DIR --pservers N, as its job did"
                    )
                source_committed = self.windows.source.committed(q.config.group)
                if q.drained or source_committed > q.committed:
                    why = (
                        "a run that finished (drained, or read to its end)"
                        if q.drained
                        else f"an earlier run: the group has committed {source_committed} since, past its {q.committed}"
                    )
                    self.log(
                        f"{self.snapshot} holds the books of {why}; this run starts from the stream's offset"
                    )
                    self.windows = None
                    return
                self.log(
                    f"resumed from {self.snapshot}: {q.config.source} committed at {q.committed}, "
                    f"{len(q.windows)} window(s) cut after it ({len(q.pending)} pending: their trainers may "
                    "still report them)"
                )
                return
            self.queue = TaskQueue.from_snapshot(body["queue"], time.monotonic())
            self.dataset_path = str(body["dataset"])
        except (OSError, ValueError, KeyError, TypeError, Error) as e:
            raise Error(f"cannot resume from the coordinator snapshot {self.snapshot}: {e}") from None
        q = self.queue
        self.log(
            f"resumed from {self.snapshot}: pass {min(q.pass_index, q.config.passes - 1) + 1} of "
            f"{q.config.passes}, {len(q.done)} tasks done, {len(q.pending)} pending (their trainers may still "
            f"report them), {len(q.todo)} to do, {len(q.discarded)} discarded"
        )

    def trainers_heard(self, now: float) -> int:
        """Trainer processes heard from within their lease allowance (for the metrics)."""
        return sum(not clock.expired(now) for clock in self._clocks.values())

    def status(self) -> dict[str, Any]:
        if self.windows is not None:
            return {
                "configured": True,
                "stream": self.windows.status(),
                "finished": self.windows.queue.drained,
            }
        if self.queue is None:
            return {"configured": False, "finished": False}
        return {"configured": True, "dataset": self.dataset_path, **self.queue.status()}


def _done_fields(text: str, window: bool = False) -> dict[str, Any]:
    """A TASK_DONE's fields, checked: its lease, the samples it trained on, its mean loss
    (and a window's: whether every batch's gradients named their batch, and per pserver
    what its acknowledgements said of its checkpoints, as {id: [count, incarnation]})."""
    schema: dict[str, Any] = {"lease": int, "samples": int, "loss": OPTIONAL_FLOAT}
    fields = json_fields(text, schema | {"exact": bool, "checkpoints": dict} if window else schema)
    if fields["samples"] < 0 or (fields["loss"] is not None and not math.isfinite(fields["loss"])):
        raise Error(f"a task report needs samples >= 0 and a finite loss, got {text!r}")
    if window:
        notes = fields["checkpoints"]
        if len(notes) > MAX_PSERVERS or not all(
            k.isdigit()
            and len(k) <= 9
            and parse_ack(ack_text(int(k), *v) if _note_shape(v) else "") is not None
            for k, v in notes.items()
        ):
            raise Error(
                f"a window's report names checkpoints as {{pserver: [count, incarnation]}}, got {text[:200]!r}"
            )
        fields["checkpoints"] = {int(k): list(v) for k, v in notes.items()}
    return fields


def _note_shape(value: Any) -> bool:
    return (
        isinstance(value, list) and len(value) == 2 and isinstance(value[0], int) and not isinstance(value[0], bool)
        and 0 <= value[0] < 10**9 and isinstance(value[1], str)
    )  # fmt: skip


def _is_stream_request(text: str) -> bool:
    """Whether a TASK_GET is a stream reader's (it names a stream, not a dataset)."""
    try:
        body = json.loads(text)
    except ValueError:
        return False
    return isinstance(body, dict) and "stream" in body
