"""An async trainer's communicator: gradients and parameters travel on a thread of their
own, so that a step costs its compute (Fluid's AsyncCommunicator).

The send op puts each gradient into its variable's queue and returns. The
communicator's thread takes what is queued, merges up to `max_merge` gradients of a
variable into one (summed or averaged, as each send op says: a sum of SGD gradients
moves the parameter as far as applying them one by one), and sends one SEND per
pserver, waiting for the acknowledgements before the next round. The slower the
pservers, the more each round merges, so the trainer never waits for the network
while its queues have room.

Parameters are pulled on the same thread, after each round, when the trainer asks
(every recv_interval steps): the trainer's recv takes the values of the last pull
finished, without waiting.

Memory is bounded: each variable's queue holds at most `queue_size` gradients. A
trainer that outruns its pservers blocks in its send op, and says so in the log every
`log_after` seconds it stays blocked. A send or pull that fails ends the communicator;
the next call from the trainer raises that failure.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import zmq

from fluidps.errors import TransportError
from fluidps.executor.ps import gradients
from fluidps.executor.ps.applied_batches import parse_ack
from fluidps.executor.transport.rpc import RpcClient, wait_all
from fluidps.executor.transport.settings import RpcSettings
from fluidps.executor.transport.wire import Kind, Message
from fluidps.ops.runtime_api import Pull, Push
from fluidps.profiling import Profile

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (pserver endpoint, the gradient's name there)


class Communicator:
    def __init__(
        self,
        settings: RpcSettings,
        trainer_id: int,
        sender: int,
        context_for: Callable[[str], zmq.Context],
        queue_size: int,
        max_merge: int,
        log_after: float,
        profile: Profile | None = None,
        replaces: int = 0,
    ):
        self.settings = settings
        self.trainer_id, self.sender, self.replaces = trainer_id, sender, replaces
        self.queue_size, self.max_merge, self.log_after = queue_size, max_merge, log_after
        self._context_for = context_for
        self._profile = profile
        self._lock = threading.Condition()
        # Guarded by _lock: what waits to be sent, pulls asked for and their results.
        self._queues: dict[Key, deque[tuple[int, Any]]] = {}  # (step, gradient), oldest first
        self._merge: dict[Key, str] = {}
        self._pulls: dict[tuple, Sequence[Pull]] = {}  # asked for, not started
        self._pulled: dict[tuple, list[Any]] = {}  # the values of each key's last pull
        self._acked: dict[int, list] = {}  # per pserver: what its latest acknowledgement said
        self._sending = False  # a round of gradients is on its way
        self._failure: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(
            target=self._run, name=f"communicator trainer {trainer_id}", daemon=True
        )
        self._thread.start()

    # -- what the trainer calls --------------------------------------------------------------

    def put(self, items: Sequence[Push], step: int, merge: str) -> None:
        """Queue the gradients (endpoint, name, value) of `step`, to be merged by `merge`.
        Blocks while a queue is full, logging every `log_after` seconds of it."""
        with self._lock:
            for endpoint, name, value in items:
                key = (endpoint, name)
                queue = self._queues.setdefault(key, deque())
                self._merge[key] = merge
                blocked_since = time.monotonic()
                log_at = blocked_since + self.log_after
                while len(queue) >= self.queue_size:
                    self._raise_failure()
                    if time.monotonic() < log_at:
                        self._lock.wait(log_at - time.monotonic())
                        continue
                    log.warning(
                        "trainer %d: the send queue of %r (pserver %s) has been full (%d gradients) for "
                        "%.1f s: the pservers take them slower than this trainer computes them, or not "
                        "at all; its send op waits (communicator_send_queue_size bounds the memory)",
                        self.trainer_id,
                        name,
                        endpoint,
                        len(queue),
                        time.monotonic() - blocked_since,
                    )
                    log_at += self.log_after
                self._raise_failure()
                queue.append((step, gradients.copy(value)))  # the step's buffers may be reused
            self._lock.notify_all()

    def ask_pull(self, key: tuple, items: Sequence[Pull]) -> None:
        """Pull `items` in the background; `pulled(key)` has the values once it is done."""
        with self._lock:
            self._raise_failure()
            self._pulls[key] = items
            self._lock.notify_all()

    def pulled(self, key: tuple) -> list[Any] | None:
        """The values of the last pull of `key` finished (None: none yet); each is given once."""
        with self._lock:
            self._raise_failure()
            return self._pulled.pop(key, None)

    def drain(self, timeout: float | None = None) -> None:
        """Wait until every gradient queued has been sent and acknowledged."""
        limit = self.settings.request_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._lock:
            while self._sending or any(self._queues.values()):
                self._raise_failure()
                left = deadline - time.monotonic()
                if left <= 0:
                    waiting = sum(map(len, self._queues.values()))
                    raise TransportError(
                        f"trainer {self.trainer_id}: {waiting} gradient(s) were not sent within {limit:g} s"
                    )
                self._lock.wait(min(left, self.settings.heartbeat_interval))
            self._raise_failure()

    def close(self) -> list[str]:
        """Send what is queued, then stop the thread; the problems met."""
        problems = []
        try:
            self.drain()
        except TransportError as e:
            problems.append(str(e))
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        self._thread.join(timeout=self.settings.peer_timeout)
        return problems

    # -- the thread --------------------------------------------------------------------------

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise TransportError(f"trainer {self.trainer_id}'s communicator failed: {self._failure}")

    def _run(self) -> None:
        clients: dict[str, RpcClient] = {}
        try:
            while True:
                with self._lock:
                    while not self._stopping and not self._pulls and not any(self._queues.values()):
                        self._lock.wait()
                    if self._stopping:
                        return
                    round_, pulls = self._take(), self._pulls
                    self._pulls = {}
                    self._sending = True
                    self._lock.notify_all()  # room in the queues
                if round_:
                    with self._span("communicator send"):
                        self._send(clients, round_)
                with self._lock:
                    self._sending = False
                    self._lock.notify_all()
                with self._span("communicator pull"):
                    pulled = {key: self._pull(clients, items) for key, items in pulls.items()}
                with self._lock:
                    self._pulled.update(pulled)
        except BaseException as e:  # raised to the trainer at its next call
            log.error("trainer %d: communicator failed: %s", self.trainer_id, e)
            with self._lock:
                self._failure, self._sending = e, False
                self._lock.notify_all()
        finally:
            for client in clients.values():
                client.close()

    def _span(self, category: str) -> AbstractContextManager[None]:
        # Its own categories: this time runs beside the steps, not in them.
        return self._profile.span(category) if self._profile is not None else nullcontext()

    def _take(self) -> dict[Key, tuple[int, str, list[Any]]]:
        """Up to max_merge of each queue: key -> (latest step, merge, gradients)."""
        taken = {}
        for key, queue in self._queues.items():
            if queue:
                batch = [queue.popleft() for _ in range(min(len(queue), self.max_merge))]
                taken[key] = (batch[-1][0], self._merge[key], [value for _, value in batch])
        return taken

    def _send(self, clients: dict[str, RpcClient], round_: dict[Key, tuple[int, str, list[Any]]]) -> None:
        """One SEND per pserver of the merged gradients, numbered by the latest step in it
        (the pserver's clock moves by the steps it covers); waits for every acknowledgement."""
        messages: dict[str, Message] = {}
        for (endpoint, name), (step, merge, values) in round_.items():
            msg = messages.setdefault(endpoint, Message(Kind.SEND, trainer_id=self.trainer_id, step=step))
            msg.step = max(msg.step, step)
            msg.tensors[name] = gradients.mean(values) if merge == "mean" else gradients.total(values)
        self._exchange(clients, messages)

    def _pull(self, clients: dict[str, RpcClient], items: Sequence[Pull]) -> list[Any]:
        messages: dict[str, Message] = {}
        for endpoint, name in items:
            messages.setdefault(endpoint, Message(Kind.GET, trainer_id=self.trainer_id)).names.append(name)
        replies = self._exchange(clients, messages)
        out = []
        for endpoint, name in items:
            if name not in replies[endpoint].tensors:
                raise TransportError(f"pserver {endpoint} did not return {name!r}")
            out.append(replies[endpoint].tensors[name])
        return out

    def _exchange(self, clients: dict[str, RpcClient], messages: dict[str, Message]) -> dict[str, Message]:
        pending = {}
        for endpoint, msg in messages.items():
            if endpoint not in clients:
                clients[endpoint] = RpcClient(
                    self._context_for(endpoint),
                    endpoint,
                    f"pserver {endpoint}",
                    self.settings,
                    self.trainer_id,
                    self.sender,
                    replaces=self.replaces,
                )
            pending[endpoint] = (clients[endpoint], clients[endpoint].request(msg))
        replies = wait_all(pending)
        with self._lock:
            for reply in replies.values():
                if (ack := parse_ack(reply.text)) is not None:
                    self._acked[ack[0]] = ack[1]
        return replies

    def take_acks(self) -> dict[int, list]:
        """What the acknowledgements since the last call said of the pservers' checkpoints
        (applied_batches.parse_ack), per pserver."""
        with self._lock:
            acked, self._acked = self._acked, {}
        return acked
