"""What a server keeps of its peers (fluidps.executor.transport.peers) stays bounded in
count and bytes, and silence drops it; the clock is passed in, so nothing here waits."""

from __future__ import annotations

import numpy as np

from fluidps.executor.transport import peers as peers_module
from fluidps.executor.transport.peers import Peers
from fluidps.executor.transport.settings import RpcSettings

SETTINGS = RpcSettings(peer_timeout=10.0, warmup_timeout=30.0)


def reply(nbytes: int) -> list:
    return [b"header", memoryview(np.zeros(nbytes, np.uint8))]


def test_a_connection_is_kept_from_its_first_request_and_dropped_once_silent_and_idle():
    peers = Peers(SETTINGS)
    assert peers.connection(b"c1", 0.0, create=False) is None  # a heartbeat leaves nothing
    state = peers.connection(b"c1", 0.0)
    state.pending.add(1)
    peers.connection(b"c2", 0.0)
    peers.prune(100.0)  # both silent for 100 s: c2 holds nothing and goes; c1 holds a request
    assert list(peers.connections) == [b"c1"]
    peers.cache(b"c1", 1, reply(10), 100.0)  # answered: it holds nothing now
    peers.prune(100.0 + peers.forget_after / 2)  # (at most one look a second, and not silent long enough)
    assert list(peers.connections) == [b"c1"]
    peers.prune(101.0 + peers.forget_after)
    assert not peers.connections and peers.cached_bytes == 0


def test_connections_beyond_the_limit_drop_the_least_recently_heard_that_hold_nothing(monkeypatch):
    monkeypatch.setattr(peers_module, "MAX_CONNECTIONS", 3)
    peers = Peers(SETTINGS)
    peers.connection(b"busy", 0.0).pending.add(7)
    for i, name in enumerate((b"a", b"b", b"c", b"d")):
        peers.connection(name, 1.0 + i)
    assert list(peers.connections) == [b"busy", b"c", b"d"]  # (busy holds a request: kept)


def test_a_connection_caches_its_last_replies_and_all_of_them_fit_the_byte_budget(monkeypatch):
    monkeypatch.setattr(peers_module, "REPLY_CACHE_BYTES", 10_000)
    peers = Peers(SETTINGS)
    for rid in range(1, 41):
        peers.cache(b"c", rid, reply(10), float(rid))
    assert list(peers.connections[b"c"].replies) == list(range(9, 41))  # the last 32
    for rid in range(1, 4):  # three large replies of another connection: the oldest go first
        peers.cache(b"big", rid, reply(4000), 50.0 + rid)
    assert peers.cached_bytes <= 10_000
    assert list(peers.connections[b"big"].replies) == [2, 3]
    assert peers.cached_bytes == sum(
        size for s in peers.connections.values() for _, size, _ in s.replies.values()
    )
    peers.prune(53.0 + peers.forget_after + 1)  # replies older than the forget time go too
    assert peers.cached_bytes == 0 and not peers.connections


def test_clocks_are_kept_only_for_tracked_incarnations_and_bounded(monkeypatch):
    monkeypatch.setattr(peers_module, "MAX_CLOCKS", 2)
    peers = Peers(SETTINGS)
    peers.heard((0, 0xA), 1.0)  # not tracked: nothing kept
    assert not peers.clocks
    peers.track((0, 0xA), 1.0)
    peers.heard((0, 0xA), 2.0)
    assert peers.clocks[(0, 0xA)].last == 2.0
    peers.track((1, 0xB), 2.0)
    peers.track((2, 0xC), 3.0)  # a third: the least recently heard goes
    assert list(peers.clocks) == [(1, 0xB), (2, 0xC)]
    peers.untrack((1, 0xB))
    assert list(peers.clocks) == [(2, 0xC)]
    peers.prune(3.0 + peers._clock_horizon + 1)
    assert not peers.clocks
