"""Pserver checkpoints: crash-safe files, checksums, the last K kept, restores that
reshard, and whole-model exports.

Checkpoint number N of pserver P is two files in the checkpoint directory:

    pserver-P-N.data   every variable the pserver holds, in Paddle's tensor format
    pserver-P-N.json   the manifest: step, variables (name, dtype, shape, and which
                       rows of which variable of the original program each one is),
                       the data file's size and sha256

The data file is written first (temporary file, fsync, rename), then the
manifest the same way, then the directory is fsynced: a checkpoint exists once
its manifest does, so a crash mid-write leaves the previous one as the latest.
Reading verifies the sha256; a corrupt checkpoint is an error naming the file.

Restoring assembles each variable a pserver needs from the newest valid
checkpoint of every pserver, by rows of the original variable: a pserver
restarting in the same job finds its own slices; a job with a different
number of pservers finds the same rows cut differently (resharding).

A shard of a hashed table is stored as the arrays of SparseTable.to_arrays (ids,
rows, optimizer state, counters), each a piece whose origin is
`<table>@hashed<shard>.<array>`; restoring hands every shard's arrays to the table,
which keeps the ids it owns (resharding by the id rule), and merging writes the
table as `<table>.npz` of (ids, rows).

A checkpoint is a base or a delta. A delta names its base (a checkpoint of the same
pserver) and holds every dense variable whole but only the hashed-table rows updated
since that base, with every live row's id and score (SparseTable.to_arrays(since)).
Loading a delta loads its base and rebuilds the whole tables (apply_delta), so what
latest() hands on is always whole; pruning keeps the bases of the deltas it keeps.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from fluidps.errors import CheckpointError, ExecutionError, SerializationError
from fluidps.io.atomic import TEMP_SUFFIX, fsync_dir, write_atomic
from fluidps.io.tensor_file import TensorReader, lod_tensor_chunks
from fluidps.ops.sparse_table import apply_delta, is_delta, newest_job_shards

FORMAT = "fluidps-pserver-checkpoint"
_NAME = re.compile(r"pserver-(\d+)-(\d+)\.json")
_HASHED = re.compile(r"(?P<origin>.+)@hashed(?P<shard>\d+)\.(?P<key>\w+)")


def hashed_piece(origin: str, shard: int, key: str) -> str:
    """The origin recorded for array `key` of shard `shard` of hashed table `origin`."""
    return f"{origin}@hashed{shard}.{key}"


def hashed_tables(
    sources: Iterable[tuple[Checkpoint, Mapping[str, np.ndarray]]],
) -> dict[str, list[dict[str, np.ndarray]]]:
    """Each hashed table's shards (their to_arrays), in the order of `sources`."""
    tables: dict[str, list[dict[str, np.ndarray]]] = {}
    for checkpoint, values in sources:
        for (origin, _), arrays in sorted(_shards(checkpoint, values).items(), key=lambda kv: kv[0][1]):
            tables.setdefault(origin, []).append(arrays)
    return tables


class Placement(NamedTuple):
    """Which variable of the original program a pserver variable is (part of)."""

    origin: str
    offset: int | None = None  # its first row there; None: all of it
    origin_rows: int | None = None  # rows of the whole original variable, when known


