"""How long a coordinator's leases take: seconds from handing a window out to its
trainer's report that it is done, as a histogram, and how many leases failed.

The coordinator's loop calls it (a lease given, finished, failed); the metrics of the
process (fluidps.executor.metrics.job_metrics) read its `snapshot`, taken on that loop. A lease
given before a restart (resumed from the snapshot) has no start here: when it finishes,
it is not timed. Pure state, no clock: callers pass `now` (seconds, monotonic).
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from dataclasses import dataclass

# Upper bounds of the histogram's buckets, in seconds: a window takes from well under a
# second (a small one, a fast trainer) to its lease's timeout (60 s by default) and past.
BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# Leases whose start it keeps at most (the least recently given go first): leases held at
# once are a few per trainer, and one never reported (its trainer died) must not pile up.
KEPT = 4096


@dataclass(frozen=True)
class LeaseTimesSnapshot:
    """A histogram's state, cumulative as Prometheus writes it: `buckets` holds
    (upper bound, leases that took at most that long), the last bound infinite."""

    buckets: tuple[tuple[float, int], ...]
    count: int
    sum: float
    failed: int


class LeaseTimes:
    def __init__(self, kept: int = KEPT):
        self.kept = kept
        self._started: OrderedDict[int, float] = OrderedDict()  # lease id -> when it was given
        self._counts = [0] * (len(BUCKETS) + 1)  # per bucket (not cumulative); the last: past them all
        self.count = 0
        self.sum = 0.0
        self.failed = 0

    def leased(self, lease_id: int, now: float) -> None:
        """Lease `lease_id` was handed out (again: the same trainer asked twice; it keeps
        its first start)."""
        if lease_id not in self._started:
            self._started[lease_id] = now
            while len(self._started) > self.kept:
                self._started.popitem(last=False)

    def finished(self, lease_id: int, now: float) -> None:
        """Lease `lease_id`'s item was reported done: its time is counted."""
        started = self._started.pop(lease_id, None)
        if started is None:  # (given before a restart, or forgotten)
            return
        seconds = max(now - started, 0.0)
        self._counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.count += 1
        self.sum += seconds

    def failed_lease(self, lease_id: int) -> None:
        """Lease `lease_id` failed (reported, expired, or its trainer restarted)."""
        self._started.pop(lease_id, None)
        self.failed += 1

    def snapshot(self) -> LeaseTimesSnapshot:
        cumulative, total = [], 0
        for bound, n in zip((*BUCKETS, float("inf")), self._counts, strict=True):
            total += n
            cumulative.append((bound, total))
        return LeaseTimesSnapshot(tuple(cumulative), self.count, self.sum, self.failed)
