"""Logging what strangers send without letting them flood the log: the first line of a
kind goes out as it happens, later ones at most once per `every` seconds, each saying
how many were held back since the last."""

from __future__ import annotations

import time
from collections.abc import Callable


class RateLimitedLog:
    def __init__(
        self, emit: Callable[[str], None], every: float = 10.0, clock: Callable[[], float] = time.monotonic
    ):
        self.emit, self.every, self.clock = emit, every, clock
        self._last: float | None = None
        self.held = 0  # lines not emitted since the last one that was

    def __call__(self, line: str) -> None:
        now = self.clock()
        if self._last is not None and now - self._last < self.every:
            self.held += 1
            return
        more = f" ({self.held} more like it in the last {now - self._last:.0f} s)" if self.held else ""
        self.emit(line + more)
        self._last, self.held = now, 0