@dataclass(frozen=True)
class Piece:
    """Rows [offset, offset + rows) of the original variable `origin` (offset None: all of it)."""

    name: str  # the variable on the pserver
    origin: str
    offset: int | None
    dtype: str
    shape: tuple[int, ...]
    origin_rows: int | None = None  # rows of the whole original variable, when known

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def first(self) -> int:
        return self.offset or 0


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint's manifest."""

    path: Path  # the manifest
    pserver_id: int
    count: int
    step: int
    pieces: tuple[Piece, ...]
    data_file: str
    data_bytes: int
    sha256: str
    reason: str
    created: float
    base: int | None = None  # a delta: the count of its base checkpoint
    # The stream batches the values hold (fluidps.executor.ps.applied_batches' books), for a
    # pserver that keeps them; checked where they are read.
    applied_batches: Any = None

    @property
    def kind(self) -> str:
        return "base" if self.base is None else "delta"

    @property
    def data_path(self) -> Path:
        return self.path.parent / self.data_file

    def load(self) -> dict[str, np.ndarray]:
        """Every variable, after checking the data file's size and sha256."""
        try:
            data = self.data_path.read_bytes()
        except OSError as e:
            raise CheckpointError(f"checkpoint {self.path.name}: cannot read {self.data_path}: {e}") from None
        if len(data) != self.data_bytes:
            raise CheckpointError(
                f"checkpoint {self.path.name} is incomplete: {self.data_path} has {len(data)} bytes, "
                f"the manifest says {self.data_bytes}"
            )
        digest = hashlib.sha256(data).hexdigest()
        if digest != self.sha256:
            raise CheckpointError(
                f"checkpoint {self.path.name} is corrupt: the sha256 of {self.data_path} is {digest}, "
                f"the manifest says {self.sha256}"
            )
        reader = TensorReader(data, str(self.data_path))
        values = {}
        try:
            for piece in self.pieces:
                array, _ = reader.read_lod_tensor(f"variable {piece.name!r}")
                if array.shape != piece.shape or array.dtype.newbyteorder("<") != np.dtype(
                    piece.dtype
                ).newbyteorder("<"):
                    raise CheckpointError(
                        f"checkpoint {self.path.name}: {piece.name!r} is {array.dtype}{list(array.shape)}, "
                        f"the manifest says {piece.dtype}{list(piece.shape)}"
                    )
                values[piece.name] = array
            reader.expect_end()
        except SerializationError as e:
            raise CheckpointError(f"checkpoint {self.path.name}: {e}") from None
        return values


