"""fluidps.endpoints: the one parser, formatter and free-port picker for endpoints.

The tables hold every rule of the implementations it replaced (the transpiler's
parse_endpoints, the environment contract's, and rpc's zmq_address), marked where a
rule is new.
"""

from __future__ import annotations

import socket

import pytest

from fluidps.endpoints import (
    format_endpoint,
    free_endpoints,
    parse_endpoints,
    pick_free_ports,
    zmq_address,
)
from fluidps.errors import BuilderError, TransportError

# -- parse_endpoints -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "endpoints"),
    [
        ("127.0.0.1:6170", ("127.0.0.1:6170",)),
        ("127.0.0.1:6170,127.0.0.1:6171", ("127.0.0.1:6170", "127.0.0.1:6171")),
        (" a:1 , b:2 ", ("a:1", "b:2")),  # whitespace around items is dropped
        (["a:1", " b:65535 "], ("a:1", "b:65535")),  # a sequence, not only text
        (("ps-0.ps.default.svc:6174",), ("ps-0.ps.default.svc:6174",)),
        ("localhost:1", ("localhost:1",)),
        ("[::1]:6170,[fe80::1%eth0]:6170", ("[::1]:6170", "[fe80::1%eth0]:6170")),  # IPv6 in brackets
        ("tcp://10.0.0.1:6170,tcp://[::1]:1", ("tcp://10.0.0.1:6170", "tcp://[::1]:1")),
        ("ipc:///tmp/ps.sock,inproc://ps0", ("ipc:///tmp/ps.sock", "inproc://ps0")),
    ],
)
def test_accepted(value, endpoints):
    assert parse_endpoints(value) == endpoints


@pytest.mark.parametrize(
    ("value", "hint"),
    [
        # nothing at all
        ("", "is empty"),
        (" , ", "is empty"),
        ([], "is empty"),
        # an empty item: an error naming it (the transpiler used to drop it)
        ("a:1,", "bad endpoint '' (item 2): it is empty (a stray comma?)"),
        (",a:1", "bad endpoint '' (item 1)"),
        # host:port
        ("a", "'a' (item 1): it is not host:port: it has no port"),
        ("localhost", "is not host:port"),
        (":80", "the host is empty"),
        ("a:", "port '' is not a number from 1 to 65535"),
        ("a:http", "port 'http'"),
        ("a:0", "port '0'"),
        ("a:65536", "port '65536'"),
        ("a:-1", "port '-1'"),
        ("a:+1", "port '+1'"),  # int() would take these three
        ("a:1_0", "port '1_0'"),
        ("a:\u0663", "port '\u0663'"),  # an Arabic-Indic 3 (str.isdigit() says yes)
        ("a:" + "6" * 5000, "port '666"),  # int() would raise ValueError on this one
        ("a:065535", "port '065535'"),
        # hosts
        ("[:80", "host '['"),
        ("[]:80", "host '[]'"),
        ("[::1:80", "host '[::1'"),
        ("::1]:80", "host '::1]'"),
        ("[[::1]]:80", "host '[[::1]]'"),
        ("a b:1", "host 'a b'"),
        ("a/b:1", "host 'a/b'"),
        (["a:1,b:2"], "host 'a:1,b'"),  # one item of a list holds one endpoint
        ("::1:6170", "an IPv6 host needs brackets, so its port is unambiguous: [::1]:6170"),
        ("fe80::1:6170", "[fe80::1]:6170"),
        # ZeroMQ addresses
        ("udp://h:1", "udp:// is not a scheme fluidps speaks"),
        ("epgm://eth0;239.1.1.1:5555", "epgm://"),
        ("tcp://", "nothing follows tcp://"),
        ("ipc://", "nothing follows ipc://"),
        ("inproc://", "nothing follows inproc://"),
        ("tcp://h", "it has no port"),  # tcp:// is checked like host:port
        ("tcp://h:0", "port '0'"),
        ("tcp://::1:5", "[::1]:5"),
        # not text
        (["a:1", 5], "bad endpoint 5 (item 2)"),
        # repeats
        ("a:1,a:1", "lists a:1 twice: endpoints must not repeat"),
        (" a:1, a:1 ", "lists a:1 twice"),
    ],
)
def test_rejected_naming_the_source_and_item(value, hint):
    with pytest.raises(BuilderError) as e:
        parse_endpoints(value, source="MY_VAR")
    message = str(e.value)
    assert message.startswith("MY_VAR ") and hint in message and "\n" not in message, message


