"""Summing and averaging gradients, dense arrays or SelectedRows: the mean over trainers a
sync pserver fills in for trainers that sent nothing, the mean over `send_interval`
steps an async trainer uploads, and what an async trainer's communicator merges. Also
what a pserver checks of a gradient it receives (GradientSpec) and the sparse rows it
records (RowLog).

A trainer with send_interval n uploads, every n steps, the mean of its last n
gradients; the sum lives in its TrainerClient (GradientSum), keyed by what is sent, so it
does not depend on how often the program is prepared again, and what is left of it
when the trainer stops is still uploaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fluidps.ir.types import VarType, to_numpy_dtype
from fluidps.ops.selected_rows import SelectedRows

ROWS_LIMIT = 1 << 16  # sparse row ids per gradient a RowLog keeps (512 KiB; its counts go on past it)


def add(total: Any, value: Any) -> Any:
    """`total` + `value` (None: nothing yet); SelectedRows keep every row, repeats too."""
    if total is None:
        return value.copy() if isinstance(value, (np.ndarray, SelectedRows)) else value
    if isinstance(value, SelectedRows):  # rows of every step, repeats kept (the pserver merges them)
        return SelectedRows(
            np.concatenate([total.rows, value.rows]), np.concatenate([total.value, value.value]), value.height
        )
    return total + value


def divide(total: Any, count: int) -> Any:
    if isinstance(total, SelectedRows):
        return SelectedRows(total.rows, (total.value / count).astype(total.value.dtype), total.height)
    return (total / count).astype(total.dtype)


def copy(value: Any) -> Any:
    """A copy of a gradient that shares no memory with it."""
    return value.copy() if isinstance(value, SelectedRows) else np.array(value, copy=True)


def total(values: list[Any]) -> Any:
    """The sum of several gradients of one variable."""
    out = None
    for value in values:
        out = add(out, value)
    return out


def mean(values: list[Any]) -> Any:
    """The mean of several gradients of one variable."""
    return divide(total(values), len(values))


class GradientSum:
    """The running sum of one send's gradients since its last upload."""

    def __init__(self, trainer_id: int, targets: tuple[tuple[str, str], ...]):
        self.trainer_id = trainer_id
        self.targets = targets  # (endpoint, name) of each gradient
        self.totals: list[Any] = [None] * len(targets)
        self.count = 0

    def add(self, values: list[Any]) -> None:
        self.totals = [add(t, v) for t, v in zip(self.totals, values, strict=True)]
        self.count += 1

    def take_mean(self) -> list[tuple[str, str, Any]]:
        """(endpoint, name, mean gradient) of every target; the sum starts again."""
        means = [divide(t, self.count) for t in self.totals]
        self.totals, self.count = [None] * len(self.targets), 0
        return [(ep, name, value) for (ep, name), value in zip(self.targets, means, strict=True)]


class RowLog:
    """The sparse rows one gradient brought, in arrival order (up to ROWS_LIMIT), and how many."""

    def __init__(self) -> None:
        self.chunks: list[np.ndarray] = []
        self.total = self.kept = 0

    def add(self, rows: np.ndarray) -> None:
        self.total += len(rows)
        room = ROWS_LIMIT - self.kept
        if room > 0:
            self.chunks.append(np.array(rows[:room], dtype=np.int64, copy=True))
            self.kept += min(room, len(rows))

    def rows(self) -> list[int]:
        return np.concatenate(self.chunks).tolist() if self.chunks else []

    def unique(self) -> np.ndarray:
        return np.unique(np.concatenate(self.chunks)) if self.chunks else np.zeros(0, np.int64)


@dataclass(frozen=True)
class GradientSpec:
    """What a gradient this pserver optimizes must look like (its declaration here): a
    dense tensor of the slice's shape, or rows of it, in the parameter's dtype. -1
    dimensions (a hashed table's rows) match any size."""

    sparse: bool
    shape: tuple[int, ...] | None
    dtype: np.dtype | None

    @staticmethod
    def of(var: Any) -> GradientSpec:
        if var is None:
            return GradientSpec(False, None, None)
        dtype = to_numpy_dtype(var.dtype) if var.dtype is not None else None
        shape = tuple(var.shape) if var.shape is not None else None
        return GradientSpec(var.type == VarType.SELECTED_ROWS, shape, dtype)

    def problem(self, name: str, value: Any) -> str | None:
        """What is wrong with `value` as gradient `name`, or None."""
        sparse = isinstance(value, SelectedRows)
        array = value.value if sparse else value
        if sparse != self.sparse:
            want = "rows (SelectedRows)" if self.sparse else "a dense tensor"
            return f"{name!r} must be {want}, got {'rows' if sparse else 'a dense tensor'}"
        if self.dtype is not None and array.dtype != self.dtype:
            return f"{name!r} must be {self.dtype}, got {array.dtype}{list(array.shape)}"
        if self.shape is None:
            return None
        got = array.shape[1:] if sparse else array.shape
        want = self.shape[1:] if sparse else self.shape
        if len(got) != len(want) or any(w >= 0 and g != w for g, w in zip(got, want, strict=False)):
            what = "rows of width" if sparse else "shape"
            return f"{name!r} must have {what} {list(want)}, got {array.dtype}{list(array.shape)}"
        if sparse:
            rows, height = value.rows, self.shape[0]
            if len(rows) != len(array):
                return f"{name!r} holds {len(array)} rows of values for {len(rows)} row ids"
            if rows.size and (int(rows.min()) < 0 or (height >= 0 and int(rows.max()) >= height)):
                bound = f"0..{height - 1}" if height >= 0 else ">= 0"
                return f"{name!r} names rows outside {bound} (rows {int(rows.min())}..{int(rows.max())})"
        return None