class CheckpointStore:
    """The checkpoint directory, from one pserver's point of view."""

    def __init__(self, directory: str | os.PathLike, pserver_id: int, keep: int = 3):
        if keep < 1:
            raise CheckpointError(f"keep must be >= 1 checkpoint, got {keep}")
        self.directory = Path(directory)
        self.pserver_id = pserver_id
        self.keep = keep

    def save(
        self,
        values: Mapping[str, np.ndarray],
        placements: Mapping[str, tuple],
        step: int,
        reason: str,
        base: int | None = None,
        applied_batches: dict[str, Any] | None = None,
    ) -> Checkpoint:
        """Write checkpoint count + 1 of `values` (name -> array), where `placements` says
        which original variable each one is (part of): name -> Placement or a tuple
        (origin, offset[, origin_rows]); a name not there is a whole variable of its own.
        `base`: the values hold deltas of hashed tables against this pserver's checkpoint
        number `base`. `applied_batches`: the stream batches the values hold, recorded in
        the manifest. Older checkpoints of this pserver beyond `keep` are removed, except
        the bases of those kept."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"cannot create the checkpoint directory {self.directory}: {e}") from None
        mine = [c for c in scan(self.directory) if c.pserver_id == self.pserver_id]
        # (by the files' names, unreadable manifests too: a count is never written twice,
        # so a reader of the newest manifests can tell checkpoints apart by it)
        count = newest_manifests(self.directory).get(self.pserver_id, (0, None))[0] + 1
        if base is not None and not any(c.count == base and c.base is None for c in mine):
            raise CheckpointError(
                f"pserver {self.pserver_id} has no base checkpoint {base} in {self.directory} for a delta"
            )
        stem = f"pserver-{self.pserver_id}-{count:06d}"
        pieces, chunks = [], []
        for name, value in values.items():
            array = np.asarray(value)
            origin, offset, origin_rows = Placement(*placements.get(name, (name,)))
            stored = array.dtype.newbyteorder("<").str  # Paddle's format is little-endian
            pieces.append(Piece(name, origin, offset, stored, tuple(array.shape), origin_rows))
            chunks += lod_tensor_chunks(array, what=f"variable {name!r}")
        digest = hashlib.sha256()
        for chunk in chunks:
            digest.update(chunk)
        try:
            size = write_atomic(str(self.directory / f"{stem}.data"), chunks, sync_dir=False)
            manifest = {
                "format": FORMAT,
                "version": 1,
                "pserver_id": self.pserver_id,
                "count": count,
                "step": step,
                "reason": reason,
                "created": time.time(),
                "base": base,
                "vars": [
                    {
                        "name": p.name,
                        "origin": p.origin,
                        "offset": p.offset,
                        "origin_rows": p.origin_rows,
                        "dtype": p.dtype,
                        "shape": list(p.shape),
                    }
                    for p in pieces
                ],
                "data": {"file": f"{stem}.data", "bytes": size, "sha256": digest.hexdigest()},
            }
            if applied_batches is not None:
                manifest["applied_batches"] = applied_batches
            write_atomic(
                str(self.directory / f"{stem}.json"),
                [json.dumps(manifest, indent=1).encode()],
                sync_dir=False,
            )
            fsync_dir(str(self.directory))
        except SerializationError as e:
            raise CheckpointError(f"cannot write checkpoint {stem} into {self.directory}: {e}") from None
        self._prune(count)
        return _parse(self.directory / f"{stem}.json")

    def _prune(self, newest: int) -> None:
        """Remove this pserver's checkpoints older than the last `keep`, and temporary
        files crashed writes left behind."""
        mine = [c for c in scan(self.directory) if c.pserver_id == self.pserver_id]
        needed = {c.base for c in mine if c.count > newest - self.keep}
        for old in mine:
            if old.count <= newest - self.keep and old.count not in needed:
                for path in (old.path, old.data_path):  # the manifest first: no half checkpoint is listed
                    path.unlink(missing_ok=True)
        prefix = f".pserver-{self.pserver_id}-"
        for temp in self.directory.glob(f"{prefix}*{TEMP_SUFFIX}"):
            temp.unlink(missing_ok=True)


def scan(directory: str | os.PathLike) -> list[Checkpoint]:
    """Every checkpoint manifest in `directory` that parses, oldest first per pserver.
    (Whether its data is intact is checked when it is loaded.)"""
    path = Path(directory)
    if not path.is_dir():
        return []
    found = []
    for manifest in path.iterdir():
        if _NAME.fullmatch(manifest.name):
            try:
                found.append(_parse(manifest))
            except CheckpointError:
                continue  # reported by latest() when it matters
    return sorted(found, key=lambda c: (c.pserver_id, c.count))


def newest_manifests(directory: str | os.PathLike) -> dict[int, tuple[int, Path]]:
    """Per pserver, the count and path of its newest checkpoint manifest, by name (not read)."""
    newest: dict[int, tuple[int, Path]] = {}
    path = Path(directory)
    if path.is_dir():
        for manifest in path.iterdir():
            if (match := _NAME.fullmatch(manifest.name)) is not None:
                pserver, count = int(match[1]), int(match[2])
                if count > newest.get(pserver, (0, path))[0]:
                    newest[pserver] = (count, manifest)
    return newest


def read_manifest(path: str | os.PathLike) -> Checkpoint:
    """One checkpoint's manifest (its data is checked when it is loaded)."""
    return _parse(Path(path))


def latest(
    directory: str | os.PathLike,
) -> tuple[dict[int, tuple[Checkpoint, dict[str, np.ndarray]]], list[str]]:
    """The newest intact checkpoint of each pserver, loaded: {pserver id: (checkpoint,
    values)}, and the problems met on the way (corrupt or unreadable newer ones, skipped)."""
    problems: list[str] = []
    path = Path(directory)
    if path.is_dir():
        for manifest in sorted(path.iterdir()):
            if _NAME.fullmatch(manifest.name):
                try:
                    _parse(manifest)
                except CheckpointError as e:
                    problems.append(str(e))
    newest: dict[int, tuple[Checkpoint, dict[str, np.ndarray]]] = {}
    by_pserver: dict[int, list[Checkpoint]] = {}
    for c in scan(directory):
        by_pserver.setdefault(c.pserver_id, []).append(c)
    for pserver_id, checkpoints in by_pserver.items():
        for c in reversed(checkpoints):
            try:
                newest[pserver_id] = _load_whole(c, checkpoints)
                break
            except CheckpointError as e:
                problems.append(f"{e}; using an older one")
    return newest, problems


