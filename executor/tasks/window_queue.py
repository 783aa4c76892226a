"""The coordinator's bookkeeping for a stream: windows of offsets, handed out as tasks.

A stream has no passes and no end. The coordinator cuts the records that arrived into
windows, `[start, stop)` of offsets: a window closes once it holds `window_records`
records or once its first record has waited `window_seconds` (then it takes what has
arrived), whichever comes first. Windows are leased like a dataset's tasks
(fluidps.executor.tasks.leases: expiry, failures, retries, discarding).

A window counts as done when its trainer reports its gradients applied. The stream's
committed offset is the start of the first window not done (or discarded): everything
before it is applied, and it only moves forward.

Where the pservers checkpoint what they applied (`saved_by_pservers`: a streaming job
whose pservers keep applied-batch books, fluidps.executor.tasks.checkpoint_watch), a
window done is also `unsaved` until every pserver's newest checkpoint holds it, and the
committed offset waits for that: a pserver restored from its checkpoint has lost what
it applied since, so the windows it lost are `reopen`ed (handed out again, first; the
other pservers drop the batches they hold). Each such window keeps what the caller
noted when it was done (the pservers' newest checkpoints then), and whether its batches
were each named (`exact`). At most UNSAVED_MAX windows wait so: then no more are cut
until the pservers checkpoint.

The coordinator persists the queue before it commits that offset to the source, so a
crash between the two commits it again on restart, and nothing is lost.

Pure state, no clock and no I/O: callers pass `now` (seconds, monotonic), the stream's
end offset, and how to count records forward from an offset (offsets need not be dense).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

from fluidps.errors import Error
from fluidps.executor.tasks.leases import Lease, LeaseBook
from fluidps.io.stream import check_group

SNAPSHOT_VERSION = 1
DISCARDED_KEPT = 64  # the latest discarded windows whose reasons the status keeps
# Windows cut ahead of the trainers at most: a backlog is cut as they take windows, so a
# drain leaves it in the stream, and the snapshot written at every report stays small.
CUT_AHEAD = 16
# Windows done and waiting for the pservers' checkpoints at most (well under the windows a
# pserver's books keep, fluidps.executor.ps.applied_batches.WINDOWS_KEPT).
UNSAVED_MAX = 256


class Awaiting(NamedTuple):
    """A window done, waiting for the pservers' checkpoints: what was noted when it was
    done (per pserver, [checkpoint count, books incarnation]) and whether its batches
    were each named."""

    note: dict[int, list]
    exact: bool


@dataclass(frozen=True)
class WindowConfig:
    """What a window queue cuts: windows of `source` (its spec) for consumer `group`."""

    source: str
    group: str
    window_records: int
    window_seconds: float | None = None  # None: windows close on their record count only

    def __post_init__(self) -> None:
        check_group(self.group)
        records = self.window_records
        if not isinstance(records, int) or isinstance(records, bool) or records < 1:
            raise Error(f"window_records must be an integer >= 1, got {records!r}")
        if self.window_seconds is not None and not (
            self.window_seconds > 0 and math.isfinite(self.window_seconds)
        ):
            raise Error(f"window_seconds must be a number > 0 or None, got {self.window_seconds}")


@dataclass(frozen=True)
class Window:
    id: int
    start: int
    stop: int


# advance(start, count): (stop, n): the offset after the first `count` records from
# `start`, or after the last one when fewer have arrived, and how many records that is
Advance = Callable[[int, int], tuple[int, int]]


class WindowQueue(LeaseBook):
    retry_first = True  # the committed offset waits for a failed window: it goes again first

    def __init__(
        self,
        config: WindowConfig,
        start: int,
        timeout: float = 60.0,
        max_failures: int = 3,
        saved_by_pservers: bool = False,
    ):
        super().__init__(timeout, max_failures)
        self.config = config
        self.saved_by_pservers = saved_by_pservers
        self.windows: dict[int, Window] = {}  # cut, not yet below the committed offset
        self.done: set[int] = set()  # windows done, not yet below the committed offset
        self.applied: dict[int, dict[str, Any]] = {}  # window -> what its trainer reported applied
        self.unsaved: set[int] = set()  # done, not yet held by every pserver's checkpoint
        self.again: set[int] = set()  # in todo again after a pserver lost them
        self.replayed = 0  # windows handed out again because a pserver lost them
        self.next_start = start  # the first offset in no window
        self.committed = start  # every record before it is applied (or its window discarded)
        self.waiting_since: float | None = None  # when records past next_start were first seen
        self.next_window = 0
        self.records = 0  # records of the windows done
        self.trained = 0  # records trained on, of windows handed out again too (only grows)
        self.discarded_windows = 0  # discarded windows now below the committed offset (not trained on)
        self.stopping = False  # draining: no new windows
        self.ended = False  # every record up to the queue's last offset is cut

    # -- cutting ---------------------------------------------------------------------------

    def offer(self, end: int, now: float, advance: Advance, final: bool = False) -> list[Window]:
        """Cut the windows the records up to offset `end` make now (at most CUT_AHEAD
        waiting in todo); returns them. `final`: `end` is where the stream ends for this
        queue (a reader that does not follow the stream reads what it held when reading
        began): the records left make a last, shorter window, and once every record up
        to `end` is cut the queue has `ended`."""
        cut: list[Window] = []
        while (
            not self.stopping
            and end > self.next_start
            and len(self.todo) < CUT_AHEAD
            and len(self.unsaved) < UNSAVED_MAX
        ):
            if self.waiting_since is None:
                self.waiting_since = now
            stop, records = advance(self.next_start, self.config.window_records)
            full = records >= self.config.window_records
            late = (
                self.config.window_seconds is not None
                and now - self.waiting_since >= self.config.window_seconds
            )
            if final and stop <= self.next_start:  # (no records left before `end`: retired, or a gap)
                self.next_start = end
                break
            if not (full or late or final) or stop <= self.next_start:
                break
            window = Window(self.next_window, self.next_start, stop)
            self.next_window += 1
            self.windows[window.id] = window
            self.todo.append(window.id)
            self.next_start = stop
            self.waiting_since = now if end > stop else None
            cut.append(window)
        if final and self.next_start >= end:
            self.ended = True
        return cut

    # -- the protocol ----------------------------------------------------------------------

    def acquire(self, trainer: int, worker: str, now: float, allowed: float | None = None) -> Lease | str:
        """A lease on the next window, the same lease again if this worker holds one,
        "wait" (no window is ready) or "stopped" (drained, or ended, and nothing is left)."""
        self.expire(now)
        self.replaced(trainer, worker)
        if (held := self.held_by(worker)) is not None:
            return held
        lease = self.lease_next(trainer, worker, now, allowed)
        if lease is not None:
            return lease
        return "stopped" if self.drained else "wait"

    def finish(
        self,
        lease_id: int,
        worker: str,
        records: int,
        exact: bool = True,
        note: dict[int, list] | None = None,
    ) -> bool:
        """Count the lease's window done (its gradients applied); False for a lease no
        longer current. With saved_by_pservers, a window that trained on records waits for
        the pservers' checkpoints, keeping `note` (CheckpointWatch.note's) and `exact`
        (its batches were each named: a pserver can tell which it holds)."""
        lease = self.end_lease(lease_id, worker)
        if lease is None:
            return False
        self.done.add(lease.task)
        self.applied[lease.task] = {"records": records}
        if self.saved_by_pservers and records > 0:  # (a window of no records sent nothing to lose)
            self.unsaved.add(lease.task)
            self.applied[lease.task] |= {"note": {str(p): n for p, n in (note or {}).items()}, "exact": exact}
        self.records += records
        self.trained += records
        self._changed()
        return True

    def awaiting(self) -> dict[int, Awaiting]:
        """The windows waiting for the pservers' checkpoints, by start."""
        return {
            self.windows[w].start: Awaiting(
                {int(p): n for p, n in self.applied[w].get("note", {}).items()},
                self.applied[w].get("exact", True),
            )
            for w in self.unsaved
        }

    def saved(self, starts: list[int]) -> None:
        """Windows (by start) every pserver's checkpoint holds: the committed offset may pass them."""
        self.unsaved -= {w for w in self.unsaved if self.windows[w].start in starts}
        self._changed()

    def reopen(self, starts: list[int]) -> list[Window]:
        """Windows (by start) waiting for the checkpoints that a pserver lost: handed out
        again, first, in offset order. Returns them."""
        lost = sorted(
            (self.windows[w] for w in self.unsaved if self.windows[w].start in starts), key=lambda w: w.start
        )
        for window in reversed(lost):
            self.done.discard(window.id)
            self.unsaved.discard(window.id)
            self.again.add(window.id)
            self.records -= self.applied.pop(window.id, {}).get("records", 0)
            self.todo.appendleft(window.id)
            self.replayed += 1
        return lost

    def stop(self) -> None:
        """Drain: cut no more windows, and take back the windows at the end that nobody
        took yet (their records stay in the stream for the next run); the windows in hand,
        any the committed offset waits for, and any some pserver applied part of (failed,
        or handed out again) are still handed out and finished."""
        self.stopping = True
        while self.windows:
            last = max(self.windows.values(), key=lambda w: w.start)
            if last.id not in self.todo or last.id in self.failures or last.id in self.again:
                break
            self.todo.remove(last.id)
            del self.windows[last.id]
            self.failures.pop(last.id, None)
            self.next_start = last.start
        self.waiting_since = None

    @property
    def drained(self) -> bool:
        """Stopped or ended, and every window cut is finished (and, with saved_by_pservers,
        held by the pservers' checkpoints, or it may be handed out again): nothing more will come."""
        return (self.stopping or self.ended) and not self.todo and not self.pending and not self.unsaved

    def fingerprint(self) -> tuple:
        """What changes whenever the books do (windows cut, leased, finished, failed, given
        back, the drain): a caller that finds it unchanged need not write them again."""
        return (
            self.next_window, self.next_lease, self.next_start, self.committed, len(self.todo),
            len(self.pending), len(self.done), len(self.discarded), sum(self.failures.values()),
            self.stopping, self.ended, len(self.unsaved), self.replayed,
        )  # fmt: skip

    def window(self, lease: Lease) -> Window:
        return self.windows[lease.task]

    def _changed(self) -> None:
        """Move the committed offset past every window at its front that is done or
        discarded, and forget them."""
        front = sorted(self.windows.values(), key=lambda w: w.start)
        for window in front:
            if (window.id not in self.done or window.id in self.unsaved) and window.id not in self.discarded:
                break
            self.committed = window.stop
            del self.windows[window.id]
            self.done.discard(window.id)
            self.applied.pop(window.id, None)
            self.failures.pop(window.id, None)
            self.again.discard(window.id)
            if window.id in self.discarded:  # (an endless stream: keep a count and the latest few)
                self.discarded_windows += 1
                while len(self.discarded) > DISCARDED_KEPT:
                    del self.discarded[min(self.discarded)]

    # -- reporting and persistence -----------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return {
            "source": self.config.source,
            "group": self.config.group,
            "committed": self.committed,
            "next_start": self.next_start,
            "windows": len(self.windows),
            "todo": len(self.todo),
            "pending": len(self.pending),
            "done_ahead": len(self.done - self.unsaved),  # done, waiting for an earlier window
            "awaiting_checkpoints": len(self.unsaved),  # done, not yet in every pserver's checkpoint
            "replayed": self.replayed,
            "discarded": {str(w): why for w, why in sorted(self.discarded.items())},
            "discarded_windows": self.discarded_windows,
            "records": self.records,
            "trained": self.trained,
            "stopping": self.stopping,
            "ended": self.ended,
        }

    def to_snapshot(self) -> dict[str, Any]:
        return {
            "version": SNAPSHOT_VERSION,
            "kind": "windows",
            "config": asdict(self.config),
            "saved_by_pservers": self.saved_by_pservers,
            "timeout": self.timeout,
            "max_failures": self.max_failures,
            "windows": [[w.id, w.start, w.stop] for w in self.windows.values()],
            "todo": list(self.todo),
            "pending": self._lease_snapshot(),
            "done": sorted(self.done),
            "unsaved": sorted(self.unsaved),
            "again": sorted(self.again),
            "replayed": self.replayed,
            "applied": {str(w): a for w, a in self.applied.items()},
            "failures": {str(w): n for w, n in self.failures.items()},
            "discarded": {str(w): why for w, why in self.discarded.items()},
            "next_start": self.next_start,
            "committed": self.committed,
            "next_window": self.next_window,
            "next_lease": self.next_lease,
            "records": self.records,
            "trained": self.trained,
            "discarded_windows": self.discarded_windows,
            "stopping": self.stopping,
            "ended": self.ended,
        }

    @classmethod
    def from_snapshot(cls, snapshot: dict[str, Any], now: float) -> WindowQueue:
        """The queue a snapshot describes (records past next_start start waiting anew)."""
        try:
            if snapshot["version"] != SNAPSHOT_VERSION or snapshot["kind"] != "windows":
                raise Error(f"not a version {SNAPSHOT_VERSION} window snapshot")
            queue = cls(
                WindowConfig(**snapshot["config"]),
                int(snapshot["committed"]),
                snapshot["timeout"],
                snapshot["max_failures"],
                bool(snapshot.get("saved_by_pservers", False)),
            )
            queue.windows = {int(i): Window(int(i), int(a), int(b)) for i, a, b in snapshot["windows"]}
            queue.todo.extend(int(w) for w in snapshot["todo"])
            queue._restore_leases(snapshot["pending"], now)
            queue.done = {int(w) for w in snapshot["done"]}
            queue.unsaved = {int(w) for w in snapshot.get("unsaved", ())} & queue.done
            queue.again = {int(w) for w in snapshot.get("again", ())} & set(queue.windows)
            queue.replayed = int(snapshot.get("replayed", 0))
            queue.applied = {int(w): dict(a) for w, a in snapshot["applied"].items()}
            queue.failures = {int(w): int(n) for w, n in snapshot["failures"].items()}
            queue.discarded = {int(w): str(why) for w, why in snapshot["discarded"].items()}
            queue.next_start = int(snapshot["next_start"])
            queue.next_window = int(snapshot["next_window"])
            queue.next_lease = int(snapshot["next_lease"])
            queue.records = int(snapshot["records"])
            queue.trained = int(snapshot.get("trained", queue.records))
            queue.stopping = bool(snapshot["stopping"])
            queue.ended = bool(snapshot.get("ended", False))
            queue.discarded_windows = int(snapshot["discarded_windows"])
        except (KeyError, TypeError, ValueError, Error) as e:
            raise Error(f"not a valid window snapshot: {type(e).__name__}: {e}") from None
        queue._check()
        return queue

    def _check(self) -> None:
        """Every window is in exactly one place, and the windows tile committed..next_start."""
        places = [*self.todo, *self.pending, *self.done, *(w for w in self.discarded if w in self.windows)]
        if len(places) != len(set(places)) or set(places) != set(self.windows):
            astray = sorted(set(places) ^ set(self.windows)) or sorted(
                {w for w in places if places.count(w) > 1}
            )
            raise Error(
                f"not a valid window snapshot: windows {astray} are not each in exactly one of todo, pending, "
                "done and discarded; start the coordinator without it (the stream's committed offset is kept)"
            )
        if self.windows and self.next_window <= max(self.windows):
            raise Error(
                f"not a valid window snapshot: next_window {self.next_window} is not past its windows"
            )
        if self.pending and self.next_lease <= max(le.id for le in self.pending.values()):
            raise Error(f"not a valid window snapshot: next_lease {self.next_lease} is not past its leases")
        offset = self.committed
        for window in sorted(self.windows.values(), key=lambda w: w.start):
            if window.start != offset or window.stop <= window.start:
                raise Error(
                    f"not a valid window snapshot: window {window.id} does not follow offset {offset}"
                )
            offset = window.stop
        if offset != self.next_start:
            raise Error("not a valid window snapshot: its windows do not end where the next starts")
