"""CURVE encryption and client allow-lists for fluidps's sockets.

A key directory made by `fluidps keys gen DIR` holds:
    server.key, server.key_secret   the servers' key pair
    client.key, client.key_secret   the clients' key pair
    allowed/client.key              public keys of the clients servers accept
Servers encrypt with their pair and accept only clients whose public key is
in allowed/ (ZeroMQ's authenticator, run on a thread per context). Clients
encrypt with their pair and check the server's public key. Binding anything
but loopback without keys is refused unless explicitly asked for.

A context has one authenticator (it binds a fixed inproc:// address), shared
by every server socket of the context; each key directory is a ZAP domain of
its own, so servers with different keys can share a context.
"""

from __future__ import annotations

import hashlib
import ipaddress
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from fluidps.errors import TransportError
from fluidps.executor.transport.ratelimit import RateLimitedLog
from fluidps.executor.transport.settings import RpcSettings

ALLOWED = "allowed"
# A context's authenticator stopped moments ago frees its address on ZeroMQ's
# I/O thread: starting the next one retries this long.
_RESTART_WAIT = 2.0


def generate_keys(directory: str | Path, overwrite: bool = False) -> Path:
    """Create a key directory (server and client pairs, the client allowed)."""
    directory = Path(directory)
    if (directory / "server.key_secret").exists() and not overwrite:
        raise TransportError(f"{directory} already holds keys; pass overwrite=True (--force) to replace them")
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("server", "client"):
        zmq.auth.create_certificates(directory, name)
    allowed = directory / ALLOWED
    allowed.mkdir(exist_ok=True)
    shutil.copy(directory / "client.key", allowed / "client.key")
    for secret in directory.glob("*.key_secret"):
        secret.chmod(0o600)
    return directory


@dataclass(frozen=True)
class Security:
    """The key directory a process uses."""

    directory: Path

    @classmethod
    def from_dir(cls, directory: str | Path) -> Security:
        directory = Path(directory)
        missing = [
            n
            for n in ("server.key", "server.key_secret", "client.key_secret")
            if not (directory / n).is_file()
        ]
        if missing or not (directory / ALLOWED).is_dir():
            raise TransportError(
                f"{directory} is not a fluidps key directory (missing {', '.join(missing) or ALLOWED + '/'}); "
                f"make one with `fluidps keys gen {directory}`"
            )
        if not zmq.has("curve"):
            raise TransportError("this libzmq was built without CURVE; install a pyzmq wheel with libsodium")
        return cls(directory)

    def _pair(self, name: str) -> tuple[bytes, bytes]:
        public, secret = zmq.auth.load_certificate(self.directory / f"{name}.key_secret")
        return public, secret

    @property
    def domain(self) -> str:
        """The ZAP domain of this key directory's servers."""
        return "fluidps-" + hashlib.sha256(str(self.directory.resolve()).encode()).hexdigest()[:16]

    def apply_server(self, socket: zmq.Socket) -> None:
        public, secret = self._pair("server")
        socket.curve_publickey, socket.curve_secretkey = public, secret
        socket.curve_server = True
        socket.zap_domain = self.domain.encode()

    def apply_client(self, socket: zmq.Socket) -> None:
        public, secret = self._pair("client")
        server_public, _ = zmq.auth.load_certificate(self.directory / "server.key")
        socket.curve_publickey, socket.curve_secretkey = public, secret
        socket.curve_serverkey = server_public

    def start_authenticator(self, context: zmq.Context) -> AuthenticatorUse:
        """Accept CURVE clients whose public key is in allowed/ on servers of `context`
        (with `apply_server`). Call `stop()` on the result when the server closes."""
        with _lock:
            shared = _shared.get(id(context))
            if shared is None or shared.context is not context:
                shared = _shared[id(context)] = _SharedAuthenticator(context, _start(context))
            shared.auth.configure_curve(domain=self.domain, location=str(self.directory / ALLOWED))
            shared.users += 1
        return AuthenticatorUse(shared)


@dataclass
class _SharedAuthenticator:
    context: zmq.Context
    auth: ThreadAuthenticator
    users: int = 0


_lock = threading.Lock()
_shared: dict[int, _SharedAuthenticator] = {}  # id(context) ->


class _RefusalLog:
    """The authenticator's log: its refusals of clients, one line each (rate-limited);
    its chatter about what it allowed, nothing."""

    def __init__(self) -> None:
        self._say = RateLimitedLog(lambda line: print(line, flush=True))

    def debug(self, message: str, *args: object) -> None:
        text = message % args if args else message
        if text.startswith("DENIED"):
            self._say(f"CURVE authenticator refused a client: {text}")

    info = warning = error = exception = debug


def _start(context: zmq.Context) -> ThreadAuthenticator:
    deadline = time.monotonic() + _RESTART_WAIT
    while True:
        auth = ThreadAuthenticator(context, log=_RefusalLog())
        try:
            auth.start()
            return auth
        except zmq.ZMQError as e:
            auth.stop()
            if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise TransportError(f"cannot start the CURVE authenticator: {e}") from None
            time.sleep(0.05)


class AuthenticatorUse:
    """One server's use of its context's authenticator, stopped with the last one."""

    def __init__(self, shared: _SharedAuthenticator):
        self._shared: _SharedAuthenticator | None = shared

    def stop(self) -> None:
        with _lock:
            shared, self._shared = self._shared, None
            if shared is None:
                return
            shared.users -= 1
            if shared.users == 0:
                shared.auth.stop()
                if _shared.get(id(shared.context)) is shared:
                    del _shared[id(shared.context)]


def is_loopback(address: str) -> bool:
    """True for inproc://, ipc:// and tcp:// on a loopback host."""
    if address.startswith(("inproc://", "ipc://")):
        return True
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(address: str, settings: RpcSettings) -> None:
    """Refuse to serve a non-loopback address in the clear, or any address but inproc://
    to whoever connects (no job secret, no CURVE allow-list), unless told to (insecure)."""
    if settings.insecure or address.startswith("inproc://"):
        return
    if settings.security is None and not is_loopback(address):
        raise TransportError(
            f"refusing to serve {address} without encryption: make keys with `fluidps keys gen DIR` "
            "and pass them (--keys DIR / keys_dir=), or bind a loopback address"
        )
    if settings.security is None and settings.secret is None:
        raise TransportError(
            f"refusing to serve {address} without the job's secret: any process that reaches it could "
            "write the job's parameters. fluidps launch and RemoteExecutor give their processes one; "
            "for processes started by hand, make one with `fluidps secret gen FILE` and give every "
            "process of the job FLUIDPS_JOB_SECRET_FILE=FILE (or --secret-file FILE)"
        )
