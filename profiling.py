"""Where a process's time goes in a profiled job: seconds by category, per step.

A profiled process (RuntimeConfig(profile=True): `fluidps serve --profile`,
FLUIDPS_PROFILE=1, JobDesc(profile=True)) keeps one Profile. Its pieces add to it:
a trainer's block runner times each op (communication ops under their own type,
the others as "compute"), the transport times encoding ("serialize") and decoding
("deserialize") messages, a pserver times each kind of request it handles and its
optimize blocks ("optimize"), and a RemoteExecutor times its steps' RUN messages from
sending to collecting ("client step"; one message may carry several steps).
Categories overlap where one contains another (a `send` op includes its
serialize); the report keeps them apart rather than guess a hierarchy.

May import: nothing
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# Ops whose time is communication with other processes, reported under their own type.
COMMUNICATION_OPS = frozenset(
    {
        "send",
        "recv",
        "send_barrier",
        "fetch_barrier",
        "distributed_lookup_table",
        "prefetch",
        "read",
        "checkpoint_notify",
    }
)


# Ops not timed: a pserver's serving loop runs for the whole job; its parts are timed inside.
UNTIMED_OPS = frozenset({"listen_and_serv"})


class Profile:
    """Seconds and calls by category, and the steps they were spread over. Thread-safe:
    a pserver's handlers and optimize blocks add to it from several threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds: dict[str, float] = {}
        self._calls: dict[str, int] = {}
        self.steps = 0

    def add(self, category: str, seconds: float) -> None:
        with self._lock:
            self._seconds[category] = self._seconds.get(category, 0.0) + seconds
            self._calls[category] = self._calls.get(category, 0) + 1

    @contextmanager
    def span(self, category: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(category, time.perf_counter() - start)

    def step(self) -> None:
        """One more step (a trainer's run of its program, a pserver's optimization)."""
        with self._lock:
            self.steps += 1

    def report(self, steps: int | None = None) -> dict[str, Any]:
        """Totals so far: {"steps", "ms": {category: ms}, "calls": {category: n}}; `steps`
        overrides the count (a pserver counts its optimizations elsewhere)."""
        with self._lock:
            return {
                "steps": self.steps if steps is None else steps,
                "ms": {c: round(t * 1e3, 3) for c, t in self._seconds.items()},
                "calls": dict(self._calls),
            }


def per_step(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What happened between two reports, per step: {"steps", "ms_per_step",
    "calls_per_step"}, categories by time, most first."""
    steps = after["steps"] - before["steps"]
    ms = {c: t - before["ms"].get(c, 0.0) for c, t in after["ms"].items()}
    order = sorted(ms, key=ms.__getitem__, reverse=True)
    each = max(steps, 1)
    return {
        "steps": steps,
        "ms_per_step": {c: round(ms[c] / each, 3) for c in order},
        "calls_per_step": {
            c: round((after["calls"][c] - before["calls"].get(c, 0)) / each, 2) for c in order
        },
    }
