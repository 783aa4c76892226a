"""Datasets of records in sharded files, cut into tasks for a coordinator to hand out.

A dataset is a directory of shards, each a file of records with the same named
fields (`image`: float32 [64], `label`: int64 [1], ...):

- `.npz`: one array per field, all with the same number of rows (records);
- `.npy`: one structured array (a field per record field), or a plain array
  whose single field the manifest names;
- `.parquet` (with pyarrow installed): a column per field; fixed-size lists
  are vectors.

`dataset.json`, written by `Dataset.write` and `fluidps data split`, lists the
fields and each shard's record count and sha256; without it the shards are
found by extension and described by opening them. A task is a range of
records in one shard (`Dataset.tasks`): a dataset has many more tasks than a
job has trainers, and a task many mini-batches. Nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import zipfile
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fluidps.errors import DatasetError
from fluidps.io.atomic import fsync_dir, write_atomic

MANIFEST = "dataset.json"
FORMAT = "fluidps-dataset"
SHARD_SUFFIXES = (".npz", ".npy", ".parquet")
_SHARDS_CACHED = 2  # shards kept loaded: the one being read and the one before


@dataclass(frozen=True)
class Field:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]  # of one record

    def describe(self) -> str:
        return f"{self.name} {self.dtype}{list(self.shape)}"


@dataclass(frozen=True)
class Shard:
    file: str  # relative to the dataset directory
    records: int
    sha256: str | None = None


@dataclass(frozen=True)
class Task:
    """Records [start, stop) of shard `shard`."""

    id: int
    shard: int
    start: int
    stop: int

    @property
    def records(self) -> int:
        return self.stop - self.start


class Dataset:
    """A sharded dataset on disk. `Dataset(path)` reads its manifest (or finds its shards)."""

    def __init__(self, path: str | os.PathLike, verify: bool = True):
        self.path = Path(path)
        self.verify = verify
        if not self.path.is_dir():
            raise DatasetError(f"dataset {self.path} is not a directory")
        manifest = self.path / MANIFEST
        if manifest.is_file():
            self.fields, self.shards = _read_manifest(manifest)
        else:
            self.fields, self.shards = _discover(self.path)
        if not self.shards:
            raise DatasetError(f"dataset {self.path} has no shards (*.npz, *.npy or *.parquet files)")
        self._loaded: OrderedDict[int, dict[str, np.ndarray]] = OrderedDict()
        self._verified: set[int] = set()

    # -- what it holds ---------------------------------------------------------------------

    @property
    def records(self) -> int:
        return sum(s.records for s in self.shards)

    @property
    def fingerprint(self) -> str:
        """A digest of the fields and the shards: two processes reading datasets with the
        same fingerprint read the same records."""
        body = {
            "fields": [[f.name, f.dtype.str, list(f.shape)] for f in self.fields.values()],
            "shards": [[s.file, s.records, s.sha256] for s in self.shards],
        }
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]

    def tasks(self, records_per_task: int) -> list[Task]:
        """The dataset cut into tasks of at most `records_per_task` records; tasks never
        span shards. Ids are positions in this list, the same in every process."""
        if records_per_task < 1:
            raise DatasetError(f"records_per_task must be >= 1, got {records_per_task}")
        out = []
        for index, shard in enumerate(self.shards):
            for start in range(0, shard.records, records_per_task):
                out.append(Task(len(out), index, start, min(start + records_per_task, shard.records)))
        return out

    def describe(self) -> str:
        fields = ", ".join(f.describe() for f in self.fields.values())
        return f"{self.records:,} records in {len(self.shards)} shard(s) of {self.path}: {fields}"

    # -- reading ---------------------------------------------------------------------------

    def read(self, shard: int, start: int, stop: int) -> dict[str, np.ndarray]:
        """Records [start, stop) of shard `shard`, field by field."""
        if not 0 <= shard < len(self.shards):
            raise DatasetError(f"dataset {self.path} has no shard {shard} (it has {len(self.shards)})")
        records = self.shards[shard].records
        if not 0 <= start <= stop <= records:
            raise DatasetError(
                f"records {start}..{stop} are outside shard {shard} ({self.shards[shard].file}, "
                f"{records} records)"
            )
        arrays = self._load(shard)
        return {name: np.ascontiguousarray(arrays[name][start:stop]) for name in self.fields}

    def read_task(self, task: Task) -> dict[str, np.ndarray]:
        return self.read(task.shard, task.start, task.stop)

    def _load(self, shard: int) -> dict[str, np.ndarray]:
        if shard in self._loaded:
            self._loaded.move_to_end(shard)
            return self._loaded[shard]
        info = self.shards[shard]
        path = self.path / info.file
        if self.verify and info.sha256 and shard not in self._verified:
            actual = _sha256(path)
            if actual != info.sha256:
                raise DatasetError(
                    f"shard {path} is corrupt: its sha256 is {actual}, the manifest says {info.sha256}"
                )
            self._verified.add(shard)
        arrays = _open_shard(path, self.fields)
        for name, field in self.fields.items():
            array = arrays.get(name)
            if array is None:
                raise DatasetError(f"shard {path} has no field {name!r}")
            if len(array) != info.records or array.shape[1:] != field.shape or array.dtype != field.dtype:
                raise DatasetError(
                    f"shard {path}: field {name!r} is {array.dtype}{list(array.shape)}, expected "
                    f"{info.records} records of {field.dtype}{list(field.shape)}"
                )
        self._loaded[shard] = arrays
        while len(self._loaded) > _SHARDS_CACHED:
            self._loaded.popitem(last=False)
        return arrays

    # -- writing ---------------------------------------------------------------------------

    @staticmethod
    def write(
        directory: str | os.PathLike,
        arrays: Mapping[str, np.ndarray],
        records_per_shard: int,
        format: str = "npz",
    ) -> Dataset:
        """Write `arrays` (field name -> array with one row per record) as shards of
        `records_per_shard` records plus a manifest; every file is written atomically."""
        fields = _fields_of(arrays, "the arrays to write")
        count = len(next(iter(arrays.values())))
        if records_per_shard < 1:
            raise DatasetError(f"records_per_shard must be >= 1, got {records_per_shard}")
        if format not in ("npz", "npy", "parquet"):
            raise DatasetError(f"format must be npz, npy or parquet, got {format!r}")
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        if any(out.iterdir()):
            raise DatasetError(f"{out} is not empty: write a dataset into a new directory")
        shards = []
        width = max(5, len(str(math.ceil(count / records_per_shard))))
        for number, start in enumerate(range(0, count, records_per_shard)):
            part = {name: a[start : start + records_per_shard] for name, a in arrays.items()}
            file = f"part-{number:0{width}d}.{format}"
            data = _encode_shard(part, fields, format)
            write_atomic(str(out / file), [data], sync_dir=False)
            shards.append(Shard(file, len(next(iter(part.values()))), hashlib.sha256(data).hexdigest()))
        _write_manifest(out / MANIFEST, fields, shards)
        fsync_dir(str(out))
        return Dataset(out)


def read_records(path: str | os.PathLike, field: str | None = None) -> dict[str, np.ndarray]:
    """Every record of one file (.npz, .npy or .parquet) or of a whole dataset directory,
    in memory, field by field. A plain (unstructured) .npy needs `field`: its name."""
    source = Path(path)
    if source.is_dir():
        dataset = Dataset(source)
        parts = [dataset.read(i, 0, s.records) for i, s in enumerate(dataset.shards)]
        return {name: np.concatenate([p[name] for p in parts]) for name in dataset.fields}
    if source.suffix not in SHARD_SUFFIXES:
        raise DatasetError(f"{source} is not a .npz, .npy or .parquet file, nor a dataset directory")
    if not source.is_file():
        raise DatasetError(f"{source} does not exist")
    fields = None if field is None else {field: Field(field, np.dtype("f4"), ())}
    arrays = _open_shard(source, fields)
    _fields_of(arrays, f"records of {source}")
    return {name: np.asarray(a) for name, a in arrays.items()}


# -- manifest --------------------------------------------------------------------------------


def _write_manifest(path: Path, fields: Mapping[str, Field], shards: Iterable[Shard]) -> None:
    body = {
        "format": FORMAT,
        "version": 1,
        "fields": [{"name": f.name, "dtype": f.dtype.str, "shape": list(f.shape)} for f in fields.values()],
        "shards": [{"file": s.file, "records": s.records, "sha256": s.sha256} for s in shards],
    }
    write_atomic(str(path), [json.dumps(body, indent=1).encode()], sync_dir=False)


def _read_manifest(path: Path) -> tuple[dict[str, Field], list[Shard]]:
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DatasetError(f"cannot read the dataset manifest {path}: {e}") from None
    where = f"dataset manifest {path}"
    if not isinstance(body, dict) or body.get("format") != FORMAT or body.get("version") != 1:
        raise DatasetError(f"{where} is not a version 1 {FORMAT} manifest")
    fields: dict[str, Field] = {}
    for item in _list(body, "fields", where):
        name = _get(item, "name", str, where)
        shape = _get(item, "shape", list, where)
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise DatasetError(f"{where}: field {name!r} has an invalid shape {shape}")
        fields[name] = Field(name, _dtype(_get(item, "dtype", str, where), where), tuple(shape))
    if not fields:
        raise DatasetError(f"{where} lists no fields")
    shards = []
    for item in _list(body, "shards", where):
        file = _get(item, "file", str, where)
        if Path(file).name != file or not file.endswith(SHARD_SUFFIXES):
            raise DatasetError(
                f"{where}: shard {file!r} must be a .npz, .npy or .parquet file in the dataset"
            )
        records = _get(item, "records", int, where)
        if records < 0:
            raise DatasetError(f"{where}: shard {file!r} has {records} records")
        digest = item.get("sha256")
        if digest is not None and not (isinstance(digest, str) and len(digest) == 64):
            raise DatasetError(f"{where}: shard {file!r} has an invalid sha256")
        shards.append(Shard(file, records, digest))
    return fields, shards


def _list(body: dict, key: str, where: str) -> list[dict]:
    value = body.get(key)
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise DatasetError(f"{where}: {key!r} must be a list of objects")
    return value


def _get(item: dict, key: str, kind: type, where: str) -> Any:
    value = item.get(key)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise DatasetError(f"{where}: {key!r} must be a {kind.__name__}, got {value!r}")
    return value


def _dtype(text: str, where: str) -> np.dtype:
    try:
        dtype = np.dtype(text)
    except TypeError:
        raise DatasetError(f"{where}: {text!r} is not a dtype") from None
    if dtype.kind not in "biuf":
        raise DatasetError(f"{where}: fields hold numbers or booleans, not {dtype}")
    return dtype


# -- shards ----------------------------------------------------------------------------------


def _fields_of(arrays: Mapping[str, np.ndarray], where: str) -> dict[str, Field]:
    if not arrays:
        raise DatasetError(f"{where} have no fields")
    counts = {name: len(a) for name, a in arrays.items() if np.ndim(a) > 0}
    if len(counts) != len(arrays) or len(set(counts.values())) != 1:
        raise DatasetError(f"{where}: every field needs one row per record, got rows {counts}")
    fields = {}
    for name, array in arrays.items():
        array = np.asarray(array)
        if array.dtype.kind not in "biuf":
            raise DatasetError(f"{where}: field {name!r} has dtype {array.dtype}; fields hold numbers")
        fields[name] = Field(name, array.dtype, tuple(array.shape[1:]))
    return fields


def _discover(path: Path) -> tuple[dict[str, Field], list[Shard]]:
    files = sorted(p for p in path.iterdir() if p.suffix in SHARD_SUFFIXES and not p.name.startswith("."))
    fields: dict[str, Field] | None = None
    shards = []
    for file in files:
        arrays = _open_shard(file, None)
        found = _fields_of(arrays, f"shard {file}")
        if fields is None:
            fields = found
        elif found != fields:
            raise DatasetError(
                f"shard {file} has fields {', '.join(f.describe() for f in found.values())}, but "
                f"{files[0].name} has {', '.join(f.describe() for f in fields.values())}"
            )
        shards.append(Shard(file.name, len(next(iter(arrays.values())))))
    return fields or {}, shards


def _open_shard(path: Path, fields: Mapping[str, Field] | None) -> dict[str, np.ndarray]:
    """Field name -> array of the shard's records (memory-mapped for .npy)."""
    try:
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as archive:
                return {name: archive[name] for name in archive.files}
        if path.suffix == ".npy":
            array = np.load(path, mmap_mode="r", allow_pickle=False)
            if array.dtype.names:
                return {name: array[name] for name in array.dtype.names}
            if fields is None or len(fields) != 1:
                raise DatasetError(
                    f"shard {path} holds a plain array: give the dataset a manifest naming its one field, "
                    "or store a structured array"
                )
            return {next(iter(fields)): array}
        return _read_parquet(path)
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
        raise DatasetError(f"cannot read shard {path}: {e}") from None


