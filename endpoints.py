"""Endpoints: what an address of a pserver or server may look like, and free ports.

The one place that checks, formats and picks them; the transpiler, the environment
contract, the launcher, the RemoteExecutor and the transport all use it. An endpoint is

  host:port         a TCP address. The host is a name, an IPv4 address or an IPv6 address
                    in brackets ([::1]:6170); the port is plain ASCII digits, 1..65535
  tcp://host:port   the same, spelled as a ZeroMQ address
  ipc://path        a Unix domain socket (ZeroMQ)
  inproc://name     a queue inside one process (ZeroMQ)

A list of endpoints is comma-separated text (Paddle's PADDLE_PSERVERS_IP_PORT_LIST) or
a sequence; surrounding whitespace is dropped, an empty item (a stray comma) is an
error, and no endpoint may repeat: each pserver needs its own.

Standard library only (and fluidps.errors): the transpiler uses it, and it never
needs ZeroMQ.

May import: fluidps.errors
"""

from __future__ import annotations

import re
import socket
from collections.abc import Sequence

from fluidps.errors import BuilderError, TransportError

SCHEMES = ("tcp://", "ipc://", "inproc://")
FORMS = "host:port (an IPv6 host in brackets: [::1]:6170) or a tcp://, ipc:// or inproc:// address"
_LIST_HINT = f"endpoints, comma-separated, each {FORMS}; e.g. 127.0.0.1:6170,127.0.0.1:6171"

# int() would also take "+3", "1_000" or "٣" (and refuses 5,000 digits): a port is a few ASCII digits.
_PORT = re.compile(r"[0-9]{1,5}")
# No host name or IP address holds these; brackets only enclose a whole IPv6 address.
_NOT_IN_HOST = re.compile(r"[\s/,\[\]]")


def _host_port_problem(text: str, lowest_port: int) -> str | None:
    """Why `text` is not host:port with a port from `lowest_port` to 65535, or None."""
    host, sep, port = text.rpartition(":")
    if not sep:
        return "it is not host:port: it has no port"
    if not host:
        return "it is not host:port: the host is empty"
    if not _PORT.fullmatch(port) or not lowest_port <= int(port) <= 65535:
        return f"its port {port!r} is not a number from {lowest_port} to 65535"
    bracketed = len(host) > 2 and host[0] == "[" and host[-1] == "]"
    if _NOT_IN_HOST.search(host[1:-1] if bracketed else host):
        return f"its host {host!r} is not a name, an IPv4 address or an IPv6 address in brackets like [::1]"
    if not bracketed and ":" in host:
        # rpartition took the last ':' for the port's, which an IPv6 address may not mean.
        return f"an IPv6 host needs brackets, so its port is unambiguous: [{host}]:{port}"
    return None


def _problem(endpoint: str, lowest_port: int) -> str | None:
    """Why `endpoint` is none of the forms above, or None."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return _host_port_problem(endpoint, lowest_port)
    if f"{scheme}://" not in SCHEMES:
        return f"{scheme}:// is not a scheme fluidps speaks (tcp://, ipc://, inproc://)"
    if not rest:
        return f"nothing follows {scheme}://"
    return _host_port_problem(rest, lowest_port) if scheme == "tcp" else None


def parse_endpoints(value: str | Sequence[str], source: str = "pservers") -> tuple[str, ...]:
    """Comma-separated text (or a sequence) -> its endpoints, in order, each checked, none
    repeated. Errors are BuilderErrors that start with `source` (what the value came from:
    an argument, an environment variable) and name the bad item."""
    items = value.split(",") if isinstance(value, str) else list(value)
    if all(isinstance(item, str) and not item.strip() for item in items):
        raise BuilderError(f"{source} is empty: it should hold {_LIST_HINT}")
    endpoints: list[str] = []
    for n, item in enumerate(items, 1):
        if not isinstance(item, str):
            raise BuilderError(
                f"{source} has a bad endpoint {item!r} (item {n}): it should hold {_LIST_HINT}"
            )
        endpoint = item.strip()
        problem = _problem(endpoint, lowest_port=1) if endpoint else "it is empty (a stray comma?)"
        if problem is not None:
            raise BuilderError(
                f"{source} has a bad endpoint {endpoint!r} (item {n}): {problem}; it should hold {_LIST_HINT}"
            )
        if endpoint in endpoints:
            raise BuilderError(
                f"{source} lists {endpoint} twice: endpoints must not repeat, each pserver needs its own"
            )
        endpoints.append(endpoint)
    return tuple(endpoints)


def format_endpoint(host: str, port: int) -> str:
    """host:port, with an IPv6 literal bracketed so the port stays unambiguous."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def zmq_address(endpoint: str) -> str:
    """The ZeroMQ address of an endpoint: 'host:port' -> 'tcp://host:port' (localhost ->
    127.0.0.1); tcp://, ipc:// and inproc:// addresses pass through as they are. Port 0 is
    allowed: a server binding it gets a free port from ZeroMQ. Raises TransportError."""
    if endpoint.startswith(SCHEMES):
        problem = None if endpoint.partition("://")[2] else "nothing follows the scheme"
    else:
        problem = _problem(endpoint, lowest_port=0)
    if problem is not None:
        raise TransportError(
            f"endpoint {endpoint!r} is neither host:port nor a tcp://, ipc:// or inproc:// address: {problem}"
        )
    if endpoint.startswith(SCHEMES):
        return endpoint
    host, _, port = endpoint.rpartition(":")
    return f"tcp://{'127.0.0.1' if host == 'localhost' else host}:{port}"


def pick_free_ports(host: str, count: int, start: int | None = None) -> list[int]:
    """`count` distinct TCP ports free on `host`: start, start + 1, ... when given, else any.

    Only for ports that must be known before their server starts: a pserver loop's
    endpoint is written into the transpiled programs (and PADDLE_PSERVERS_IP_PORT_LIST)
    before any pserver runs. Servers that can announce where they listen (executor
    servers, a RemoteExecutor's coordinator) bind port 0 instead and report the port
    ZeroMQ picked, with no race.

    The race that remains: the ports are checked by binding them all at once (so they
    are distinct) and released right away for the pservers to bind. Another program may
    take one in between; that pserver then fails to start with "cannot listen on <address>"
    (fluidps.executor.transport.rpc.RpcServer). A taken port here is a BuilderError.
    """
    if start is not None and not 1 <= start <= 65536 - count:
        raise BuilderError(
            f"start port {start} is invalid: ports {start}..{start + count - 1} must be 1..65535"
        )
    try:
        family = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][0]
    except (socket.gaierror, UnicodeError) as e:
        raise BuilderError(f"host {host!r} cannot be resolved: {e}") from None
    socks: list[socket.socket] = []
    try:
        for i in range(count):
            port = 0 if start is None else start + i
            s = socket.socket(family, socket.SOCK_STREAM)
            socks.append(s)
            # As ZeroMQ's listeners do, so a port left in TIME_WAIT by an earlier job counts as free.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                where = f"port {port} on {host}" if port else f"a port on {host}"
                raise BuilderError(f"cannot bind {where}: {e.strerror or e}") from None
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_endpoints(host: str, count: int) -> list[str]:
    """`count` distinct host:port endpoints free on `host` now (see pick_free_ports for the race)."""
    return [format_endpoint(host, port) for port in pick_free_ports(host, count)]
