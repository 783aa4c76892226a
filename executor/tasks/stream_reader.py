"""A trainer's stream reader: mini-batches from windows of a stream, window after window.

The `read` op asks it for the next batch, as it asks a dataset's TaskReader. It holds one
window at a time: the batches of the window's records in order, then (once the step
using the last batch has run, before that run returns) it reports the window done,
and the window's records count as applied: the stream's committed offset for the
reader's consumer group moves past the windows done in order. Windows come from the
job's coordinator, or, for a plain Executor with no coordinator, from StreamWindows in
this process over the same stream.

When no window is ready (the stream has no new records) the reader waits, as a
TaskReader does for a task; when the windows are stopped (the job drains, or a reader
that does not follow the stream read what it held) the read raises EOFException.

Records that fail their checks (a bad CRC, wrong fields) are never trained on: the
reader skips them, appends each to the dead-letter file (dead_letters.py: the reader's
`dead_letters`, else FLUIDPS_DEAD_LETTERS), counts them and says so, once per window.

A window whose trainer died goes to another, which reads it from its first record. So
that the batches the first one pushed are not applied twice, the step's SENDs name the
stream batch it trained on (`batch_tag`: the stream, the window's start and the batch's
first offset) and
each pserver applies a batch's gradients once (fluidps.executor.ps.applied_batches);
before a window is reported done, the reader waits until every gradient sent was
acknowledged.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from fluidps.errors import EOFException, NoDataYet, StreamError
from fluidps.executor.ps.applied_batches import batch_tag, stream_id, window_key
from fluidps.executor.tasks.dead_letters import DeadLetters
from fluidps.executor.tasks.stream_windows import StreamWindows
from fluidps.executor.tasks.task_reader import LossTally
from fluidps.executor.tasks.window_queue import WindowConfig
from fluidps.io.stream import Records, open_stream, read_range
from fluidps.ops.reader import StreamReaderSpec

if TYPE_CHECKING:
    from fluidps.executor.tasks.task_reader import Readers

DEAD_LETTERS_ENV = "FLUIDPS_DEAD_LETTERS"  # where a reader with no dead_letters of its own writes them
# Waiting for records, a reader asks again after WAIT_POLL_S, then twice as long each
# time up to WAIT_POLL_MAX_S: soon while records trickle in, rarely while the stream is quiet
# (and at least four times a window_seconds: a window closed by time is asked for soon).
WAIT_POLL_S = 0.05
WAIT_POLL_MAX_S = 1.0


@dataclass(frozen=True)
class WindowLease:
    lease: int
    window: int
    start: int
    stop: int
    attempt: int
    timeout: float


class WindowSource(Protocol):
    """Where a stream reader's windows come from: StreamWindows in this process or the coordinator."""

    def acquire(self) -> WindowLease | str: ...  # a lease, "wait" or "stopped"

    # `exact`: every batch's gradients named their batch (fluidps.executor.ps.applied_batches);
    # `acked`: what the pservers' acknowledgements said of their checkpoints (Delivered.acked)
    def finish(
        self, lease: WindowLease, records: int, loss: float | None, exact: bool, acked: dict[int, list]
    ) -> None: ...

    def fail(self, lease: WindowLease, reason: str) -> None: ...

    def release(self, lease: WindowLease) -> None: ...

    def renew(self, lease: WindowLease) -> bool: ...  # False: the lease is no longer this trainer's

    def stop(self) -> None: ...

    def close(self) -> None: ...


def window_config(spec: StreamReaderSpec) -> WindowConfig:
    """The windows a reader of `spec` asks for (the coordinator checks every trainer asks alike)."""
    return WindowConfig(spec.source, spec.group, spec.window_records, spec.window_seconds)