def _load_whole(
    checkpoint: Checkpoint, same_pserver: list[Checkpoint]
) -> tuple[Checkpoint, dict[str, np.ndarray]]:
    """A checkpoint's values, its hashed-table deltas applied to its base's whole arrays
    (the checkpoint returned then lists whole pieces)."""
    loaded = checkpoint.load()
    if checkpoint.base is None:
        return checkpoint, loaded
    where = f"checkpoint {checkpoint.path.name} (a delta of checkpoint {checkpoint.base})"
    base = next((c for c in same_pserver if c.count == checkpoint.base and c.base is None), None)
    if base is None:
        raise CheckpointError(f"{where}: its base checkpoint is missing")
    try:
        base_values = base.load()
    except CheckpointError as e:
        raise CheckpointError(f"{where}: its base is unusable: {e}") from None
    base_shards = _shards(base, base_values)
    pieces = [p for p in checkpoint.pieces if not _HASHED.fullmatch(p.origin)]
    values = {p.name: loaded[p.name] for p in pieces}
    for (origin, shard), arrays in _shards(checkpoint, loaded).items():
        if not is_delta(arrays):
            whole = arrays
        elif (origin, shard) not in base_shards:
            raise CheckpointError(f"{where}: its base holds no shard {shard} of hashed table {origin!r}")
        else:
            try:
                whole = apply_delta(base_shards[origin, shard], arrays, origin)
            except ExecutionError as e:
                raise CheckpointError(f"{where}: {e}") from None
        for key, array in whole.items():
            name = hashed_piece(origin, shard, key)
            pieces.append(Piece(name, name, None, array.dtype.str, tuple(array.shape)))
            values[name] = array
    return replace(checkpoint, pieces=tuple(pieces)), values


def _shards(
    checkpoint: Checkpoint, values: Mapping[str, np.ndarray]
) -> dict[tuple[str, int], dict[str, np.ndarray]]:
    """The hashed-table shards a checkpoint holds: {(table, shard): {key: array}}."""
    shards: dict[tuple[str, int], dict[str, np.ndarray]] = {}
    for piece in checkpoint.pieces:
        match = _HASHED.fullmatch(piece.origin)
        if match:
            shards.setdefault((match["origin"], int(match["shard"])), {})[match["key"]] = values[piece.name]
    return shards


def assemble(
    wanted: Iterable[tuple[str, str, int | None, tuple[int, ...], np.dtype]],
    sources: Iterable[tuple[Checkpoint, Mapping[str, np.ndarray]]],
) -> dict[str, np.ndarray]:
    """Each wanted variable (name, origin, row offset or None, shape, dtype) built from
    the rows of its origin that the checkpoints hold, taking each row from the first
    source that holds it (give them newest first). Raises CheckpointError naming what
    is missing or does not fit."""
    pieces = _pieces_by_origin(sources)
    out = {}
    for name, origin, offset, shape, dtype in wanted:
        found = pieces.get(origin)
        if not found:
            raise CheckpointError(f"no checkpoint holds {origin!r} (needed for {name!r})")
        if offset is None:
            value = _whole(origin, found)
        else:
            value = _rows(origin, found, offset, shape[0] if shape else 1)
        if value.shape != tuple(shape) or value.dtype.newbyteorder("<") != np.dtype(dtype).newbyteorder("<"):
            raise CheckpointError(
                f"checkpoint value for {name!r} (from {origin!r}) is {value.dtype}{list(value.shape)}, "
                f"the program needs {np.dtype(dtype)}{list(shape)}"
            )
        out[name] = np.array(value, dtype=dtype, copy=True)
    return out


