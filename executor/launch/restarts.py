"""When `fluidps launch --dataset` starts a dead process again.

A process may be restarted `limit` times within any `window` seconds, so a job that
runs for days rides through a few failures a day instead of burning a lifetime budget.
Each restart waits a backoff that doubles with the process's recent restarts (BACKOFF
up to BACKOFF_MAX), so a crash loop does not spin. A process that exited with
fluidps.executor.peer_exit's status failed because a peer restarted or went silent (a
pserver restarting fails its trainers' step): that is the peer's failure, and counts
against a budget PEER_FACTOR times larger, kept only so that nothing restarts forever.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from fluidps.executor.peer_exit import PEER_FAILURE_STATUS

BACKOFF = 0.2  # seconds before a first restart
BACKOFF_MAX = 10.0
PEER_FACTOR = 4


@dataclass
class RestartBudget:
    limit: int  # restarts per process within `window`
    window: float  # seconds
    _own: dict[str, deque[float]] = field(default_factory=dict)
    _peer: dict[str, deque[float]] = field(default_factory=dict)

    @staticmethod
    def peer_caused(returncode: int | None) -> bool:
        return returncode == PEER_FAILURE_STATUS

    def _recent(self, book: dict[str, deque[float]], name: str, now: float) -> deque[float]:
        times = book.setdefault(name, deque())
        while times and now - times[0] > self.window:
            times.popleft()
        return times

    def allows(self, name: str, returncode: int | None, now: float) -> bool:
        """Whether `name`, which exited with `returncode`, may be started again now."""
        if self.peer_caused(returncode):
            return len(self._recent(self._peer, name, now)) < self.limit * PEER_FACTOR
        return len(self._recent(self._own, name, now)) < self.limit

    def record(self, name: str, returncode: int | None, now: float) -> float:
        """Count a restart of `name`; the seconds to wait before starting it."""
        times = self._recent(self._peer if self.peer_caused(returncode) else self._own, name, now)
        times.append(now)
        recent = len(self._recent(self._own, name, now)) + len(self._recent(self._peer, name, now))
        return min(BACKOFF * 2 ** (recent - 1), BACKOFF_MAX)

    def used(self, name: str, now: float, returncode: int | None = None) -> int:
        """Restarts of `name` within the window, of the budget an exit with `returncode`
        draws on (its own unless a peer caused it)."""
        return len(self._recent(self._peer if self.peer_caused(returncode) else self._own, name, now))
