"""Trainer ids claimed by a new incarnation while a live one holds them.

A trainer process restarted without naming the incarnation it replaces (a launcher's
restarts name it: FLUIDPS_REPLACES) claims a trainer id whose holder, as far as the
pserver knows, is alive. Its requests wait, in the order they came, until the holder is
evicted for its silence; then they are handled as if they had just arrived. A holder
that keeps proving alive for longer than its allowance and a peer timeout is not gone:
two processes were started with one trainer id, and the claim is refused, saying so.
At most CLAIMS_LIMIT connections wait at once, with at most QUEUE_LIMIT requests each.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from fluidps.executor.ps.membership import Claim, Membership
from fluidps.executor.transport.liveness import SilenceClock
from fluidps.executor.transport.ratelimit import RateLimitedLog
from fluidps.executor.transport.rpc import Request
from fluidps.executor.transport.settings import RpcSettings

CLAIMS_LIMIT = 64  # connections whose new incarnation waits for a trainer id (more are refused)
QUEUE_LIMIT = 1024  # requests waiting behind one claim (a trainer has a few in flight)


class WaitingClaims:
    """The connections whose claim waits, with their requests. `refuse(request, why)`
    answers a request with an error; `heard((trainer, incarnation))` is the server's
    clock of that incarnation's messages (None: never heard from)."""

    def __init__(
        self,
        members: Membership,
        settings: RpcSettings,
        refuse: Callable[[Request, str], None],
        heard: Callable[[tuple[int, int]], SilenceClock | None],
        log: Callable[[str], None],
    ):
        self._members = members
        self._settings = settings
        self._refuse = refuse
        self._heard = heard
        self._log = log
        self._log_claim = RateLimitedLog(log)  # (a stranger could make many)
        self._waiting: dict[bytes, tuple[float, list[Request]]] = {}  # connection -> (since, requests)

    def queue(self, request: Request) -> bool:
        """Whether `request` came on a connection whose claim waits: then it waits behind
        (up to QUEUE_LIMIT requests; later ones are refused)."""
        waiting = self._waiting.get(request.client)
        if waiting is not None and len(waiting[1]) >= QUEUE_LIMIT:
            self._refuse(request, f"{QUEUE_LIMIT} requests already wait behind this connection's claim")
        elif waiting is not None:
            waiting[1].append(request)
        return waiting is not None

    def wait(self, request: Request, claim: Claim) -> None:
        """`request` claims a trainer id that a live incarnation holds: it waits (see retry)."""
        if len(self._waiting) >= CLAIMS_LIMIT:
            self._refuse(request, f"{claim}; too many processes wait to claim trainer ids")
            return
        self._log_claim(
            f"incarnation {request.msg.sender:x} claims trainer {claim.trainer}, held by incarnation "
            f"{claim.holder:x}: it waits until that one is evicted for its silence (a restarted trainer "
            f"that names the one it replaces, as the launcher's do, takes over at once)"
        )
        self._waiting[request.client] = (time.monotonic(), [request])

    def retry(self, handle: Callable[[Request], None]) -> None:
        """`handle` the requests of each claim whose trainer id is free now; refuse those
        whose holder kept proving alive for longer than its allowance and a peer timeout
        (it would have been evicted by then were it gone)."""
        now = time.monotonic()
        for connection, (since, requests) in list(self._waiting.items()):
            msg = requests[0].msg
            holder = self._members.members[msg.trainer_id].sender
            if holder not in (0, msg.sender):
                silence = self._heard((msg.trainer_id, holder))
                allowed = (silence.allowance() if silence else self._settings.warmup_timeout) + (
                    self._settings.peer_timeout
                )
                if now - since <= allowed:
                    continue
                del self._waiting[connection]
                why = (
                    f"trainer {msg.trainer_id} is held by incarnation {holder:x}, which is alive; incarnation "
                    f"{msg.sender:x} waited {now - since:.1f} s for it: two processes were started with one "
                    "trainer id, or a restarted one did not name the incarnation it replaces (FLUIDPS_REPLACES)"
                )
                self._log(why)  # (at most CLAIMS_LIMIT per allowance: no flood)
                for request in requests:
                    self._refuse(request, why)
                continue
            del self._waiting[connection]
            for request in requests:
                handle(request)
