"""RpcSettings: how a process talks to its peers (timeouts, message limits, keys).

Kept apart from the sockets so that configuration can be made, from the environment
or by hand, without loading ZeroMQ.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fluidps.executor.transport.proof import JobSecret
    from fluidps.executor.transport.security import Security


DEFAULT_MAX_MESSAGE_BYTES = 1 << 34


@dataclass(frozen=True)
class RpcSettings:
    heartbeat_interval: float = 0.5  # seconds between application heartbeats while waiting
    # A peer silent this long is dead: the floor of its allowance, which stretches with
    # the gaps seen between its messages (fluidps.executor.transport.liveness).
    peer_timeout: float = 10.0
    # A peer's allowance until its first step is done (it imports, transpiles and
    # compiles its kernels), and a trainer's to say anything at all.
    warmup_timeout: float = 120.0
    request_timeout: float = 600.0  # the longest any reply may take (barriers wait for slow trainers)
    retry_after: float = 2.0  # resend a request the server says it does not hold after this long
    # ZeroMQ drops a larger message unread, with its sender's connection. None: a pserver
    # derives its limit from its plan (fluidps.executor.ps.message_limit); other
    # sockets take DEFAULT_MAX_MESSAGE_BYTES (a batch or a program has no static bound).
    max_message_bytes: int | None = None
    security: Security | None = None
    # The job's secret: every message carries a proof made with it, and servers refuse
    # messages without one (fluidps.executor.transport.proof).
    secret: JobSecret | None = None
    # Serve without the job's secret, and non-loopback addresses without CURVE: anyone
    # who reaches the port is heard.
    insecure: bool = False
    # Trainers are disposable (a coordinator hands out the data): pservers evict a trainer
    # that goes silent and let a restarted one rejoin, instead of failing the job.
    elastic: bool = False
    # An elastic pserver whose trainers were all evicted waits this long for one to come
    # back (keeping its state and its checkpoints) before it gives the job up.
    rejoin_timeout: float = 600.0
    # An async trainer blocked on its communicator's full send queue logs it this often.
    send_queue_log_after: float = 10.0
    # A pserver's: each trainer's incarnation, as the launcher that started them said
    # (empty: each trainer id goes to the first incarnation that speaks for it).
    trainer_incarnations: tuple[int, ...] = ()

    def with_(self, **changes: Any) -> RpcSettings:
        return replace(self, **changes)

    @property
    def message_limit(self) -> int:
        return self.max_message_bytes or DEFAULT_MAX_MESSAGE_BYTES
