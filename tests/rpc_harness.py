"""Test harness for the transport: RpcServers answered on threads, clients, raw sockets.

Every wait is bounded, every thread joined and every socket closed (`Net.close`).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

import zmq

from fluidps.endpoints import pick_free_ports, zmq_address
from fluidps.executor.transport.proof import JobSecret
from fluidps.executor.transport.rpc import Request, RpcClient, RpcServer
from fluidps.executor.transport.settings import RpcSettings
from fluidps.executor.transport.wire import Kind, Message, decode

TRANSPORTS = ["tcp", "ipc", "inproc"]
# Alive peers get a generous timeout (a loaded machine must not look dead). Tests of
# dead peers use a small peer timeout and a request timeout LONG on purpose: which
# error surfaces (PeerLostError, not "did not answer ... within") tells which one fired.
LONG = 120.0
# Every server of these tests belongs to a job: its messages prove this secret.
SECRET = JobSecret.generate()
FAST = RpcSettings(
    heartbeat_interval=0.1, peer_timeout=10.0, request_timeout=30.0, retry_after=0.3, secret=SECRET
)
DEAD = FAST.with_(peer_timeout=1.0, request_timeout=LONG)
# A hang guard, not a speed claim: a wait that an event (a dead peer, a wake) should
# end must end well before the LONG timeout it would otherwise run into.
NOT_HUNG = LONG / 2


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (fluidps.endpoints.pick_free_ports; a race remains)."""
    return pick_free_ports("127.0.0.1", 1)[0]


def echo(request: Request) -> Message:
    return Message(Kind.VALUES, tensors=dict(request.msg.tensors), text=request.msg.text)


class Harness:
    """An RpcServer answered on a thread. `handler` returns the reply, or None to hold
    the request (a barrier that never opens); with `delay`, replies go that many
    seconds late (heartbeats are answered meanwhile). `pause()` stops answering
    anything, heartbeats included, but keeps the socket: a hung server."""

    def __init__(
        self, server: RpcServer, handler: Callable[[Request], Message | None] = echo, delay: float = 0.0
    ):
        self.server, self.handler, self.delay = server, handler, delay
        self.delivered: list[Message] = []
        self.held: list[Request] = []
        self._late: list[tuple[float, Request, Message]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"harness {server.address}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            for request in self.server.receive(0.02):
                self.delivered.append(request.msg)
                reply = self.handler(request)
                if reply is None:
                    self.held.append(request)
                else:
                    self._late.append((time.monotonic() + self.delay, request, reply))
            now = time.monotonic()
            for item in [item for item in self._late if item[0] <= now]:
                self._late.remove(item)
                self.server.reply(item[1], item[2])

    def pause(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        assert not self._thread.is_alive()

    def close(self) -> None:
        self.pause()
        self.server.close()


class Net:
    """Makes servers, harnesses and clients on one context; `close()` stops them all."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.harnesses: list[Harness] = []
        self.servers: list[RpcServer] = []
        self.sockets: list[RpcClient | zmq.Socket] = []

    def server(self, endpoint: str, settings: RpcSettings = FAST, name: str = "test server") -> RpcServer:
        server = RpcServer(self.context, endpoint, name, settings)
        self.servers.append(server)
        return server

    def serve(self, endpoint: str, settings: RpcSettings = FAST, handler=echo, delay=0.0) -> Harness:
        harness = Harness(self.server(endpoint, settings), handler, delay)
        self.harnesses.append(harness)
        return harness

    def client(self, endpoint: str, settings: RpcSettings = FAST, peer: str = "test server") -> RpcClient:
        client = RpcClient(self.context, endpoint, peer, settings, trainer_id=0)
        self.sockets.append(client)
        return client

    def raw(self, endpoint: str) -> zmq.Socket:
        """A bare DEALER: sends whatever frames a test wants."""
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(zmq_address(endpoint))
        self.sockets.append(dealer)
        return dealer

    def close(self) -> None:
        for harness in self.harnesses:
            harness.pause()
        for item in [*self.sockets, *self.servers]:
            item.close()
        self.context.destroy(linger=0)


def endpoint_for(kind: str, tmp_path) -> str:
    if kind == "tcp":
        return f"tcp://127.0.0.1:{free_port()}"
    if kind == "ipc":
        return f"ipc://{tmp_path}/rpc-{uuid.uuid4().hex[:8]}.sock"
    return f"inproc://rpc-{uuid.uuid4().hex}"


def recv(dealer: zmq.Socket, timeout: float = 10.0, secret: JobSecret | None = SECRET) -> Message:
    """The next message on a raw DEALER, checked with `secret` (None: an unsigned refusal)."""
    assert dealer.poll(int(timeout * 1000)), "no reply within the bound"
    return decode(dealer.recv_multipart(copy=False), secret)


def signed(frames: list) -> list:
    """`frames` with frame 0 proven with the tests' secret, whatever it holds."""
    head = bytes(frames[0])
    return [SECRET.tag(head) + head, *frames[1:]]


def lose_requests(server: RpcServer, lose: Callable[[Request], bool]) -> list[int]:
    """From now on, requests for which `lose(request)` holds vanish on the way to `server`
    (as in a reconnect): the client resends them. The ids of those lost, as they go."""
    accept, lost = server._accept, []

    def accept_or_lose(frames):
        request = accept(frames)
        if request is not None and lose(request):
            lost.append(request.msg.request_id)
            server.peers.connections[request.client].pending.discard(request.msg.request_id)
            return None
        return request

    server._accept = accept_or_lose
    return lost


def receive_until(server: RpcServer, done: Callable[[], bool], timeout: float = 10.0) -> list[Request]:
    """Serve by hand (no thread) until `done()`; the requests handed out on the way."""
    deadline = time.monotonic() + timeout
    requests: list[Request] = []
    while not done():
        assert time.monotonic() < deadline, "the condition did not come true within the bound"
        requests += server.receive(0.02)
    return requests