def test_errors_say_what_to_write():
    with pytest.raises(BuilderError, match="it should hold endpoints, comma-separated, each host:port"):
        parse_endpoints("nope")
    with pytest.raises(BuilderError, match=r"^pservers "):  # the default source: the transpiler's argument
        parse_endpoints("a:1,a:1")


# -- format_endpoint -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "port", "endpoint"),
    [
        ("127.0.0.1", 6170, "127.0.0.1:6170"),
        ("localhost", 1, "localhost:1"),
        ("ps-0.job", 65535, "ps-0.job:65535"),
        ("::1", 5, "[::1]:5"),
        ("fe80::1%eth0", 6170, "[fe80::1%eth0]:6170"),
        ("[::1]", 5, "[::1]:5"),  # already bracketed: left alone
    ],
)
def test_format_round_trips(host, port, endpoint):
    assert format_endpoint(host, port) == endpoint
    assert parse_endpoints(endpoint) == (endpoint,)
    assert zmq_address(endpoint) == f"tcp://{endpoint}".replace("localhost", "127.0.0.1")


# -- zmq_address (its main table is in test_rpc.py) --------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "address"),
    [
        ("127.0.0.1:0", "tcp://127.0.0.1:0"),  # port 0: a server binding it lets ZeroMQ pick
        ("[::1]:0", "tcp://[::1]:0"),
        ("localhost:65535", "tcp://127.0.0.1:65535"),
        ("tcp://localhost:0", "tcp://localhost:0"),  # ZeroMQ addresses pass through as they are
        ("tcp://*:6174", "tcp://*:6174"),
    ],
)
def test_zmq_address_allows_port_zero(endpoint, address):
    assert zmq_address(endpoint) == address


@pytest.mark.parametrize(
    ("endpoint", "hint"),
    [
        ("h:65536", "port '65536' is not a number from 0 to 65535"),  # new: the range
        ("h:\u0663", "port"),  # new: ASCII digits only
        ("::1:6174", "[::1]:6174"),  # new: unbracketed IPv6
        ("[]:1", "host '[]'"),  # new: the contract's bracket rule
        ("tcp://", "nothing follows the scheme"),  # new: the transpiler's rule
        ("inproc://", "nothing follows the scheme"),
    ],
)
def test_zmq_address_refuses(endpoint, hint):
    with pytest.raises(TransportError, match="is neither host:port nor") as e:
        zmq_address(endpoint)
    assert hint in str(e.value)


# -- pick_free_ports -------------------------------------------------------------------------


def test_picked_ports_are_distinct_and_free():
    ports = pick_free_ports("127.0.0.1", 8)
    assert len(set(ports)) == 8 and all(1 <= p <= 65535 for p in ports)
    for port in ports:  # released: a server can bind them now (barring the race the docstring owns)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))


def test_ports_from_a_start():
    for _ in range(20):  # find two free neighbouring ports
        start = pick_free_ports("127.0.0.1", 1)[0]
        if start < 65535:
            try:
                assert pick_free_ports("127.0.0.1", 2, start) == [start, start + 1]
                return
            except BuilderError:
                continue
    pytest.fail("no two free neighbouring ports in 20 tries")


@pytest.mark.parametrize(("count", "start"), [(1, 0), (2, 65535), (1, 65536)])
def test_start_must_leave_room(count, start):
    with pytest.raises(BuilderError, match=f"start port {start} is invalid"):
        pick_free_ports("127.0.0.1", count, start)


def test_a_taken_port_is_reported():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(BuilderError, match=f"cannot bind port {port} on 127.0.0.1"):
            pick_free_ports("127.0.0.1", 1, port)


def test_free_endpoints():
    endpoints = free_endpoints("127.0.0.1", 3)
    assert parse_endpoints(endpoints) == tuple(endpoints)  # distinct, and well formed
    assert all(e.startswith("127.0.0.1:") for e in endpoints)


def test_free_endpoints_bracket_ipv6():
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    (endpoint,) = free_endpoints("::1", 1)
    assert endpoint.startswith("[::1]:") and parse_endpoints(endpoint) == (endpoint,)
