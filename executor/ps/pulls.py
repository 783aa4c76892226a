"""What a GET or a PREFETCH may read on a pserver, and what it sends.

A GET reads whole persistable variables; a PREFETCH reads rows of distributed tables'
blocks, by index (or, of a hashed table, by id). Each request is checked whole before
anything is read, so that a mistaken or hostile one is refused with a reason instead
of failing half-answered (or, for a row outside its table, reading memory numba does
not bounds-check).
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from fluidps.errors import ExecutionError
from fluidps.executor.ps import gradients
from fluidps.ops.selected_rows import SelectedRows
from fluidps.ops.sparse_table import SparseTable


def check_get(names: list[str], served: Collection[str], env: Mapping[str, Any]) -> None:
    """Raise unless every one of `names` is a served variable that may be read whole."""
    unknown = [n for n in names if n not in served or n not in env]
    if unknown:
        raise ExecutionError(f"holds no variable {', '.join(map(repr, unknown))}")
    hashed = [n for n in names if isinstance(env[n], SparseTable)]
    if hashed:
        raise ExecutionError(f"hashed table {hashed[0]!r} is read by id (PREFETCH), never whole")


def check_prefetch(tensors: Mapping[str, Any], tables: Collection[str], env: Mapping[str, Any]) -> None:
    """Raise unless each tensor names a table block here and holds int64 row indices into it."""
    for name, rows in tensors.items():
        if name not in tables:
            held = ", ".join(sorted(tables)) or "none"
            raise ExecutionError(
                f"holds no distributed table {name!r} (its tables: {held}); the trainer's program was "
                "transpiled for another job: transpile trainers and pservers together"
            )
        if isinstance(rows, SelectedRows) or rows.dtype != np.int64 or rows.ndim != 1:
            raise ExecutionError(f"a prefetch of {name!r} must carry 1-D int64 row indices")
        table = env[name]
        if isinstance(table, SparseTable):
            table.check_ids(rows, f"a prefetch of {name!r}")  # ids >= 0 that this shard owns
            continue
        height = np.shape(table)[0]
        if rows.size and (rows.min() < 0 or rows.max() >= height):
            bad = int(rows[np.flatnonzero((rows < 0) | (rows >= height))[0]])
            raise ExecutionError(f"row {bad} asked of table block {name!r} is outside its {height} rows")


def read(
    env: Mapping[str, Any],
    name: str,
    rows: np.ndarray | None = None,
    lock: contextlib.AbstractContextManager | None = None,
) -> Any:
    """What is sent of `name`: the whole value, or `rows` of a table block (a copy: of a
    hashed one by id, ids without a row reading their initial values). With `lock` (an
    optimize thread may be updating it), a copy taken holding it; without, the value
    itself, which nothing changes before it is sent."""
    with lock if lock is not None else contextlib.nullcontext():
        value = env[name]
        if rows is not None:
            return value.lookup(rows) if isinstance(value, SparseTable) else np.take(value, rows, axis=0)
        return gradients.copy(value) if lock is not None else value
