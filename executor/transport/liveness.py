"""How long a peer may stay silent before it counts as dead.

The configured peer timeout is a floor, never a ceiling: a loaded or paused machine
is slow, not dead. Each peer's allowance stretches to STRETCH times the longest gap
between its messages among the last WINDOW, so a peer that became five times slower
(it sends its heartbeats five times further apart) gets five times longer, up to
CEILING times the floor so that a dead peer is still found. Until a peer is warm
(its first step is done: that step compiles its kernels, which holds the GIL for
seconds at a time and is a pause nothing later repeats) it has the warm-up
allowance instead.
"""

from __future__ import annotations

from collections import deque

STRETCH = 4.0  # allowance: this many times the longest recent gap...
WINDOW = 64  # ...among this many
CEILING = 10.0  # at most this many times the configured timeout
REPORT_GROWTH = 1.5  # say so each time the allowance grew this much since last said


class SilenceClock:
    """One peer's silence: when it was last heard from, and how long it may be silent."""

    def __init__(self, floor: float, warmup: float, now: float, stretch: float = STRETCH):
        self.floor, self.warmup, self.stretch = floor, max(floor, warmup), stretch
        self.last = now
        self.gaps: deque[float] = deque(maxlen=WINDOW)
        self.longest = 0.0  # of `gaps`: kept as they change, since every wait asks for it
        self.warm = False
        self._said = floor  # the allowance last reported

    def heard(self, now: float) -> None:
        """A message from the peer arrived at `now` (gaps count once it is warm: the
        warm-up allowance covers its first step's pauses)."""
        if self.warm:
            self.gaps.append(max(now - self.last, 0.0))
            self.longest = max(self.gaps)
        self.last = max(self.last, now)

    def restart(self, now: float) -> None:
        """Count silence from `now` without taking the time since as a gap (a client
        starts waiting: between its waits nobody was expected to say anything)."""
        self.last = max(self.last, now)

    def allowance(self, first_step: bool = True) -> float:
        """How long the peer may be silent; `first_step`: while it may be doing its first
        step (a client waiting for the reply to a step's request)."""
        if not self.warm and first_step:
            return self.warmup
        stretched = self.stretch * self.longest
        return min(max(self.floor, stretched), CEILING * self.floor)

    def silent_for(self, now: float) -> float:
        return now - self.last

    def expired(self, now: float, first_step: bool = True) -> bool:
        return self.silent_for(now) > self.allowance(first_step)

    def stretch_report(self) -> str | None:
        """A line to log when the allowance grew REPORT_GROWTH-fold since last reported."""
        allowance = self.allowance()
        if not self.warm or allowance < self._said * REPORT_GROWTH:
            return None
        self._said = allowance
        return (
            f"peer timeout stretched to {allowance:.1f} s (configured {self.floor:g} s): its messages "
            f"came up to {self.longest:.2f} s apart lately"
        )
