"""Liveness of request / reply: dead and hung servers are reported by name within the
peer timeout, restarts by their incarnation, slow replies are kept alive by heartbeats,
timeouts are honoured, and requests given up on are forgotten.

Timing checks assert which path ended a wait (the error raised) and that it did not
end before its timeout; no test asserts how fast anything is. A broken path would run
into the LONG timeout (rpc_harness.LONG), past this module's hang guard (NOT_HUNG).
"""

from __future__ import annotations

import re
import time

import pytest
import zmq
from rpc_harness import DEAD, FAST, LONG, NOT_HUNG, SECRET, TRANSPORTS, endpoint_for, lose_requests, recv

from fluidps.errors import PeerLostError, RemoteError, TransportError
from fluidps.executor.transport.rpc import wait_all
from fluidps.executor.transport.wire import Kind, Message, encode

pytestmark = pytest.mark.timeout(NOT_HUNG)  # the hang guard of every wait here

# -- dead peers, restarts, timeouts --------------------------------------------------------


def test_client_talking_to_nothing_raises_peer_lost_naming_the_peer(net, endpoint):
    client = net.client(endpoint, DEAD, peer="pserver 3")
    start = time.monotonic()
    with pytest.raises(PeerLostError, match=r"pserver 3 \(.+\) has not answered for"):
        client.call(Message(Kind.GET))
    # not before the peer timeout; PeerLostError (not the LONG request timeout's error) ended it
    assert time.monotonic() - start >= DEAD.peer_timeout
    with pytest.raises(PeerLostError, match=re.escape(f"({endpoint})")):
        client.call(Message(Kind.GET))


def test_server_that_stops_answering_is_reported_within_the_peer_timeout(net, endpoint):
    harness = net.serve(endpoint, DEAD)
    client = net.client(endpoint, DEAD, peer="pserver 0")
    assert client.call(Message(Kind.GET, text="up")).text == "up"
    harness.pause()  # hung: the socket is open, nothing answers
    with pytest.raises(PeerLostError, match=r"pserver 0 \(.+\) has not answered for"):
        client.call(Message(Kind.GET))


def test_server_that_closes_is_reported_within_the_peer_timeout(net, endpoint):
    harness = net.serve(endpoint, DEAD, handler=lambda request: None)
    client = net.client(endpoint, DEAD, peer="pserver 0")
    rid = client.request(Message(Kind.SEND_BARRIER))
    deadline = time.monotonic() + 10
    while not harness.held:  # the server holds the request, then goes away
        assert time.monotonic() < deadline
        time.sleep(0.01)
    harness.close()
    with pytest.raises(PeerLostError, match=r"pserver 0 \(.+\) has not answered for"):
        client.wait(rid)


def test_heartbeats_keep_a_slow_request_alive_past_the_peer_timeout(net, endpoint):
    settings = FAST.with_(peer_timeout=1.5)
    harness = net.serve(endpoint, settings, delay=2 * settings.peer_timeout)  # a slow barrier
    client = net.client(endpoint, settings)
    start = time.monotonic()
    assert client.call(Message(Kind.SEND_BARRIER, text="late")).text == "late"
    assert time.monotonic() - start >= 2 * settings.peer_timeout
    assert len(harness.delivered) == 1


@pytest.mark.parametrize("kind", ["tcp", "ipc"])
def test_restarted_server_is_detected_by_its_incarnation(net, kind, tmp_path):
    endpoint = endpoint_for(kind, tmp_path)
    first = net.serve(endpoint)
    client = net.client(endpoint, peer="pserver 1")
    client.call(Message(Kind.GET))
    first.close()
    second = net.serve(endpoint)
    assert second.server.incarnation != first.server.incarnation
    with pytest.raises(TransportError, match=r"pserver 1 .*restarted \(incarnation"):
        client.call(Message(Kind.GET))
    assert second.delivered == []  # the request for the old server's state was not run


def test_inproc_server_restart_is_reported_not_a_hang(net):
    # inproc:// connections do not come back once the server closes; the client
    # must not block sending to it.
    endpoint = endpoint_for("inproc", None)
    first = net.serve(endpoint)
    client = net.client(endpoint, DEAD)
    client.call(Message(Kind.GET))
    first.close()
    net.serve(endpoint)
    with pytest.raises(PeerLostError, match="has not answered for"):
        client.call(Message(Kind.GET))


def test_server_rejects_a_stale_incarnation(net, endpoint):
    harness = net.serve(endpoint)
    dealer = net.raw(endpoint)
    stale = harness.server.incarnation ^ 2
    dealer.send_multipart(encode(Message(Kind.GET, request_id=1, incarnation=stale), SECRET))
    reply = recv(dealer)
    assert reply.kind == Kind.ERROR and reply.request_id == 1 and "stale incarnation" in reply.text
    assert harness.delivered == []