def _encode_shard(part: Mapping[str, np.ndarray], fields: Mapping[str, Field], format: str) -> bytes:
    buffer = io.BytesIO()
    if format == "npz":
        np.savez(buffer, **{name: np.ascontiguousarray(a) for name, a in part.items()})
    elif format == "npy":
        dtype = np.dtype([(f.name, f.dtype, f.shape) for f in fields.values()])
        records = np.empty(len(next(iter(part.values()))), dtype=dtype)
        for name, array in part.items():
            records[name] = array
        np.save(buffer, records, allow_pickle=False)
    else:
        _write_parquet(buffer, part)
    return buffer.getvalue()


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise DatasetError(
            "Parquet shards need pyarrow: pip install 'fluidps[parquet]' (or pip install pyarrow)"
        ) from None
    return pyarrow


def _read_parquet(path: Path) -> dict[str, np.ndarray]:
    pa = _pyarrow()
    table = pa.parquet.read_table(path)
    out = {}
    for name, column in zip(table.column_names, table.columns, strict=True):
        column = column.combine_chunks()
        if pa.types.is_fixed_size_list(column.type):
            width = column.type.list_size
            values = column.flatten().to_numpy(zero_copy_only=False)
            out[name] = values.reshape(len(column), width)
        else:
            out[name] = column.to_numpy(zero_copy_only=False)
    return out


def _write_parquet(buffer: io.BytesIO, part: Mapping[str, np.ndarray]) -> None:
    pa = _pyarrow()
    columns = {}
    for name, array in part.items():
        array = np.ascontiguousarray(array)
        if array.ndim == 1:
            columns[name] = pa.array(array)
        elif array.ndim == 2:
            columns[name] = pa.FixedSizeListArray.from_arrays(pa.array(array.reshape(-1)), array.shape[1])
        else:
            raise DatasetError(
                f"field {name!r} has {array.ndim - 1} record dimensions; Parquet shards hold 0 or 1"
            )
    pa.parquet.write_table(pa.table(columns), buffer)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    except OSError as e:
        raise DatasetError(f"cannot read shard {path}: {e}") from None
    return digest.hexdigest()