class StreamReader:
    """The reader of one READER variable of a stream (create_stream_reader's), in a
    process's Readers: one window at a time, its batches in offset order."""

    def __init__(self, spec: StreamReaderSpec, readers: Readers):
        self.spec = spec
        self.config = window_config(spec)  # (checks the group and the window's size)
        self._readers = readers
        self.stream = open_stream(spec.source)
        known = self.stream.fields
        missing = [f for f in spec.fields if known is not None and f not in known]
        if missing:
            raise StreamError(
                f"stream {spec.source} has no field {', '.join(map(repr, missing))} (it has {', '.join(known)})"
            )
        self._source: WindowSource | None = None
        self._lease: WindowLease | None = None
        self._records: Records | None = None
        self._cursor = 0
        self._losses = LossTally()
        self._batch = 0
        self._renewed = 0.0
        self.windows_done = 0
        self.records_read = 0
        self.bad_records = 0
        self.exhausted = False
        self._stopping = False  # (set by stop(), maybe in a signal handler: acted on at the next ask)
        self._poll_s = WAIT_POLL_S
        self._poll_max = (
            min(WAIT_POLL_MAX_S, spec.window_seconds / 4) if spec.window_seconds else WAIT_POLL_MAX_S
        )
        self.batch_tag: str | None = None  # the batch of the step running now, as its SENDs name it
        self._stream_id = stream_id(spec.source, spec.group)
        dead_letters = spec.dead_letters or os.environ.get(DEAD_LETTERS_ENV, "").strip()
        self._dead_letters = DeadLetters(dead_letters) if dead_letters else None

    @property
    def last_batch(self) -> int:
        return self._batch

    @property
    def reading(self) -> bool:
        return self._source is not None and not self.exhausted

    # -- what the read op calls ---------------------------------------------------------

    def next_batch(self) -> dict[str, np.ndarray]:
        source = self._source or self._bind()
        while True:
            left = len(self._records) - self._cursor if self._records is not None else 0
            if left > 0:
                return self._take(min(left, self.spec.batch_size), source)
            if self._lease is not None:
                self._finish(source)
            if self._stopping:
                source.stop()
            got = source.acquire()
            if got == "stopped":
                self.exhausted = True
                raise EOFException(
                    f"the reader of stream {self.spec.source} stopped after {self.windows_done} window(s), "
                    f"{self.records_read:,} records"
                )
            if got == "wait":
                if not self._readers.wait_for_tasks:
                    raise NoDataYet(f"no window of stream {self.spec.source} is ready")
                if not self._readers.idle_trainer():
                    time.sleep(self._poll_s)
                    self._poll_s = min(self._poll_s * 2, self._poll_max)
                continue
            self._poll_s = WAIT_POLL_S
            self._lease, self._cursor, self._renewed = got, 0, time.monotonic()
            self._losses = LossTally()
            self._records = self._read_window(got)

    def observe(self, fetched: list[Any]) -> None:
        """After a step: its first scalar floating fetch counts as this batch's loss (and
        the step's SENDs are behind: no other program's SEND names this batch). After the
        window's last batch, the window is done now, so that the run returns with it
        committed (a loop may export then), not at the next read."""
        self._losses.observe(fetched, self._batch)
        self.batch_tag = None
        left = len(self._records) - self._cursor if self._records is not None else 0
        if self._lease is not None and self._source is not None and left == 0:
            self._finish(self._source)

    def fail_current(self, reason: str) -> None:
        """The step using this window's batch failed: the window goes back (or is discarded)."""
        if self._lease is not None and self._source is not None:
            lease, self._lease, self._records = self._lease, None, None
            self._source.fail(lease, reason.splitlines()[0][:500] if reason else "failed")

    def stop(self) -> None:
        """Drain: finish the window in hand, then end (the next read past it raises
        EOFException). Only sets a flag: safe in a signal handler."""
        self._stopping = True

    def close(self) -> None:
        """Report a window whose every batch was used; give back one left half done."""
        if self._lease is not None and self._source is not None:
            lease, self._lease = self._lease, None
            if self._records is not None and self._cursor >= len(self._records):
                self._source.finish(lease, self._cursor, self._losses.mean(), *self._delivered(lease))
            else:
                self._source.release(lease)
        if self._source is not None:
            self._source.close()
            self._source = None
        self.stream.close()

    # -- inside --------------------------------------------------------------------------

    def _read_window(self, lease: WindowLease) -> Records:
        # (a window holds at most window_records records: one read, even where offsets are sparse)
        records = read_range(self.stream, lease.start, lease.stop, self.spec.window_records)
        if records.bad:
            self.bad_records += len(records.bad)
            first = records.bad[0]
            kept = ""
            if self._dead_letters is not None:
                window = (lease.start, lease.stop)
                problem = self._dead_letters.write(self.spec.source, self.spec.group, window, records.bad)
                kept = f" ({problem})" if problem else f" (written to {self._dead_letters.path})"
            print(
                f"stream {self.spec.source}: window {lease.window} ({lease.start}..{lease.stop - 1}): "
                f"{len(records.bad)} bad record(s) skipped{kept}, the first at offset {first.offset}: {first.reason}",
                file=sys.stderr,
                flush=True,
            )
        missing = [f for f in self.spec.fields if f not in records.fields]
        if len(records) and missing:
            raise StreamError(
                f"stream {self.spec.source} has no field {', '.join(map(repr, missing))} for this reader (it "
                f"has {', '.join(records.fields)})"
            )
        if not len(records) and not records.bad:
            print(
                f"stream {self.spec.source}: window {lease.window} ({lease.start}..{lease.stop - 1}) has no records "
                "left (retention retired them before they were read): nothing to train on",
                file=sys.stderr,
                flush=True,
            )
        return records

    def _take(self, count: int, source: WindowSource) -> dict[str, np.ndarray]:
        records, start = self._records, self._cursor
        assert records is not None and self._lease is not None
        batches, reading = -(-len(records) // self.spec.batch_size), int(records.offsets[0])
        self.batch_tag = batch_tag(
            self._stream_id, self._lease.start, int(records.offsets[start]), batches, reading
        )
        self._cursor += count
        self._batch = count
        self.records_read += count
        if time.monotonic() - self._renewed > self._lease.timeout / 3:
            self._renewed = time.monotonic()
            if not source.renew(self._lease):  # a long window: keep the lease, or see it went to another
                print(
                    f"stream {self.spec.source}: window {self._lease.window} went to another trainer (this one "
                    "was silent too long); its batches are applied once, whoever sends them",
                    file=sys.stderr,
                    flush=True,
                )
        return {field: records.fields[field][start : start + count] for field in self.spec.fields}

    def _finish(self, source: WindowSource) -> None:
        lease, self._lease = self._lease, None
        assert lease is not None
        self.batch_tag = None
        source.finish(lease, self._cursor, self._losses.mean(), *self._delivered(lease))
        self._records = None
        self.windows_done += 1

    def _delivered(self, lease: WindowLease) -> tuple[bool, dict[int, list]]:
        """Wait until the pservers acknowledged every gradient computed (a window counts as
        done only then); whether the window's batches were each named (exactly once), and
        what the acknowledgements said of the pservers' checkpoints."""
        delivered = self._readers.deliver()
        return window_key(self._stream_id, lease.start) not in delivered.untagged, delivered.acked

    def _bind(self) -> WindowSource:
        if self._readers.coordinator is None:
            self._source = LocalWindows(StreamWindows.open(self.stream, self.config, self.spec.follow))
        else:
            request = {
                "stream": self.spec.source,
                "group": self.spec.group,
                "window_records": self.spec.window_records,
                "window_seconds": self.spec.window_seconds,
                "follow": self.spec.follow,
            }
            self._source = self._readers.coordinator_source(request)
        if self._stopping:
            self._source.stop()
        return self._source


class LocalWindows:
    """Windows from StreamWindows in this process (a plain Executor, no coordinator):
    a window done commits the stream's offset at once."""

    def __init__(self, windows: StreamWindows):
        self.windows = windows

    def acquire(self) -> WindowLease | str:
        got = self.windows.acquire(0, "local", time.monotonic(), math.inf)
        if isinstance(got, str):
            return got
        window = self.windows.queue.window(got)
        return WindowLease(got.id, window.id, window.start, window.stop, got.attempt, math.inf)

    def finish(
        self, lease: WindowLease, records: int, loss: float | None, exact: bool, acked: dict[int, list]
    ) -> None:
        self.windows.queue.finish(lease.lease, "local", records)
        self.windows.commit()

    def fail(self, lease: WindowLease, reason: str) -> None:
        self.windows.queue.fail(lease.lease, "local", reason)
        self.windows.commit()  # (a discarded window at the front moves the offset too)

    def release(self, lease: WindowLease) -> None:
        self.windows.queue.release(lease.lease, "local")

    def renew(self, lease: WindowLease) -> bool:
        return True  # nothing expires in this process

    def stop(self) -> None:
        self.windows.stop()

    def close(self) -> None:
        pass  # (the stream is the reader's)
