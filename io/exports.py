"""Model exports for serving: a base, then deltas, each written whole or not at all.

    exporter = fluidps.io.Exporter("exports", ["x"], [prediction], main_program)
    exporter.export(scope)      # version 1: a base (every variable the inference program reads)
    exporter.export(scope)      # version 2: a delta (what changed since version 1)
    version, values = fluidps.io.load_export("exports")   # base + deltas: the state at the latest

An export directory holds the inference program once (`model/__model__`, Fluid's format:
fluidps.io.save_inference_model's program) and one directory per version,
`versions/00000007/`: a manifest (`manifest.json`: the version, its kind, its parent,
the program's checksum, and per variable its file, encoding, shape, dtype and SHA-256)
and one file per variable, in Paddle's tensor format (fluidps.io.tensor_file). A delta
holds a variable only if it changed since its parent: whole, or, for a table (two or
more dimensions) whose changed rows are fewer than half, only those rows (a
SelectedRows). `LATEST` names the newest version. A version is written into a
temporary directory, synced and renamed into place, and only then named in LATEST: a
reader sees whole versions or none.

A version can say which records of its training streams it holds: `export(scope,
offsets={"log:/data/clicks": 1200})` records in its manifest that every record before
offset 1200 of that stream was trained on before the values were read (a trainer passes
its consumer group's committed offset, read after the window's commit and before the
export); `stream_offsets(directory, version)` reads them back. A record at offset o is
then in version v, and in every later one, when o < stream_offsets(directory, v)[stream].

Every `base_every` versions the exporter writes a base instead of a delta (and whenever
the newest version is not the one it wrote last: another writer's); the chains before
the previous base are then deleted (a reader still loading one has the chain after it).
Writers take turns (a lock file); a version a writer renamed into place but died
before naming in LATEST is deleted by the next one. Loading checks every file against
its manifest: a damaged version raises SerializationError naming the file, and nothing
of it is used.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fluidps.errors import SerializationError
from fluidps.io.atomic import fsync_dir, write_atomic
from fluidps.io.inference import MODEL_FILENAME, prune_for_inference
from fluidps.io.persistables import is_persistable
from fluidps.io.tensor_file import (
    lod_tensor_from_bytes,
    lod_tensor_to_bytes,
    selected_rows_from_bytes,
    selected_rows_to_bytes,
)
from fluidps.ir.program import Program
from fluidps.ir.types import FEED_VAR_NAME, FETCH_VAR_NAME
from fluidps.ops.selected_rows import SelectedRows

if TYPE_CHECKING:
    from fluidps.executor.scope import Scope
    from fluidps.ir.variable import Variable

FORMAT = 1
LATEST = "LATEST"
MODEL_DIR = "model"
VERSIONS_DIR = "versions"
MANIFEST = "manifest.json"
ROWS_FRACTION = 0.5  # a table whose changed rows are fewer than this share goes as those rows


class Exporter:
    """Writes versions of the variables `main_program`'s inference part (from
    `feeded_var_names` to `target_vars`) reads into `directory`."""

    def __init__(
        self,
        directory: str | os.PathLike,
        feeded_var_names: Sequence[str],
        target_vars: Sequence[Variable | str],
        main_program: Program,
        base_every: int = 10,
    ):
        if base_every < 1:
            raise SerializationError(f"base_every must be >= 1, got {base_every}")
        self.directory = Path(directory)
        targets = [t if isinstance(t, str) else t.name for t in target_vars]
        self.program = prune_for_inference(main_program, list(feeded_var_names), targets)
        self.base_every = base_every
        block = self.program.global_block()
        self.names = sorted(
            n for n, v in block.vars.items() if is_persistable(v) and n not in (FEED_VAR_NAME, FETCH_VAR_NAME)
        )
        self.program_bytes = self.program.serialize_to_string()
        self.program_sha = hashlib.sha256(self.program_bytes).hexdigest()
        self._last: dict[str, np.ndarray] | None = None  # what the version it wrote last holds
        self._written: int | None = None  # that version
        self._since_base = 0

    @property
    def latest(self) -> int | None:
        return latest_version(self.directory)

    def export(self, values: Scope | Mapping[str, Any], offsets: Mapping[str, int] | None = None) -> int:
        """Write the next version from `values` (a scope, or name -> array); returns it. A
        base when this exporter wrote none yet (it does not trust what it did not write)
        or every `base_every` versions; else a delta from the version before. `offsets`:
        by stream (its spec, as `layers.stream_reader` names it), the offset before which
        every record was trained on in `values` (e.g. the consumer group's committed
        offset), kept in the manifest (see stream_offsets)."""
        covered = _checked_offsets(offsets, "export: offsets")
        current = {name: _array(name, _lookup(values, name)) for name in self.names}
        with _exclusive(self.directory):
            return self._export(current, covered)

    def _export(self, current: dict[str, np.ndarray], offsets: dict[str, int] | None = None) -> int:
        self._write_program()
        latest = self.latest
        _drop_unpublished(self.directory, latest or 0)  # (a writer that died before naming them)
        version = (latest or 0) + 1
        # A delta only on what this exporter wrote last: another writer's version is not its parent.
        base = self._last is None or latest != self._written or self._since_base + 1 >= self.base_every
        if base:
            entries = {name: ("whole", value) for name, value in current.items()}
        else:
            assert self._last is not None
            entries = {
                n: e for n, value in current.items() if (e := _changed(value, self._last[n])) is not None
            }
        manifest = {
            "format": FORMAT,
            "version": version,
            "kind": "base" if base else "delta",
            "parent": None if base else version - 1,
            "program_sha256": self.program_sha,
            "created": time.time(),
            "vars": {},
        }
        if offsets is not None:
            manifest["offsets"] = offsets
        final = self.directory / VERSIONS_DIR / f"{version:08d}"
        staging = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        for index, (name, (encoding, value)) in enumerate(sorted(entries.items())):
            data = lod_tensor_to_bytes(value) if encoding == "whole" else selected_rows_to_bytes(value)
            file = f"{index:04d}.{encoding}"
            write_atomic(str(staging / file), [data], sync_dir=False)
            manifest["vars"][name] = {
                "file": file,
                "encoding": encoding,
                "shape": list(current[name].shape),
                "dtype": current[name].dtype.str,
                "sha256": hashlib.sha256(data).hexdigest(),
                "bytes": len(data),
            }
        write_atomic(str(staging / MANIFEST), [json.dumps(manifest, indent=1).encode()])
        os.replace(staging, final)
        fsync_dir(str(final.parent))
        write_atomic(str(self.directory / LATEST), [json.dumps({"version": version}).encode()])
        self._last = {name: value.copy() for name, value in current.items()}
        self._written = version
        self._since_base = 0 if base else self._since_base + 1
        if base:
            try:
                _release(self.directory, version)
            except (OSError, SerializationError) as e:  # (the version is out: a leftover is no failure)
                print(f"export {version}: older versions were not all released: {e}", file=sys.stderr)
        return version

    def _write_program(self) -> None:
        path = self.directory / MODEL_DIR / MODEL_FILENAME
        if path.exists():
            if hashlib.sha256(path.read_bytes()).hexdigest() != self.program_sha:
                raise SerializationError(
                    f"{self.directory} holds exports of another inference program: export into a new directory"
                )
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(str(path), [self.program_bytes])


def latest_version(directory: str | os.PathLike) -> int | None:
    """The newest version LATEST names (None: nothing exported yet)."""
    path = Path(directory) / LATEST
    try:
        body = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise SerializationError(f"{path}: not a readable LATEST file ({e})") from None
    version = body.get("version") if isinstance(body, dict) else None
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise SerializationError(f"{path}: 'version' must be an integer >= 1, got {version!r}")
    return version


def load_program(directory: str | os.PathLike) -> Program:
    """The inference program of an export directory."""
    path = Path(directory) / MODEL_DIR / MODEL_FILENAME
    try:
        return Program.parse_from_string(path.read_bytes())
    except OSError as e:
        raise SerializationError(f"cannot read the exported inference program {path}: {e}") from None


def chain(directory: str | os.PathLike, version: int) -> list[int]:
    """The versions that make `version`: its base first, then each delta up to it."""
    out, current = [], version
    while True:
        manifest = read_manifest(directory, current)
        out.append(current)
        if manifest["kind"] == "base":
            return out[::-1]
        current = manifest["parent"]


def load_export(
    directory: str | os.PathLike,
    version: int | None = None,
    start: tuple[int, Mapping[str, np.ndarray]] | None = None,
) -> tuple[int, dict[str, np.ndarray]]:
    """(version, values) of `version` (default: the latest): its base, then each delta.
    `start`: (a version, its values) already loaded; the deltas after it are applied to a
    copy, when `version`'s chain goes through it."""
    version = latest_version(directory) if version is None else version
    if version is None:
        raise SerializationError(f"{directory} holds no export yet (no {LATEST} file)")
    versions = chain(directory, version)
    if start is not None and start[0] in versions:
        values = {name: value.copy() for name, value in start[1].items()}
        versions = versions[versions.index(start[0]) + 1 :]
    else:
        values = {}
    for v in versions:
        _apply(directory, v, values)
    return version, values


