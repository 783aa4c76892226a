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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from fluidps.errors import StreamError
from fluidps.io.dataset import Field

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

    def advance(self, start: int, count: int, end: int) -> tuple[int, int]:
        """(stop, n): the offset after the first `count` records from `start` that lie before
        `end` (after the last of them when fewer are there), and how many records that is:
        where a window of `count` records starting at `start` ends."""
        ...

    def commit(self, group: str, offset: int) -> None:
        """Record that `group` is done with every record before `offset`."""
        ...

    def committed(self, group: str) -> int:
        """The offset `group` committed last (the stream's start if it never did)."""
        ...

    def close(self) -> None: ...


def read_range(source: StreamSource, start: int, stop: int, chunk: int = 65536) -> Records:
    """Every record of `source` at offsets start .. stop - 1 (a window), read `chunk`
    records at a time (a window's record count reads it at once, whether its offsets are
    dense or not); records retired meanwhile are missing, and `next_offset` is `stop`."""
    parts: list[Records] = []
    offset = max(start, min(source.start_offset(), stop))
    while offset < stop:
        part = source.read(offset, min(chunk, stop - offset))  # (fewer when offsets are sparse)
        keep = part.offsets < stop
        if not keep.all():
            part = Records(
                part.offsets[keep],
                part.timestamps[keep],
                {name: a[keep] for name, a in part.fields.items()},
                stop,
                tuple(b for b in part.bad if b.offset < stop),
            )
        parts.append(part)
        if part.next_offset <= offset:  # (nothing more there: the stream ends before stop)
            break
        offset = part.next_offset
    if not parts:
        return Records(np.zeros(0, np.int64), np.zeros(0), {}, stop)
    return Records(
        np.concatenate([p.offsets for p in parts]),
        np.concatenate([p.timestamps for p in parts]),
        {name: np.concatenate([p.fields[name] for p in parts]) for name in parts[0].fields},
        stop,
        tuple(b for p in parts for b in p.bad),
    )


def check_group(group: str) -> str:
    """`group` if it is a usable consumer group name, else a StreamError saying why."""
    if not isinstance(group, str) or not GROUP_NAME.fullmatch(group):
        raise StreamError(
            f"consumer group {group!r}: use 1-64 letters, digits, '_', '.' or '-', starting with a "
            "letter or digit"
        )
    return group


# -- the records' fields, as every source checks them ----------------------------------------


def field_of(name: str, value: object) -> Field:
    """Field `name` from a Field or an example of one record's value."""
    if isinstance(value, Field):
        return Field(name, value.dtype.newbyteorder("="), tuple(value.shape))
    example = np.asarray(value)
    if example.dtype.kind not in "biuf":
        raise StreamError(f"field {name!r} is {example.dtype}; fields hold numbers")
    return Field(name, example.dtype.newbyteorder("="), example.shape)


def describe_fields(fields: Mapping[str, Field] | None) -> str:
    return "(none)" if not fields else ", ".join(f.describe() for f in fields.values())


def fields_to_json(fields: Mapping[str, Field]) -> list[dict[str, Any]]:
    return [
        {"name": f.name, "dtype": f.dtype.newbyteorder("<").str, "shape": list(f.shape)}
        for f in fields.values()
    ]


def fields_from_json(items: object, where: str) -> dict[str, Field]:
    """fields_to_json's fields back, checked (`where` names their file or key in errors)."""
    if not isinstance(items, list) or not items:
        raise StreamError(f"{where}: 'fields' must be a non-empty list")
    fields: dict[str, Field] = {}
    for item in items:
        try:
            name, dtype, shape = item["name"], np.dtype(item["dtype"]), tuple(item["shape"])
        except (KeyError, TypeError) as e:
            raise StreamError(f"{where}: a field needs a name, a dtype and a shape ({e})") from None
        if (
            not isinstance(name, str)
            or dtype.kind not in "biuf"
            or not all(isinstance(d, int) and d >= 0 for d in shape)
        ):
            raise StreamError(f"{where}: field {item!r} is not a name, a numeric dtype and a shape")
        fields[name] = Field(name, dtype.newbyteorder("="), shape)
    return fields


def batch_arrays(batch: Mapping[str, object], where: str) -> dict[str, np.ndarray]:
    """An append's `batch` as arrays, each with one row per record."""
    if not isinstance(batch, Mapping) or not batch:
        raise StreamError(
            f"{where}: append takes a mapping of field name to array, got {type(batch).__name__}"
        )
    arrays = {str(name): np.asarray(value) for name, value in batch.items()}
    rows = {name: (len(a) if a.ndim else None) for name, a in arrays.items()}
    if None in rows.values() or len(set(rows.values())) != 1:
        raise StreamError(f"{where}: every field needs one row per record, got rows {rows}")
    return arrays


def fields_of_batch(arrays: Mapping[str, np.ndarray], where: str) -> dict[str, Field]:
    """The fields a first append's arrays give a stream."""
    for name, array in arrays.items():
        if array.dtype.kind not in "biuf":
            raise StreamError(f"{where}: field {name!r} is {array.dtype}; fields hold numbers")
    return {name: Field(name, a.dtype.newbyteorder("="), a.shape[1:]) for name, a in arrays.items()}


def check_batch(arrays: Mapping[str, np.ndarray], fields: Mapping[str, Field], where: str) -> None:
    """That an append's arrays are the stream's fields, each convertible without loss."""
    if set(arrays) != set(fields):
        missing, extra = sorted(set(fields) - set(arrays)), sorted(set(arrays) - set(fields))
        raise StreamError(
            f"{where}: its records have fields {describe_fields(fields)}; missing {missing}, unknown {extra}"
        )
    for name, f in fields.items():
        array = arrays[name]
        if array.shape[1:] != f.shape:
            raise StreamError(
                f"{where}: field {name!r} is {f.dtype}{list(f.shape)} a record, got {array.dtype}{list(array.shape[1:])}"
            )
        if not np.can_cast(array.dtype, f.dtype, "safe"):
            raise StreamError(
                f"{where}: field {name!r} holds {f.dtype}; {array.dtype} does not convert to it without loss "
                "(cast it first)"
            )


def canonical_spec(spec: str) -> str:
    """`spec` as every process of a job reads it: a log's directory made absolute (a
    process started elsewhere opens the same log)."""
    if spec.startswith("log:") and len(spec) > len("log:"):
        return "log:" + str(Path(spec[len("log:") :]).expanduser().resolve())
    return spec


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