def merge(sources: Iterable[tuple[Checkpoint, Mapping[str, np.ndarray]]]) -> dict[str, np.ndarray]:
    """Whole variables of the original program from pserver checkpoints' pieces (each row
    from the first source holding it: give them newest first)."""
    pieces = _pieces_by_origin(sources)
    return {origin: np.array(_whole(origin, found), copy=True) for origin, found in pieces.items()}


def _pieces_by_origin(
    sources: Iterable[tuple[Checkpoint, Mapping[str, np.ndarray]]],
) -> dict[str, list[tuple[Piece, np.ndarray]]]:
    pieces: dict[str, list[tuple[Piece, np.ndarray]]] = {}
    for checkpoint, values in sources:
        for piece in checkpoint.pieces:
            if not _HASHED.fullmatch(piece.origin):  # hashed tables: hashed_tables()
                pieces.setdefault(piece.origin, []).append((piece, values[piece.name]))
    return pieces


def _whole(origin: str, found: list[tuple[Piece, np.ndarray]]) -> np.ndarray:
    """All of `origin`: the newest whole copy, or its rows from the pieces. Its height is
    what the manifests say it is, so rows held only by a lost checkpoint are an error."""
    newest_piece, newest_value = found[0]
    if newest_piece.offset is None and (newest_value.ndim == 0 or all(p.offset is None for p, _ in found)):
        return newest_value
    heights = {p.origin_rows for p, _ in found if p.origin_rows is not None}
    if len(heights) > 1:
        raise CheckpointError(f"the checkpoints disagree on how many rows {origin!r} has: {sorted(heights)}")
    total = heights.pop() if heights else max(p.first + p.rows for p, _ in found)
    return _rows(origin, found, 0, total)


def _rows(origin: str, found: list[tuple[Piece, np.ndarray]], offset: int, rows: int) -> np.ndarray:
    """Rows [offset, offset + rows) of `origin`, each from the first piece holding it (a
    whole copy holds them all)."""
    parts, at, end = [], offset, offset + rows
    while at < end:
        covering = next(((p, v) for p, v in found if v.ndim > 0 and p.first <= at < p.first + p.rows), None)
        if covering is None:
            raise CheckpointError(
                f"the checkpoints do not hold row {at} of {origin!r} (rows {offset}..{end - 1} are needed)"
            )
        piece, value = covering
        stop = min(piece.first + piece.rows, end)
        parts.append(value[at - piece.first : stop - piece.first])
        at = stop
    if not parts:
        raise CheckpointError(f"no rows of {origin!r} were asked for")
    return np.concatenate(parts)


def _parse(path: Path) -> Checkpoint:
    where = f"checkpoint manifest {path}"
    try:
        body = json.loads(path.read_text())
        if body.get("format") != FORMAT or body.get("version") != 1:
            raise CheckpointError(f"{where} is not a version 1 {FORMAT} manifest")
        pieces = []
        for item in body["vars"]:
            offset = item["offset"]
            shape = tuple(int(d) for d in item["shape"])
            if not isinstance(item["name"], str) or not isinstance(item["origin"], str):
                raise TypeError("names must be strings")
            if offset is not None and (not isinstance(offset, int) or offset < 0):
                raise ValueError(f"bad offset {offset!r}")
            if any(d < 0 for d in shape) or math.prod(shape) > 1 << 40:
                raise ValueError(f"bad shape {list(shape)}")
            np.dtype(item["dtype"])
            origin_rows = item.get("origin_rows")
            if origin_rows is not None and (not isinstance(origin_rows, int) or origin_rows < 0):
                raise ValueError(f"bad origin_rows {origin_rows!r}")
            pieces.append(Piece(item["name"], item["origin"], offset, item["dtype"], shape, origin_rows))
        data = body["data"]
        if Path(data["file"]).name != data["file"]:
            raise ValueError(f"the data file {data['file']!r} must be in the checkpoint directory")
        return Checkpoint(
            path,
            int(body["pserver_id"]),
            int(body["count"]),
            int(body["step"]),
            tuple(pieces),
            data["file"],
            int(data["bytes"]),
            str(data["sha256"]),
            str(body.get("reason", "")),
            float(body.get("created", 0.0)),
            _base(body.get("base")),
            _books(body.get("applied_batches")),
        )
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{where} is unreadable: {type(e).__name__}: {e}") from None


