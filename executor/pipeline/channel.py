"""A stage process's channel to the other stages: values cross as STAGE_SEND messages.

A stage's executor server takes its peers' STAGE_SEND messages on its serving loop
(`deliver`, which checks them: another stage's, of this step and one of its
micro-batches, and not more than a bounded number waiting); its worker thread, running the stage's programs,
sends with `send` (without waiting for the answer, which `flush` collects at the end
of the step) and takes with `recv`, which waits for the value of this step and
micro-batch (a peer a step ahead may send the next step's values already). While it
waits it keeps a HELLO in flight to the peer it waits for: a peer silent past the
peer timeout (as fluidps.executor.transport.liveness stretches it) is reported by
name, never waited for forever.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import zmq

from fluidps.errors import Error, ExecutionError, PeerLostError
from fluidps.executor.transport.rpc import RpcClient
from fluidps.executor.transport.settings import RpcSettings
from fluidps.executor.transport.wire import Kind, Message

STAGE_SEND = Kind.STAGE_SEND
# Values a stage keeps for its worker at most: a step's crossings into it, for every
# micro-batch, fit many times over; a peer that sends more is refused, not stored.
MAX_WAITING = 65536


class RemoteStageChannel:
    def __init__(
        self,
        stage: int,
        endpoints: list[str],
        settings: RpcSettings,
        context: zmq.Context,
        micro_batches: int,
    ):
        self.stage = stage
        self.micro_batches = micro_batches
        self.micro_batch = 0
        self.step = 0  # counted alike on every stage: each RUN of the stage is one step
        self._endpoints = endpoints
        self._settings = settings
        self._context = context
        self._clients: dict[int, RpcClient] = {}
        self._mail: dict[tuple[int, str, int, int], Any] = {}  # (from, name, step, micro-batch) -> value
        self._arrived = threading.Condition()
        self._unacknowledged: list[tuple[int, str, int]] = []  # (peer, variable, request id)
        # Peers that answered once: until then a peer may still be starting (a launched stage
        # binds its endpoint at its first step), and gets the warm-up allowance, not the timeout.
        self._answered: set[int] = set()
        self.deaf: str | None = None  # why whoever delivers the peers' values stopped (see stop_hearing)
        self.waited_s = 0.0  # spent in recv waiting for peers' values (a stage's idle time)

    # -- the serving loop's side ---------------------------------------------------------

    def deliver(self, msg: Message) -> None:
        """Keep a peer's STAGE_SEND values for the worker; Error when it is no peer's."""
        try:
            src = int(msg.text)
        except ValueError:
            src = -1
        if not 0 <= src < len(self._endpoints) or src == self.stage:
            raise Error(f"STAGE_SEND from {msg.text[:40]!r}: not another stage of this pipeline")
        if not msg.tensors:
            raise Error("STAGE_SEND without values")
        with self._arrived:
            # A peer may be a step ahead (stages step on their own when launched: its next
            # step's activations can come while this stage still updates); never further.
            if msg.step not in (self.step, self.step + 1) or msg.micro_batch >= self.micro_batches:
                raise Error(
                    f"STAGE_SEND from stage {src} for step {msg.step}, micro-batch {msg.micro_batch}: this stage "
                    f"is at step {self.step} of {self.micro_batches} micro-batches"
                )
            if len(self._mail) + len(msg.tensors) > MAX_WAITING:
                raise Error(f"STAGE_SEND from stage {src}: {len(self._mail)} values wait here already")
            for name, value in msg.tensors.items():
                self._mail[(src, name, msg.step, msg.micro_batch)] = value
            self._answered.add(src)  # (it is running: from now on its silence counts)
            self._arrived.notify_all()

    # -- the worker's side ------------------------------------------------------------------

    def send(self, peer: int, name: str, value: Any) -> None:
        """Hand the value on without waiting for the peer: its serving loop may be waiting
        for the GIL its own compute holds, and a stage that waited for that would wait out
        the peer's whole step. The answers are collected as they come and by `flush`."""
        # (a parameter is updated in place later: the message holds a copy of its own)
        copied = np.array(value, copy=True)
        msg = Message(STAGE_SEND, tensors={name: copied}, step=self.step, micro_batch=self.micro_batch)
        msg.text = str(self.stage)
        client = self._client(peer)
        self._unacknowledged.append((peer, name, client.request(msg)))
        self._collect(wait=False)

    def flush(self) -> None:
        """Wait until every value sent was taken by its peer (the end of a step)."""
        self._collect(wait=True)

    def stop_hearing(self, reason: str) -> None:
        """What delivers the peers' values failed: a stage waiting for one is told at once."""
        with self._arrived:
            self.deaf = reason
            self._arrived.notify_all()

    def next_step(self) -> None:
        """This stage's step is done (flushed): take the next step's values."""
        with self._arrived:
            self.step += 1

    def _collect(self, wait: bool) -> None:
        still = []
        for peer, name, rid in self._unacknowledged:
            client = self._client(peer)
            try:
                if wait:
                    client.wait(rid, self._settings.request_timeout, warming=peer not in self._answered)
                else:
                    client.begin_wait()  # (only collecting: whether the peer is alive is for flush)
                    if client.poll(rid, 0) is None:
                        still.append((peer, name, rid))
                        continue
                self._answered.add(peer)
            except Error as e:
                self._unacknowledged = []
                raise ExecutionError(
                    f"stage {self.stage} could not send {name!r} to stage {peer}: {e}"
                ) from None
        self._unacknowledged = still

    def recv(self, peer: int, name: str) -> Any:
        key = (peer, name, self.step, self.micro_batch)
        started = time.perf_counter()
        client: RpcClient | None = None  # (made when the value is not there yet: a probe of the peer)
        probe: int | None = None
        deadline = time.monotonic() + self._settings.request_timeout  # a bound for a hang
        while True:
            with self._arrived:
                if key in self._mail or self._arrived.wait_for(
                    lambda: key in self._mail or self.deaf is not None, self._settings.heartbeat_interval
                ):
                    if key in self._mail:
                        if probe is not None:
                            client.forget(probe)
                        self.waited_s += time.perf_counter() - started
                        return self._mail.pop(key)
                    raise ExecutionError(
                        f"stage {self.stage} waited for {name!r} from stage {peer}, but it no longer hears its "
                        f"peers: {self.deaf}"
                    )
            client = client or self._client(peer)
            if probe is None:
                client.begin_wait()
                probe = client.request(Message(Kind.HELLO))
            try:
                if client.poll(probe, 0, warming=peer not in self._answered) is not None:
                    probe = None  # it answered: alive; ask again next time round
                    self._answered.add(peer)
            except PeerLostError as e:
                what = (
                    "stopped answering"
                    if peer in self._answered
                    else "never answered (did its process start?)"
                )
                raise ExecutionError(
                    f"stage {self.stage} waited for {name!r} (step {self.step}, micro-batch {self.micro_batch}) "
                    f"from stage {peer}, which {what}: {e}"
                ) from None
            if time.monotonic() > deadline:
                raise ExecutionError(
                    f"stage {self.stage} waited {self._settings.request_timeout:g} s for {name!r} from stage {peer}"
                )

    def _client(self, peer: int) -> RpcClient:
        if peer not in self._clients:
            self._clients[peer] = RpcClient(
                self._context, self._endpoints[peer], f"stage {peer}", self._settings
            )
        return self._clients[peer]

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