def stream_offsets(directory: str | os.PathLike, version: int) -> dict[str, int]:
    """What version `version` holds of its training streams, by stream: every record
    before the offset was trained on (Exporter.export's `offsets`; {} when not given)."""
    return dict(read_manifest(directory, version).get("offsets", {}))


def read_manifest(directory: str | os.PathLike, version: int) -> dict[str, Any]:
    path = Path(directory) / VERSIONS_DIR / f"{version:08d}" / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SerializationError(f"version {version} of {directory}: cannot read {path} ({e})") from None
    ok = (
        isinstance(manifest, dict)
        and manifest.get("format") == FORMAT
        and manifest.get("version") == version
        and manifest.get("kind") in ("base", "delta")
        and (manifest.get("parent") is None) == (manifest.get("kind") == "base")
        and (
            manifest["kind"] == "base"
            or (isinstance(manifest["parent"], int) and 0 < manifest["parent"] < version)
        )
        and isinstance(manifest.get("vars"), dict)
    )
    if not ok:
        raise SerializationError(f"{path} is not a version {version} manifest of format {FORMAT}")
    if "offsets" in manifest:
        _checked_offsets(manifest["offsets"], f"{path}: 'offsets'")
    return manifest


def _checked_offsets(offsets: Any, where: str) -> dict[str, int] | None:
    """`offsets` as a manifest keeps them (stream -> offset >= 0, sorted), or a
    SerializationError saying what is wrong."""
    if offsets is None:
        return None
    if not isinstance(offsets, Mapping) or not all(
        isinstance(k, str) and k and isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 0
        for k, v in offsets.items()
    ):
        raise SerializationError(f"{where} must map stream names to offsets >= 0, got {offsets!r}")
    return {str(k): int(v) for k, v in sorted(offsets.items())}


