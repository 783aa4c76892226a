"""A stream's windows handed out as leases: a WindowQueue fed from its source, committing
the queue's committed offset back to the source's consumer group.

What the coordinator serves to a streaming job's readers, and what a plain Executor's
stream reader uses in its own process. Before each lease is handed out, the records
that arrived since are cut into windows. When windows are done the caller persists
the queue first (the coordinator's snapshot), then calls `commit`: a crash between the
two commits the same offset again on restart, so the source's offset never runs ahead
of what the queue knows is applied.
"""

from __future__ import annotations

import time
from typing import Any

from fluidps.errors import Error
from fluidps.executor.tasks.leases import Lease
from fluidps.executor.tasks.window_queue import Window, WindowConfig, WindowQueue
from fluidps.io.stream import StreamSource


class StreamWindows:
    """The windows of `source` for `queue.config.group`. `follow`: cut windows as records
    arrive, without end; otherwise cut what the stream held at the first cut (`through`,
    the end offset then), the last window short, and stop."""

    def __init__(self, source: StreamSource, queue: WindowQueue, follow: bool, through: int | None = None):
        self.source, self.queue, self.follow, self.through = source, queue, follow, through
        self._committed = queue.committed  # what the source was told last

    @classmethod
    def open(
        cls,
        source: StreamSource,
        config: WindowConfig,
        follow: bool = True,
        timeout: float = 60.0,
        max_failures: int = 3,
        saved_by_pservers: bool = False,
    ) -> StreamWindows:
        """Windows from the group's committed offset on (the stream's start, or past the
        records retention retired); `saved_by_pservers`: committed once the pservers'
        checkpoints hold them (WindowQueue)."""
        start = max(source.committed(config.group), source.start_offset())
        return cls(source, WindowQueue(config, start, timeout, max_failures, saved_by_pservers), follow)

    def cut(self, now: float) -> list[Window]:
        """Cut the windows the records that arrived make now."""
        if self.queue.stopping:
            return []
        end = self.source.end_offset()
        if not self.follow:
            self.through = end if self.through is None else self.through
            end = self.through
        return self.queue.offer(
            end, now, lambda start, count: self.source.advance(start, count, end), final=not self.follow
        )

    def acquire(self, trainer: int, worker: str, now: float, allowed: float | None = None) -> Lease | str:
        """A lease on the next window, "wait" or "stopped" (WindowQueue.acquire), after
        cutting what arrived."""
        self.cut(now)
        return self.queue.acquire(trainer, worker, now, allowed)

    def commit(self) -> bool:
        """Tell the source the queue's committed offset, if it moved; whether it did."""
        if self.queue.committed <= self._committed:
            return False
        self.source.commit(self.queue.config.group, self.queue.committed)
        self._committed = self.queue.committed
        return True

    def stop(self) -> None:
        """Drain: the windows cut are still handed out and finished; no more are cut."""
        self.queue.stop()

    def status(self) -> dict[str, Any]:
        return {**self.queue.status(), "follow": self.follow, "end": self.source.end_offset()}

    def to_snapshot(self) -> dict[str, Any]:
        return {"follow": self.follow, "through": self.through, "queue": self.queue.to_snapshot()}

    @classmethod
    def from_snapshot(cls, source: StreamSource, snapshot: dict[str, Any]) -> StreamWindows:
        """The windows a snapshot describes, on `source` (reopened): the source is told the
        snapshot's committed offset again (a crash may have come before it was)."""
        try:
            follow, through = bool(snapshot["follow"]), snapshot["through"]
            if through is not None and not isinstance(through, int):
                raise Error(f"'through' is {through!r}, not an offset")
            queue = WindowQueue.from_snapshot(snapshot["queue"], time.monotonic())
        except (KeyError, TypeError) as e:
            raise Error(f"not a valid stream snapshot: {type(e).__name__}: {e}") from None
        if source.committed(queue.config.group) < queue.committed:  # (a crash came between the two)
            source.commit(queue.config.group, queue.committed)
        return cls(source, queue, follow, through)
