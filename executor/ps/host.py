"""The pserver loops one process serves, and the gradient queues their blocks share.

The kernels of listen_and_serv, enqueue and dequeue call it (as
fluidps.ops.runtime_api's PserverHost). Each listen_and_serv runs a
ParameterServer loop until its trainers are done; the loops stay listed after
they end, so that their stats can still be read.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from fluidps.errors import TransportError
from fluidps.executor.ps.checkpointer import CheckpointOverrides
from fluidps.executor.ps.parameter_server import ParameterServer
from fluidps.executor.transport.settings import RpcSettings
from fluidps.ir.operator import Operator
from fluidps.ir.program import Block
from fluidps.profiling import Profile

if TYPE_CHECKING:
    from fluidps.executor.block_runner import BlockRunner


class GradientQueue:
    """A pserver's queue of one gradient (async / SSP modes)."""

    def __init__(self) -> None:
        self._items: deque[Any] = deque()
        self._lock = threading.Lock()  # the loop puts, the optimize thread pops

    def put(self, value: Any) -> None:
        with self._lock:
            self._items.append(value)

    def pop(self) -> Any:
        with self._lock:
            if not self._items:
                raise TransportError("dequeue from an empty gradient queue")
            return self._items.popleft()

    def __len__(self) -> int:
        return len(self._items)


class PserverHost:
    def __init__(
        self,
        settings: RpcSettings,
        checkpoints: CheckpointOverrides,
        context_for: Callable[[str], zmq.Context],
        runner_for: Callable[[Block], BlockRunner],
        profile: Profile | None = None,
    ):
        self.settings = settings
        self.profile = profile  # this process's, when it is profiled
        self.checkpoints = checkpoints
        self.context_for = context_for  # the ZeroMQ context to serve an endpoint on
        self.runner_for = runner_for  # a pserver's sub-blocks, built with this process's runtime
        self.queues: dict[str, GradientQueue] = {}
        self.loops: list[ParameterServer] = []  # every loop this process ran, ended ones too
        # Called by each loop with itself between requests, on its thread (fluidps.executor.metrics).
        self.ticks: list[Callable[[ParameterServer], None]] = []

    def queue(self, name: str) -> GradientQueue:
        return self.queues.setdefault(name, GradientQueue())

    def serve(self, op: Operator, env: dict[str, Any]) -> None:
        """Run a pserver loop (listen_and_serv) until every trainer is done."""
        loop = ParameterServer(op, env, self)
        self.loops.append(loop)
        loop.serve()

    def stop(self, reason: str) -> None:
        """Make every loop still serving end (checkpointing first when it has a directory)."""
        for loop in self.loops:
            loop.stop(reason)
