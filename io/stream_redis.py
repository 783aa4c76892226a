"""Redis Streams as a stream source: `redis://HOST:PORT/STREAM` (the `redis` extra).

Each record is a stream entry whose fields are the record's fields, each value written
as text: a number, or a vector's numbers separated by spaces, so any producer can
append (`redis-cli XADD clicks '*' ids '3 14' clicked 1`). The records' fields (names,
dtypes, shapes) live next to the stream, in the key `STREAM:fluidps-fields`, set by the
first fluidps append or by `fields=`. An entry without those fields, or whose values do
not parse as them, is handed back aside (Records.bad) for a dead-letter file.

Offsets are the entries' ids as one integer, `ms << 20 | seq` (increasing, as the ids
are; an entry's time is its ms). A consumer group's committed offset is the group's
last-delivered id in Redis (XGROUP SETID), moved only by `commit`: a record is
acknowledged once what it trained is applied, and Redis's own tools (XINFO GROUPS)
show where the group is.

Redis going away does not lose anything: every call retries with a log line until
`retry_s` has passed, then raises a StreamError saying where it could not connect.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np

from fluidps.errors import StreamError
from fluidps.io.dataset import Field
from fluidps.io.stream import (
    BadRecord,
    Records,
    batch_arrays,
    check_batch,
    check_group,
    describe_fields,
    field_of,
    fields_from_json,
    fields_of_batch,
    fields_to_json,
)

log = logging.getLogger(__name__)

URL = re.compile(r"redis://(?P<host>[^:/]+)(?::(?P<port>\d+))?/(?P<stream>[^/\s]+)")
SEQ_BITS = 20  # an id's sequence number: below 2**20 entries a millisecond
MS_BITS = 63 - SEQ_BITS  # its milliseconds (an offset is an int64)
FIELDS_KEY = "{stream}:fluidps-fields"
T = TypeVar("T")


def id_to_offset(entry_id: bytes | str) -> int:
    """The offset of a stream entry id `ms-seq`: ms << 20 | seq."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    if int(seq) >= 1 << SEQ_BITS or int(ms) >= 1 << MS_BITS:
        raise StreamError(
            f"entry id {text} has no fluidps offset (ids must be below {1 << MS_BITS}-{(1 << SEQ_BITS) - 1}): "
            "append with automatic ids ('*')"
        )
    return int(ms) << SEQ_BITS | int(seq)


def offset_to_id(offset: int) -> str:
    """The stream entry id of an offset (id_to_offset's inverse)."""
    return f"{offset >> SEQ_BITS}-{offset & ((1 << SEQ_BITS) - 1)}"