def _apply(directory: str | os.PathLike, version: int, values: dict[str, np.ndarray]) -> None:
    """Apply version `version` (a base: every variable; a delta: what changed) to `values`."""
    manifest = read_manifest(directory, version)
    folder = Path(directory) / VERSIONS_DIR / f"{version:08d}"
    program = Path(directory) / MODEL_DIR / MODEL_FILENAME
    if program.exists() and hashlib.sha256(program.read_bytes()).hexdigest() != manifest.get(
        "program_sha256"
    ):
        raise SerializationError(
            f"version {version} of {directory} was exported from another inference program"
        )
    if manifest["kind"] == "base":
        values.clear()
    for name, entry in manifest["vars"].items():
        try:
            path = folder / str(entry["file"])
            data = path.read_bytes()
            if hashlib.sha256(data).hexdigest() != entry["sha256"]:
                raise SerializationError(
                    f"{path} does not match its checksum in {MANIFEST}: the file is damaged"
                )
            shape, dtype = tuple(entry["shape"]), np.dtype(entry["dtype"])
            if entry["encoding"] == "whole":
                value, _ = lod_tensor_from_bytes(data, str(path))
                values[name] = value.astype(dtype, copy=False).reshape(shape)
            elif entry["encoding"] == "rows" and name in values:
                rows = selected_rows_from_bytes(data, str(path))
                table, index = values[name], np.asarray(rows.rows)
                if table.shape != shape or rows.height != shape[0] or rows.value.shape[1:] != shape[1:]:
                    raise SerializationError(
                        f"{path}: rows of a {list(shape)} table do not fit {list(table.shape)}"
                    )
                if len(index) and (index.min() < 0 or index.max() >= shape[0]):
                    raise SerializationError(f"{path}: row indices outside 0..{shape[0] - 1}")
                table[index] = rows.value.astype(table.dtype, copy=False)
            else:
                raise SerializationError(
                    f"{path}: encoding {entry['encoding']!r} for {name!r} cannot be applied"
                )
        except (KeyError, TypeError, ValueError, OSError) as e:
            raise SerializationError(f"version {version} of {directory}, variable {name!r}: {e}") from None


