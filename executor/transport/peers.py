"""What a server keeps of its peers, bounded however many come and go.

Per connection (a ZeroMQ routing id) a server keeps the ids of the requests it holds
and the replies it sent lately, so that a request resent after a reconnect is answered
again, not run again. Per trainer incarnation its owner asks it to track, it keeps a
clock of that incarnation's messages (liveness.py). Connections come and go without a
word (a restarted trainer connects anew; a closed connection never says so), and a
process of the job with a bug could open many, so none of it may grow with time:

- a connection is kept from its first request (a heartbeat alone leaves nothing), and
  dropped once it holds no request and was silent for `forget_after` seconds (a client
  that lost a reply keeps asking while it waits, so it is not silent); beyond
  MAX_CONNECTIONS, those heard least recently that hold nothing go first;
- a connection's cache holds its last REPLY_CACHE replies, each at most `forget_after`
  seconds old; beyond REPLY_CACHE_BYTES in all, the oldest replies go first (a resent
  request whose reply went is run again: the client hears about every reply within
  seconds, so only a flood gets this far);
- clocks are kept only for incarnations the owner tracks (the trainers it admitted),
  at most MAX_CLOCKS, and dropped when it untracks them or they are silent for
  `forget_after` past the longest allowance a clock gives.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from fluidps.executor.transport.liveness import SilenceClock
from fluidps.executor.transport.settings import RpcSettings

MAX_CONNECTIONS = 4096
MAX_CLOCKS = 4096
REPLY_CACHE = 32  # replies kept per connection
REPLY_CACHE_BYTES = 256 << 20  # replies kept in all, by their frames' bytes
PRUNE_EVERY = 1.0  # seconds between looks for silent peers


@dataclass
class Connection:
    last: float  # when its last message came
    pending: set[int] = field(default_factory=set)
    replies: OrderedDict[int, tuple[float, int, list[Any]]] = field(default_factory=OrderedDict)


def frames_bytes(frames: list[Any]) -> int:
    return sum(getattr(f, "nbytes", None) or len(f) for f in frames)


class Peers:
    """A server's connections and clocks (see the module's docstring)."""

    def __init__(self, settings: RpcSettings):
        self.settings = settings
        # A clock outlives its longest allowance; a connection, a few peer timeouts.
        self.forget_after = max(2 * settings.peer_timeout, 10.0)
        self._clock_horizon = max(settings.warmup_timeout, settings.peer_timeout * 10) + self.forget_after
        self.connections: OrderedDict[bytes, Connection] = OrderedDict()  # least recently heard first
        self.clocks: OrderedDict[tuple[int, int], SilenceClock] = OrderedDict()
        self.cached_bytes = 0
        self._next_prune = 0.0

    # -- connections ---------------------------------------------------------------------

    def connection(self, client: bytes, now: float, create: bool = True) -> Connection | None:
        """`client`'s state, noting it was heard from `now` (made when `create`)."""
        state = self.connections.get(client)
        if state is None:
            if not create:
                return None
            state = self.connections[client] = Connection(now)
            if len(self.connections) > MAX_CONNECTIONS:
                self._drop_idle(len(self.connections) - MAX_CONNECTIONS)
        else:
            self.connections.move_to_end(client)
        state.last = now
        return state

    def cache(self, client: bytes, request_id: int, frames: list[Any], now: float) -> None:
        """Keep `frames`, the reply to `request_id`, for a resend of that request."""
        state = self.connection(client, now)
        assert state is not None
        state.pending.discard(request_id)
        size = frames_bytes(frames)
        state.replies[request_id] = (now, size, frames)
        self.cached_bytes += size
        while len(state.replies) > REPLY_CACHE:
            self.cached_bytes -= state.replies.popitem(last=False)[1][1]
        if self.cached_bytes > REPLY_CACHE_BYTES:
            self._drop_replies()

    def _drop_replies(self) -> None:
        """Drop cached replies, oldest first, until they fit REPLY_CACHE_BYTES."""
        entries = sorted(
            (when, client, rid)
            for client, state in self.connections.items()
            for rid, (when, _, _) in state.replies.items()
        )
        for _, client, rid in entries:
            if self.cached_bytes <= REPLY_CACHE_BYTES:
                return
            self.cached_bytes -= self.connections[client].replies.pop(rid)[1]

    def _drop_idle(self, count: int) -> None:
        """Drop up to `count` connections that hold no request, least recently heard first."""
        idle = [c for c, state in self.connections.items() if not state.pending][:count]
        for client in idle:
            self._forget_connection(client)

    def _forget_connection(self, client: bytes) -> None:
        state = self.connections.pop(client)
        self.cached_bytes -= sum(size for _, size, _ in state.replies.values())

    # -- clocks ----------------------------------------------------------------------------

    def track(self, key: tuple[int, int], now: float) -> SilenceClock:
        """Start (or go on) keeping the clock of `key` (trainer id, incarnation)."""
        clock = self.clocks.get(key)
        if clock is None:
            clock = self.clocks[key] = SilenceClock(
                self.settings.peer_timeout, self.settings.warmup_timeout, now
            )
            while len(self.clocks) > MAX_CLOCKS:
                self.clocks.popitem(last=False)
        return clock

    def untrack(self, key: tuple[int, int]) -> None:
        self.clocks.pop(key, None)

    def heard(self, key: tuple[int, int], now: float) -> None:
        clock = self.clocks.get(key)
        if clock is not None:
            clock.heard(now)
            self.clocks.move_to_end(key)

    # -- forgetting --------------------------------------------------------------------------

    def prune(self, now: float) -> None:
        """Drop what silence made useless (at most once every PRUNE_EVERY seconds)."""
        if now < self._next_prune:
            return
        self._next_prune = now + PRUNE_EVERY
        silent = [
            c
            for c, state in self.connections.items()
            if not state.pending and now - state.last > self.forget_after
        ]
        for client in silent:
            self._forget_connection(client)
        for state in self.connections.values():  # (each cache is oldest first)
            while state.replies and now - next(iter(state.replies.values()))[0] > self.forget_after:
                self.cached_bytes -= state.replies.popitem(last=False)[1][1]
        for key in [k for k, clock in self.clocks.items() if clock.silent_for(now) > self._clock_horizon]:
            del self.clocks[key]
