"""Request / reply over ZeroMQ ROUTER (servers) and DEALER (clients) sockets.

Every wait is bounded. A client waiting for a reply pings the server with
application heartbeats; a server that says nothing for longer than its
allowance (`peer_timeout`, stretched for a slow server: liveness.py) is
reported dead by name. Requests carry ids: a server answers a
repeated id from its reply cache instead of running it again, so a client
may resend a request the server says it does not hold (lost on a
reconnect). Replies carry the server's incarnation, drawn at random when it
starts: a client noticing a change knows the server restarted and lost its
state. ZeroMQ's own heartbeats run underneath to drop dead connections.
"""

from __future__ import annotations

import contextlib
import functools
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from fluidps.endpoints import zmq_address
from fluidps.errors import (
    PeerLostError,
    PeerRestartedError,
    RemoteError,
    TransportError,
    UnprovenMessageError,
    WireError,
)
from fluidps.executor.transport.liveness import SilenceClock
from fluidps.executor.transport.peers import Peers
from fluidps.executor.transport.ratelimit import RateLimitedLog
from fluidps.executor.transport.security import check_bind
from fluidps.executor.transport.settings import RpcSettings
from fluidps.executor.transport.wire import Kind, Message, decode, encode
from fluidps.profiling import Profile

# A socket closed in this process releases its TCP port moments later, on ZeroMQ's
# I/O thread: a server rebinding the port (restarted in-process) retries this long.
_REBIND_WAIT = 2.0
# Frames sent with copy=False are still copied below this size. A frame sent without a
# copy is let go on pyzmq's garbage-collector thread, which must take the GIL from the
# thread that computes or serves; on a parameter server's 100 KiB messages that costs
# more than the copy (about 3% of a CTR step with a distributed table).
_COPY_BELOW = 1 << 20


def _common_options(socket: zmq.Socket, settings: RpcSettings) -> None:
    socket.copy_threshold = _COPY_BELOW
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, settings.message_limit)
    ivl = max(int(settings.heartbeat_interval * 1000), 100)
    socket.setsockopt(zmq.HEARTBEAT_IVL, ivl)
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(settings.peer_timeout * 1000))
    socket.setsockopt(zmq.HEARTBEAT_TTL, int(settings.peer_timeout * 1000))


def connect_dealer(context: zmq.Context, endpoint: str, settings: RpcSettings, tag: str) -> zmq.Socket:
    """A DEALER connected to `endpoint`, encrypted when the settings have keys."""
    socket = context.socket(zmq.DEALER)
    _common_options(socket, settings)
    # A fixed routing id lets the server route replies across reconnects.
    socket.setsockopt(zmq.ROUTING_ID, f"{tag}-{secrets.token_hex(6)}".encode())
    address = zmq_address(endpoint)
    # inproc:// never leaves the process: nothing to encrypt.
    if settings.security is not None and not address.startswith("inproc://"):
        settings.security.apply_client(socket)
    socket.connect(address)
    return socket


