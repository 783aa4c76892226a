"""Streams: unbounded sources of records with offsets, read in ranges, and committed.

A stream is what a streaming job trains from: records of named fields (as a dataset's),
appended without end. Every source behind this interface numbers its records with
increasing int offsets, reads a range of them, and keeps a consumer group's committed
offset (the first record the group has not finished with):

    source = open_stream("log:/data/clicks")
    batch = source.read(source.committed("trainers"), 1000)
    ...  # train on batch.fields; records that failed their checks are in batch.bad
    source.commit("trainers", batch.next_offset)

Offsets need not be dense (a source may skip numbers); `next_offset` is where a read
that follows this one starts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from fluidps.errors import StreamError

GROUP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


@dataclass(frozen=True)
class BadRecord:
    """A record that failed its checks (a bad CRC, the wrong fields): kept aside, with its
    offset and the reason, for a dead-letter file; never trained on."""

    offset: int
    reason: str
    raw: bytes = b""


@dataclass(frozen=True)
class Records:
    """The records of one read: the good ones' offsets, append times (seconds since the
    epoch) and fields (one row per record), the bad ones, and the offset the next read
    starts at."""

    offsets: np.ndarray
    timestamps: np.ndarray
    fields: dict[str, np.ndarray]
    next_offset: int
    bad: tuple[BadRecord, ...] = field(default=())

    def __len__(self) -> int:
        return len(self.offsets)


@runtime_checkable
class StreamSource(Protocol):
    """What a streaming job reads from (a segment log, Redis Streams)."""

    name: str

    def start_offset(self) -> int:
        """The first offset still held (earlier ones were retired by retention)."""
        ...

    def end_offset(self) -> int:
        """The offset the next appended record will have."""
        ...

    def read(self, start: int, count: int) -> Records:
        """Up to `count` records from offset `start` (fewer at the end of the stream)."""
        ...

    def commit(self, group: str, offset: int) -> None:
        """Record that `group` is done with every record before `offset`."""
        ...

    def committed(self, group: str) -> int:
        """The offset `group` committed last (the stream's start if it never did)."""
        ...

    def close(self) -> None: ...


def check_group(group: str) -> str:
    """`group` if it is a usable consumer group name, else a StreamError saying why."""
    if not isinstance(group, str) or not GROUP_NAME.fullmatch(group):
        raise StreamError(
            f"consumer group {group!r}: use 1-64 letters, digits, '_', '.' or '-', starting with a "
            "letter or digit"
        )
    return group


def open_stream(spec: str) -> StreamSource:
    """The source `spec` names: `log:DIR` (a fluidps.io.StreamLog in DIR) or
    `redis://HOST:PORT/STREAM` (a Redis stream, fluidps.io.stream_redis.RedisStream)."""
    if spec.startswith("log:") and len(spec) > len("log:"):
        from fluidps.io.stream_log import StreamLog

        return StreamLog(spec[len("log:") :])
    if spec.startswith("redis://"):
        from fluidps.io.stream_redis import RedisStream

        return RedisStream(spec)
    raise StreamError(f"stream {spec!r}: expected log:DIR (a segment log in DIR) or redis://HOST:PORT/STREAM")