class RedisStream:
    """A Redis stream as a StreamSource. `url`: redis://HOST:PORT/STREAM."""

    def __init__(
        self,
        url: str,
        *,
        fields: Mapping[str, object] | None = None,
        retry_s: float = 60.0,
        client: Any = None,
    ):
        match = URL.fullmatch(url)
        if match is None:
            raise StreamError(f"stream {url!r}: expected redis://HOST:PORT/STREAM")
        self.name, self.stream = url, match["stream"]
        self.host, self.port = match["host"], int(match["port"] or 6379)
        self.retry_s = retry_s
        if client is None:
            try:
                import redis
            except ImportError:
                raise StreamError(
                    f"stream {url}: Redis Streams need the redis client: pip install 'fluidps[redis]'"
                ) from None
            client = redis.Redis(host=self.host, port=self.port, socket_timeout=10, socket_connect_timeout=5)
        self._redis = client
        self._fields: dict[str, Field] | None = None
        if fields is not None:
            given = {name: field_of(name, value) for name, value in fields.items()}
            stored = self._stored_fields()
            if stored is None:
                self._call(lambda r: r.set(self._fields_key, json.dumps(fields_to_json(given)), nx=True))
                stored = self._stored_fields()
            if stored != given:
                raise StreamError(
                    f"{url} holds records of {describe_fields(stored)}, not {describe_fields(given)}"
                )

    @property
    def _fields_key(self) -> str:
        return FIELDS_KEY.format(stream=self.stream)

    @property
    def fields(self) -> dict[str, Field] | None:
        if self._fields is None:
            self._fields = self._stored_fields()
        return self._fields

    # -- offsets and reads ------------------------------------------------------------------

    def start_offset(self) -> int:
        first = self._call(lambda r: r.xrange(self.stream, "-", "+", count=1))
        return id_to_offset(first[0][0]) if first else self.end_offset()

    def end_offset(self) -> int:
        last = self._call(lambda r: r.xrevrange(self.stream, "+", "-", count=1))
        return id_to_offset(last[0][0]) + 1 if last else 0

    def read(self, start: int, count: int) -> Records:
        if (
            not isinstance(start, (int, np.integer))
            or not isinstance(count, (int, np.integer))
            or start < 0
            or count < 0
        ):
            raise StreamError(f"read(start, count) takes offsets >= 0, got start={start!r}, count={count!r}")
        fields = self.fields
        if fields is None:
            raise StreamError(
                f"{self.name}: no records were appended by fluidps yet, so its fields are unknown"
            )
        entries = (
            self._call(lambda r: r.xrange(self.stream, offset_to_id(int(start)), "+", count=int(count)))
            if count
            else []
        )
        offsets, stamps, rows, bad = [], [], {name: [] for name in fields}, []
        for entry_id, values in entries:
            offset = id_to_offset(entry_id)
            parsed = _parse(values, fields)
            if isinstance(parsed, str):
                raw = json.dumps(
                    {k.decode(errors="replace"): v.decode(errors="replace") for k, v in values.items()}
                )
                bad.append(BadRecord(offset, f"entry {entry_id.decode()}: {parsed}", raw.encode()))
                continue
            offsets.append(offset)
            stamps.append((offset >> SEQ_BITS) / 1000.0)
            for name, value in parsed.items():
                rows[name].append(value)
        next_offset = id_to_offset(entries[-1][0]) + 1 if entries else int(start)
        arrays = {
            name: np.array(rows[name], f.dtype).reshape((len(offsets), *f.shape))
            for name, f in fields.items()
        }
        return Records(
            np.array(offsets, np.int64), np.array(stamps, np.float64), arrays, next_offset, tuple(bad)
        )

    def advance(self, start: int, count: int, end: int) -> tuple[int, int]:
        """(stop, n): where `count` entries from `start` end, before `end` (StreamSource.advance)."""
        if count < 1 or end <= start:
            return start, 0
        entries = self._call(
            lambda r: r.xrange(
                self.stream, offset_to_id(int(start)), offset_to_id(int(end) - 1), count=int(count)
            )
        )
        return (id_to_offset(entries[-1][0]) + 1, len(entries)) if entries else (start, 0)

    def append(self, batch: Mapping[str, object]) -> np.ndarray:
        """Append one entry per row of `batch` (in one transaction); returns their offsets.
        At least once: a batch whose reply a dropped connection lost is sent again, and
        may then be in the stream twice."""
        where = f"append to {self.name}"
        arrays = batch_arrays(batch, where)
        fields = self.fields
        if fields is None:
            given = fields_of_batch(arrays, where)
            self._call(lambda r: r.set(self._fields_key, json.dumps(fields_to_json(given)), nx=True))
            self._fields = None
            fields = self.fields
        check_batch(arrays, fields, where)
        count = len(next(iter(arrays.values())))
        text = {name: [_format(v) for v in arrays[name].astype(fields[name].dtype)] for name in fields}

        def add(r: Any) -> list:
            pipe = r.pipeline(transaction=True)
            for i in range(count):
                pipe.xadd(self.stream, {name: text[name][i] for name in fields})
            return pipe.execute()

        return np.array([id_to_offset(i) for i in self._call(add)], np.int64)

    # -- consumer groups --------------------------------------------------------------------

    def commit(self, group: str, offset: int) -> None:
        """Move `group`'s last-delivered id to the entry before `offset`."""
        check_group(group)
        end = self.end_offset()
        if not isinstance(offset, (int, np.integer)) or isinstance(offset, bool) or not 0 <= offset <= end:
            raise StreamError(f"{self.name}: cannot commit offset {offset!r} (its end is {end})")
        last = offset_to_id(int(offset) - 1) if offset > 0 else "0-0"
        self._ensure_group(group)
        self._call(lambda r: r.xgroup_setid(self.stream, group, last))

    def committed(self, group: str) -> int:
        check_group(group)
        for info in self._call(lambda r: r.xinfo_groups(self.stream)) if self._exists() else []:
            name = info["name"].decode() if isinstance(info["name"], bytes) else info["name"]
            if name == group:
                return (
                    id_to_offset(info["last-delivered-id"]) + 1
                    if info["last-delivered-id"] not in (b"0-0", "0-0")
                    else 0
                )
        return self.start_offset()

    def groups(self) -> dict[str, int]:
        infos = self._call(lambda r: r.xinfo_groups(self.stream)) if self._exists() else []
        names = [i["name"].decode() if isinstance(i["name"], bytes) else i["name"] for i in infos]
        return {name: self.committed(name) for name in names}

    def close(self) -> None:
        self._redis.close()

    def __enter__(self) -> RedisStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------

    def _exists(self) -> bool:
        return bool(self._call(lambda r: r.exists(self.stream)))

    def _ensure_group(self, group: str) -> None:
        try:
            self._call(lambda r: r.xgroup_create(self.stream, group, id="0", mkstream=True))
        except StreamError as e:
            if "BUSYGROUP" not in str(e):  # (the group exists already: what commit wants)
                raise

    def _stored_fields(self) -> dict[str, Field] | None:
        text = self._call(lambda r: r.get(self._fields_key))
        if text is None:
            return None
        try:
            items = json.loads(text)
        except ValueError as e:
            raise StreamError(
                f"{self.name}: the key {self._fields_key} does not hold fluidps fields: {e}"
            ) from None
        return fields_from_json(items, f"{self.name} (key {self._fields_key})")

    def _call(self, action: Callable[[Any], T]) -> T:
        """`action(client)`, retried while Redis cannot be reached, for up to retry_s."""
        import redis

        deadline, delay = time.monotonic() + self.retry_s, 0.1
        while True:
            try:
                return action(self._redis)
            except redis.AuthenticationError as e:
                raise StreamError(f"{self.name}: Redis at {self.host}:{self.port} refused: {e}") from None
            except (redis.ConnectionError, redis.TimeoutError) as e:
                if time.monotonic() + delay > deadline:
                    raise StreamError(
                        f"{self.name}: Redis at {self.host}:{self.port} could not be reached for {self.retry_s:g} s "
                        f"({e}); is redis-server running?"
                    ) from None
                log.warning(
                    "%s: Redis at %s:%d unreachable (%s); retrying in %.1f s",
                    self.name,
                    self.host,
                    self.port,
                    e,
                    delay,
                )
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
            except redis.RedisError as e:  # (not a connection's: asking again would not help)
                raise StreamError(f"{self.name}: Redis at {self.host}:{self.port} refused: {e}") from None


def _parse(values: Mapping[bytes, bytes], fields: Mapping[str, Field]) -> dict[str, np.ndarray] | str:
    """The record's fields, or why they do not parse."""
    names = {k.decode(errors="replace") for k in values}
    if names != set(fields):
        return f"fields {sorted(names)}, not {sorted(fields)}"
    out = {}
    for name, f in fields.items():
        text = values[name.encode()].decode(errors="replace").split()
        size = int(np.prod(f.shape))
        try:
            numbers = np.array([float(t) if f.dtype.kind == "f" else int(t) for t in text])
            value = numbers.astype(f.dtype)
        except (ValueError, OverflowError):
            return f"field {name!r}: {' '.join(text)!r} is not {f.dtype} numbers"
        if len(value) != size or (f.dtype.kind != "f" and not np.array_equal(value, numbers)):
            return f"field {name!r}: {' '.join(text)!r} is not {size} {f.dtype} number(s)"
        out[name] = value.reshape(f.shape)
    return out


def _format(value: np.ndarray) -> str:
    """A record's field as text that parses back to the same numbers (booleans as 0 / 1)."""
    if value.dtype.kind == "b":
        value = value.astype(np.int64)
    return " ".join(repr(v) for v in np.ravel(value).tolist())
