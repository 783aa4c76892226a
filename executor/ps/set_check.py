"""What a SET may write on a pserver (a value of the variable's kind, shape and dtype), and
what the pserver keeps of it.

A SET comes from the job's client (RemoteExecutor loading or writing values) and is
proven by the job's secret like every message; it is still checked whole before any
value is stored, so that a mistake cannot leave a parameter of another shape or type
for the next step's kernels to meet.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fluidps.ops.selected_rows import SelectedRows
from fluidps.ops.sparse_table import SparseTable


def set_problem(current: Any, value: Any) -> str | None:
    """Why `value` may not replace `current` (None: it may): a dense value replaces a dense
    variable of its shape and dtype, a SelectedRows one of its height, width and dtype;
    nothing else is ever stored."""
    if current is None:
        return "this pserver holds no such variable"
    if isinstance(current, SparseTable):
        return "it is a hashed table: its rows are restored from checkpoints, never set whole"
    if isinstance(current, SelectedRows):
        if not isinstance(value, SelectedRows):
            return f"it is a SelectedRows ({current!r}), got a dense {value.dtype}{list(value.shape)}"
        same = (value.height, value.value.shape[1:], value.value.dtype) == (
            current.height,
            current.value.shape[1:],
            current.value.dtype,
        )
        return None if same else f"got {value!r}, it is {current!r}"
    if not isinstance(current, np.ndarray):
        return f"it holds a {type(current).__name__}, which is never set over the wire"
    if isinstance(value, SelectedRows):
        return f"it is a dense {current.dtype}{list(current.shape)}, got a SelectedRows ({value!r})"
    if value.shape != current.shape or value.dtype != current.dtype:
        return f"got {value.dtype}{list(value.shape)}, it is {current.dtype}{list(current.shape)}"
    return None


def stored(value: Any, own_memory: bool) -> Any:
    """What a pserver keeps of a SET's value: the value itself when its frame is this
    process's own memory (`own_memory`: it came over TCP) and writable, else a copy (an
    inproc frame may be the sender's own array; a SelectedRows' frames are read-only views)."""
    if isinstance(value, SelectedRows):
        return SelectedRows(np.array(value.rows), np.array(value.value), value.height)
    if own_memory and value.flags.writeable and value.flags.aligned:
        return value
    return np.array(value, copy=True)