def _timed(profile: Profile | None, category: str, work: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`work`, adding its time to `category` of `profile` (`work` itself without one)."""
    if profile is None:
        return work

    def timed(arg: Any) -> Any:
        with profile.span(category):
            return work(arg)

    return timed


# A server has done a step (compiled its kernels: see liveness) once it answered one of these.
WARMING_KINDS = frozenset({Kind.SEND, Kind.RUN, Kind.TASK_DONE})


class RpcClient:
    """A DEALER connected to one server; `peer` names it in errors."""

    def __init__(
        self,
        context: zmq.Context,
        endpoint: str,
        peer: str,
        settings: RpcSettings,
        trainer_id: int = -1,
        sender: int = 0,
        profile: Profile | None = None,
        replaces: int = 0,
    ):
        self.endpoint = endpoint
        # Signed and checked with the job's secret; timed in a profiled process.
        self._encode = _timed(profile, "serialize", functools.partial(encode, secret=settings.secret))
        self._decode = _timed(profile, "deserialize", functools.partial(decode, secret=settings.secret))
        self.peer = peer
        self.settings = settings
        self.trainer_id = trainer_id
        self.sender = sender  # this process's incarnation, stamped on every message
        self.replaces = replaces  # a trainer's: the incarnation of its id it replaces (see Membership)
        self.incarnation = 0
        self.lost = False  # it went silent once: talking to it again would only wait again
        self._socket = connect_dealer(context, endpoint, settings, f"c{trainer_id}")
        self._next_id = 1
        self._sent: dict[int, tuple[list[Any], float, int]] = {}  # id -> (frames, sent at, kind)
        self._replies: dict[int, Message] = {}
        self.silence = SilenceClock(settings.peer_timeout, settings.warmup_timeout, time.monotonic())
        self._last_ping = 0.0

    def request(self, msg: Message) -> int:
        """Send `msg` without waiting; returns its request id."""
        rid = self._next_id
        self._next_id += 1
        msg.request_id, msg.incarnation = rid, self.incarnation
        if msg.trainer_id < 0:
            msg.trainer_id = self.trainer_id
        msg.sender = msg.sender or self.sender
        msg.replaces = msg.replaces or self.replaces
        frames = self._encode(msg)
        # Not sent (no peer to queue it for): sent at 0, so it goes as soon as a server answers.
        sent = self._send(frames)
        self._sent[rid] = (frames, time.monotonic() if sent else 0.0, msg.kind)
        return rid

    def _send(self, frames: list[Any]) -> bool:
        """Queue `frames` without blocking. A DEALER with no peer (an inproc:// server
        that closed: inproc never reconnects) or a full queue would block forever;
        then the message is not sent and the peer timeout tells."""
        try:
            self._socket.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    def wait(self, rid: int, timeout: float | None = None, warming: bool | None = None) -> Message:
        """The reply to request `rid`; raises if the server errs, dies or takes too long.
        `warming`: as for poll."""
        limit = self.settings.request_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        self.begin_wait()
        try:
            while (reply := self.poll(rid, self.settings.heartbeat_interval, warming)) is None:
                if time.monotonic() > deadline:
                    kind = Kind.Name(self._sent[rid][2]) if rid in self._sent else "?"
                    raise TransportError(
                        f"{self.peer} ({self.endpoint}) did not answer {kind} within {limit:g} s"
                    )
        except TransportError:
            self.forget(rid)
            raise
        return reply

    def forget(self, rid: int) -> None:
        """Give up on request `rid`: it is not resent any more, a late reply is dropped."""
        self._sent.pop(rid, None)
        self._replies.pop(rid, None)

    def begin_wait(self) -> None:
        """Start counting the server's silence now: between waits nobody pings it."""
        self.silence.restart(time.monotonic())

    def poll(self, rid: int, timeout: float, warming: bool | None = None) -> Message | None:
        """Wait at most `timeout` seconds for the reply to `rid`: the reply, or None.
        Pings the server while waiting and raises PeerLostError once it has been
        silent for longer than its allowance (counted from `begin_wait`; the peer
        timeout, stretched as fluidps.executor.transport.liveness says), RemoteError
        if it erred. `warming`: whether the server may still be starting (its warm-up
        allowance applies); None: as the request's kind says (WARMING_KINDS)."""
        if rid not in self._replies:
            now = time.monotonic()
            first_step = (
                warming if warming is not None else rid in self._sent and self._sent[rid][2] in WARMING_KINDS
            )
            if self.silence.expired(now, first_step):
                self._drain()  # what arrived while this thread was busy counts before any silence
            if rid not in self._replies and self.silence.expired(now, first_step):
                self.lost = True
                raise PeerLostError(
                    f"{self.peer} ({self.endpoint}) has not answered for {self.silence.silent_for(now):.1f} s "
                    f"(allowed {self.silence.allowance(first_step):.1f} s): it is down or unreachable"
                )
            if (report := self.silence.stretch_report()) is not None:
                print(f"{self.peer} ({self.endpoint}): {report}", flush=True)
            if now - self._last_ping >= self.settings.heartbeat_interval:
                ping = Message(Kind.HEARTBEAT, trainer_id=self.trainer_id, sender=self.sender)
                self._send(encode(ping, self.settings.secret))
                self._last_ping = now
            if rid not in self._replies and self._socket.poll(
                int(min(timeout, self.settings.heartbeat_interval) * 1000)
            ):
                self._drain()
            if rid not in self._replies:
                return None
        self._sent.pop(rid, None)
        reply = self._replies.pop(rid)
        if reply.kind == Kind.ERROR:
            raise RemoteError(f"{self.peer} ({self.endpoint}): {reply.text}")
        return reply

    def call(self, msg: Message, timeout: float | None = None) -> Message:
        return self.wait(self.request(msg), timeout)

    def _drain(self) -> None:
        while True:
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.silence.heard(time.monotonic())
            try:
                reply = self._decode(frames)
            except UnprovenMessageError:
                raise TransportError(
                    f"{self.peer} ({self.endpoint}) answered without this job's proof: it was started "
                    f"for another job, or with another secret{_refusal(frames)}"
                ) from None
            except WireError as e:
                raise TransportError(f"{self.peer} ({self.endpoint}) sent a malformed message: {e}") from None
            self._check_incarnation(reply)
            if reply.kind == Kind.HEARTBEAT:
                self._resend_lost(set(reply.pending))
            elif reply.request_id in self._sent:
                self._replies[reply.request_id] = reply
                if self._sent[reply.request_id][2] in WARMING_KINDS:
                    self.silence.warm = True  # it has done a step: its kernels are compiled

    def _check_incarnation(self, reply: Message) -> None:
        if not reply.incarnation:
            return
        if self.incarnation and reply.incarnation != self.incarnation:
            raise PeerRestartedError(
                f"{self.peer} ({self.endpoint}) restarted (incarnation {self.incarnation:x} -> "
                f"{reply.incarnation:x}); the state it held for this job is gone"
            )
        self.incarnation = reply.incarnation

    def _resend_lost(self, pending: set[int]) -> None:
        """Resend requests the server does not hold. Either the request was lost (a
        reconnect) or its reply was: the server answered it (it lists those in the
        heartbeat's names), but replies come in order, before this heartbeat, so one
        not here never arrives. The server answers a repeat from its reply cache."""
        now = time.monotonic()
        for rid, (frames, sent, kind) in list(self._sent.items()):
            if rid in pending or rid in self._replies:
                continue
            if now - sent >= self.settings.retry_after and self._send(frames):
                self._sent[rid] = (frames, now, kind)

    def close(self) -> None:
        self._socket.close(linger=0)


def _refusal(frames: list[Any]) -> str:
    """What an unsigned answer says, when it is a server's refusal (its own words)."""
    try:
        reply = decode(frames)
    except WireError:
        return ""
    return f" (it said: {reply.text[:300]})" if reply.kind == Kind.ERROR and reply.text else ""


def wait_all(pending: dict[Any, tuple[RpcClient, int]], timeout: float | None = None) -> dict[Any, Message]:
    """Wait for several requests at once: {key: (client, request id)} -> {key: reply}.
    Any server that errs or goes silent raises at once, not after the others answer."""
    if not pending:
        return {}
    settings = next(iter(pending.values()))[0].settings
    limit = settings.request_timeout if timeout is None else timeout
    deadline = time.monotonic() + limit
    for client, _ in pending.values():
        client.begin_wait()
    poller = zmq.Poller()
    for client, _ in pending.values():
        poller.register(client._socket, zmq.POLLIN)
    replies: dict[Any, Message] = {}
    try:
        while True:
            for key, (client, rid) in pending.items():
                # poll(rid, 0) drains what arrived, pings when due and checks liveness.
                if key not in replies and (reply := client.poll(rid, 0)) is not None:
                    replies[key] = reply
            if len(replies) == len(pending):
                break
            if time.monotonic() > deadline:
                silent = [c.peer for k, (c, _) in pending.items() if k not in replies]
                raise TransportError(f"{', '.join(silent)} did not answer within {limit:g} s")
            poller.poll(int(settings.heartbeat_interval * 1000))
    except TransportError:
        for client, rid in pending.values():  # the caller gives up on all of them
            client.forget(rid)
        raise
    return replies


@dataclass
class Request:
    client: bytes
    msg: Message


class Waker:
    """Lets other threads end a server loop's wait (`RpcServer.receive(..., wake=waker.socket)`):
    an inproc PULL the loop polls, fed by one PUSH that `wake` (thread-safe) writes to."""

    def __init__(self, context: zmq.Context):
        address = f"inproc://wake-{secrets.token_hex(8)}"
        self.socket = context.socket(zmq.PULL)
        self.socket.bind(address)
        self._push = context.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 1)  # one pending wake says it all
        self._push.connect(address)
        self._lock = threading.Lock()

    def wake(self) -> None:
        with self._lock, contextlib.suppress(zmq.Again):  # Again: a wake is already pending
            if not self._push.closed:  # (a thread outliving the loop wakes nothing)
                self._push.send(b"", zmq.NOBLOCK)

    def close(self) -> None:
        with self._lock:
            self._push.close(linger=0)
        self.socket.close(linger=0)


