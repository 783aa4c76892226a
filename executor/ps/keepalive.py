"""A trainer's keepalive: heartbeats to every pserver while the trainer computes.

A trainer only talks to its pservers a few times a step; between those it may
compute for a long while (the first step compiles kernels, an evaluation runs
between epochs). Pservers tell a trainer that is busy from one that is dead or
hung by these heartbeats, sent from a thread of their own every
heartbeat_interval: a dead or stopped (SIGSTOP) process sends none.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import zmq

from fluidps.executor.transport.rpc import connect_dealer
from fluidps.executor.transport.settings import RpcSettings
from fluidps.executor.transport.wire import Kind, Message, encode


class Keepalive:
    def __init__(
        self, settings: RpcSettings, trainer_id: int, sender: int, context_for: Callable[[str], zmq.Context]
    ):
        self.settings = settings
        self.trainer_id, self.sender = trainer_id, sender
        self._context_for = context_for
        self._added: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"keepalive trainer {trainer_id}", daemon=True)
        self._thread.start()

    def add(self, endpoint: str) -> None:
        """Also keep `endpoint` informed (sockets are made on the keepalive's own thread)."""
        self._added.put(endpoint)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        sockets: list[zmq.Socket] = []
        beat = encode(
            Message(Kind.HEARTBEAT, trainer_id=self.trainer_id, sender=self.sender), self.settings.secret
        )
        try:
            while True:
                while not self._added.empty():
                    endpoint = self._added.get()
                    sockets.append(connect_dealer(self._context_for(endpoint), endpoint, self.settings, "k"))
                for socket in sockets:
                    try:
                        socket.send_multipart(beat, zmq.NOBLOCK)
                        while socket.poll(0):
                            socket.recv_multipart(zmq.NOBLOCK)  # the server's answer says nothing new
                    except zmq.ZMQError:
                        pass  # a full queue or a peer gone: the pserver's own timeout tells
                if self._stop.wait(self.settings.heartbeat_interval):
                    return
        finally:
            for socket in sockets:
                socket.close(linger=0)
