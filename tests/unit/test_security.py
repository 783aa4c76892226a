"""CURVE keys, the loopback rule for plain binds, and encrypted request / reply on tcp 127.0.0.1."""

from __future__ import annotations

import re
import shutil
import stat
import threading
import time
import uuid

import pytest
import zmq
from rpc_harness import SECRET, free_port

from fluidps.errors import PeerLostError, TransportError
from fluidps.executor.transport.rpc import RpcClient, RpcServer
from fluidps.executor.transport.security import Security, check_bind, generate_keys, is_loopback
from fluidps.executor.transport.settings import RpcSettings
from fluidps.executor.transport.wire import Kind, Message

FAST = RpcSettings(heartbeat_interval=0.1, peer_timeout=10.0, request_timeout=30.0, secret=SECRET)
# A refused client hears nothing: the 1 s peer timeout ends its wait, well before the
# request timeout, kept long on purpose so that the error raised tells which one fired.
DEAD = FAST.with_(peer_timeout=1.0, request_timeout=120.0)
KEY_FILES = {"server.key", "server.key_secret", "client.key", "client.key_secret", "allowed/client.key"}


def files(directory) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()}


# -- keys ----------------------------------------------------------------------------------


def test_generate_keys_layout(tmp_path):
    keys = generate_keys(tmp_path / "keys")
    assert keys == tmp_path / "keys"
    assert files(keys) == KEY_FILES
    assert (keys / "allowed" / "client.key").read_bytes() == (keys / "client.key").read_bytes()
    for secret in ("server.key_secret", "client.key_secret"):
        assert stat.S_IMODE((keys / secret).stat().st_mode) == 0o600
    public, secret = zmq.auth.load_certificate(keys / "server.key_secret")
    assert len(public) == len(secret) == 40  # z85 of 32-byte curve25519 keys
    assert zmq.auth.load_certificate(keys / "server.key")[0] == public
    assert Security.from_dir(keys).directory == keys


def test_generate_keys_refuses_to_overwrite(tmp_path):
    keys = generate_keys(tmp_path / "keys")
    before = (keys / "server.key").read_bytes()
    with pytest.raises(TransportError, match="already holds keys; pass overwrite=True"):
        generate_keys(keys)
    assert (keys / "server.key").read_bytes() == before
    generate_keys(keys, overwrite=True)
    assert (keys / "server.key").read_bytes() != before
    assert files(keys) == KEY_FILES


