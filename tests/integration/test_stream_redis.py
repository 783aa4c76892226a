"""Redis Streams as a stream source, against a real redis-server on a loopback port
(Debian's `redis-server`: .ci/run installs it; where it cannot be, these tests skip and say so)."""

from __future__ import annotations

import logging
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from fluidps.endpoints import pick_free_ports
from fluidps.errors import StreamError
from fluidps.io import open_stream
from fluidps.io.stream import read_range
from fluidps.io.stream_redis import RedisStream, id_to_offset

SERVER = shutil.which("redis-server")
pytestmark = pytest.mark.skipif(
    SERVER is None, reason="redis-server is not installed (apt-get install redis-server; .ci/run does)"
)


class Server:
    """A redis-server process on 127.0.0.1:port, its data kept in `folder` across restarts."""

    def __init__(self, folder: Path):
        self.folder, self.port = folder, pick_free_ports("127.0.0.1", 1)[0]
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder),
             "--appendonly", "yes", "--save", "", "--protected-mode", "yes"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        client = redis.Redis(port=self.port, socket_connect_timeout=1)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError(f"redis-server on port {self.port} did not start") from None
                time.sleep(0.05)
        client.close()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def url(self, stream: str) -> str:
        return f"redis://127.0.0.1:{self.port}/{stream}"


@pytest.fixture
def server(tmp_path) -> Iterator[Server]:
    running = Server(tmp_path)
    running.start()
    try:
        yield running
    finally:
        running.stop()


def clicks(rows: int, start: int = 0) -> dict[str, np.ndarray]:
    ids = np.arange(start, start + rows, dtype=np.int64)
    return {"ids": np.stack([ids, ids * 7], axis=1), "dense": (ids[:, None] * 0.25).astype(np.float32),
            "clicked": ids % 2 == 1}  # fmt: skip


def test_appended_records_read_back_by_offset(server):
    stream = open_stream(server.url("clicks"))
    assert isinstance(stream, RedisStream) and stream.end_offset() == 0
    offsets = np.concatenate([stream.append(clicks(5, start)) for start in (0, 5, 10)])
    assert len(offsets) == 15 and np.all(np.diff(offsets) > 0)  # increasing, as the entry ids
    assert stream.start_offset() == offsets[0] and stream.end_offset() == offsets[-1] + 1

    got = stream.read(int(offsets[3]), 8)
    assert (
        got.offsets.tolist() == offsets[3:11].tolist() and got.next_offset == offsets[10] + 1 and not got.bad
    )
    want = clicks(8, 3)
    for name in want:
        np.testing.assert_array_equal(got.fields[name], want[name])
        assert got.fields[name].dtype == want[name].dtype
    assert got.timestamps.tolist() == [(o >> 20) / 1000 for o in got.offsets.tolist()]  # the ids' times
    rest = stream.read(int(got.next_offset), 100)
    assert rest.offsets.tolist() == offsets[11:].tolist()
    end = stream.read(stream.end_offset(), 10)
    assert len(end) == 0 and end.next_offset == stream.end_offset()


def test_windows_of_sparse_offsets_end_where_their_records_do(server):
    """advance and read_range over entry ids (offsets with gaps): what a window is cut from."""
    stream = open_stream(server.url("clicks"))
    offsets = np.concatenate([stream.append(clicks(4, start)) for start in (0, 4, 8)])
    end = stream.end_offset()
    stop, n = stream.advance(int(offsets[0]), 5, end)
    assert (stop, n) == (offsets[4] + 1, 5)
    assert stream.advance(int(offsets[10]), 5, end) == (end, 2)  # fewer there
    assert stream.advance(int(offsets[2]), 5, int(offsets[4])) == (offsets[3] + 1, 2)  # before `end`
    assert stream.advance(end, 5, end) == (end, 0)
    window = read_range(stream, int(offsets[2]), int(stop))
    assert window.offsets.tolist() == offsets[2:5].tolist() and window.next_offset == stop
    np.testing.assert_array_equal(window.fields["ids"], clicks(3, 2)["ids"])


