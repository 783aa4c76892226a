"""Request / reply over ROUTER and DEALER sockets, on tcp 127.0.0.1, ipc:// and inproc://:
replies, the reply cache, resends, malformed and oversized messages, addresses.

Servers run on threads (rpc_harness); tests assert events and their order, never
durations: every wait is bounded only as a guard against a hang.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from rpc_harness import FAST, SECRET, endpoint_for, lose_requests, receive_until, recv, signed

from fluidps.endpoints import zmq_address
from fluidps.errors import RemoteError, TransportError
from fluidps.executor.transport.proof import JobSecret
from fluidps.executor.transport.ratelimit import RateLimitedLog
from fluidps.executor.transport.rpc import Request, RpcClient
from fluidps.executor.transport.wire import Kind, Message, decode, encode

# -- request / reply -----------------------------------------------------------------------


def test_request_reply(net, endpoint):
    harness = net.serve(endpoint)
    client = net.client(endpoint)
    x = np.arange(12, dtype="float32").reshape(3, 4)
    reply = client.call(Message(Kind.SEND, tensors={"x": x}, text="hello"))
    assert reply.kind == Kind.VALUES and reply.text == "hello"
    np.testing.assert_array_equal(reply.tensors["x"], x)
    assert reply.incarnation == harness.server.incarnation == client.incarnation
    second = client.request(Message(Kind.GET, names=["x"]))
    assert client.wait(second).request_id == second
    assert [m.request_id for m in harness.delivered] == [1, second] and second == 2
    assert all(m.trainer_id == 0 for m in harness.delivered)


def test_concurrent_clients_get_their_own_replies(net, endpoint):
    net.serve(endpoint)
    clients = [net.client(endpoint) for _ in range(3)]
    failures: list[BaseException] = []

    def run(i: int, client: RpcClient) -> None:
        try:
            for step in range(20):
                value = np.full((4,), i * 100 + step, dtype="int64")
                reply = client.call(Message(Kind.SEND, tensors={"v": value}))
                np.testing.assert_array_equal(reply.tensors["v"], value)
        except BaseException as e:
            failures.append(e)

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert not failures, failures


def test_server_error_is_a_remote_error_naming_the_peer(net, endpoint):
    def refuse(request: Request) -> Message:
        return Message(Kind.ERROR, text="no such variable 'w'")

    net.serve(endpoint, handler=refuse)
    client = net.client(endpoint, peer="pserver 7")
    with pytest.raises(RemoteError, match=r"pserver 7 .*no such variable 'w'"):
        client.call(Message(Kind.GET, names=["w"]))


def test_repeated_request_id_is_answered_from_the_cache(net, endpoint):
    server = net.server(endpoint)
    dealer = net.raw(endpoint)
    frames = encode(
        Message(Kind.SEND, request_id=5, trainer_id=0, tensors={"g": np.ones(3, "float32")}), SECRET
    )
    dealer.send_multipart(frames)
    (request,) = receive_until(server, lambda: bool(server.peers.connections))
    # a repeat while the request is held is neither delivered again nor answered
    dealer.send_multipart(frames)
    assert server.receive(0.3) == [] and not dealer.poll(0)
    server.reply(request, Message(Kind.VALUES, text="first"))
    assert recv(dealer).text == "first"
    # a repeat after the reply gets the same reply again, and the request is not run again
    dealer.send_multipart(frames)
    assert receive_until(server, lambda: dealer.poll(0) != 0) == []
    again = recv(dealer)
    assert (again.text, again.request_id, again.incarnation) == ("first", 5, server.incarnation)
    # a new id is a new request
    dealer.send_multipart(encode(Message(Kind.GET, request_id=6, trainer_id=0), SECRET))
    (new,) = receive_until(server, lambda: len(server.peers.connections[request.client].pending) > 0)
    assert new.msg.request_id == 6


def test_client_resends_a_request_the_server_never_got(net, endpoint):
    harness = net.serve(endpoint)
    lost = lose_requests(harness.server, lambda request: not lost)  # the first one vanishes on the way
    client = net.client(endpoint)
    assert client.call(Message(Kind.GET, text="again")).text == "again"
    assert lost == [1] and [m.request_id for m in harness.delivered] == [1]


def test_client_recovers_a_lost_reply_from_the_reply_cache(net, endpoint):
    ran: list[int] = []

    def run_once(request: Request) -> Message:
        ran.append(request.msg.request_id)
        return Message(Kind.VALUES, text=f"ran {len(ran)} time(s)")

    harness = net.serve(endpoint, handler=run_once)
    sock, dropped = harness.server._socket, []
    send = sock.send_multipart

    def drop_first_reply(frames, *args, **kwargs):  # the reply vanishes on the way back
        if decode(frames[1:], SECRET).kind == Kind.VALUES and not dropped:
            dropped.append(True)
            return None
        return send(frames, *args, **kwargs)

    sock.send_multipart = drop_first_reply
    client = net.client(endpoint)
    assert client.call(Message(Kind.SEND)).text == "ran 1 time(s)"
    assert dropped == [True] and ran == [1]


# -- malformed and oversized messages ------------------------------------------------------


@pytest.mark.parametrize(
    "frames",
    [
        [b"garbage"],
        [b""],
        [b"\x08\x14", b"a stray frame"],  # a SEND header, and a frame it does not describe
        [encode(Message(Kind.SEND, tensors={"x": np.ones(4, "float32")}))[0], b"\0" * 15],
    ],
    ids=["garbage", "empty", "extra-frame", "short-tensor"],
)
def test_malformed_message_gets_an_error_and_the_server_keeps_serving(net, endpoint, frames):
    harness = net.serve(endpoint)
    dealer = net.raw(endpoint)
    dealer.send_multipart(signed(frames))  # proven, so that what is malformed is read
    reply = recv(dealer)
    assert reply.kind == Kind.ERROR and "test server rejected a malformed message" in reply.text
    assert reply.incarnation == harness.server.incarnation
    assert harness.server.rejected == 1 and harness.delivered == []
    client = net.client(endpoint)
    assert client.call(Message(Kind.GET, text="still here")).text == "still here"
    assert harness.server.rejected == 1


@pytest.mark.parametrize("secret", [None, JobSecret.generate()], ids=["no-secret", "another-secret"])
def test_a_message_without_the_jobs_proof_is_refused_unread_and_leaves_nothing(net, endpoint, secret):
    harness = net.serve(endpoint)
    dealer = net.raw(endpoint)
    stranger = Message(Kind.SET, request_id=1, trainer_id=0, tensors={"w": np.ones(3, "float32")})
    dealer.send_multipart(encode(stranger, secret))
    reply = recv(dealer, secret=None)  # the refusal goes unsigned: the stranger has no secret
    assert reply.kind == Kind.ERROR and "refused a message without this job's proof" in reply.text
    server = harness.server
    assert (server.unproven, server.rejected) == (1, 1)
    assert harness.delivered == [] and not server.peers.connections and not server.peers.clocks


def test_a_client_with_another_secret_is_told_the_server_is_not_of_its_job(net, endpoint):
    net.serve(endpoint)
    client = net.client(endpoint, settings=FAST.with_(secret=JobSecret.generate()))
    with pytest.raises(
        TransportError, match=r"answered without this job's proof.*it said: test server refused"
    ):
        client.call(Message(Kind.GET, text="hello"))


def test_rejected_messages_are_logged_one_line_at_a_time(net, endpoint, capsys):
    harness = net.serve(endpoint)
    dealer = net.raw(endpoint)
    for _ in range(5):
        dealer.send_multipart(signed([b"garbage"]))
        assert recv(dealer).kind == Kind.ERROR
    lines = [line for line in capsys.readouterr().out.splitlines() if "rejected a malformed message" in line]
    # the first at once; the next ones held back within the rate limit (counted, not lost)
    assert len(lines) == 1 and lines[0].startswith("test server: rejected a malformed message from client ")
    assert harness.server.rejected == 5


def test_a_rate_limited_log_says_how_many_lines_it_held_back():
    said, now = [], [0.0]
    log = RateLimitedLog(said.append, every=10.0, clock=lambda: now[0])
    for t in (0.0, 1.0, 2.0, 10.5, 11.0):
        now[0] = t
        log(f"bad message at {t}")
    assert said == ["bad message at 0.0", "bad message at 10.5 (2 more like it in the last 10 s)"]
    assert log.held == 1


@pytest.mark.parametrize("kind", ["tcp", "ipc"])  # inproc:// passes messages by pointer: no size limit
def test_oversized_message_is_dropped_and_the_server_keeps_serving(net, kind, tmp_path):
    endpoint = endpoint_for(kind, tmp_path)
    harness = net.serve(endpoint, FAST.with_(max_message_bytes=4096))
    small = net.client(endpoint)
    assert small.call(Message(Kind.GET, text="before")).text == "before"
    big = net.client(endpoint, FAST.with_(request_timeout=2.0))
    rid = big.request(Message(Kind.SEND, tensors={"x": np.zeros(16384, "float32")}))
    assert small.call(Message(Kind.GET, text="during")).text == "during"
    # it fails (the 2 s request timeout, or the peer timeout if the connection stays down), not hangs
    with pytest.raises(TransportError, match=r"did not answer SEND within 2 s|has not answered"):
        big.wait(rid)
    assert small.call(Message(Kind.GET, text="after")).text == "after"
    assert all(not m.tensors for m in harness.delivered)  # the big one never arrived
    # the big client's connection comes back: small messages get through again
    assert big.call(Message(Kind.GET, text="small now")).text == "small now"


# -- addresses -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "address"),
    [
        ("127.0.0.1:6174", "tcp://127.0.0.1:6174"),
        ("localhost:80", "tcp://127.0.0.1:80"),
        ("ps-0.ps.default.svc:6174", "tcp://ps-0.ps.default.svc:6174"),
        ("[::1]:6174", "tcp://[::1]:6174"),
        ("tcp://10.0.0.1:1", "tcp://10.0.0.1:1"),
        ("ipc:///tmp/x.sock", "ipc:///tmp/x.sock"),
        ("inproc://ps0", "inproc://ps0"),
    ],
)
def test_zmq_address(endpoint, address):
    assert zmq_address(endpoint) == address


@pytest.mark.parametrize(
    "endpoint",
    ["", "6174", ":6174", "host:", "host:port", "udp://h:1", "epgm://eth0;239.1.1.1:5555", "host:-1"],
)
def test_zmq_address_refuses_what_is_no_endpoint(endpoint):
    with pytest.raises(TransportError, match="is neither host:port nor"):
        zmq_address(endpoint)


@pytest.mark.parametrize("kind", ["tcp", "inproc"])  # ipc:// binds take the path over (ZeroMQ's way)
def test_server_refuses_a_taken_address(net, kind, tmp_path):
    endpoint = endpoint_for(kind, tmp_path)
    net.server(endpoint)
    with pytest.raises(TransportError, match="second cannot listen on"):
        net.server(endpoint, name="second")