def _changed(value: np.ndarray, last: np.ndarray) -> tuple[str, Any] | None:
    """What a delta holds of a variable: None (unchanged), its rows, or the whole of it.
    Values compare by their bytes (-0.0 is not 0.0, a NaN equals itself)."""
    if value.shape != last.shape or value.dtype != last.dtype:
        return "whole", value
    if value.ndim >= 2 and value.shape[0] > 0:
        n = value.shape[0]
        differs = value.view(np.uint8).reshape(n, -1) != last.view(np.uint8).reshape(n, -1)
        rows = np.flatnonzero(differs.any(axis=1))
        if not len(rows):
            return None
        if len(rows) < ROWS_FRACTION * value.shape[0]:
            return "rows", SelectedRows(rows.astype(np.int64), value[rows], value.shape[0])
        return "whole", value
    return None if value.tobytes() == last.tobytes() else ("whole", value)


def _lookup(values: Scope | Mapping[str, Any], name: str) -> Any:
    found = values.find(name) if hasattr(values, "find") else values.get(name)
    if found is None:
        raise SerializationError(
            f"export: variable {name!r} is not in the scope (run the startup program first)"
        )
    return found


def _array(name: str, value: Any) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise SerializationError(
            f"export: variable {name!r} holds a {type(value).__name__}, not an array; a hashed table lives on "
            "the pservers, and exports of it are not built yet"
        )
    return np.ascontiguousarray(value)


@contextlib.contextmanager
def _exclusive(directory: Path) -> Iterator[None]:
    """One writer of `directory` at a time (an advisory lock on `.export.lock`)."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".export.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _drop_unpublished(directory: Path, latest: int) -> None:
    """Delete versions past LATEST: a writer renamed them into place and died before
    naming them, so no reader has seen them."""
    folder = directory / VERSIONS_DIR
    if folder.is_dir():
        for path in folder.iterdir():
            if path.name.isdigit() and int(path.name) > latest:
                shutil.rmtree(path)


def _release(directory: Path, base: int) -> None:
    """Delete the versions before the previous base (a reader may still load that chain)."""
    folder = directory / VERSIONS_DIR
    versions = sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())
    bases = [v for v in versions if v <= base and read_manifest(directory, v)["kind"] == "base"]
    if len(bases) < 2:
        return
    keep_from = bases[-2]
    for v in versions:
        if v < keep_from:
            shutil.rmtree(folder / f"{v:08d}", ignore_errors=True)