def test_entries_from_other_producers_are_read_and_bad_ones_set_aside(server):
    stream = RedisStream(server.url("clicks"), fields={"ids": np.zeros(2, np.int64), "clicked": np.int64(0)})
    client = redis.Redis(port=server.port)
    good = client.xadd("clicks", {"ids": "3 14", "clicked": "1"})  # as redis-cli XADD would
    wrong_names = client.xadd("clicks", {"id": "3 14", "clicked": "1"})
    not_numbers = client.xadd("clicks", {"ids": "3 x", "clicked": "1"})
    too_few = client.xadd("clicks", {"ids": "3", "clicked": "1"})
    fraction = client.xadd("clicks", {"ids": "3 14", "clicked": "0.5"})
    last = client.xadd("clicks", {"ids": "1 2", "clicked": "0"})
    got = stream.read(0, 100)
    assert got.offsets.tolist() == [id_to_offset(good), id_to_offset(last)]
    assert got.fields["ids"].tolist() == [[3, 14], [1, 2]] and got.fields["clicked"].tolist() == [1, 0]
    reasons = {b.offset: b.reason for b in got.bad}
    assert list(reasons) == [id_to_offset(i) for i in (wrong_names, not_numbers, too_few, fraction)]
    assert (
        reasons[id_to_offset(wrong_names)]
        == f"entry {wrong_names.decode()}: fields ['clicked', 'id'], not ['clicked', 'ids']"
    )
    assert "field 'ids': '3 x' is not int64 numbers" in reasons[id_to_offset(not_numbers)]
    assert "field 'ids': '3' is not 2 int64 number(s)" in reasons[id_to_offset(too_few)]
    assert "field 'clicked': '0.5' is not int64 numbers" in reasons[id_to_offset(fraction)]
    with pytest.raises(StreamError, match="holds records of ids int64"):
        RedisStream(server.url("clicks"), fields={"x": np.float32(0)})
    with pytest.raises(
        StreamError, match=r"field 'ids' holds int64; float64 does not convert to it without loss"
    ):
        stream.append({"ids": np.zeros((1, 2)), "clicked": np.zeros(1, np.int64)})


def test_a_consumer_groups_offset_is_its_last_delivered_id_in_redis(server):
    stream = RedisStream(server.url("clicks"))
    offsets = stream.append(clicks(6))
    assert stream.committed("trainers") == offsets[0] and stream.groups() == {}
    stream.commit("trainers", int(offsets[4]))  # done with the first four
    assert stream.committed("trainers") == offsets[4] and stream.groups() == {"trainers": offsets[4]}
    (info,) = redis.Redis(port=server.port).xinfo_groups("clicks")
    assert info["last-delivered-id"] == redis.Redis(port=server.port).xrange("clicks", count=4)[-1][0]
    with pytest.raises(StreamError, match="consumer group"):
        stream.commit("bad name", 1)
    with pytest.raises(
        StreamError, match=rf"cannot commit offset {offsets[-1] + 2} \(its end is {offsets[-1] + 1}\)"
    ):
        stream.commit("trainers", int(offsets[-1] + 2))
    redis.Redis(port=server.port).set("plain", "a string, not a stream")
    with pytest.raises(StreamError, match=r"plain: Redis at 127\.0\.0\.1:\d+ refused: WRONGTYPE"):
        open_stream(server.url("plain")).end_offset()


def test_redis_going_away_is_waited_for_and_nothing_is_lost(server, caplog):
    stream = RedisStream(server.url("clicks"), retry_s=60)
    stream.append(clicks(3))
    server.stop()
    result: dict = {}

    def read_meanwhile() -> None:
        result["records"] = stream.read(0, 10)

    with caplog.at_level(logging.WARNING, logger="fluidps.io.stream_redis"):
        reader = threading.Thread(target=read_meanwhile)
        reader.start()
        deadline = time.monotonic() + 30
        while "unreachable" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        assert f"Redis at 127.0.0.1:{server.port} unreachable" in caplog.text  # it says so, and waits
        server.start()  # the same data (appendonly), the same port
        reader.join(timeout=60)
    assert not reader.is_alive() and result["records"].fields["ids"][:, 0].tolist() == [0, 1, 2]

    server.stop()
    impatient = RedisStream(server.url("clicks"), retry_s=0.5)
    with pytest.raises(
        StreamError, match=rf"Redis at 127.0.0.1:{server.port} could not be reached for 0.5 s"
    ):
        impatient.end_offset()