def test_from_dir_on_a_directory_without_keys_says_what_is_missing(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(TransportError, match=r"is not a fluidps key directory \(missing server.key, "):
        Security.from_dir(tmp_path / "empty")
    with pytest.raises(TransportError, match="fluidps keys gen"):
        Security.from_dir(tmp_path / "does-not-exist")
    keys = generate_keys(tmp_path / "keys")
    shutil.rmtree(keys / "allowed")
    with pytest.raises(TransportError, match=r"missing allowed/"):
        Security.from_dir(keys)


# -- which binds need keys -----------------------------------------------------------------


@pytest.mark.parametrize(
    "address",
    [
        "tcp://127.0.0.1:6174",
        "tcp://127.3.2.1:6174",
        "tcp://localhost:6174",
        "tcp://[::1]:6174",
        "ipc:///tmp/fluidps.sock",
        "inproc://ps0",
    ],
)
def test_loopback_addresses_may_be_served_in_the_clear(address):
    assert is_loopback(address)
    check_bind(address, RpcSettings(secret=SECRET))


@pytest.mark.parametrize(
    "address",
    ["tcp://0.0.0.0:6174", "tcp://*:6174", "tcp://10.1.2.3:6174", "tcp://[::]:6174", "tcp://eth0:6174"],
)
def test_other_addresses_need_keys_or_insecure(address, tmp_path):
    assert not is_loopback(address)
    with pytest.raises(TransportError, match=f"refusing to serve {re.escape(address)} without encryption"):
        check_bind(address, RpcSettings(secret=SECRET))
    check_bind(address, RpcSettings(insecure=True))
    check_bind(address, RpcSettings(security=Security.from_dir(generate_keys(tmp_path / "keys"))))


def test_server_refuses_a_plain_wildcard_bind():
    context = zmq.Context()
    try:
        with pytest.raises(TransportError, match="refusing to serve"):
            RpcServer(context, f"0.0.0.0:{free_port()}", "pserver 0", FAST)
    finally:
        context.term()  # returns at once: no socket was left open


# -- CURVE end to end ----------------------------------------------------------------------


class Served:
    """A CURVE server on a thread echoing text back, and clients made on the side."""

    def __init__(self, settings: RpcSettings):
        self.context = zmq.Context()
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.server = RpcServer(self.context, self.endpoint, "secure server", settings)
        self.delivered: list[Message] = []
        self.clients: list[RpcClient] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            for request in self.server.receive(0.02):
                self.delivered.append(request.msg)
                self.server.reply(request, Message(Kind.VALUES, text=request.msg.text))

    def client(self, settings: RpcSettings, peer: str = "secure server") -> RpcClient:
        client = RpcClient(self.context, self.endpoint, peer, settings, trainer_id=0)
        self.clients.append(client)
        return client

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        assert not self._thread.is_alive()
        for client in self.clients:
            client.close()
        self.server.close()
        self.context.term()


@pytest.fixture
def keys(tmp_path):
    return Security.from_dir(generate_keys(tmp_path / "keys"))


@pytest.fixture
def served(keys):
    served = Served(FAST.with_(security=keys))
    yield served
    served.close()


def refused(client: RpcClient) -> None:
    with pytest.raises(TransportError) as info:
        client.call(Message(Kind.GET, text="let me in"))
    # the peer timeout ended it (PeerLostError), not the request timeout it would otherwise hit
    assert isinstance(info.value, PeerLostError), info.value


def test_allowed_client_gets_encrypted_replies(served, keys):
    client = served.client(FAST.with_(security=keys))
    assert client.call(Message(Kind.GET, text="hello")).text == "hello"
    assert client._socket.mechanism == zmq.CURVE
    assert served.server._socket.mechanism == zmq.CURVE


def test_client_with_a_key_not_allowed_is_refused(served, keys, tmp_path, capfd):
    intruder_dir = generate_keys(tmp_path / "intruder")
    # it knows the server's public key, so it can attempt the handshake
    shutil.copy(keys.directory / "server.key", intruder_dir / "server.key")
    intruder = served.client(DEAD.with_(security=Security.from_dir(intruder_dir)), peer="guarded server")
    allowed = served.client(FAST.with_(security=keys))
    assert allowed.call(Message(Kind.GET, text="before")).text == "before"
    refused(intruder)
    assert allowed.call(Message(Kind.GET, text="after")).text == "after"
    assert [m.text for m in served.delivered] == ["before", "after"]
    assert "CURVE authenticator refused a client: DENIED" in capfd.readouterr().out  # said, rate-limited


def test_allowed_key_added_before_the_server_starts_is_accepted(tmp_path):
    keys = generate_keys(tmp_path / "keys")
    other = generate_keys(tmp_path / "other")
    shutil.copy(keys / "server.key", other / "server.key")
    shutil.copy(other / "client.key", keys / "allowed" / "other.key")
    served = Served(FAST.with_(security=Security.from_dir(keys)))
    try:
        client = served.client(FAST.with_(security=Security.from_dir(other)))
        assert client.call(Message(Kind.GET, text="second client")).text == "second client"
    finally:
        served.close()


def test_plain_client_gets_nothing_from_a_curve_server(served):
    refused(served.client(DEAD))
    assert served.delivered == []


def test_curve_client_gets_nothing_from_a_plain_server(keys):
    served = Served(FAST)
    try:
        refused(served.client(DEAD.with_(security=keys)))
        assert served.delivered == []
    finally:
        served.close()


def test_client_expecting_another_server_key_gets_nothing(served, keys, tmp_path):
    impostor_view = generate_keys(tmp_path / "elsewhere")  # a server key pair this server does not have
    shutil.copy(keys.directory / "client.key_secret", impostor_view / "client.key_secret")
    shutil.copy(keys.directory / "client.key", impostor_view / "client.key")
    refused(served.client(DEAD.with_(security=Security.from_dir(impostor_view))))


def test_servers_sharing_a_context_share_its_authenticator(tmp_path):
    # The authenticator binds a fixed inproc:// address: one per context, for every
    # CURVE server on it (different key directories included), restartable.
    first, second = (Security.from_dir(generate_keys(tmp_path / n)) for n in ("a", "b"))
    context = zmq.Context()
    try:
        for _ in range(3):
            servers = [
                RpcServer(context, f"tcp://127.0.0.1:{free_port()}", f"server {i}", FAST.with_(security=s))
                for i, s in enumerate((first, second, first))
            ]
            for server, security in zip(servers, (first, second, first), strict=True):
                client = RpcClient(context, server.address, "server", FAST.with_(security=security))
                rid = client.request(Message(Kind.GET, text="hi"))
                deadline = time.monotonic() + 10
                while not (requests := server.receive(0.02)):
                    assert time.monotonic() < deadline
                server.reply(requests[0], Message(Kind.VALUES, text="hi"))
                assert client.wait(rid).text == "hi"
                client.close()
            wrong = RpcClient(context, servers[1].address, "server", DEAD.with_(security=first))
            refused(wrong)
            wrong.close()
            for server in servers:
                server.close()
    finally:
        context.destroy(linger=0)


def test_inproc_needs_no_encryption_with_keys(keys):
    context = zmq.Context()
    endpoint = f"inproc://secure-{uuid.uuid4().hex}"
    settings = FAST.with_(security=keys)
    server = RpcServer(context, endpoint, "in-process server", settings)
    client = RpcClient(context, endpoint, "in-process server", settings)
    try:
        rid = client.request(Message(Kind.GET))
        deadline = time.monotonic() + 10
        while not (requests := server.receive(0.02)):
            assert time.monotonic() < deadline
        server.reply(requests[0])
        assert client.wait(rid).kind == Kind.OK
        assert client._socket.mechanism == zmq.NULL
    finally:
        client.close()
        server.close()
        context.term()