def test_request_timeout_is_honoured_while_the_server_lives(net, endpoint):
    harness = net.serve(endpoint, handler=lambda request: None)  # holds every request
    client = net.client(endpoint, FAST.with_(request_timeout=1.0), peer="pserver 2")
    start = time.monotonic()
    with pytest.raises(TransportError, match=r"pserver 2 .*did not answer GET within 1 s") as info:
        client.call(Message(Kind.GET))
    assert not isinstance(info.value, PeerLostError)
    # not before the limit; the message shows the 1 s request timeout, not the peer timeout, ended it
    assert time.monotonic() - start >= 1.0
    rid = client.request(Message(Kind.SEND))
    with pytest.raises(TransportError, match="did not answer SEND within"):
        client.wait(rid, timeout=0.3)
    # held requests are listed as pending by heartbeats: never resent, so delivered once
    assert [m.request_id for m in harness.delivered] == [1, 2]


def test_a_request_given_up_on_is_not_resent(net, endpoint):
    harness = net.serve(endpoint)
    # every SEND vanishes on the way: the client resends it
    seen = lose_requests(harness.server, lambda request: request.msg.kind == Kind.SEND)
    client = net.client(endpoint)
    rid = client.request(Message(Kind.SEND))
    with pytest.raises(TransportError, match=r"did not answer SEND within 1\.5 s"):
        client.wait(rid, timeout=1.5)
    assert seen.count(rid) >= 2  # it was resent while the client waited
    given_up = len(seen)
    start = time.monotonic()
    while time.monotonic() - start < 1.0:  # other calls keep heartbeats going for a while
        assert client.call(Message(Kind.GET, text="x")).text == "x"
    assert len(seen) == given_up


# -- several servers at once ---------------------------------------------------------------


def test_wait_all_gathers_replies_by_key(net, tmp_path):
    endpoints = [endpoint_for(kind, tmp_path) for kind in TRANSPORTS]
    for endpoint in endpoints:
        net.serve(endpoint)
    clients = {kind: net.client(ep) for kind, ep in zip(TRANSPORTS, endpoints, strict=True)}
    pending = {kind: (c, c.request(Message(Kind.GET, text=kind))) for kind, c in clients.items()}
    replies = wait_all(pending)
    assert {kind: reply.text for kind, reply in replies.items()} == {k: k for k in TRANSPORTS}
    assert wait_all({}) == {}


def test_wait_all_reports_a_dead_server_without_waiting_for_the_others(net, tmp_path):
    live, dead = endpoint_for("tcp", tmp_path), endpoint_for("tcp", tmp_path)
    net.serve(live, handler=lambda request: None)  # a barrier that never opens
    clients = {"live": net.client(live, DEAD, "pserver 0"), "dead": net.client(dead, DEAD, "pserver 1")}
    with pytest.raises(PeerLostError, match=r"pserver 1 \(.+\) has not answered for"):
        wait_all({k: (c, c.request(Message(Kind.SEND_BARRIER))) for k, c in clients.items()})
    # (waiting for pserver 0 would end in the LONG request timeout, as a TransportError)


def test_wait_all_timeout_names_the_silent_servers(net, tmp_path):
    quick, slow = endpoint_for("tcp", tmp_path), endpoint_for("ipc", tmp_path)
    net.serve(quick)
    net.serve(slow, handler=lambda request: None)
    clients = [net.client(quick, peer="pserver 0"), net.client(slow, peer="pserver 1")]
    pending = {i: (c, c.request(Message(Kind.GET))) for i, c in enumerate(clients)}
    assert clients[0]._socket.poll(10_000)  # pserver 0's reply is in: only pserver 1 can be silent
    with pytest.raises(TransportError, match=r"^pserver 1 did not answer within 0\.5 s$"):
        wait_all(pending, timeout=0.5)
    assert not clients[1]._sent  # forgotten: never resent


def test_wait_all_raises_a_server_error(net, endpoint):
    net.serve(endpoint, handler=lambda request: Message(Kind.ERROR, text="bad step"))
    client = net.client(endpoint, peer="pserver 4")
    with pytest.raises(RemoteError, match=r"pserver 4 .*bad step"):
        wait_all({0: (client, client.request(Message(Kind.GET)))})


def test_receive_returns_early_when_woken(net, endpoint):
    server = net.server(endpoint)
    wake_address = f"inproc://wake-{id(server)}"
    pull = net.context.socket(zmq.PULL)
    pull.bind(wake_address)
    push = net.context.socket(zmq.PUSH)
    push.connect(wake_address)
    net.sockets += [pull, push]
    push.send(b"")
    assert server.receive(LONG, wake=pull) == []  # the wake message ended it (or the hang guard fails it)
    assert not pull.poll(0)  # consumed
    dealer = net.raw(endpoint)
    dealer.send_multipart(encode(Message(Kind.GET, request_id=1), SECRET))
    deadline = time.monotonic() + 10
    while not (requests := server.receive(0.05, wake=pull)):
        assert time.monotonic() < deadline
    assert requests[0].msg.request_id == 1
    server.reply(requests[0], Message(Kind.VALUES, text="ok"))
    assert recv(dealer).text == "ok"
