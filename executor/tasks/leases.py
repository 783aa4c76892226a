"""Leases on a coordinator's work items (a dataset's tasks, a stream's windows), by id.

An item waits in `todo`; a trainer gets a lease on it and it is `pending` until the
lease's trainer reports it finished or failed. A lease that expires (its trainer died or
hangs), a failure, or the trainer restarting sends the item back to todo with its
failure count + 1; past `max_failures` it is discarded and reported. Only the current
lease of a pending item can finish it, so an item is counted done at most once, even when
a trainer thought dead reports late.

Pure state, no clock and no I/O: callers pass `now` (seconds, monotonic). What an item is,
what "done" adds up to and when new items appear is the subclass's (TaskQueue: passes
over a dataset; WindowQueue: windows of a stream).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from fluidps.errors import Error


@dataclass
class Lease:
    id: int
    task: int  # the item's id (a dataset's task, a stream's window)
    trainer: int
    worker: str  # the trainer process's incarnation
    attempt: int  # failures the item had when this lease was given
    deadline: float = 0.0
    allowed: float = 0.0  # the seconds of silence its deadline allows (the timeout, or stretched)


class LeaseBook:
    """Items (by id) in todo, pending under a lease, failed so many times, or discarded."""

    # Where a failed item goes back: last (a dataset's pass: the others first) or first
    # (a stream's window: the committed offset waits for it).
    retry_first = False

    def __init__(self, timeout: float = 60.0, max_failures: int = 3):
        if timeout <= 0 or max_failures < 0:
            raise Error(f"a lease's timeout must be > 0 and max_failures >= 0, got {timeout}, {max_failures}")
        self.timeout = timeout
        self.max_failures = max_failures
        self.failures: dict[int, int] = {}
        self.discarded: dict[int, str] = {}  # item id -> why (its last failure)
        self.todo: deque[int] = deque()
        self.pending: dict[int, Lease] = {}  # item id -> its current lease
        self.next_lease = 1

    def replaced(self, trainer: int, worker: str) -> list[tuple[Lease, str]]:
        """Fail the leases an earlier process of this trainer id held (it restarted):
        [(lease, "requeued" or "discarded")]."""
        old = self._in_retry_order(
            [le for le in self.pending.values() if le.trainer == trainer and le.worker != worker]
        )
        return [(le, self._failed(le, f"trainer {trainer} restarted while it held the task")) for le in old]

    def held_by(self, worker: str) -> Lease | None:
        """The lease this worker holds, if any (it asks again: it gets the same one)."""
        return next((lease for lease in self.pending.values() if lease.worker == worker), None)

    def lease_next(self, trainer: int, worker: str, now: float, allowed: float | None = None) -> Lease | None:
        """A lease on the first item of todo (None when todo is empty), due `allowed`
        seconds from now (default: the timeout)."""
        if not self.todo:
            return None
        item = self.todo.popleft()
        allowed = allowed or self.timeout
        lease = Lease(
            self.next_lease, item, trainer, worker, self.failures.get(item, 0), now + allowed, allowed
        )
        self.next_lease += 1
        self.pending[item] = lease
        return lease

    def end_lease(self, lease_id: int, worker: str) -> Lease | None:
        """Take a current lease out of pending (its item is done); None when it is not current."""
        lease = self._current(lease_id, worker)
        if lease is not None:
            del self.pending[lease.task]
        return lease

    def fail(self, lease_id: int, worker: str, reason: str) -> str:
        """ "requeued", "discarded" or "stale" (not a current lease: nothing changes)."""
        lease = self._current(lease_id, worker)
        if lease is None:
            return "stale"
        return self._failed(lease, reason)

    def release(self, lease_id: int, worker: str) -> bool:
        """Give an item back unfinished without counting a failure (a trainer stopping early)."""
        lease = self._current(lease_id, worker)
        if lease is None:
            return False
        del self.pending[lease.task]
        self.todo.appendleft(lease.task)
        return True

    def expire(self, now: float) -> list[tuple[Lease, str]]:
        """Fail every lease past its deadline: [(lease, "requeued" or "discarded")]."""
        late = self._in_retry_order([lease for lease in self.pending.values() if lease.deadline <= now])
        return [(lease, self._failed(lease, f"timed out after {self.allowed(lease):g} s")) for lease in late]

    def postpone(self, seconds: float) -> None:
        """Move every deadline `seconds` later: the coordinator was not listening that long
        (a slow source held it), so its trainers' silence then is not theirs."""
        for lease in self.pending.values():
            lease.deadline += seconds

    def allowed(self, lease: Lease) -> float:
        return lease.allowed or self.timeout

    def renew(self, lease_id: int, worker: str, now: float, allowed: float | None = None) -> bool:
        """Push a current lease's deadline back (its trainer is alive and working on it),
        `allowed` seconds away (default: the timeout)."""
        lease = self._current(lease_id, worker)
        if lease is None:
            return False
        lease.allowed = allowed or self.timeout
        lease.deadline = now + lease.allowed
        return True

    def _in_retry_order(self, leases: list[Lease]) -> list[Lease]:
        """Leases to fail together, ordered so that their items go back in id order (the
        last failed goes first when failed items go to the front)."""
        return sorted(leases, key=lambda lease: lease.task, reverse=self.retry_first)

    def _current(self, lease_id: int, worker: str) -> Lease | None:
        for lease in self.pending.values():
            if lease.id == lease_id:
                return lease if lease.worker == worker else None
        return None

    def _failed(self, lease: Lease, reason: str) -> str:
        del self.pending[lease.task]
        count = self.failures[lease.task] = self.failures.get(lease.task, 0) + 1
        if count > self.max_failures:
            self.discarded[lease.task] = reason
            outcome = "discarded"
        else:
            (self.todo.appendleft if self.retry_first else self.todo.append)(lease.task)
            outcome = "requeued"
        self._changed()
        return outcome

    def _changed(self) -> None:
        """After an item left pending (done, failed): the subclass's bookkeeping."""

    def _restore_leases(self, items: list[dict], now: float) -> None:
        """Pending leases from a snapshot (their deadlines restart from `now`)."""
        self.pending = {}
        for item in items:
            lease = Lease(**item, deadline=now + self.timeout, allowed=self.timeout)
            self.pending[lease.task] = lease

    def _lease_snapshot(self) -> list[dict]:
        return [
            {"id": le.id, "task": le.task, "trainer": le.trainer, "worker": le.worker, "attempt": le.attempt}
            for le in self.pending.values()
        ]
