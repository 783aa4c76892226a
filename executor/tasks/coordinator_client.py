"""A trainer's side of the coordinator: asking it for tasks and reporting them.

The coordinator may restart: a request that meets a restart or silence is sent
again, on a new connection, until the coordinator answers or `patience` seconds
pass (the time a launcher needs to bring it back). Every reply is parsed into
checked fields (`wire.json_fields`).
"""

from __future__ import annotations

import json
import time
from typing import Any

import zmq

from fluidps.errors import Error, PeerLostError, RemoteError, TransportError
from fluidps.executor.tasks.stream_reader import WindowLease
from fluidps.executor.tasks.task_reader import TaskLease
from fluidps.executor.transport.rpc import RpcClient
from fluidps.executor.transport.settings import RpcSettings
from fluidps.executor.transport.wire import Kind, Message, json_fields


class CoordinatorClient:
    """A trainer's connection to the coordinator, which may restart: a request that meets
    a restart or silence is sent again, on a new connection, until the coordinator answers
    or `patience` seconds pass (the time a launcher needs to bring it back)."""

    def __init__(
        self,
        context: zmq.Context,
        endpoint: str,
        settings: RpcSettings,
        trainer_id: int,
        sender: int,
        patience: float = 120.0,
    ):
        self.context, self.endpoint, self.settings = context, endpoint, settings
        self.trainer_id, self.sender, self.patience = trainer_id, sender, patience
        self._client: RpcClient | None = None

    def call(self, kind: int, fields: dict[str, Any]) -> Message:
        deadline = time.monotonic() + self.patience
        while True:
            client = self._connect()
            try:
                return client.call(
                    Message(kind, text=json.dumps(fields)), timeout=self.settings.peer_timeout * 3
                )
            except RemoteError:
                raise
            except (PeerLostError, TransportError) as e:  # down, restarting, or restarted
                self.close()
                if time.monotonic() > deadline:
                    raise TransportError(
                        f"the coordinator ({self.endpoint}) has not come back within {self.patience:g} s: {e}"
                    ) from None
                time.sleep(min(1.0, self.settings.heartbeat_interval * 2))

    def _connect(self) -> RpcClient:
        if self._client is None:
            self._client = RpcClient(
                self.context, self.endpoint, "the coordinator", self.settings, self.trainer_id, self.sender
            )
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


_TASK_REPLY = {
    "lease": int,
    "task": int,
    "shard": int,
    "start": int,
    "stop": int,
    "pass": int,
    "attempt": int,
    "timeout": float,
}


class _Leases:
    """What a trainer's reader tells the coordinator about the lease it holds (a task's or
    a window's: both carry `lease`)."""

    def __init__(self, client: CoordinatorClient, request: dict[str, Any]):
        self.client = client
        self.request = request

    def finish(self, lease: TaskLease | WindowLease, samples: int, loss: float | None) -> None:
        self.client.call(Kind.TASK_DONE, {"lease": lease.lease, "samples": samples, "loss": loss})

    def fail(self, lease: TaskLease | WindowLease, reason: str) -> None:
        self.client.call(Kind.TASK_FAILED, {"lease": lease.lease, "reason": reason})

    def release(self, lease: TaskLease | WindowLease) -> None:
        # Given back as a failure the coordinator can count: it cannot tell a trainer that
        # stops early from one that stops because of the task.
        self.client.call(Kind.TASK_FAILED, {"lease": lease.lease, "reason": "its trainer stopped early"})

    def renew(self, lease: TaskLease | WindowLease) -> bool:
        """Keep the lease; False when it is no longer this trainer's."""
        return self.client.call(Kind.TASK_RENEW, {"lease": lease.lease}).text == "renewed"

    def close(self) -> None:
        self.client.close()

    def _ask(self, what: str, done: tuple[str, ...]) -> Message | str:
        """The coordinator's answer to TASK_GET: a TASK message, or one of `done` ("wait", ...)."""
        reply = self.client.call(Kind.TASK_GET, self.request)
        if reply.kind == Kind.NO_TASK and reply.text in done:
            return reply.text
        if reply.kind != Kind.TASK:
            raise Error(
                f"the coordinator answered a {what} request with {reply.kind_name} {reply.text[:200]!r}"
            )
        return reply


class CoordinatorSource(_Leases):
    """Tasks from the job's coordinator."""

    def acquire(self) -> TaskLease | str:
        reply = self._ask("task", ("wait", "finished"))
        if isinstance(reply, str):
            return reply
        f = json_fields(reply.text, _TASK_REPLY)
        if not (0 <= f["start"] <= f["stop"]) or f["timeout"] <= 0:
            raise Error(f"the coordinator sent an invalid task {reply.text!r}")
        return TaskLease(f["lease"], f["task"], f["shard"], f["start"], f["stop"], f["pass"], f["timeout"])


_WINDOW_REPLY = {"lease": int, "window": int, "start": int, "stop": int, "attempt": int, "timeout": float}


class CoordinatorWindows(_Leases):
    """A stream's windows from the job's coordinator. `stop` drains this trainer only:
    it finishes the window in hand, then asks for no more (the job goes on without it)."""

    def __init__(self, client: CoordinatorClient, request: dict[str, Any]):
        super().__init__(client, request)
        self.stopping = False

    def acquire(self) -> WindowLease | str:
        if self.stopping:
            return "stopped"
        reply = self._ask("window", ("wait", "stopped"))
        if isinstance(reply, str):
            return reply
        f = json_fields(reply.text, _WINDOW_REPLY)
        if not (0 <= f["start"] < f["stop"]) or f["timeout"] <= 0:
            raise Error(f"the coordinator sent an invalid window {reply.text!r}")
        return WindowLease(f["lease"], f["window"], f["start"], f["stop"], f["attempt"], f["timeout"])

    def finish(
        self,
        lease: WindowLease,
        samples: int,
        loss: float | None,
        exact: bool = True,
        acked: dict | None = None,
    ) -> None:
        """`exact`: every batch's gradients named their batch (applied exactly once);
        `acked`: what the pservers' acknowledgements said of their checkpoints."""
        checkpoints = {str(p): note for p, note in (acked or {}).items()}
        body = {
            "lease": lease.lease,
            "samples": samples,
            "loss": loss,
            "exact": exact,
            "checkpoints": checkpoints,
        }
        self.client.call(Kind.TASK_DONE, body)

    def stop(self) -> None:
        self.stopping = True