def _books(value: Any) -> dict[str, Any] | None:
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"bad applied_batches {str(value)[:80]!r}")
    return value


def _base(value: Any) -> int | None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"bad base {value!r}")
    return value


def merge_checkpoints(
    checkpoint_dir: str | os.PathLike, dirname: str | os.PathLike | None = None
) -> dict[str, np.ndarray]:
    """The whole variables of a job's model, from the newest intact checkpoint of each of
    its pservers; with `dirname`, also saved there one file per variable in Paddle's
    format (fluidps.io.load_persistables / load_vars read it, into a job of any size),
    and each hashed table as `<table>.npz` holding `ids` and `rows` (merge_hashed_tables).
    Raises CheckpointError when there is none, or rows of a variable are missing."""
    sources, problems = _newest(checkpoint_dir)
    try:
        values, hashed = merge(sources), _merge_hashed(sources)
    except CheckpointError as e:
        detail = f" (skipped: {'; '.join(problems)})" if problems else ""
        raise CheckpointError(f"{e}{detail}") from None
    if dirname is not None:
        out = Path(dirname)
        out.mkdir(parents=True, exist_ok=True)
        for name, value in values.items():
            write_atomic(
                str(out / _file_name(name)),
                lod_tensor_chunks(value, what=f"variable {name!r}"),
                sync_dir=False,
            )
        for name, (ids, rows) in hashed.items():
            buffer = io.BytesIO()
            np.savez(buffer, ids=ids, rows=rows)
            write_atomic(str(out / _file_name(f"{name}.npz")), [buffer.getvalue()], sync_dir=False)
        fsync_dir(str(out))
    return values


def merge_hashed_tables(checkpoint_dir: str | os.PathLike) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each hashed table of a job's newest checkpoints as (ids, rows), ids sorted."""
    sources, _ = _newest(checkpoint_dir)
    return _merge_hashed(sources)


def _newest(
    checkpoint_dir: str | os.PathLike,
) -> tuple[list[tuple[Checkpoint, dict[str, np.ndarray]]], list[str]]:
    found, problems = latest(checkpoint_dir)
    if not found:
        detail = f" ({'; '.join(problems)})" if problems else ""
        raise CheckpointError(f"no intact pserver checkpoint in {checkpoint_dir}{detail}")
    return sorted(found.values(), key=lambda cv: cv[0].created, reverse=True), problems


def _merge_hashed(sources) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    merged = {}
    for origin, shards in hashed_tables(sources).items():
        try:
            shards = newest_job_shards(origin, shards)
        except ExecutionError as e:
            raise CheckpointError(str(e)) from None
        ids = np.concatenate([s["ids"] for s in shards])
        rows = np.concatenate([s["values"] for s in shards])
        ids, first = np.unique(ids, return_index=True)  # an id in two shards: the newest one's row
        merged[origin] = (ids, rows[first])
    return merged


def _file_name(name: str) -> str:
    if Path(name).name != name or name in (".", ".."):
        raise CheckpointError(f"variable {name!r} cannot be saved to its own file")
    return name


def describe(checkpoint: Checkpoint) -> dict[str, Any]:
    return {
        "pserver_id": checkpoint.pserver_id,
        "count": checkpoint.count,
        "step": checkpoint.step,
        "reason": checkpoint.reason,
        "kind": checkpoint.kind,
        "base": checkpoint.base,
        "vars": len(checkpoint.pieces),
        "bytes": checkpoint.data_bytes,
        "file": checkpoint.data_file,
    }
