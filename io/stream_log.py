"""The embedded append-only segment log: fluidps's default stream, no server needed.

A log is a directory:

    stream.json           the records' fields (name, dtype, shape of one record), the
                          segment size, the retention
    <base:020d>.seg       segments: a header, then fixed-size records from offset `base`
    groups/<group>.json   each consumer group's committed offset
    .append.lock          held (flock) by an appender while it appends, so that several
                          processes can append and offsets stay dense

A record is its offset (u64), its append time (f64, seconds since the epoch), its fields'
bytes in the manifest's order, and a CRC32 of all of that (u32), little-endian. Records
have one size, so record k of a segment sits at a computed position and nothing needs an
index; a segment's file size says how many whole records it holds (the CRCs are
computed in one compiled pass: fluidps.io.crc). A tail torn by an appender that died
mid-write is cut off by the next append. A record whose CRC or offset
does not check out is handed back aside (Records.bad, for a dead-letter file), never
trained on and never a crash.

Segments roll once they reach `segment_bytes`; retention (`retain_bytes`,
`retain_seconds`) removes whole segments, oldest first, never the one being appended to.
Reading needs no lock: a reader counts only whole records, and a segment retired under
it is reported as retired.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import struct
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

from fluidps.errors import SerializationError, StreamError
from fluidps.io.atomic import fsync_dir, write_atomic
from fluidps.io.crc import crc32_rows
from fluidps.io.dataset import Field
from fluidps.io.stream import (
    GROUP_NAME,
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

MANIFEST = "stream.json"
FORMAT = "fluidps-stream"
SEGMENT = re.compile(r"(\d{20})\.seg")
HEADER = struct.Struct("<8sII")  # magic, format version, record size
MAGIC = b"FPSLOG\r\n"
VERSION = 1
DEFAULT_SEGMENT_BYTES = 64 << 20
_PREFIX = 16  # the offset (u64) and the append time (f64)
_CRC = 4


class StreamLog:
    """An append-only log of records in `path` (created on the first append if missing).

    `fields` fixes the records' fields up front (a mapping of name to an example array of
    one record, or Field objects); otherwise the first append sets them. `segment_bytes`,
    `retain_bytes` and `retain_seconds` are kept in the log's manifest: given for an
    existing log, they replace what it holds (`configure` can also lift a limit).
    `sync`: fsync every append (a record appended is a record kept, even on power loss).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        fields: Mapping[str, object] | None = None,
        segment_bytes: int | None = None,
        retain_bytes: int | None = None,
        retain_seconds: float | None = None,
        sync: bool = True,
    ):
        self.path = Path(path)
        self.name = f"log:{self.path}"
        self.sync = sync
        if self.path.exists() and not self.path.is_dir():
            raise StreamError(f"stream log {self.path} is a file; a log is a directory")
        self._manifest = self._read_manifest() if (self.path / MANIFEST).exists() else None
        wanted = {
            k: v
            for k, v in (
                ("segment_bytes", segment_bytes),
                ("retain_bytes", retain_bytes),
                ("retain_seconds", retain_seconds),
            )
            if v is not None
        }
        if fields is not None:
            given = {name: field_of(name, value) for name, value in fields.items()}
            if self._manifest is None:
                with self._append_lock():  # (another process may be creating it too)
                    if (self.path / MANIFEST).exists():
                        self._manifest = self._read_manifest()
                    else:
                        self._create(given, wanted)
            if given != self.fields:
                raise StreamError(
                    f"stream log {self.path} holds records of {describe_fields(self.fields)}, not "
                    f"{describe_fields(given)}"
                )
        if self._manifest is None:
            self._settings = {"segment_bytes": DEFAULT_SEGMENT_BYTES, "retain_bytes": None,
                              "retain_seconds": None, **wanted}  # fmt: skip
            _check_settings(self._settings, str(self.path))
        elif any(self._manifest[k] != v for k, v in wanted.items()):
            self.configure(**{**self.settings, **wanted})

    # -- what the log holds ---------------------------------------------------------------

    @property
    def fields(self) -> dict[str, Field] | None:
        """The records' fields, in their order on disk (None before the first append)."""
        return None if self._manifest is None else self._manifest["fields"]

    @property
    def settings(self) -> dict:
        """segment_bytes, retain_bytes and retain_seconds (None: no limit)."""
        source = self._settings if self._manifest is None else self._manifest
        return {k: source[k] for k in ("segment_bytes", "retain_bytes", "retain_seconds")}

    def segments(self) -> list[tuple[int, Path]]:
        """(base offset, file) of every segment, oldest first."""
        if not self.path.is_dir():
            return []
        found = [
            (int(m.group(1)), self.path / n) for n in os.listdir(self.path) if (m := SEGMENT.fullmatch(n))
        ]
        return sorted(found)

    def start_offset(self) -> int:
        """The first offset still held (earlier ones were retired by retention)."""
        segments = self.segments()
        return segments[0][0] if segments else 0

    def end_offset(self) -> int:
        """The next record's offset: the record count when nothing was retired."""
        segments = self.segments()
        if not segments:
            return 0
        base, file = segments[-1]
        return base + self._whole_records(file)

    def total_bytes(self) -> int:
        return sum(_size(file) for _, file in self.segments())

    # -- appending ------------------------------------------------------------------------

    def append(self, batch: Mapping[str, object], timestamp: float | np.ndarray | None = None) -> np.ndarray:
        """Append one record per row of `batch` (field name -> array, rows first); returns
        their offsets. `timestamp`: the records' time (one for all, or one a row; default
        now), which time windows and retention go by."""
        arrays = self._checked_batch(batch)
        rows = len(next(iter(arrays.values())))
        try:
            stamps = np.broadcast_to(
                np.asarray(time.time() if timestamp is None else timestamp, np.float64), (rows,)
            )
        except (ValueError, TypeError):
            raise StreamError(
                f"append to {self.path}: timestamp must be one time for all {rows} records or one a "
                f"record, got {np.shape(timestamp)}"
            ) from None
        if not np.all(np.isfinite(stamps)):
            raise StreamError(f"append to {self.path}: timestamps must be finite seconds since the epoch")
        if rows == 0:
            return np.zeros(0, np.int64)
        with self._append_lock():
            self._manifest = self._read_manifest()  # (another appender may have changed it)
            file, start = self._segment_to_append()
            records = self._encode(arrays, stamps, start)
            try:
                fd = os.open(file, os.O_WRONLY | os.O_APPEND)
                try:
                    view = memoryview(records)
                    while view:
                        view = view[os.write(fd, view) :]
                    if self.sync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError as e:  # (a part written is a torn tail: the next append cuts it off)
                raise StreamError(f"append to {self.path}: cannot write {file.name}: {e}") from None
            self._retire()
        return np.arange(start, start + rows, dtype=np.int64)

    def configure(
        self, segment_bytes: int, retain_bytes: int | None = None, retain_seconds: float | None = None
    ) -> None:
        """Replace the log's segment size and retention (None: no limit)."""
        settings = {
            "segment_bytes": segment_bytes,
            "retain_bytes": retain_bytes,
            "retain_seconds": retain_seconds,
        }
        _check_settings(settings, str(self.path))
        if self._manifest is None:
            self._settings = settings
            return
        with self._append_lock():
            self._manifest = {**self._read_manifest(), **settings}
            self._write_manifest()

    # -- reading --------------------------------------------------------------------------

    def read(self, start: int, count: int) -> Records:
        """Up to `count` records from offset `start`; fewer at the end of the log."""
        if not _is_offset(start) or not _is_offset(count):
            raise StreamError(f"read(start, count) takes integers >= 0, got start={start!r}, count={count!r}")
        if self._manifest is None and (self.path / MANIFEST).exists():
            self._manifest = self._read_manifest()
        segments = self.segments()  # (one listing for the whole read: an appender may roll meanwhile)
        first = segments[0][0] if segments else 0
        end = segments[-1][0] + self._whole_records(segments[-1][1]) if segments else 0
        if start < first:
            raise StreamError(
                f"stream log {self.path}: offsets {start}..{first - 1} were retired by retention; "
                f"it now starts at {first}"
            )
        if start > end:
            raise StreamError(f"stream log {self.path}: offset {start} is past its end ({end})")
        stop = min(start + int(count), end)
        if stop == start or self._manifest is None:
            return _empty(self.fields or {}, start)
        ends = [b for b, _ in segments[1:]] + [end]
        chunks = [self._read_span(file, base, max(start, base), min(stop, nxt))
                  for (base, file), nxt in zip(segments, ends, strict=True) if base < stop and nxt > start]  # fmt: skip
        return self._decode(chunks, stop)

    def advance(self, start: int, count: int, end: int) -> tuple[int, int]:
        """(stop, n): where `count` records from `start` end, before `end` (StreamSource.advance)."""
        first, last = max(start, self.start_offset()), min(end, self.end_offset())
        n = max(0, min(count, last - first))
        return (first + n, n) if n else (start, 0)

    def tail(self, start: int, poll_s: float = 0.2, batch: int = 1024) -> Iterator[Records]:
        """Reads from `start` on, forever: each new run of records as it is appended."""
        offset = start
        while True:
            records = self.read(offset, batch)
            if records.next_offset == offset:
                time.sleep(poll_s)
                continue
            offset = records.next_offset
            yield records

    # -- consumer groups ------------------------------------------------------------------

    def commit(self, group: str, offset: int) -> None:
        """Record that `group` is done with every record before `offset`."""
        check_group(group)
        end = self.end_offset()
        if not _is_offset(offset) or offset > end:
            raise StreamError(f"stream log {self.path}: cannot commit offset {offset!r} (its end is {end})")
        groups = self.path / "groups"
        body = json.dumps({"group": group, "offset": int(offset), "time": time.time()})
        try:
            groups.mkdir(parents=True, exist_ok=True)
            write_atomic(str(groups / f"{group}.json"), [body.encode()])
        except (OSError, SerializationError) as e:
            raise StreamError(
                f"stream log {self.path}: cannot commit group {group!r}'s offset: {e}"
            ) from None

    def committed(self, group: str) -> int:
        """The offset `group` committed last (the log's start if it never did)."""
        file = self.path / "groups" / f"{check_group(group)}.json"
        if not file.exists():
            return self.start_offset()
        try:
            body = json.loads(file.read_text())
            offset = body["offset"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise StreamError(f"cannot read consumer group {group!r}'s offset from {file}: {e}") from None
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise StreamError(f"{file}: offset must be an integer >= 0, got {offset!r}")
        return offset

    def groups(self) -> dict[str, int]:
        """Every consumer group's committed offset."""
        folder = self.path / "groups"
        names = sorted(f.stem for f in folder.glob("*.json")) if folder.is_dir() else []
        return {
            name: self.committed(name) for name in names if GROUP_NAME.fullmatch(name)
        }  # (not stray files)

    def close(self) -> None:
        """Nothing is held open between calls; here for the StreamSource interface."""

    def __enter__(self) -> StreamLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def describe(self) -> str:
        fields = "no records yet" if self.fields is None else describe_fields(self.fields)
        start, end = self.start_offset(), self.end_offset()
        held = f"offsets {start}..{end - 1}" if end > start else "no records held"
        return (
            f"stream log {self.path}: {fields}; {held} (the next is {end}) "
            f"in {len(self.segments())} segment(s), {self.total_bytes():,} bytes"
        )

    # -- internals ------------------------------------------------------------------------

    def _checked_batch(self, batch: Mapping[str, object]) -> dict[str, np.ndarray]:
        where = f"append to {self.path}"
        arrays = batch_arrays(batch, where)
        if self.fields is None:  # the first append sets the fields
            fields = fields_of_batch(arrays, where)
            with self._append_lock():
                if (self.path / MANIFEST).exists():  # another process created it first
                    self._manifest = self._read_manifest()
                else:
                    self._create(fields, self._settings)
        check_batch(arrays, self.fields, where)
        return arrays

    def _record_dtype(self) -> np.dtype:
        columns = [("offset", "<u8"), ("time", "<f8")]
        columns += [
            (f"f_{name}", field.dtype.newbyteorder("<"), field.shape) for name, field in self.fields.items()
        ]
        return np.dtype([*columns, ("crc", "<u4")])

    def _encode(self, arrays: Mapping[str, np.ndarray], stamps: np.ndarray, start: int) -> np.ndarray:
        rows = len(stamps)
        records = np.zeros(rows, self._record_dtype())
        records["offset"] = np.arange(start, start + rows, dtype=np.uint64)
        records["time"] = stamps
        for name, array in arrays.items():
            records[f"f_{name}"] = array
        raw = records.view(np.uint8).reshape(rows, -1)
        records["crc"] = crc32_rows(raw, raw.shape[1] - _CRC)
        return records

    def _decode(self, chunks: list[tuple[np.ndarray, int, int]], stop: int) -> Records:
        """Records from (records read, the offset they start at, the offset they should
        reach) of each segment read: those that check out, the others and any a segment
        lacks (cut short by a crash before its fsync) as bad records."""
        raw = np.concatenate([c for c, _, _ in chunks]) if len(chunks) > 1 else chunks[0][0]
        expected = np.concatenate([np.arange(a, a + len(c), dtype=np.uint64) for c, a, _ in chunks])
        rows = raw.view(np.uint8).reshape(len(raw), raw.dtype.itemsize)
        crcs = crc32_rows(rows, rows.shape[1] - _CRC)
        good = (crcs == raw["crc"]) & (raw["offset"] == expected)
        bad = []
        for i in np.flatnonzero(~good):
            offset = int(expected[i])
            reason = (
                "its CRC does not match"
                if crcs[i] != raw["crc"][i]
                else f"it says offset {int(raw['offset'][i])}"
            )
            bad.append(BadRecord(offset, reason, rows[i].tobytes()))
        for records, first, last in chunks:
            for offset in range(first + len(records), last):
                bad.append(BadRecord(offset, "its segment ends before it (cut short by a crash)"))
        kept = raw[good]
        fields = {
            name: np.ascontiguousarray(kept[f"f_{name}"], dtype=field.dtype).reshape(
                (len(kept), *field.shape)
            )
            for name, field in self.fields.items()
        }
        return Records(
            kept["offset"].astype(np.int64), kept["time"].astype(np.float64), fields, stop,
            tuple(sorted(bad, key=lambda b: b.offset)),
        )  # fmt: skip

    def _read_span(self, file: Path, base: int, start: int, stop: int) -> tuple[np.ndarray, int, int]:
        """The whole records of `file` in [start, stop), and start and stop."""
        dtype = self._record_dtype()
        try:
            with open(file, "rb") as f:
                self._check_header(f.read(HEADER.size), file)
                f.seek(HEADER.size + (start - base) * dtype.itemsize)
                data = f.read((stop - start) * dtype.itemsize)
        except FileNotFoundError:
            raise StreamError(
                f"stream log {self.path}: offsets from {start} were retired by retention while being read; "
                f"it now starts at {self.start_offset()}"
            ) from None
        except OSError as e:
            raise StreamError(f"stream log {self.path}: cannot read segment {file.name}: {e}") from None
        whole = len(data) // dtype.itemsize
        return np.frombuffer(data[: whole * dtype.itemsize], dtype).copy(), start, stop

    def _check_header(self, header: bytes, file: Path) -> None:
        if len(header) < HEADER.size:
            raise StreamError(f"stream log {self.path}: segment {file.name} has no header")
        magic, version, size = HEADER.unpack(header)
        if magic != MAGIC or version != VERSION:
            raise StreamError(f"{file} is not a version {VERSION} fluidps stream segment")
        if size != self._record_dtype().itemsize:
            raise StreamError(
                f"{file} holds records of {size} bytes; the manifest's fields "
                f"({describe_fields(self.fields)}) make {self._record_dtype().itemsize}"
            )

    def _whole_records(self, file: Path) -> int:
        if self._manifest is None:
            if not (self.path / MANIFEST).exists():
                return 0
            self._manifest = self._read_manifest()
        return max(_size(file) - HEADER.size, 0) // self._record_dtype().itemsize

    def _segment_to_append(self) -> tuple[Path, int]:
        """The segment the next records go to, and their first offset: the last segment,
        its torn tail cut off, or a new one once it is full (under the append lock)."""
        segments = self.segments()
        size = self._record_dtype().itemsize
        if segments:
            base, file = segments[-1]
            length = _size(file)
            whole = max(length - HEADER.size, 0) // size
            if length < HEADER.size:  # created, not yet headed, when its appender died
                self._write_header(file)
            elif length != HEADER.size + whole * size:  # a torn tail: its appender died mid-write
                os.truncate(file, HEADER.size + whole * size)
            if HEADER.size + whole * size < self._manifest["segment_bytes"]:
                return file, base + whole
            start = base + whole
        else:
            start = 0
        file = self.path / f"{start:020d}.seg"
        self._write_header(file)
        fsync_dir(str(self.path))
        return file, start

    def _write_header(self, file: Path) -> None:
        with open(file, "wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, self._record_dtype().itemsize))
            f.flush()
            os.fsync(f.fileno())

    def _retire(self) -> None:
        """Remove whole segments past the retention, oldest first, never the last one."""
        limit_bytes, limit_s = self._manifest["retain_bytes"], self._manifest["retain_seconds"]
        if limit_bytes is None and limit_s is None:
            return
        segments = self.segments()
        total = sum(_size(file) for _, file in segments)
        removed = False
        for _, file in segments[:-1]:
            too_big = limit_bytes is not None and total > limit_bytes
            too_old = limit_s is not None and self._last_time(file) < time.time() - limit_s
            if not (too_big or too_old):
                break
            total -= _size(file)
            file.unlink()
            removed = True
        if removed:
            fsync_dir(str(self.path))

    def _last_time(self, file: Path) -> float:
        size = self._record_dtype().itemsize
        whole = self._whole_records(file)
        if whole == 0:
            return float("-inf")
        with open(file, "rb") as f:
            f.seek(HEADER.size + (whole - 1) * size + 8)
            return struct.unpack("<d", f.read(8))[0]

    @contextlib.contextmanager
    def _append_lock(self) -> Iterator[None]:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path / ".append.lock", os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as e:
            raise StreamError(f"stream log {self.path}: cannot take its append lock: {e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # (closing releases the lock)

    def _create(self, fields: dict[str, Field], settings: dict) -> None:
        _check_settings({"segment_bytes": DEFAULT_SEGMENT_BYTES, "retain_bytes": None,
                         "retain_seconds": None, **settings}, str(self.path))  # fmt: skip
        self.path.mkdir(parents=True, exist_ok=True)
        self._manifest = {
            "segment_bytes": DEFAULT_SEGMENT_BYTES,
            "retain_bytes": None,
            "retain_seconds": None,
            **settings,
            "fields": fields,
        }
        self._write_manifest()

    def _write_manifest(self) -> None:
        body = {
            "format": FORMAT,
            "version": VERSION,
            "fields": fields_to_json(self._manifest["fields"]),
            **self.settings,
        }
        write_atomic(str(self.path / MANIFEST), [json.dumps(body, indent=1).encode()])

    def _read_manifest(self) -> dict:
        file = self.path / MANIFEST
        try:
            body = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise StreamError(f"cannot read the stream log manifest {file}: {e}") from None
        if not isinstance(body, dict) or body.get("format") != FORMAT or body.get("version") != VERSION:
            raise StreamError(f"{file} is not a version {VERSION} {FORMAT} manifest")
        fields = fields_from_json(body.get("fields"), str(file))
        settings = {k: body.get(k) for k in ("segment_bytes", "retain_bytes", "retain_seconds")}
        _check_settings(settings, str(file))
        return {**settings, "fields": fields}


def _check_settings(settings: dict, where: str) -> None:
    segment = settings.get("segment_bytes")
    if not isinstance(segment, int) or isinstance(segment, bool) or segment <= HEADER.size:
        raise StreamError(f"{where}: segment_bytes must be an integer above {HEADER.size}, got {segment!r}")
    for key in ("retain_bytes", "retain_seconds"):
        value = settings.get(key)
        if value is not None and (
            not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0
        ):
            raise StreamError(f"{where}: {key} must be a number > 0 or None (no limit), got {value!r}")


def _is_offset(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 0


def _size(file: Path) -> int:
    try:
        return file.stat().st_size
    except FileNotFoundError:
        return 0


def _empty(fields: Mapping[str, Field], offset: int) -> Records:
    arrays = {name: np.zeros((0, *f.shape), f.dtype) for name, f in fields.items()}
    return Records(np.zeros(0, np.int64), np.zeros(0, np.float64), arrays, offset)
