"""When a pserver stops waiting for its trainers.

A trainer silent for longer than its allowance is lost: evicted in an elastic job (a
new incarnation of it may join), the job's failure otherwise. Its allowance is the
peer timeout, stretched by how far apart its messages came lately
(fluidps.executor.transport.liveness), or the warm-up timeout until it is first heard
from (it may still be importing and transpiling). Paused trainers count too: one
waiting for a task keeps sending heartbeats. With every trainer not done evicted, the
pserver keeps its state and waits up to RpcSettings.rejoin_timeout for one to come
back before it gives the job up; and with no message at all for IDLE_TIMEOUT while
trainers may still send, it gives up too.

TrainerWatch decides and logs; the pserver loop acts on what it says.
"""

from __future__ import annotations

from collections.abc import Callable

from fluidps.executor.ps.membership import Membership
from fluidps.executor.transport.liveness import SilenceClock
from fluidps.executor.transport.settings import RpcSettings

IDLE_TIMEOUT = 3600.0  # seconds without any message while trainers may still send


class TrainerWatch:
    def __init__(self, members: Membership, settings: RpcSettings, log: Callable[[str], None], now: float):
        self._members = members
        self._settings = settings
        self._log = log
        self._started = self._last_heard = now
        self._alone_since: float | None = None  # when the last trainer not done was evicted

    def heard(self, now: float) -> None:
        """A message came (from anyone)."""
        self._last_heard = now

    def idle(self, now: float) -> str | None:
        """Why to give up when no message came for IDLE_TIMEOUT while trainers may still send."""
        if self._members.active and now - self._last_heard > IDLE_TIMEOUT:
            return f"no message for {IDLE_TIMEOUT:.0f} s from trainers {sorted(self._members.active)}"
        return None

    def silent(
        self, clock: Callable[[tuple[int, int]], SilenceClock | None], now: float
    ) -> list[tuple[int, str]]:
        """(trainer, why) of each trainer that may still send and was silent past its
        allowance; `clock` gives a (trainer, incarnation)'s silence, None if not heard."""
        out = []
        for trainer in sorted(self._members.active):
            member = self._members.members[trainer]
            silence = clock((trainer, member.sender)) if member.sender else None
            if silence is None:
                silent = now - self._started
                allowed = max(self._settings.warmup_timeout, self._settings.peer_timeout)
            else:
                silent, allowed = silence.silent_for(now), silence.allowance()
                if (report := silence.stretch_report()) is not None:
                    self._log(f"trainer {trainer}: {report}")
            if silent > allowed:
                why = f"not heard from for {silent:.1f} s, allowed {allowed:.1f} s (it is down, hung or cut off)"
                out.append((trainer, why))
        return out

    def given_up(self, now: float) -> bool:
        """Whether every trainer not done has been evicted for longer than the rejoin
        timeout (the log says when that wait begins, and when a trainer ends it)."""
        members = self._members
        if members.active or not members.lost:
            if self._alone_since is not None:
                self._alone_since = None
                self._log(f"trainers {sorted(members.active)} are back; the job goes on")
            return False
        if self._alone_since is None:
            self._alone_since = now
            self._log(
                f"every trainer not done was evicted ({', '.join(map(str, sorted(members.lost)))}); waiting up "
                f"to {self._settings.rejoin_timeout:g} s for one to rejoin, keeping the parameters and checkpointing"
            )
            return False
        return now - self._alone_since > self._settings.rejoin_timeout