class RpcServer:
    """A ROUTER bound to one address. `receive` hands out checked requests; the
    caller answers each with `reply` / `error`, now or later."""

    def __init__(
        self,
        context: zmq.Context,
        endpoint: str,
        name: str,
        settings: RpcSettings,
        profile: Profile | None = None,
    ):
        self.name = name
        # Signed and checked with the job's secret; timed in a profiled process.
        self._encode = _timed(profile, "serialize", functools.partial(encode, secret=settings.secret))
        self._decode = _timed(profile, "deserialize", functools.partial(decode, secret=settings.secret))
        self.settings = settings
        self.address = zmq_address(endpoint)
        check_bind(self.address, settings)
        self.incarnation = secrets.randbits(63) | 1
        self.rejected = 0
        self.unproven = 0  # messages refused for want of the job's proof (counted in rejected too)
        self.log_rejected = RateLimitedLog(lambda line: print(f"{name}: {line}", flush=True))
        self._socket = context.socket(zmq.ROUTER)
        _common_options(self._socket, settings)
        self._socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._auth = None
        if settings.security is not None and not self.address.startswith("inproc://"):
            try:
                self._auth = settings.security.start_authenticator(context)
                settings.security.apply_server(self._socket)
            except BaseException:
                self.close()  # an open socket would hang the context's term()
                raise
        deadline = time.monotonic() + _REBIND_WAIT
        while True:
            try:
                self._socket.bind(self.address)
                break
            except zmq.ZMQError as e:
                if e.errno == zmq.EADDRINUSE and time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                self.close()
                raise TransportError(f"{name} cannot listen on {self.address}: {e}") from None
        # Port 0 binds any free port: from here on, the address is the one ZeroMQ picked.
        self.address = self._socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        # Per connection: requests held and replies sent; per tracked trainer incarnation:
        # its silence. Bounded, and dropped once silent (peers.py).
        self.peers = Peers(settings)
        self._poller: tuple[zmq.Socket, zmq.Poller] | None = None  # (wake socket, poller of both)

    def receive(self, timeout: float, wake: zmq.Socket | None = None) -> list[Request]:
        """Requests that arrived within `timeout` seconds; heartbeats, repeats and
        malformed messages are handled here and not returned. A message on `wake`
        (another thread saying it has something to send) ends the wait early."""
        requests: list[Request] = []
        if wake is None:
            ready = self._socket.poll(int(timeout * 1000))
        else:
            if self._poller is None or self._poller[0] is not wake:
                poller = zmq.Poller()
                poller.register(self._socket, zmq.POLLIN)
                poller.register(wake, zmq.POLLIN)
                self._poller = (wake, poller)
            events = dict(self._poller[1].poll(int(timeout * 1000)))
            while wake in events:
                try:
                    wake.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
            ready = self._socket in events
        self.peers.prune(time.monotonic())
        if not ready:
            return requests
        while True:
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return requests
            request = self._accept(frames)
            if request is not None:
                requests.append(request)

    def _accept(self, frames: list[Any]) -> Request | None:
        client, body = bytes(frames[0].buffer if hasattr(frames[0], "buffer") else frames[0]), frames[1:]
        try:
            msg = self._decode(body)
        except UnprovenMessageError:
            # Nothing of it is read, and nothing is kept of its sender. The answer goes
            # unsigned: it is for a process without the secret.
            self.rejected += 1
            self.unproven += 1
            self.log_rejected(f"refused a message without this job's proof from client {client.hex()}")
            refusal = Message(Kind.ERROR, text=f"{self.name} refused a message without this job's proof")
            self._socket.send_multipart([client, *encode(refusal)], copy=False)
            return None
        except WireError as e:
            self.rejected += 1
            self.log_rejected(f"rejected a malformed message from client {client.hex()}: {e}")
            self._send(client, Message(Kind.ERROR, text=f"{self.name} rejected a malformed message: {e}"))
            return None
        now = time.monotonic()
        if msg.trainer_id >= 0:
            self.peers.heard((msg.trainer_id, msg.sender), now)
        # A heartbeat alone leaves nothing behind: only a request makes a connection's state.
        state = self.peers.connection(client, now, create=msg.kind != Kind.HEARTBEAT)
        if msg.kind == Kind.HEARTBEAT:
            pending, answered = (
                (sorted(state.pending), [str(r) for r in state.replies]) if state else ([], [])
            )
            self._send(client, Message(Kind.HEARTBEAT, pending=pending, names=answered))
            return None
        if msg.incarnation and msg.incarnation != self.incarnation:
            self._send(
                client,
                Message(
                    Kind.ERROR,
                    request_id=msg.request_id,
                    text=f"{self.name} restarted since this client last spoke to it (stale incarnation)",
                ),
            )
            return None
        if msg.request_id in state.replies:
            self._socket.send_multipart([client, *state.replies[msg.request_id][2]], copy=False)
            return None
        if msg.request_id in state.pending:
            return None
        state.pending.add(msg.request_id)
        return Request(client, msg)

    def track(self, key: tuple[int, int]) -> None:
        """Keep the clock of trainer incarnation `key` = (trainer id, sender): one the
        owner admitted (a server keeps none for whoever else speaks)."""
        self.peers.track(key, time.monotonic())

    def untrack(self, key: tuple[int, int]) -> None:
        self.peers.untrack(key)

    def clock(self, key: tuple[int, int]) -> SilenceClock | None:
        """The silence of tracked incarnation `key`: when any message of it last came
        (heartbeats included), and the gaps between them; None when not tracked."""
        return self.peers.clocks.get(key)

    def reply(self, request: Request, msg: Message | None = None) -> None:
        msg = msg or Message(Kind.OK)
        msg.request_id = request.msg.request_id
        frames = self._send(request.client, msg)
        self.peers.cache(request.client, msg.request_id, frames, time.monotonic())

    def error(self, request: Request, text: str) -> None:
        self.reply(request, Message(Kind.ERROR, text=text))

    def _send(self, client: bytes, msg: Message) -> list[Any]:
        msg.incarnation = self.incarnation
        frames = self._encode(msg)
        self._socket.send_multipart([client, *frames], copy=False)
        return frames

    def close(self, linger_s: float = 0.0) -> None:
        """Close the socket; replies still queued get up to `linger_s` seconds to leave."""
        self._socket.close(linger=int(linger_s * 1000))
        if self._auth is not None:
            self._auth.stop()
